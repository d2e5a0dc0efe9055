"""`slabpool serve MODEL [MODEL ...]`: its arguments, and the start of the server.

This module imports only argparse: `slabpool --help` must not load uvicorn or grpcio. The
server's modules are imported when `serve` runs, and a missing extra says how to install it.
"""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path
from typing import Any

_NAME = re.compile(r"[A-Za-z0-9_.-]+")
SERVE_EXAMPLES = """\
examples:
  slabpool serve model.onnx                          HTTP on 127.0.0.1:8000, gRPC on 127.0.0.1:8001
  slabpool serve resnet=r50.onnx mlp.onnx --workers 4 --max-batch-size 8   (dynamic batching)
  slabpool serve model.onnx --http-port 0 --grpc-port 0     (free ports, printed at start)

Status codes: 400 bad request or input contract; 404 unknown model; 500 the model failed or
the request killed --max-attempts workers; 503 queue full or draining; 504 the request's timeout.
SIGTERM drains (exit 0); SIGHUP reloads every model from its file. See docs/serve.md.
"""


# the engine's spin_us for a server: 4x Engine's default, since between one request's answer
# and the next one's engine call the server does a request's HTTP work (~300-500 us on 2 cores),
# which a 250 us poll in the worker misses (bench.serve_ab at one connection, docs/serve.md)
SERVE_SPIN_US = 1000.0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port 0-65535 (0: any free port), got {text}")
    return value


