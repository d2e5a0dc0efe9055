"""`python -m bench.serve_stacks`: what the HTTP stack alone costs, to choose the one under
`slabpool serve` (docs/serve.md). Each candidate serves the same POST (read the body, answer a
fixed JSON) with no model behind it, under the same wrk load, twice in alternation:

    raw-joined      the same app on uvicorn, httptools, uvloop, with serve's protocol class
                    (engine/serve/uvproto.py: an answer's head and body in one write)    (what serve uses)
    raw-httptools   the same app on uvicorn's own httptools protocol (two writes an answer)
    raw-h11         the same app on uvicorn's pure-Python h11 parser, asyncio loop
    starlette       a Starlette Route (Request.body(), Response) on uvicorn, httptools, uvloop
    protocol        an asyncio Protocol on httptools' parser, uvloop, no ASGI  (the servefast branch's h1.py: not kept)
    granian         the same ASGI app on granian (Rust HTTP), embedded in the uvloop loop as serve
                    would embed it (granian.server.embed, one runtime thread); only with
                    --granian-python, a Python that has granian (it is no extra of this project)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.serve import LUA, _free_port, _http, wrk

ANSWER = b'{"model_name":"mlp","outputs":[{"name":"probs","datatype":"FP32","shape":[1,8],"data":[0.1,0.2]}]}'
APP = """
import sys
ANSWER = {answer!r}
async def raw(scope, receive, send):
    if scope["type"] != "http":
        return
    msg = await receive()
    while msg.get("more_body"):
        msg = await receive()
    await send({{"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]}})
    await send({{"type": "http.response.body", "body": ANSWER}})
def starlette():
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route
    async def infer(request):
        await request.body()
        return Response(ANSWER, media_type="application/json")
    return Starlette(routes=[Route("/v2/models/{{name}}/infer", infer, methods=["POST"])])
class Proto:
    def connection_made(self, transport):
        import httptools
        self.t, self.p = transport, httptools.HttpRequestParser(self)
    def data_received(self, data):
        self.p.feed_data(data)
    def on_message_complete(self):
        self.t.write(b"HTTP/1.1 200 OK\\r\\ncontent-type: application/json\\r\\ncontent-length: %d\\r\\n\\r\\n%s"
                     % (len(ANSWER), ANSWER))
    def connection_lost(self, exc):
        pass
    def pause_writing(self):
        pass
    def resume_writing(self):
        pass
    def eof_received(self):
        pass
kind, port = sys.argv[1], int(sys.argv[2])
if kind == "protocol":
    import asyncio, uvloop
    async def main():
        srv = await asyncio.get_running_loop().create_server(Proto, "127.0.0.1", port)
        await srv.serve_forever()
    uvloop.run(main())
    sys.exit()
app = starlette() if kind == "starlette" else raw
if kind == "granian":
    import asyncio, uvloop
    from granian.constants import Interfaces
    from granian.server.embed import Server
    async def main():
        await Server(raw, address="127.0.0.1", port=port, interface=Interfaces.ASGI, log_enabled=False,
                     websockets=False).serve()
    uvloop.run(main())
    sys.exit()
import uvicorn
http, loop = ("h11", "asyncio") if kind == "raw-h11" else ("httptools", "uvloop")
if kind == "raw-joined":
    from slabpool.engine.serve.uvproto import JoinedHttpToolsProtocol as http
uvicorn.run(app, host="127.0.0.1", port=port, http=http, loop=loop, log_level="warning", access_log=False,
            lifespan="off")
"""
KINDS = ("protocol", "raw-joined", "raw-httptools", "raw-h11", "starlette", "granian")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve_stacks")
    p.add_argument("--duration", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--only", type=lambda s: s.split(","), default=list(KINDS[:-1]), help="kinds, comma-separated")
    p.add_argument("--granian-python", help="a Python with granian installed (for the granian kind)")
    args = p.parse_args(argv)
    if "granian" in args.only and not args.granian_python:
        p.error("the granian kind needs --granian-python (granian is no extra of this project)")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "body.json").write_bytes(b'{"inputs":[{"name":"x","shape":[1,16],"datatype":"FP32","data":[' +
                                        b",".join([b"0.5"] * 16) + b"]}]}")
        (tmp / "post.lua").write_text(LUA.format(body=tmp / "body.json"))
        (tmp / "app.py").write_text(APP.format(answer=ANSWER))
        rows: dict[str, list[tuple[float, float, float]]] = {k: [] for k in args.only}
        for _ in range(args.rounds):
            for kind in args.only:
                port = _free_port()
                python = args.granian_python if kind == "granian" else sys.executable
                proc = subprocess.Popen([python, str(tmp / "app.py"), kind, str(port)])
                try:
                    url = f"http://127.0.0.1:{port}/v2/models/mlp/infer"
                    while _http("POST", url, b"{}")[0] != 200:
                        time.sleep(0.1)
                    c1, c8 = wrk(url, tmp / "post.lua", 1, args.duration), wrk(url, tmp / "post.lua", 8, args.duration)
                    rows[kind].append((c1.p50_ms * 1e3, c8.rps, c8.p99_ms))
                finally:
                    proc.terminate()
                    proc.wait()
    print("| stack | p50 at c=1 (us) | req/s at c=8 | p99 at c=8 (ms) |\n|---|---|---|---|")
    for kind, runs in rows.items():
        print(f"| {kind} | {' / '.join(f'{r[0]:.0f}' for r in runs)} | {' / '.join(f'{r[1]:.0f}' for r in runs)} "
              f"| {' / '.join(f'{r[2]:.2f}' for r in runs)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
