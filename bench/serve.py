"""`python -m bench.serve`: `slabpool serve` vs MLServer (parallel workers) vs FastAPI +
ProcessPoolExecutor, side by side in one run, on the same model and the same load generator.

    model      the tiny MLP of the tests (16 -> 32 -> 8, a few us per row), one row a request
    servers    slabpool serve MODEL --workers W            (this checkout's .venv)
               mlserver start (parallel_workers=W)          (a throwaway venv, see below)
               bench/serve_fastapi.py (uvicorn, ProcessPoolExecutor(W))   (the same throwaway venv)
    load       wrk (Debian's `wrk`), the same V2 JSON POST for all three, at each concurrency
               (1, 8, 64 connections): p50, p99 and requests/s, non-2xx and socket errors
    crash run  the same load at concurrency 8 while one worker process of the server is
               SIGKILLed every second: requests failed (non-2xx), lost (wrk's socket errors:
               read, write, timeout: a request whose connection closed or that had no answer in
               5 s; a server that closes the connection after an error answer counts here too),
               p99, and whether it still serves
    baseline   Engine.infer_async's own round trip at concurrency 1, in-process: the server's
               p50 minus it is what the HTTP front end adds. Taken apart (another process, no
               load) it flatters the engine on a small host; so the same is also measured
               interleaved (bench/serve_overhead.py: one connection alternates a JSON request, a
               binary one and an in-server infer_async probe), which is the figure to quote

MLServer pins what the project cannot take (its own uvloop<0.22, fastapi, pydantic, ...), so it
is never an extra: it is installed into a throwaway venv, by default
~/.cache/slabpool-bench/mlserver-venv (`--venv`), created on first use with pip
(mlserver==1.7.1, uvloop<0.22: 0.22 kills its workers at start). The FastAPI app runs there
too (fastapi comes with MLServer). `--only slabpool` skips both.

    python -m bench.serve                           # all three, ~3 min; writes bench/results/serve.json
    python -m bench.serve --duration 10 --crash-seconds 20
    python -m bench.serve --only slabpool,fastapi
    python -m bench.serve --only slabpool --slabpool-args "--max-batch-size 8"   (dynamic batching)

Figures depend on the host: on a shared machine take them as a smoke run only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "serve.json"
DEFAULT_VENV = Path.home() / ".cache" / "slabpool-bench" / "mlserver-venv"
THROWAWAY_PINS = ["mlserver==1.7.1", "uvloop<0.22", "onnxruntime==1.32.0", "numpy<2.5"]
CONTENDERS = ("slabpool", "mlserver", "fastapi")
_INFRA = ("forkserver", "resource_tracker", "semaphore_tracker")

LUA = """
wrk.method = "POST"
local f = io.open("{body}", "rb"); wrk.body = f:read("*a"); f:close()
wrk.headers["Content-Type"] = "application/json"
"""


@dataclass
class Load:
    concurrency: int
    requests: int = 0
    rps: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    non_2xx: int = 0
    socket_errors: dict[str, int] = field(default_factory=dict)

    @property
    def lost(self) -> int:
        return sum(v for k, v in self.socket_errors.items() if k in ("read", "write", "timeout"))


@dataclass
class Crash:
    kills: int
    load: Load
    serving_after: bool


# -- the load generator --------------------------------------------------------------------------

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s)", text)
    assert m, text
    return float(m.group(1)) * _UNITS[m.group(2)]


def wrk(url: str, script: Path, concurrency: int, seconds: float) -> Load:
    threads = min(concurrency, 2)
    out = subprocess.run(
        ["wrk", f"-t{threads}", f"-c{concurrency}", f"-d{seconds:g}s", "--latency", "--timeout", "5s",
         "-s", str(script), url], capture_output=True, text=True, check=True).stdout
    load = Load(concurrency)
    load.requests = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    load.rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    load.p50_ms = _ms(re.search(r"^\s+50%\s+(\S+)$", out, re.M).group(1))  # type: ignore[union-attr]
    load.p99_ms = _ms(re.search(r"^\s+99%\s+(\S+)$", out, re.M).group(1))  # type: ignore[union-attr]
    if m := re.search(r"Non-2xx or 3xx responses: (\d+)", out):
        load.non_2xx = int(m.group(1))
    if m := re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out):
        load.socket_errors = dict(zip(("connect", "read", "write", "timeout"), map(int, m.groups()), strict=True))
    return load


# -- the servers ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http(method: str, url: str, body: bytes | None = None, timeout: float = 5) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


class Running:
    """A server process; its worker processes are its descendants minus multiprocessing's own."""

    def __init__(self, name: str, argv: list[str], port: int, cwd: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(argv, cwd=cwd, stdout=self.log, stderr=self.log,
                                     env={**os.environ, **(env or {})}, start_new_session=True)

    def wait_ready(self, body: bytes, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if _http("POST", f"{self.url}/v2/models/mlp/infer", body)[0] == 200:
                return
            time.sleep(0.2)
        self.log.seek(0)
        raise RuntimeError(f"{self.name} did not start:\n{self.log.read().decode(errors='replace')[-3000:]}")

    def workers(self) -> list[int]:
        """Descendants, less multiprocessing's forkserver and resource tracker (children of the
        server itself; a worker forked by the forkserver carries the forkserver's command line)."""
        import psutil

        out = []
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if p.ppid() == self.proc.pid and any(k in " ".join(p.cmdline()) for k in _INFRA):
                    continue
                out.append(p.pid)
        return out

    def stop(self) -> None:
        """SIGTERM to the server's process group, then SIGKILL to whatever of the group is left
        once the server has exited: the FastAPI app's ProcessPoolExecutor workers are forked
        with uvicorn's SIGTERM handler (they ignore it in effect) and outlived their server,
        orphaned, still holding its listening socket."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()


def ensure_venv(venv: Path) -> Path:
    """The throwaway venv with MLServer (and FastAPI) in it; made with pip on first use."""
    py = venv / "bin" / "python"
    if not (venv / "bin" / "mlserver").exists():
        print(f"making the throwaway venv {venv} (MLServer, once) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *THROWAWAY_PINS], check=True)
    return py


def start(name: str, model: Path, workers: int, tmp: Path, venv: Path | None, extra: list[str]) -> Running:
    port = _free_port()
    if name == "slabpool":
        argv = [sys.executable, "-m", "slabpool", "serve", f"mlp={model}", "--workers", str(workers),
                "--http-port", str(port), "--grpc-port", "0", *extra]
        return Running(name, argv, port, REPO)
    assert venv is not None
    py = ensure_venv(venv)
    if name == "fastapi":
        return Running(name, [str(py), str(REPO / "bench" / "serve_fastapi.py"), str(model), str(port), str(workers)],
                       port, REPO)
    folder = tmp / "mlserver"
    (folder / "mlp").mkdir(parents=True, exist_ok=True)
    (folder / "settings.json").write_text(json.dumps({
        "http_port": port, "grpc_port": _free_port(), "metrics_port": _free_port(), "parallel_workers": workers,
        "debug": False}))
    (folder / "mlp" / "model-settings.json").write_text(json.dumps({
        "name": "mlp", "implementation": "serve_mlserver.OnnxRuntime", "parameters": {"uri": str(model)}}))
    return Running(name, [str(venv / "bin" / "mlserver"), "start", str(folder)], port, folder,
                   env={"PYTHONPATH": str(REPO / "bench")})


# -- one contender ---------------------------------------------------------------------------------


def check_outputs(srv: Running, body: bytes, want: dict[str, np.ndarray]) -> bool:
    status, raw = _http("POST", f"{srv.url}/v2/models/mlp/infer", body)
    if status != 200:
        return False
    got = {o["name"]: np.asarray(o["data"], np.float32).reshape(o["shape"]) for o in json.loads(raw)["outputs"]}
    return all(np.allclose(got[k].reshape(v.shape), v, rtol=1e-6, atol=1e-7) for k, v in want.items())


def crash_run(srv: Running, script: Path, seconds: float, body: bytes) -> Crash:
    """The load at concurrency 8 while a worker is SIGKILLed every second."""
    stop = threading.Event()
    kills = 0

    def killer() -> None:
        nonlocal kills
        rng = np.random.default_rng(0)
        while not stop.wait(1.0):
            pids = srv.workers()
            if pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(rng.choice(pids)), signal.SIGKILL)
                    kills += 1

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    try:
        load = wrk(f"{srv.url}/v2/models/mlp/infer", script, 8, seconds)
    finally:
        stop.set()
        t.join()
    time.sleep(2.0)  # a last restart
    serving = any(_http("POST", f"{srv.url}/v2/models/mlp/infer", body)[0] == 200 for _ in range(5))
    return Crash(kills, load, serving)


def measure(name: str, args: argparse.Namespace, model: Path, script: Path, body: bytes,
            want: dict[str, np.ndarray], tmp: Path) -> dict[str, Any]:
    print(f"-- {name}", flush=True)
    srv = start(name, model, args.workers, tmp, None if name == "slabpool" else args.venv, args.slabpool_args.split())
    try:
        srv.wait_ready(body)
        correct = check_outputs(srv, body, want)
        url = f"{srv.url}/v2/models/mlp/infer"
        wrk(url, script, 8, 1.0)  # warm-up
        loads = []
        for c in args.concurrency:
            loads.append(wrk(url, script, c, args.duration))
            print(f"   c={c:<3} {loads[-1].rps:9.0f} req/s  p50 {loads[-1].p50_ms:7.3f} ms  p99 {loads[-1].p99_ms:7.3f} ms"
                  f"  non-2xx {loads[-1].non_2xx}  lost {loads[-1].lost}", flush=True)
        crash = crash_run(srv, script, args.crash_seconds, body) if args.crash_seconds else None
        if crash:
            print(f"   crash: {crash.kills} kills, {crash.load.requests} requests, failed {crash.load.non_2xx}, "
                  f"lost {crash.load.lost}, p99 {crash.load.p99_ms:.3f} ms, serving after: {crash.serving_after}",
                  flush=True)
    finally:
        srv.stop()
    return {"correct": correct, "loads": [asdict(x) | {"lost": x.lost} for x in loads],
            "crash": None if crash is None else {**asdict(crash), "load": asdict(crash.load) | {"lost": crash.load.lost}}}


def engine_round_trip(model: Path, workers: int, n: int = 3000) -> float:
    """Engine.infer_async's p50 at concurrency 1, in-process (ms): what the server wraps."""
    code = f"""
import asyncio, time, numpy as np, uvloop
from slabpool import Engine
async def main(eng):
    x = {{"x": np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)}}
    for _ in range(300): await eng.infer_async(x)
    ts = []
    for _ in range({n}):
        t0 = time.perf_counter(); await eng.infer_async(x); ts.append(time.perf_counter() - t0)
    print(sorted(ts)[len(ts) // 2] * 1e3)
if __name__ == "__main__":
    with Engine({str(model)!r}, workers={workers}) as eng:
        uvloop.run(main(eng))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    return float(out.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def workload(tmp: Path) -> Iterator[tuple[Path, Path, bytes, dict[str, np.ndarray]]]:
    sys.path.insert(0, str(REPO))
    from tests.models import onnx_models
    from tests.reference import ort_run

    model = onnx_models.mlp(tmp / "mlp.onnx")
    x = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32",
                                   "data": x.ravel().tolist()}]}).encode()
    (tmp / "body.json").write_bytes(body)
    script = tmp / "post.lua"
    script.write_text(LUA.format(body=tmp / "body.json"))
    yield model, script, body, ort_run(model, {"x": x})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--duration", type=float, default=5.0, help="seconds of load per concurrency (default 5)")
    p.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 8, 64])
    p.add_argument("--crash-seconds", type=float, default=10.0, help="length of the crash run (0: none)")
    p.add_argument("--only", type=lambda s: s.split(","), default=list(CONTENDERS))
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="the throwaway venv for MLServer and FastAPI")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--slabpool-args", default="", help="more flags for slabpool serve, e.g. '--max-batch-size 8'")
    p.add_argument("--overhead-requests", type=int, default=2000,
                   help="rounds of the interleaved c=1 overhead measure (bench.serve_overhead; 0: none)")
    args = p.parse_args(argv)
    if shutil.which("wrk") is None:
        print("bench.serve needs wrk: apt-get install wrk", file=sys.stderr)
        return 1
    results: dict[str, Any] = {"host": {"cpus": os.cpu_count(), "load_avg": os.getloadavg()},
                               "settings": {k: str(v) for k, v in vars(args).items()}, "servers": {}}
    with tempfile.TemporaryDirectory(prefix="slabpool-bench-serve-") as d, workload(Path(d)) as (model, script, body, want):
        results["engine_p50_ms"] = engine_round_trip(model, args.workers)
        print(f"Engine.infer_async round trip, c=1: p50 {results['engine_p50_ms']:.3f} ms", flush=True)
        if "slabpool" in args.only and args.overhead_requests:
            from bench import serve_overhead

            results["overhead"] = serve_overhead.measure([str(REPO)], args.overhead_requests, False)[0]
        for name in args.only:
            results["servers"][name] = measure(name, args, model, script, body, want, Path(d))
    _summary(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def _summary(results: dict[str, Any]) -> None:
    servers = results["servers"]
    print("\n| server | c | req/s | p50 ms | p99 ms | non-2xx | lost |\n|---|---|---|---|---|---|---|")
    for name, r in servers.items():
        for load in r["loads"]:
            print(f"| {name} | {load['concurrency']} | {load['rps']:.0f} | {load['p50_ms']:.3f} | {load['p99_ms']:.3f} "
                  f"| {load['non_2xx']} | {load['lost']} |")
    print("\n| server (crash run, c=8, SIGKILL a worker every second) | kills | requests | failed | lost | p99 ms "
          "| serving after |\n|---|---|---|---|---|---|---|")
    for name, r in servers.items():
        if c := r["crash"]:
            print(f"| {name} | {c['kills']} | {c['load']['requests']} | {c['load']['non_2xx']} | {c['load']['lost']} "
                  f"| {c['load']['p99_ms']:.3f} | {c['serving_after']} |")
    if "slabpool" in servers and servers["slabpool"]["loads"][0]["concurrency"] == 1:
        added = servers["slabpool"]["loads"][0]["p50_ms"] - results["engine_p50_ms"]
        print(f"\nslabpool serve p50 at c=1 (wrk) minus Engine.infer_async's (another process, no load): "
              f"{added * 1e3:.0f} us")
    if o := results.get("overhead"):
        print(f"interleaved, one connection, c=1 (bench.serve_overhead): JSON request - engine round trip "
              f"{o['json - engine']:.0f} us, binary {o['binary - engine']:.0f} us, transport alone "
              f"{o['probe - engine']:.0f} us (engine {o['median_us']['engine']:.0f} us)")


if __name__ == "__main__":
    raise SystemExit(main())
