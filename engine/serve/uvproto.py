"""uvicorn's httptools protocol, with each answer leaving in one write instead of two, and the
connection's end told to the app at once.

An ASGI answer is two messages, `http.response.start` (the head) and `http.response.body`, and
uvicorn writes each to the transport as it comes: two `write` calls, and on loopback two
deliveries to the client, which wakes for a head it cannot use yet (seen with strace; uvloop
writes at once when nothing is buffered). This protocol is uvicorn's own (`Config(http=...)`
takes a protocol class), given a transport that holds what is written until the answer is
complete, then hands it on in one `writelines` (one `writev`):

    cycle.send(start)  -> write(head)     held
    cycle.send(body)   -> write(body)     held
    on_response_complete                  flushed: one writev, then uvicorn's own step

Nothing else changes: every other call goes to the real transport, and whatever is held is
flushed first by close() and write_eof(), and at the latest at the loop's next turn (a
100-continue interim line, a streamed answer's chunks, an error uvicorn writes itself).

The connection's end: ASGI tells an app that its client went away only through `receive()`,
which a waiting handler would have to await in a task of its own (~20 us a request, and more
of them the longer requests wait: under load, when the event loop can least afford it). The
protocol knows it first (`connection_lost`), so it offers each request's scope an extension,
`scope["extensions"][DISCONNECT]`: a list the app puts a callback in while it waits, called
when the connection is lost (http.py cancels the request with it). Before the callbacks, every
request of the connection not yet answered is marked disconnected: uvicorn marks only its
newest (`self.cycle`, which is a queued pipelined request while an earlier one runs), and the
earlier one, cancelled by its callback and so left unanswered, was taken for an app that forgot
to answer: an ERROR logged, and a 500 written to the closed transport (a RuntimeError).

A large body: uvicorn stops reading the socket while more than 64 KiB (`HIGH_WATER_LIMIT`)
of a body waits for the app, and reads again only when the app calls `receive()`, which an app
that has its whole body never does again. So a client that went away after sending a large
request was not seen (its FIN waits unread behind the paused socket) until the request had
run. Once a request is complete and none is pipelined behind it, reading resumes here: there
is nothing left of it to buffer, and a request that follows is held by uvicorn's own pause
for pipelined requests.

Bytes the parser refuses end the connection with uvicorn's 400, written as they arrive; here
after the answers to the requests before them on the connection (RFC 9112: pipelined answers
in the order of their requests). uvicorn wrote it at once, so a client that pipelined a good
request and a bad one read the 400 as its good request's answer, and lost that answer. Bad
bytes inside a request's body (a chunk's framing) are that request's: its 400 goes at once.

A client too slow to send its request: its headers must arrive within `read_timeout` seconds
of the request's first byte (or of the connection, for its first request), and its body
without a pause longer than that; else the connection is closed. uvicorn times only the idle
keep-alive between requests, so a client that dribbled its headers or body (slowloris) held
its connection, and its file descriptor, for ever: 300 of them, with a host's fd limit, were
enough to stop every rebuild of a worker (a hostile run).

Started at once: an app may offer `eager(scope)`, a handler for a route whose work needs no
ASGI (serve's inference: http.py). A request it takes, which came whole in one read, the only
request of its connection in flight, runs in that read's `data_received`, not in a Task
scheduled for the loop's next turn (eager.py), and its answer is written here (`answer`: what
uvicorn's send does with a complete answer, in one write):

    data_received  parse: uvicorn's cycle (its state: keep-alive, disconnected, pipelining)
                   the body complete, no other request queued  -> the handler, started now
                   else (more body to come, pipelined, 100-continue) -> uvicorn's ASGI task
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from slabpool.engine.serve import eager

JOIN_BYTES = 64 * 1024
READ_TIMEOUT_S = 30.0  # a request's headers, and each pause in its body (the config's slabpool_read_timeout)
DISCONNECT = "slabpool_disconnect"  # the scope extension: callbacks to run when the client goes away
Headers = list[tuple[bytes, bytes]]
Respond = Callable[[int, bytes, Headers], Awaitable[None]]  # an answer: status, body, headers
Handler = Callable[[bytes, Respond], Coroutine[Any, Any, None]]  # a route started at once: body, respond
log = logging.getLogger("uvicorn.error")  # (where uvicorn logs what an app raised)


class JoinedWrites:
    """A transport that holds writes until flush() (scheduled at the first held write)."""

    __slots__ = ("_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._held:
            self._loop.call_soon(self.flush)  # nothing may wait past this turn
        self._held.append(data)

    def flush(self) -> None:
        held = self._held
        if not held:
            return
        self._held = []
        if len(held) == 1:
            self._transport.write(held[0])
        elif sum(map(len, held)) <= JOIN_BYTES:  # a copy this small is cheaper than writelines
            self._transport.write(b"".join(held))
        else:
            self._transport.writelines(held)  # one writev, no copy of a large body

    def is_closing(self) -> bool:  # asked several times an answer: not through __getattr__
        return self._transport.is_closing()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def __getattr__(self, name: str) -> Any:  # is_closing, get_extra_info, pause_reading, ...
        return getattr(self._transport, name)


class JoinedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol on a JoinedWrites transport: a complete answer is flushed
    the moment uvicorn marks it complete, before it starts the next pipelined request; and
    the DISCONNECT extension in every request's scope."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.on_lost: list[Callable[[], None]] = []
        self.unanswered: list[RequestResponseCycle] = []  # this connection's requests, running or pipelined
        self.refused: str | None = None  # a 400 waiting for the answers before it
        self.reading = False  # in data_received: a request the app takes at once waits for its end
        self.deferred: tuple[RequestResponseCycle, Any, Handler] | None = None
        # a request being read (its headers, or its body: `in_body`) must arrive by `read_by`
        # (headers: read_timeout from its first byte; a body: from its last read). Kept as a
        # time, not a timer a request: one timer, only while a request spans reads (a request
        # whole in one read makes none: three timers a request were ~5 us of the event loop)
        self.read_timeout: float = getattr(self.config, "slabpool_read_timeout", READ_TIMEOUT_S)
        self.partial, self.in_body = True, False  # (the first request is awaited from the connection)
        self.read_by = self.loop.time() + self.read_timeout
        self.read_timer: asyncio.TimerHandle | None = self.loop.call_later(self.read_timeout, self._read_due)
        super().connection_made(JoinedWrites(transport, self.loop))  # type: ignore[arg-type]

    def _read_due(self) -> None:
        """The request being read is late (its headers past read_timeout, a pause in its body as
        long): the connection is closed, nothing of it can be answered. Else look again then."""
        self.read_timer = None
        if not self.partial or self.transport.is_closing():
            return
        if self.flow.read_paused:  # (the server is not reading: a request pipelined behind one that
            self.read_by = self.loop.time() + self.read_timeout  # runs, a large body the app has not taken)
        left = self.read_by - self.loop.time()
        if left > 0:
            self.read_timer = self.loop.call_later(left, self._read_due)
            return
        log.debug("closing a connection whose request did not arrive within %s s", self.read_timeout)
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.in_body:
            self.read_by = self.loop.time() + self.read_timeout
        self.reading = True
        try:
            super().data_received(data)
        finally:
            self.reading = False
        if self.partial and self.read_timer is None:  # (a request spans reads: its deadline watched)
            self.read_timer = self.loop.call_later(max(0.0, self.read_by - self.loop.time()), self._read_due)
        deferred = self.deferred
        if deferred is None:
            return
        self.deferred = None
        cycle, app, handler = deferred
        if cycle.more_body or cycle is not self.cycle or self.pipeline or cycle.disconnected \
                or self.transport.is_closing():
            super()._start_asgi_task(cycle, app)  # what uvicorn did at its headers
            return
        self._start_now(cycle, handler)

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        """At a request's headers (or a pipelined one's turn): an ASGI task, as uvicorn starts
        it, unless the app takes this request at once (a handler): then it waits for the end
        of this read, which may bring its whole body."""
        route = getattr(app, "eager", None)
        handler = route(cycle.scope) if route is not None and self.reading and not cycle.waiting_for_100_continue \
            else None
        if handler is None:
            super()._start_asgi_task(cycle, app)
            return
        self.deferred = (cycle, app, handler)

    def _start_now(self, cycle: RequestResponseCycle, handler: Handler) -> None:
        body = bytes(cycle.body)
        cycle.body = bytearray()
        try:
            task = eager.run(self.loop, handler(body, functools.partial(self.answer, cycle)))
        except BaseException as exc:  # noqa: BLE001 - what uvicorn's run_asgi does with it
            self._ended(cycle, exc)
            return
        if task is None:
            self._ended(cycle, None)
            return
        self.tasks.add(task)  # (uvicorn's shutdown waits for these)
        task.add_done_callback(self.tasks.discard)
        task.add_done_callback(lambda t: self._ended(cycle, asyncio.CancelledError() if t.cancelled() else t.exception()))

    def _ended(self, cycle: RequestResponseCycle, exc: BaseException | None) -> None:
        """A handler's end, checked as uvicorn's run_asgi checks an ASGI app's (a Task
        cancelled, by the server's shutdown, is an exception there too)."""
        if exc is not None:
            log.error("Exception in ASGI application\n", exc_info=exc)
        elif cycle.response_complete or cycle.disconnected:
            return
        else:
            log.error("ASGI callable returned without starting response.")
        if not cycle.response_started and not cycle.disconnected:
            eager.run(self.loop, cycle.send_500_response())  # (written now: the server may be stopping)
        elif not cycle.response_complete:
            self.transport.close()

    async def answer(self, cycle: RequestResponseCycle, status: int, body: bytes, headers: Headers) -> None:
        """A whole answer on `cycle`, as uvicorn's send writes an http.response.start and its
        one body (headers made by the app: valid names and values, a content-length), in one
        write; then uvicorn's own step to the next request."""
        if cycle.response_started:  # (uvicorn's send refuses a second answer too)
            raise RuntimeError(f"a second answer ({status}) to a request already answered")
        if cycle.flow.write_paused and not cycle.disconnected:
            await cycle.flow.drain()
        if cycle.disconnected:
            return
        cycle.response_started = True
        head = [STATUS_LINE[status]]
        for name, value in cycle.default_headers:
            head += (name, b": ", value, b"\r\n")
        for name, value in headers:
            head += (name, b": ", value, b"\r\n")
        if (b"connection", b"close") in headers:  # the app's own (a draining server's: http.py), as
            cycle.keep_alive = False  # uvicorn's send reads it: the connection ends with this answer
        elif not cycle.keep_alive:
            head.append(b"connection: close\r\n")
        head.append(b"\r\n")
        self.transport.write(b"".join(head))
        self.transport.write(body)
        cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            self.transport.close()
        cycle.on_response()

    def on_message_begin(self) -> None:
        self.partial, self.read_by = True, self.loop.time() + self.read_timeout  # (its headers from its first byte)
        super().on_message_begin()
        self.scope["extensions"] = {DISCONNECT: self.on_lost}  # type: ignore[dict-item]  # ASGI types it loosely

    def on_headers_complete(self) -> None:
        self.in_body, self.read_by = True, self.loop.time() + self.read_timeout
        super().on_headers_complete()
        cycles = self.unanswered
        if not cycles or cycles[-1] is not self.cycle:  # a new request (not an upgrade's early return)
            while cycles and cycles[0].response_complete:  # answered in order: the oldest go first
                del cycles[0]
            cycles.append(self.cycle)

    def on_message_complete(self) -> None:
        self.partial = self.in_body = False  # (whole: it runs as long as it runs; uvicorn times the keep-alive after it)
        super().on_message_complete()
        if not self.cycle.more_body and not self.pipeline and self.refused is None:
            self.flow.resume_reading()  # (see the module's docstring: a large body's pause)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.read_timer is not None:
            self.read_timer.cancel()
        for cycle in self.unanswered:  # uvicorn marks only self.cycle: the newest
            if not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
        super().connection_lost(exc)
        for callback in list(self.on_lost):
            callback()

    def on_response_complete(self) -> None:
        self.transport.flush()  # type: ignore[attr-defined]
        super().on_response_complete()
        if self.refused is not None and self._answered() and not self.transport.is_closing():
            super().send_400_response(self.refused)

    def send_400_response(self, msg: str) -> None:
        waiting = [c for c in self.unanswered if not c.response_complete]
        if not waiting or any(c.more_body for c in waiting):  # none before it, or the bad bytes are
            super().send_400_response(msg)  # in a request's own body: its 400 at once (uvicorn's)
            return
        self.refused = msg  # after whole requests: sent when the last of them is answered
        self.flow.pause_reading()  # what follows the bad bytes is never parsed

    def _answered(self) -> bool:
        return all(c.response_complete for c in self.unanswered)