def _milliseconds(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be milliseconds >= 0, got {text}")
    return value


def _spin(text: str) -> float:
    from slabpool.engine.core.config import MAX_SPIN_US

    value = float(text)
    if not 0 <= value <= MAX_SPIN_US:
        raise argparse.ArgumentTypeError(f"must be microseconds in [0, {MAX_SPIN_US:g}], got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def add_parser(sub: Any, **kw: Any) -> argparse.ArgumentParser:
    """The `serve` subcommand on the `slabpool` command's subparsers."""
    p: argparse.ArgumentParser = sub.add_parser(
        "serve", help="serve models over the Open Inference Protocol (KServe V2), HTTP and gRPC",
        description="Serve each MODEL (its own engine, named after its file, or NAME=PATH) over HTTP/REST "
                    "and gRPC. A worker that dies is rebuilt and the requests it held are replayed.",
        epilog=SERVE_EXAMPLES, **kw)
    p.add_argument("models", nargs="+", metavar="MODEL", help="PATH (.onnx/.tflite) or NAME=PATH")
    p.add_argument("--workers", type=_positive_int, help="worker processes per model (default: usable CPUs)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--http-port", type=_port, default=8000, help="HTTP port (default 8000; 0: a free one)")
    p.add_argument("--grpc-port", type=_port, default=8001, help="gRPC port (default 8001; 0: a free one)")
    p.add_argument("--queue-capacity", type=_positive_int, default=1024,
                   help="requests that may wait for a worker, per model (default 1024)")
    p.add_argument("--admission", choices=("reject", "block"), default="reject",
                   help="when the queue is full: reject (503 at once, the default) or block (wait for room, "
                        "up to the request's timeout)")
    p.add_argument("--max-batch-size", type=_positive_int, default=1,
                   help="concurrent requests stacked into one model call (dynamic batching; default 1: off, "
                        "as in Triton and MLServer)")
    p.add_argument("--max-batch-wait-ms", type=_milliseconds, default=0.0,
                   help="how long a batch may wait for more requests to fill it (default 0: it takes what is "
                        "queued and never waits, as Triton's max_queue_delay_microseconds)")
    p.add_argument("--max-attempts", type=_positive_int, default=3,
                   help="worker deaths a request may cause before it fails with 500 (default 3)")
    p.add_argument("--task-timeout", type=_positive_float, help="seconds a request may run in a worker")
    p.add_argument("--preprocess", metavar="MOD:FN", help="runs in the workers: inputs -> model feeds")
    p.add_argument("--postprocess", metavar="MOD:FN", help="runs in the workers: (outputs, inputs) -> outputs")
    p.add_argument("--initializer", metavar="MOD:FN", help="runs once in each worker at start")
    p.add_argument("--start-method", choices=("forkserver", "spawn"), default="forkserver")
    p.add_argument("--spin-us", type=_spin, default=SERVE_SPIN_US,
                   help="an idle request's engine call polls this long before it sleeps, in the server "
                        f"and in its worker (default {SERVE_SPIN_US:g}: a request's HTTP work sits between "
                        "two engine calls; 0: never, for a host busy with other work)")
    p.add_argument("--drain-timeout", type=_positive_float, default=30.0,
                   help="seconds SIGTERM waits for accepted requests (default 30)")
    p.add_argument("--max-request-bytes", type=_positive_int, default=64 * 2**20,
                   help="largest request body (HTTP) or message (gRPC); larger ones answer 413 / "
                        "RESOURCE_EXHAUSTED before they are buffered (default 64 MiB)")
    p.add_argument("--read-timeout", type=_positive_float, default=30.0,
                   help="seconds an HTTP client has to send a request's headers, and the longest pause in its "
                        "body; a slower one is disconnected (it would hold its connection for ever; default 30)")
    p.add_argument("--access-log", action="store_true", help="one JSON line per request on stderr")
    p.add_argument("--verbose", "-v", action="store_true", default=argparse.SUPPRESS)
    p.set_defaults(func=cmd_serve)
    return p


def model_specs(items: list[str]) -> list[tuple[str, str]]:
    """NAME=PATH or PATH (named after the file's stem) -> [(name, path)], names unique."""
    out: list[tuple[str, str]] = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep:
            name, path = Path(item).stem, item
        if not _NAME.fullmatch(name):  # it goes into URLs (v2/models/NAME) unescaped
            raise ValueError(f"model name {name!r} (from {item!r}) must be one or more of A-Z a-z 0-9 _ . -; "
                             "name it with NAME=PATH")
        if not Path(path).is_file():
            raise FileNotFoundError(f"model not found: {path}")
        if name in (n for n, _ in out):
            raise ValueError(f"two models are named {name!r}; name them apart with NAME=PATH")
        out.append((name, path))
    return out


def cmd_serve(args: argparse.Namespace, argv: list[str]) -> int:
    specs = model_specs(args.models)
    try:
        from slabpool.engine.serve import server
        from slabpool.engine.serve.core import Frontend
        from slabpool.engine.serve.metrics import RequestMetrics
        from slabpool.engine.serve.models import Repository, Served
    except ModuleNotFoundError as exc:
        raise ImportError(f"slabpool serve needs {exc.name}: pip install 'slabpool[serve]'") from None
    from slabpool.engine.local.pool import Engine

    if args.access_log:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        access = logging.getLogger("slabpool.engine.serve.access")
        access.addHandler(handler)
        access.setLevel(logging.INFO)
        access.propagate = False
    settings = dict(
        workers=args.workers, queue_capacity=args.queue_capacity, admission=args.admission,
        max_batch_size=args.max_batch_size, max_batch_wait_ms=args.max_batch_wait_ms,
        max_attempts=args.max_attempts, task_timeout=args.task_timeout, preprocess=args.preprocess,
        postprocess=args.postprocess, initializer=args.initializer, start_method=args.start_method,
        spin_us=args.spin_us,
    )
    served: list[Served] = []
    metrics = RequestMetrics()
    try:
        for name, path in specs:
            served.append(Served(name, path, Engine(path, **settings)))
            metrics.add_engine(name, served[-1].engine)
    except BaseException:
        Repository(served).close()
        raise
    fe = Frontend(Repository(served), metrics, log_access=args.access_log)
    listen = server.Listen(args.host, args.http_port, args.grpc_port, args.drain_timeout, args.max_request_bytes,
                           args.read_timeout)
    return server.run(fe, listen)
