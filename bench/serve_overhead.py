"""`python -m bench.serve_overhead`: what `slabpool serve` adds to the engine at concurrency 1,
measured side by side in one run, and where it goes (the table in docs/serve.md).

A server process runs the real server (engine/serve/server.py, one engine, 2 workers) with one
more route, `GET /bench/engine`, which awaits `engine.submit_async` (what the inference route
awaits) of the same tensor in that process and answers the nanoseconds it took. One client
connection alternates: a JSON inference, a binary one, the probe. So each server answer is paired with an engine round trip
taken the moment before and after, on the same engine, under the same load:

    json - engine        what the server adds to a JSON request (client, TCP, HTTP, decode, encode)
    binary - engine      the same with the binary tensor extension
    probe - engine       the transport alone: client, TCP, HTTP/1.1, uvicorn's task, the ASGI send

With --hops, the server stamps each hop of the inference requests (perf_counter_ns; patched in
here, never in the server's code) and prints their medians. Several servers (--repo A --repo B:
two checkouts, e.g. before and after a change) are measured in the same alternation.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
_HOPS = [  # (name, from stamp, to stamp)
    ("HTTP parse (bytes in -> request)", "recv", "parsed"),
    ("to the route (started at once, or the app's task), body received", "parsed", "decode>"),
    ("decode (JSON / binary -> numpy)", "decode>", "decode<"),
    ("front end to the engine", "decode<", "eng>"),
    ("submit_async (the engine)", "eng>", "eng<"),
    ("select outputs, back to the handler", "eng<", "encode>"),
    ("encode", "encode>", "encode<"),
    ("encode -> send", "encode<", "write>"),
    ("send: the answer (serve's protocol, or uvicorn's send)", "write>", "write<"),
    ("send -> accounting", "write<", "record>"),
    ("accounting (metrics)", "record>", "record<"),
]


# -- the server side (a child process) ----------------------------------------------------------------


def serve(model: str, port_file: str, hops: bool) -> None:
    import uvloop

    from slabpool.engine.local.pool import Engine
    from slabpool.engine.serve import server
    from slabpool.engine.serve.core import Frontend
    from slabpool.engine.serve.metrics import RequestMetrics
    from slabpool.engine.serve.models import Repository, Served

    try:  # the engine as `slabpool serve` builds it
        from slabpool.engine.serve.cli import SERVE_SPIN_US

        settings: dict[str, Any] = {"spin_us": SERVE_SPIN_US}
    except ImportError:  # (a checkout from before spin_us, measured beside this one)
        settings = {}
    eng = Engine(model, workers=2, **settings)
    metrics = RequestMetrics()
    fe = Frontend(Repository([Served("mlp", model, eng)]), metrics)
    x = {"x": np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)}
    medians = _stamp(eng) if hops else None
    from slabpool.engine.serve import http

    class App(http.HttpApp):
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            path = scope.get("path")
            if path == "/bench/engine":
                t0 = time.perf_counter_ns()
                await eng.submit_async(x)
                await _answer(send, b"%d" % (time.perf_counter_ns() - t0))
            elif path == "/bench/hops":
                await _answer(send, json.dumps(medians() if medians else {}).encode())
            else:
                await super().__call__(scope, receive, send)

    server.HttpApp = App  # type: ignore[misc]

    def announce(line: str) -> None:
        Path(port_file).write_text(line.split("http://", 1)[1].split(",", 1)[0].rsplit(":", 1)[1])

    try:
        uvloop.run(server.serve(fe, server.Listen(http_port=0, grpc_port=0), announce))
    finally:
        fe.repo.close(timeout=5)


async def _answer(send: Any, body: bytes) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


def _stamp(eng: Any) -> Any:
    """Stamps around each hop of one request at a time (concurrency 1); their medians by kind.
    The HTTP hops are uvicorn's (httptools_impl): bytes in, the request complete, the app's
    send of the answer's start and of its body."""
    from uvicorn.protocols.http import httptools_impl as uv

    from slabpool.engine.serve import core, http, uvproto

    pc = time.perf_counter_ns
    st: dict[str, Any] = {}
    got: dict[str, dict[str, list[int]]] = {}

    def keep() -> None:
        if "record<" in st and "decode>" in st and "write>" in st:
            for name, a, b in _HOPS:
                got.setdefault(st["kind"], {}).setdefault(name, []).append(st[b] - st[a])
            got[st["kind"]].setdefault("total, bytes in -> written", []).append(st["write<"] - st["recv"])

    def around(owner: Any, name: str, key: str, before: Any = None) -> None:
        f = getattr(owner, name)

        def g(*a: Any, **k: Any) -> Any:
            if before:
                before(*a)
            st[key + ">"] = pc()
            try:
                return f(*a, **k)
            finally:
                st[key + "<"] = pc()

        setattr(owner, name, g)

    recv, complete = uv.HttpToolsProtocol.data_received, uv.HttpToolsProtocol.on_message_complete
    send = uv.RequestResponseCycle.send

    def data_received(self: Any, data: bytes) -> None:
        keep()
        st.clear()
        st["recv"] = pc()
        recv(self, data)

    def on_message_complete(self: Any) -> None:
        st["parsed"] = pc()
        complete(self)

    async def send_stamped(self: Any, message: Any) -> None:
        start = message["type"] == "http.response.start"
        if start:
            st["write>"] = pc()
        await send(self, message)
        if not start:
            st["write<"] = pc()

    uv.HttpToolsProtocol.data_received = data_received  # type: ignore[method-assign]
    uv.HttpToolsProtocol.on_message_complete = on_message_complete  # type: ignore[method-assign]
    uv.RequestResponseCycle.send = send_stamped  # type: ignore[method-assign]
    answer = getattr(uvproto.JoinedHttpToolsProtocol, "answer", None)  # (an inference started at once)

    async def answer_stamped(self: Any, *a: Any) -> None:
        st["write>"] = pc()
        await answer(self, *a)
        st["write<"] = pc()

    if answer is not None:
        uvproto.JoinedHttpToolsProtocol.answer = answer_stamped  # type: ignore[method-assign]
    around(http, "decode_request", "decode", lambda *a: st.update(kind="json" if a[3] is None else "binary"))
    around(http, "encode_response", "encode")
    around(core.Frontend, "record", "record")
    submit = type(eng).submit_async

    async def submit_async(self: Any, *a: Any, **k: Any) -> Any:
        st["eng>"] = pc()
        try:
            return await submit(self, *a, **k)
        finally:
            st["eng<"] = pc()

    type(eng).submit_async = submit_async

    def medians() -> dict[str, dict[str, float]]:
        out = {kind: {k: statistics.median(v) / 1e3 for k, v in h.items()} for kind, h in got.items()}
        got.clear()
        return out

    return medians


