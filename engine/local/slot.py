"""One slot: a worker process, its private pipe, and the batches it holds, in order.

The head of `batches` is the one running; the rest were sent ahead and wait in the pipe.
A slot is rebuilt in place: same index, new process, new pipe, new incarnation number.
"""

from __future__ import annotations

import os
import signal
import time
from collections import deque
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any

from slabpool.engine.core.states import KillReason, SlotState
from slabpool.engine.core.task import Batch
from slabpool.engine.local.forks import WORKER_NAME
from slabpool.shm.mapping import PassFd
from slabpool.workers.main import SealedBoot, WorkerBoot, main
from slabpool.workers.protocol import SessionInfo, encode
from slabpool.workers.wire import FrameReader


class Slot:
    def __init__(self, index: int) -> None:
        self.index = index
        self.state = SlotState.NEW
        self.incarnation = 0
        self.process: BaseProcess | None = None
        self.conn: Connection | None = None
        self.reader: FrameReader | None = None  # reads conn's frames in bulk
        self.pid = 0
        self.info: SessionInfo | None = None
        self.batches: deque[Batch] = deque()
        self.tasks_done = 0  # over every incarnation
        self.incarnation_done = 0  # by the current process (max_tasks_per_worker)
        self.restarts = 0
        self.startup_failures = 0
        self.init_error: Any = None  # the InitFailed error of the current incarnation
        self.spec: Any = None  # the SessionSpec the current incarnation was started on
        self.respawn_at: float | None = None
        self.kill_reason: KillReason | None = None  # why we are killing it (None: we are not)
        self.kill_escalate_at: float | None = None
        self.retiring = False
        self.stalled_since: float | None = None  # its running batch made no progress for stall_after
        self.rss = 0
        self.model_version = ""

    # -- lifecycle ----------------------------------------------------------------------------

    def move(self, new: SlotState) -> None:
        self.state.check(new)
        self.state = new

    def spawn(self, ctx: BaseContext, boot: WorkerBoot, in_fd: int, out_fd: int) -> None:
        parent, child = ctx.Pipe(duplex=True)
        self.incarnation += 1
        proc = ctx.Process(  # type: ignore[attr-defined]
            target=main,
            args=(SealedBoot.of(boot), child, PassFd(in_fd), PassFd(out_fd)),  # see SealedBoot
            name=f"{WORKER_NAME}{self.index}",  # how a forked child tells them (local.forks)
            daemon=True,
        )
        proc.start()
        child.close()
        self.process, self.conn, self.pid = proc, parent, proc.pid or 0
        self.reader = FrameReader(parent.fileno())
        self.batches.clear()
        self.incarnation_done = 0
        self.init_error = None
        self.kill_reason = self.kill_escalate_at = self.respawn_at = None
        self.retiring = False
        self.stalled_since = None
        self.move(SlotState.STARTING)

    def send(self, msg: Any) -> bool:
        """Send a message; False if the pipe is broken (the worker is dying: its sentinel fires)."""
        return self.send_bytes(encode(msg))

    def send_bytes(self, data: bytes) -> bool:
        """Send an encoded message; False if the pipe is broken."""
        if self.conn is None:
            return False
        try:
            self.conn.send_bytes(data)
            return True
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            return False

    def kill(self, reason: KillReason, grace: float = 0.5) -> None:
        """SIGTERM now, SIGKILL after `grace`: the only way to stop code that will not return."""
        if self.process is None or self.kill_reason is not None:
            return
        self.kill_reason = reason
        self.kill_escalate_at = time.monotonic() + grace
        self._signal(signal.SIGTERM)

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
        self.process, self.conn, self.reader = None, None, None
        return code

    # -- views --------------------------------------------------------------------------------

    @property
    def can_take(self) -> bool:
        return self.state in (SlotState.READY, SlotState.BUSY) and not self.retiring and self.stalled_since is None

    def __repr__(self) -> str:
        return f"<Slot {self.index} {self.state.name} pid={self.pid} holds={len(self.batches)}>"
