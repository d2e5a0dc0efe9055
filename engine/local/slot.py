"""One slot's worker process, its private pipe, and the batches sent to it, in order (the
local transport's; the slot's state and tasks are the owner's, engine.core.slots).

The head of `sent` is the one running; the rest were sent ahead and wait in the pipe.
A slot is rebuilt in place: same index, new process, new pipe, new incarnation number.

The supervisor never blocks writing a pipe: its end does not block, and what the pipe does not
take now waits in the slot's `outbox`, written when the selector says the pipe is writable. A
worker blocked sending its BatchDone (or its log records) is then always read, whatever the
sizes: two ends that both block on a send while neither reads would wait for ever.
"""

from __future__ import annotations

import os
import signal
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any

from slabpool.engine.local.forks import WORKER_NAME
from slabpool.engine.local.regions import Sent
from slabpool.shm.mapping import PassFd
from slabpool.workers.main import SealedBoot, WorkerBoot, main
from slabpool.workers.protocol import Shutdown, encode
from slabpool.workers.wire import FrameReader, head

SPAWN_FDS = 8  # file descriptors a worker's start holds at once: its pipe, and multiprocessing's
# socket and two pipes to the forkserver (or the spawned child's)


def _fds_free(n: int) -> None:
    """OSError (EMFILE) now if this process cannot open `n` more file descriptors: before a
    start, not midway through the forkserver's handshake. There a client that runs out of them
    (its os.pipe() after the connect) kills CPython's forkserver (an EOFError it does not catch,
    3.11), and every worker it started then reads as dead (exit 255): one slot's rebuild in a
    process at its limit on open files would take every slot down."""
    held: list[int] = []
    try:
        for _ in range(n):
            held.append(os.open(os.devnull, os.O_RDONLY))
    finally:
        for fd in held:
            os.close(fd)


class Slot:
    """The process side of one slot (its state and tasks are the owner's, engine.core.slots)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.incarnation = 0
        self.process: BaseProcess | None = None
        self.conn: Connection | None = None
        self.fd = -1  # conn's file descriptor, kept while conn is set (Connection.fileno() is two Python calls)
        self.reader: FrameReader | None = None  # reads conn's frames in bulk
        self.pid = 0
        self.up = False  # this incarnation sent its Ready
        self.sent: deque[Sent] = deque()  # batches sent and not yet answered, in order
        self.init_error: Any = None  # the InitFailed error of the current incarnation
        self.killing = False  # told to exit, or signalled: its death is coming
        self.kill_escalate_at: float | None = None
        self.outbox = bytearray()  # frames written to the pipe only in part, or not yet
        self.on_backlog: Callable[[Slot], None] = _no_backlog  # told when the outbox fills
        self.lent = False  # its pipe is a waiting caller's to poll, not the selector's (core.fastpath)

    # -- lifecycle ----------------------------------------------------------------------------

    def spawn(self, ctx: BaseContext, boot: WorkerBoot, in_fd: int, out_fd: int) -> None:
        """A new incarnation of this slot's worker. OSError if the OS refuses it (out of file
        descriptors: EMFILE at once, see `_fds_free`), nothing kept of it."""
        _fds_free(SPAWN_FDS)
        parent, child = ctx.Pipe(duplex=True)
        self.incarnation += 1
        proc = ctx.Process(  # type: ignore[attr-defined]
            target=main,
            args=(SealedBoot.of(boot), child, PassFd(in_fd), PassFd(out_fd)),  # see SealedBoot
            name=f"{WORKER_NAME}{self.index}",  # how a forked child tells them (local.forks)
            daemon=True,
        )
        try:
            proc.start()
        except BaseException:  # (the OS refused the process: EMFILE, EAGAIN; its pipe is not kept)
            parent.close()
            child.close()
            raise
        child.close()
        os.set_blocking(parent.fileno(), False)
        self.process, self.conn, self.pid, self.fd = proc, parent, proc.pid or 0, parent.fileno()
        self.reader = FrameReader(parent.fileno())
        self.outbox = bytearray()
        self.sent.clear()
        self.init_error = None
        self.up = self.killing = self.lent = False
        self.kill_escalate_at = None

    def send(self, msg: Any) -> bool:
        """Send a message; False if the pipe is broken (the worker is dying: its sentinel fires)."""
        return self.send_bytes(encode(msg))

    def send_bytes(self, data: bytes) -> bool:
        """Send an encoded message without blocking: what the pipe does not take now waits in
        the outbox, in order (see `flush`). False if the pipe is broken."""
        if self.conn is None:
            return False
        if self.outbox:  # behind what waits already
            self.outbox += head(len(data))
            self.outbox += data
            return True
        frame = head(len(data))
        try:
            n = os.writev(self.fd, (frame, data))
        except BlockingIOError:
            n = 0
        except OSError:
            return False  # the worker is dying: its sentinel fires
        if n < len(frame) + len(data):
            if n < len(frame):
                self.outbox += frame[n:]
                self.outbox += data
            else:
                self.outbox += memoryview(data)[n - len(frame) :]
            self.on_backlog(self)
        return True

    def flush(self) -> bool:
        """Write what the pipe takes of the outbox now (it said it is writable); True once the
        outbox is empty. A broken pipe empties it: the worker is dying, nothing will read."""
        if self.conn is None:
            self.outbox.clear()
            return True
        try:
            n = os.write(self.fd, self.outbox)
        except BlockingIOError:
            return False
        except OSError:
            self.outbox.clear()
            return True
        del self.outbox[:n]
        return not self.outbox

    def kill(self, grace: float = 0.5) -> None:
        """SIGTERM now, SIGKILL after `grace`: the only way to stop code that will not return."""
        if self.process is None or self.killing:
            return
        self.killing = True
        self.kill_escalate_at = time.monotonic() + grace
        self._signal(signal.SIGTERM)

    def ask_exit(self, grace: float) -> None:
        """Shutdown on the pipe (the worker exits once it has answered what it holds), SIGKILL
        after `grace`."""
        if self.process is None or self.killing:
            return
        self.killing = True
        self.kill_escalate_at = time.monotonic() + grace
        self.send(Shutdown())

    def escalate(self) -> None:
        self.kill_escalate_at = None
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        try:
            if self.pid:
                os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def reap(self) -> int | None:
        """Join the dead process and close its pipe; return its exit code."""
        assert self.process is not None
        self.process.join()
        code = self.process.exitcode
        if self.conn is not None:
            self.conn.close()
        self.process.close()
        self.process, self.conn, self.reader, self.fd = None, None, None, -1
        self.lent = False
        self.outbox = bytearray()  # nobody will read it
        return code

    def __repr__(self) -> str:
        return f"<worker of slot {self.index} pid={self.pid} sent={len(self.sent)}>"


def _no_backlog(slot: Slot) -> None:
    """Until the owner of the selector says whom to tell."""