# -- the client side ------------------------------------------------------------------------------------


def _request(method: str, path: str, body: bytes = b"", headers: str = "") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def _roundtrip(sock: socket.socket, req: bytes) -> tuple[bytes, bytes]:
    sock.sendall(req)
    buf = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"the server closed the connection; it answered {buf[:300]!r}")
        buf += chunk
        i = buf.find(b"\r\n\r\n")
        if i >= 0:
            head = buf[:i].lower()
            n = int(head[head.find(b"content-length:") + 15:].split(b"\r\n")[0])
            while len(buf) < i + 4 + n:
                buf += sock.recv(65536)
            return buf[:i], buf[i + 4 : i + 4 + n]


def measure(repos: list[str], n: int, hops: bool, turn: int = 25) -> list[dict[str, Any]]:
    from tests.models import onnx_models

    with tempfile.TemporaryDirectory(prefix="slabpool-bench-overhead-") as d:
        model = onnx_models.mlp(Path(d) / "mlp.onnx")
        procs, socks = [], []
        try:
            for i, repo in enumerate(repos):
                pf = Path(d) / f"port{i}"
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "bench.serve_overhead", "--serve", str(model), str(pf)] + (["--hops"] * hops),
                    cwd=repo, env={**os.environ, "PYTHONPATH": repo}, stdout=subprocess.DEVNULL))
                while not pf.exists():
                    if procs[-1].poll() is not None:
                        raise RuntimeError(f"the server of {repo} did not start")
                    time.sleep(0.1)
            for i in range(len(repos)):  # once all are up: an idle keep-alive connection is closed after 5 s
                s = socket.create_connection(("127.0.0.1", int((Path(d) / f"port{i}").read_text())))
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                socks.append(s)
            return _alternate(socks, n, hops, turn)
        finally:
            for s in socks:
                s.close()
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(60)


