"""`python -m bench.serve_ab`: servers side by side at one concurrency, in interleaved rounds.

Every server is up at once, and each round runs wrk on each in turn, so a change in the host's
load (a shared machine) falls on all of them alike; the table gives each server's median over
the rounds. Besides latency and throughput it gives the CPU time each request cost the server
(its event loop thread, its other threads: the engine's owner thread and lanes) and its workers,
read from /proc: less sensitive to other work on the host than a latency.

    SPEC  NAME=CHECKOUT[ FLAGS]   `slabpool serve` from a checkout (PYTHONPATH), with more flags
          NAME=fastapi            bench/serve_fastapi.py (the throwaway venv of bench.serve)
          NAME=mlserver           MLServer, parallel_workers (the same venv)

    python -m bench.serve_ab base=/tmp/serve-base "after=. " "batched=. --max-batch-size 8" f=fastapi
    python -m bench.serve_ab --concurrency 1 --rounds 5 a=/tmp/serve-base b=.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import serve as S

COLUMNS = ("req/s", "p50 ms", "p99 ms", "loop us", "threads us", "workers us")


def start(name: str, spec: str, model: Path, tmp: Path, venv: Path) -> S.Running:
    if spec in ("fastapi", "mlserver"):
        return S.start(spec, model, 2, tmp, venv, [])
    repo, _, flags = spec.partition(" ")
    repo = str(Path(repo).resolve())
    port = S._free_port()
    argv = [sys.executable, "-m", "slabpool", "serve", f"mlp={model}", "--workers", "2", "--http-port", str(port),
            "--grpc-port", "0", *flags.split()]
    return S.Running(name, argv, port, Path(repo), env={"PYTHONPATH": repo})


def _cpu(pid: int) -> tuple[float, float, float]:
    """CPU seconds so far: the main thread, the other threads, the descendants."""
    import psutil

    proc = psutil.Process(pid)
    threads = {t.id: t.user_time + t.system_time for t in proc.threads()}
    kids = 0.0
    for child in proc.children(recursive=True):
        try:
            kids += sum(child.cpu_times()[:2])
        except psutil.Error:
            pass
    main = threads.pop(pid, 0.0)
    return main, sum(threads.values()), kids


def one_round(srv: S.Running, script: Path, concurrency: int, seconds: float) -> tuple[float, ...]:
    before = _cpu(srv.proc.pid)
    load = S.wrk(f"{srv.url}/v2/models/mlp/infer", script, concurrency, seconds)
    after = _cpu(srv.proc.pid)
    per = [(a - b) / max(load.requests, 1) * 1e6 for a, b in zip(after, before, strict=True)]
    if load.non_2xx or load.lost:
        raise RuntimeError(f"{srv.name}: {load.non_2xx} non-2xx and {load.lost} lost answers")
    return (load.rps, load.p50_ms, load.p99_ms, *per)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve_ab", description=__doc__.split("\n\n")[0])
    p.add_argument("servers", nargs="+", metavar="NAME=SPEC")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--duration", type=int, default=3, help="whole seconds of load per server per round (wrk)")
    p.add_argument("--venv", type=Path, default=S.DEFAULT_VENV, help="the throwaway venv for MLServer and FastAPI")
    args = p.parse_args(argv)
    specs = [s.split("=", 1) for s in args.servers]
    rows: dict[str, list[tuple[float, ...]]] = {name: [] for name, _ in specs}
    loads: list[float] = []
    with tempfile.TemporaryDirectory(prefix="slabpool-bench-ab-") as d, S.workload(Path(d)) as (model, script, body, _):
        servers: dict[str, S.Running] = {}
        try:
            for name, spec in specs:
                servers[name] = start(name, spec, model, Path(d), args.venv)
            for srv in servers.values():
                srv.wait_ready(body)
                S.wrk(f"{srv.url}/v2/models/mlp/infer", script, args.concurrency, 1.0)  # warm-up
            for r in range(args.rounds):
                for name, srv in servers.items():
                    rows[name].append(one_round(srv, script, args.concurrency, args.duration))
                    loads.append(os.getloadavg()[0])
                    print(f"round {r} {name}: " + ", ".join(f"{c} {v:.2f}" for c, v in zip(COLUMNS, rows[name][-1],
                                                                                             strict=True)), flush=True)
        finally:
            for srv in servers.values():
                srv.stop()
    report(rows, args, loads)
    return 0


def report(rows: dict[str, list[tuple[float, ...]]], args: Any, loads: list[float]) -> None:
    print(f"\nc={args.concurrency}, {args.rounds} rounds of {args.duration:g} s, medians; load average "
          f"{min(loads):.1f}-{max(loads):.1f} (CPU us per request: the server's event loop thread, its other "
          "threads, its workers)")
    print("| server | " + " | ".join(COLUMNS) + " |\n" + "|---" * (len(COLUMNS) + 1) + "|")
    for name, runs in rows.items():
        med = [statistics.median(col) for col in zip(*runs, strict=True)]
        print(f"| {name} | {med[0]:,.0f} | {med[1]:.2f} | {med[2]:.2f} | " + " | ".join(f"{v:.0f}" for v in med[3:])
              + " |")


if __name__ == "__main__":
    raise SystemExit(main())
