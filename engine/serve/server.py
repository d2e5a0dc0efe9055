"""Both transports on one event loop (uvloop), and the process's life: start, signals, drain.

    main thread, one uvloop event loop
      uvicorn (httptools) on the HTTP socket  --+
      grpc.aio server on the gRPC port        --+--> Frontend --> Engine.submit_async (per model)
      SIGTERM/SIGINT: drain   SIGHUP: reload every model from its file

    drain: ready answers 503 / false and new inferences 503 / UNAVAILABLE at once; what was
    accepted finishes (up to --drain-timeout, or a second SIGTERM/SIGINT: then what is left is
    cancelled, and answered 503 / UNAVAILABLE); then both servers stop, the engines close, and
    the process exits 0 (1 if the drain was cut short).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import uvicorn

from slabpool.engine.serve.core import Frontend
from slabpool.engine.serve.grpc import GrpcService
from slabpool.engine.serve.http import HttpApp
from slabpool.engine.serve.uvproto import READ_TIMEOUT_S, JoinedHttpToolsProtocol

log = logging.getLogger("slabpool.engine.serve")
MAX_REQUEST_BYTES = 64 * 2**20


def grpc_options(max_request_bytes: int) -> list[tuple[str, int]]:
    """A message past the limit is refused by grpcio before it is buffered: RESOURCE_EXHAUSTED."""
    return [
        ("grpc.so_reuseport", 0),  # a port in use is an error, not a second listener
        ("grpc.max_receive_message_length", max_request_bytes),
        ("grpc.max_send_message_length", 2**31 - 1),
    ]


@dataclass(frozen=True)
class Listen:
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    drain_timeout: float = 30.0
    max_request_bytes: int = MAX_REQUEST_BYTES
    read_timeout: float = READ_TIMEOUT_S


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """The server's own signal handlers stay: SIGTERM drains, SIGHUP reloads."""
        yield


def http_server(app: HttpApp, read_timeout: float = READ_TIMEOUT_S) -> uvicorn.Server:
    """uvicorn as serve runs it: its httptools protocol with each answer in one write
    (uvproto.py; the event loop is the caller's: uvloop), no lifespan, no websockets, no access
    log of its own (--access-log is the server's), and no proxy-headers middleware (its
    X-Forwarded-* rewrite of the client address, which nothing here reads, was a middleware
    call per request: ~10 us, docs/serve.md)."""
    config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False,
                            http=JoinedHttpToolsProtocol, ws="none", proxy_headers=False, timeout_graceful_shutdown=5)
    config.slabpool_read_timeout = read_timeout  # type: ignore[attr-defined]  # (uvproto: a slow client's limit)
    return _Uvicorn(config)


async def serve(fe: Frontend, listen: Listen, announce: Callable[[str], None]) -> bool:
    """Serve until SIGTERM/SIGINT, then drain; True when every accepted request was answered."""
    loop = asyncio.get_running_loop()
    sock = socket.create_server((listen.host, listen.http_port), backlog=2048)
    http = http_server(HttpApp(fe, listen.max_request_bytes), listen.read_timeout)
    rpc = grpc.aio.server(options=grpc_options(listen.max_request_bytes))
    rpc.add_generic_rpc_handlers((GrpcService(fe).handler(),))
    try:
        grpc_port = rpc.add_insecure_port(f"{listen.host}:{listen.grpc_port}")
    except RuntimeError as exc:
        sock.close()
        raise OSError(f"cannot listen for gRPC on {listen.host}:{listen.grpc_port}: {exc}") from None
    await rpc.start()
    http_task = asyncio.ensure_future(http.serve(sockets=[sock]))
    while not http.started and not http_task.done():
        await asyncio.sleep(0.01)
    _freeze_startup_heap()
    stop = asyncio.Event()
    hurry = asyncio.Event()  # a second SIGTERM/SIGINT during the drain: what is left is cancelled now

    def stop_on(sig: signal.Signals) -> None:
        if stop.is_set():
            log.warning("slabpool serve: %s again: the drain stops, what is left is cancelled", sig.name)
            fe.hurried_by = sig.name
            hurry.set()
            return
        fe.drained_by = sig.name
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_on, sig)
    loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(_reload_all(fe)))
    http_port = sock.getsockname()[1]
    announce(f"slabpool serve: HTTP on http://{listen.host}:{http_port}, gRPC on {listen.host}:{grpc_port}; "
             f"models: {', '.join(fe.repo)}")
    try:
        await asyncio.wait((asyncio.ensure_future(stop.wait()), http_task), return_when=asyncio.FIRST_COMPLETED)
        fe.draining = True
        log.warning("slabpool serve: draining %d requests (up to %s s)", fe.inflight, listen.drain_timeout)
        idle = asyncio.ensure_future(fe.wait_idle(listen.drain_timeout))
        hurried = asyncio.ensure_future(hurry.wait())
        await asyncio.wait((idle, hurried), return_when=asyncio.FIRST_COMPLETED)
        hurried.cancel()
        drained = idle.done() and idle.result()
        idle.cancel()
        # the engines close here, inside the loop: a reload still running (a worker that never
        # starts) ends with EngineClosed, its request answered. Closed after the loop (was), its
        # thread held the loop's executor, whose shutdown waited for it: the process never exited.
        # Not drained: what is left is cancelled, and answers 503 before the servers stop.
        with ThreadPoolExecutor(1, thread_name_prefix="slabpool-serve-close") as own:  # (not the loop's
            await loop.run_in_executor(own, fe.repo.close, 5.0, not drained)  # executor: reloads may hold it)
        if not drained:
            await fe.wait_idle(5.0)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        http.should_exit = True
        await rpc.stop(grace=1.0)
        await http_task
    return drained


def _freeze_startup_heap() -> None:
    """Move what start-up made (modules, engines, protobuf descriptors: ~50,000 objects) out of
    the collector's reach: a full collection then scans only what serving made since. Measured
    at concurrency 8 (docs/serve.md): without it, one gen-2 collection took 92 ms on a loaded
    2-core host and set the p99; requests allocate no cycles that these objects would hold."""
    gc.collect()
    gc.freeze()


async def _reload_all(fe: Frontend) -> None:
    for name, served in fe.repo.items():
        try:
            version = await served.reload()
        except Exception as exc:  # noqa: BLE001 - a failed reload leaves the old model serving
            log.error("slabpool serve: SIGHUP reload of %r failed, the old model keeps serving: %s", name, exc)
        else:
            log.warning("slabpool serve: %r reloaded from %s, version %s", name, served.path, version)


def run(fe: Frontend, listen: Listen) -> int:
    """Serve on a fresh uvloop event loop; close the engines; the exit status."""
    import uvloop

    def announce(line: str) -> None:
        print(line, flush=True)

    try:
        drained = uvloop.run(serve(fe, listen, announce))
    finally:
        fe.repo.close(timeout=5.0)
    if not drained:
        why = (f"a second {fe.hurried_by} ended the drain" if fe.hurried_by else
               f"the drain timeout ({listen.drain_timeout} s) passed")
        print(f"slabpool serve: {why} with requests in flight; they were cancelled", file=sys.stderr)
    return 0 if drained else 1