def _alternate(socks: list[socket.socket], n: int, hops: bool, turn: int = 25, warm: int = 300) -> list[dict[str, Any]]:
    """Rounds of (json, binary, probe), `turn` rounds on each server in turn, each turn started
    by two unmeasured probes. An engine that polls (spin_us) has, at the start of a turn, slept
    while the other servers were measured: the first call's poll runs out, and its back-off
    (workers.wire.Spin) makes the next wait sleep too; the two probes take those wake-ups. And
    the server measured before goes on polling for a while after its last answer (its
    workers' spin_us, 1 ms under serve), on the cores the next server is measured on: turns
    of many rounds leave that to their first requests (was: one round a turn, in which it
    overlapped most of the turn). (The probe is not stamped by --hops.)"""
    x = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
    jb = json.dumps({"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": x.ravel().tolist()}]})
    hb = json.dumps({"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32",
                                 "parameters": {"binary_data_size": 64}}], "parameters": {"binary_data_output": True}})
    reqs = {"json": _request("POST", "/v2/models/mlp/infer", jb.encode()),
            "binary": _request("POST", "/v2/models/mlp/infer", hb.encode() + x.tobytes(),
                               f"Inference-Header-Content-Length: {len(hb)}\r\n"),
            "probe": _request("GET", "/bench/engine")}
    times: list[dict[str, list[int]]] = [{k: [] for k in (*reqs, "engine")} for _ in socks]

    def rounds(s: socket.socket, t: dict[str, list[int]] | None, count: int) -> None:
        _roundtrip(s, reqs["probe"])
        _roundtrip(s, reqs["probe"])
        for _ in range(count):
            for kind, req in reqs.items():
                t0 = time.perf_counter_ns()
                head, body = _roundtrip(s, req)
                dt = time.perf_counter_ns() - t0
                assert b" 200 " in head.split(b"\r\n")[0] + b" ", (head, body)
                if t is not None:
                    t[kind].append(dt)
                    if kind == "probe":
                        t["engine"].append(int(body))

    for s in socks:  # warm-up, unmeasured
        rounds(s, None, warm)
        if hops:
            _roundtrip(s, _request("GET", "/bench/hops"))  # drop the warm-up's stamps
    for done in range(0, n, turn):
        for s, t in zip(socks, times, strict=True):
            rounds(s, t, min(turn, n - done))
    out = []
    for s, t in zip(socks, times, strict=True):
        med = {k: statistics.median(v) / 1e3 for k, v in t.items()}
        row: dict[str, Any] = {"median_us": med, **{f"{k} - engine": med[k] - med["engine"] for k in reqs}}
        if hops:
            row["hops_us"] = json.loads(_roundtrip(s, _request("GET", "/bench/hops"))[1])
        out.append(row)
    return out


def report(repos: list[str], rows: list[dict[str, Any]]) -> None:
    for repo, row in zip(repos, rows, strict=True):
        med = row["median_us"]
        print(f"{repo}: medians (us) json {med['json']:.0f}, binary {med['binary']:.0f}, probe {med['probe']:.0f}, "
              f"engine {med['engine']:.0f}; json - engine {row['json - engine']:.0f}, binary - engine "
              f"{row['binary - engine']:.0f}, probe - engine {row['probe - engine']:.0f}")
        for kind, h in row.get("hops_us", {}).items():
            print(f"  {kind}: " + ", ".join(f"{k} {v:.1f}" for k, v in h.items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000, help="rounds of (json, binary, probe) per server")
    p.add_argument("--repo", action="append", help="a checkout to measure (repeat: side by side); default this one")
    p.add_argument("--hops", action="store_true", help="stamp each hop in the server (adds ~1 us per stamp)")
    p.add_argument("--turn", type=int, default=25, help="rounds on one server before the next server's turn")
    p.add_argument("--runs", type=int, default=1,
                   help="measure this many times, servers started anew each time (the host's placement of "
                        "client, server and workers moves every figure of a run together): each run, then "
                        "the median of the runs")
    p.add_argument("--serve", nargs=2, metavar=("MODEL", "PORT_FILE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.serve[0], args.serve[1], args.hops)
        return 0
    repos = args.repo or [str(REPO)]
    runs = []
    for _ in range(args.runs):
        runs.append(measure(repos, args.requests, args.hops, args.turn))
        report(repos, runs[-1])
    if args.runs > 1:
        for i, repo in enumerate(repos):
            each = {k: sorted(round(r[i][f"{k} - engine"]) for r in runs) for k in ("json", "binary", "probe")}
            print(f"{repo}: over {args.runs} runs, the server's answer - the engine (us): "
                  + "; ".join(f"{k} median {statistics.median(v):.0f} (runs: {', '.join(map(str, v))})"
                              for k, v in each.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
