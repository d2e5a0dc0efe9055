"""HTTP/1.1 on httptools' parser, as an asyncio Protocol: the server's own, with no ASGI layer.

    socket bytes -> data_received -> httptools parser callbacks
       on_url, on_header           the request line and headers (431 past MAX_HEAD_BYTES)
       on_headers_complete         Content-Length past the limit: 413 before a body byte is read;
                                   Expect: 100-continue answered
       on_body                     chunks, 413 as soon as a chunked body passes the limit
       on_message_complete         a `Request`: answered in order (pipelined ones wait their turn)
    handler(request) -> a `Response`, or a coroutine that makes one (run as this request's task)
    one transport.write of the status line, headers and body; keep-alive unless the client
    (HTTP/1.0, Connection: close) or the error says otherwise

A client that goes away (connection_lost) cancels the task of its request: a queued inference
is dropped by the engine, never run. Idle keep-alive connections are closed after
KEEP_ALIVE_S by the server's sweep. Why not ASGI on uvicorn: per request it builds a scope
dict, a cycle object, receive/send message dicts, a task, a disconnect watcher and two writes;
this is ~40 us of a ~60 us stack at concurrency 1 (docs/serve.md, measured).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote

import httptools

MAX_HEAD_BYTES = 64 * 1024  # the request line and headers together
KEEP_ALIVE_S = 5.0  # an idle connection is closed after this (uvicorn's default)
MAX_PIPELINED = 16  # complete requests waiting behind the one in flight: then reading pauses
JSON = b"application/json"


@dataclass
class Request:
    method: str
    path: str
    headers: dict[bytes, bytes]  # names lowercased; a repeated header keeps its last value
    body: bytes
    started: float = field(default_factory=time.perf_counter)
    gone: bool = False  # set before the task is cancelled when the client went away


@dataclass
class Response:
    status: int
    body: bytes
    content_type: bytes = JSON
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    close: bool = False  # close the connection after it (the rest of the request was not read)
    after: Callable[[], None] | None = None  # run once it is written (accounting: off the latency path)


Handler = Callable[[Request], "Response | Awaitable[Response]"]
Refuse = Callable[[int, str], Response]  # (status, message) -> the error answer
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


def encode(resp: Response, keep_alive: bool, head_only: bool = False) -> bytes:
    """The status line, headers and body as one buffer (HEAD: the same headers, no body)."""
    head = [b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n"
            % (resp.status, _REASONS.get(resp.status, b""), resp.content_type, len(resp.body))]
    for k, v in resp.headers:
        head.append(b"%s: %s\r\n" % (k, v))
    if not keep_alive:
        head.append(b"connection: close\r\n")
    head.append(b"\r\n")
    if not head_only:
        head.append(resp.body)
    return b"".join(head)


class Connection(asyncio.Protocol):
    """One client connection: parse, answer in order, cancel on disconnect."""

    def __init__(self, handler: Handler, refuse: Refuse, limit: int, conns: set[Connection]) -> None:
        self.handler, self.refuse, self.limit, self.conns = handler, refuse, limit, conns
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.pending: deque[tuple[Request | Response, bool]] = deque()  # not yet answered, in order
        self.running: asyncio.Task[Response] | None = None
        self.current: Request | None = None
        self.writable = True
        self.paused = False  # reading, while more than MAX_PIPELINED requests wait
        self.idle_since = time.monotonic()
        self._reset()

    def _reset(self) -> None:
        self.url, self.size, self.head_bytes = b"", 0, 0
        self.headers: dict[bytes, bytes] = {}
        self.chunks: list[bytes] = []
        self.refused = False

    # -- asyncio.Protocol ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport subclass
        self.conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.conns.discard(self)
        self.transport = None
        self.pending.clear()
        if self.running is not None and self.current is not None:
            self.current.gone = True
            self.running.cancel()

    def data_received(self, data: bytes) -> None:
        if self.refused:  # an answer that closes the connection is on its way; nothing more is read
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # an Upgrade (websocket, h2c) is not taken: the request is served
            pass
        except httptools.HttpParserError as exc:
            if not self.refused:
                self._refuse(400, f"malformed HTTP request: {exc}")

    def eof_received(self) -> bool:
        return False  # a half-closed client is a gone client (as uvicorn has it): close

    def pause_writing(self) -> None:
        self.writable = False

    def resume_writing(self) -> None:
        self.writable = True
        self._next()

    # -- httptools callbacks ------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._reset()

    def on_url(self, url: bytes) -> None:
        self.url += url
        self._head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value
        self._head(len(name) + len(value))

    def _head(self, n: int) -> None:
        self.head_bytes += n
        if self.head_bytes > MAX_HEAD_BYTES and not self.refused:
            self._refuse(431, f"the request line and headers pass {MAX_HEAD_BYTES} bytes")
            raise httptools.HttpParserError("head too large")

    def on_headers_complete(self) -> None:
        declared = self.headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            self._refuse(413, _too_large(f"its Content-Length is {int(declared)} bytes", self.limit))
            raise httptools.HttpParserError("body too large")
        if self.headers.get(b"expect", b"").lower() == b"100-continue" and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size > self.limit:
            self._refuse(413, _too_large(f"{self.size} bytes of it were read", self.limit))
            raise httptools.HttpParserError("body too large")
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        path = self.url.partition(b"?")[0].decode("latin-1")
        if "%" in path:
            path = unquote(path)
        body = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        req = Request(self.parser.get_method().decode("latin-1"), path, self.headers, body)
        self.pending.append((req, self.parser.should_keep_alive()))
        if len(self.pending) > MAX_PIPELINED and self.transport is not None and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._next()

    # -- answering, in order ------------------------------------------------------------------------

    def _next(self) -> None:
        while self.pending and self.running is None and self.writable and self.transport is not None:
            req, keep_alive = self.pending.popleft()
            out = req if isinstance(req, Response) else self._call(req)  # a Response: a refusal queued
            if isinstance(out, Response):
                self._write(out, keep_alive, isinstance(req, Request) and req.method == "HEAD")
                continue
            assert isinstance(req, Request)
            self.current = req
            self.running = asyncio.ensure_future(out)
            self.running.add_done_callback(functools.partial(self._done, keep_alive=keep_alive))

    def _call(self, req: Request) -> Response | Awaitable[Response]:
        try:
            return self.handler(req)
        except Exception as exc:  # noqa: BLE001 - a bug in a route answers 500; the connection lives on
            return self.refuse(500, f"internal error: {exc!r}")

    def _done(self, task: asyncio.Task[Response], keep_alive: bool) -> None:
        self.running = self.current = None
        if task.cancelled() or self.transport is None:
            return  # the client went away (or the server stops): nobody reads an answer
        exc = task.exception()
        resp = self.refuse(500, f"internal error: {exc!r}") if exc else task.result()
        self._write(resp, keep_alive)
        self._next()

    def _write(self, resp: Response, keep_alive: bool, head_only: bool = False) -> None:
        if self.transport is None:
            return
        keep = keep_alive and not resp.close
        self.transport.write(encode(resp, keep, head_only))
        self.idle_since = time.monotonic()
        if resp.after is not None:
            resp.after()
        if not keep:
            self.transport.close()
            self.transport = None
        elif self.paused and len(self.pending) <= MAX_PIPELINED:
            self.paused = False
            self.transport.resume_reading()

    def _refuse(self, status: int, message: str) -> None:
        """An answer that ends the connection: what follows the request cannot be read."""
        self.refused = True
        resp = self.refuse(status, message)
        resp.close = True
        self.pending.append((resp, False))  # after the answers of requests before it
        self._next()

    def idle(self, now: float) -> bool:
        return self.running is None and not self.pending and now - self.idle_since > KEEP_ALIVE_S

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _too_large(got: str, limit: int) -> str:
    return f"the request body is too large: {got}; the limit is {limit} bytes (--max-request-bytes)"


class Server:
    """The listening socket, its connections, and the sweep that closes idle ones."""

    def __init__(self, handler: Handler, refuse: Refuse, limit: int) -> None:
        self.handler, self.refuse, self.limit = handler, refuse, limit
        self.conns: set[Connection] = set()
        self._server: asyncio.AbstractServer | None = None
        self._sweep: asyncio.Task[None] | None = None

    async def start(self, sock: Any) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: Connection(self.handler, self.refuse, self.limit, self.conns), sock=sock, backlog=2048)
        self._sweep = asyncio.ensure_future(self._sweeping())

    async def _sweeping(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for c in [c for c in self.conns if c.idle(now)]:
                c.close()

    async def stop(self) -> None:
        """Stop accepting; close every connection (the drain has answered what was accepted)."""
        if self._sweep is not None:
            self._sweep.cancel()
        if self._server is not None:
            self._server.close()
        for c in list(self.conns):
            c.close()
        if self._server is not None:
            await self._server.wait_closed()
