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
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

JOIN_BYTES = 64 * 1024
DISCONNECT = "slabpool_disconnect"  # the scope extension: callbacks to run when the client goes away


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
        super().connection_made(JoinedWrites(transport, self.loop))  # type: ignore[arg-type]

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {DISCONNECT: self.on_lost}  # type: ignore[dict-item]  # ASGI types it loosely

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        cycles = self.unanswered
        if not cycles or cycles[-1] is not self.cycle:  # a new request (not an upgrade's early return)
            while cycles and cycles[0].response_complete:  # answered in order: the oldest go first
                del cycles[0]
            cycles.append(self.cycle)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if not self.cycle.more_body and not self.pipeline and self.refused is None:
            self.flow.resume_reading()  # (see the module's docstring: a large body's pause)

    def connection_lost(self, exc: Exception | None) -> None:
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
