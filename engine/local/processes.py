"""The worker processes of a local Engine: spawn, start-up, the one selector that watches
every pipe and sentinel (and the wake-up pipe), rebuild, retire. What pebble calls the worker
manager; the supervisor (engine.local.supervisor) adds the tasks.

Each slot's status words live in one cache line at the start of the output arena: the id of
the task its worker is in (IDLE, or STACKED for a whole stacked batch), read after a death,
and when that task's time started (task_timeout).
"""

from __future__ import annotations

import logging
import os
import selectors
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from multiprocessing.context import BaseContext
from typing import Any

import numpy as np

from slabpool.engine.core.config import EngineConfig
from slabpool.engine.core.states import KillReason, SlotState
from slabpool.engine.local.slot import Slot
from slabpool.shm import Arena
from slabpool.workers import errors as E
from slabpool.workers.errors import crash_hint, describe_exit
from slabpool.workers.main import WorkerBoot
from slabpool.workers.pipeline import IDLE
from slabpool.workers.protocol import RemoteError, SessionInfo, Shutdown
from slabpool.workers.session import SessionSpec

log = logging.getLogger("slabpool.engine")


class SlotProcesses:
    """Every slot's process and pipe, and the selector over them. Not thread-safe: the owner
    thread (and, before it starts, the constructor's thread) alone calls these."""

    def __init__(
        self,
        cfg: EngineConfig,
        inputs: Arena,
        outputs: Arena,
        ctx: BaseContext,
        boot: Callable[[int, int, SessionSpec | None, int], WorkerBoot],
    ) -> None:
        self.cfg, self.inputs, self.outputs = cfg, inputs, outputs
        self.ctx, self.boot = ctx, boot
        self.slots = [Slot(i) for i in range(cfg.workers)]
        for slot in self.slots:
            slot.on_backlog = self._on_backlog
        self.specs: list[SessionSpec | None] = [cfg.session_spec()] * cfg.workers  # per slot
        self.info: SessionInfo | None = None  # the session's description, from the first Ready
        self._status_lease = outputs.lease(64 * cfg.workers)
        self.status = outputs.array(self._status_lease.offset, np.dtype(np.int64), (cfg.workers, 8))
        self.status[:, 0] = IDLE
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._wake_pending = False
        # closed under this lock, and never written once closed (CPython's _ThreadWakeup): a
        # caller's late wake() must not write into an fd number that something else now holds
        self._wake_lock = threading.Lock()
        self._wake_closed = False
        self._selector = selectors.DefaultSelector()
        self._watched: dict[int, tuple[Any, ...]] = {}
        self._watch_dirty = True  # set whenever a pipe or a process comes or goes

    def _drain(self, slot: Slot, to_end: bool = False) -> None:
        """Handle what a worker sent (the supervisor's)."""
        raise NotImplementedError

    def start_slots(self) -> None:
        """Spawn every slot, wait until all are READY; SessionInitError if one cannot start.
        On any exception (KeyboardInterrupt too) every worker started is killed and reaped."""
        try:
            for slot in self.slots:
                self._spawn(slot)
            self._wait_ready(time.monotonic() + self.cfg.startup_timeout)
        except BaseException:
            self._abort_startup()
            raise

    def _wait_ready(self, deadline: float) -> None:
        while any(s.state is SlotState.STARTING for s in self.slots):
            left = deadline - time.monotonic()
            if left <= 0:
                raise E.SessionInitError(f"workers not ready after {self.cfg.startup_timeout} s")
            waitables: list[Any] = [s.conn for s in self.slots if s.state is SlotState.STARTING and s.conn]
            waitables += [s.process.sentinel for s in self.slots if s.process]
            ready = wait(waitables, timeout=left)
            for slot in self.slots:
                if slot.conn is not None and slot.conn in ready:
                    self._drain(slot)
                if slot.process is not None and slot.process.sentinel in ready:
                    if slot.conn is not None:
                        self._drain(slot, to_end=True)
                    raise self._init_error(slot, slot.reap())

    def _abort_startup(self) -> None:
        if hasattr(self, "status"):
            del self.status
        for slot in self.slots:
            if slot.process is not None:
                slot.kill(KillReason.STARTUP_FAILED, grace=0.0)
                slot.escalate()
                slot.reap()
        self._close_wakeup()

    def _init_error(self, slot: Slot, code: int | None) -> E.SessionInitError:
        if slot.init_error is not None:
            err: RemoteError = slot.init_error
            exc = E.SessionInitError(f"slot {slot.index} could not build its session: {err.type_name}: {err.message}")
            exc.__cause__ = E.RemoteTraceback(err.traceback)
            return exc
        return E.SessionInitError(
            f"slot {slot.index} (pid {slot.pid}) died during start-up with {describe_exit(code)}."
            + (_unreported(self.cfg.start_method) if code == 1 else crash_hint(code))
        )

    def status_offset(self, slot: int) -> int:
        return self._status_lease.offset + 64 * slot

    def _spawn(self, slot: Slot) -> None:
        self._watch_dirty = True
        self.status[slot.index, 0:2] = IDLE, 0
        boot = self.boot(slot.index, slot.incarnation + 1, self.specs[slot.index], self.status_offset(slot.index))
        slot.spawn(self.ctx, boot, self.inputs.fd, self.outputs.fd)
        slot.spec = self.specs[slot.index]
        slot.ready_by = time.monotonic() + self.cfg.startup_timeout  # a rebuild is bounded like the first start

    def respawn(self, slot: Slot) -> None:
        """Rebuild a dead slot now (no back-off)."""
        slot.respawn_at = None
        self._spawn(slot)

    def replace_slot(self, slot: Slot, *, drain: bool) -> None:
        """Rebuild a live slot on its (new) spec: after what it holds (drain), or at once,
        handing its tasks back to the queue uncharged."""
        if slot.process is None:
            if slot.state is SlotState.DEAD:
                self.respawn(slot)
            return
        if slot.state is SlotState.STARTING:  # holds nothing yet: restart it on the new spec
            slot.kill(KillReason.RELOAD, grace=1.0)
            return
        slot.retiring = True
        if drain:
            self._maybe_retire(slot)
        else:
            slot.kill(KillReason.RELOAD, grace=1.0)

    def wake(self) -> None:
        if self._wake_pending:
            return  # a byte is already on its way: one wake-up serves every caller before it
        with self._wake_lock:
            if self._wake_closed:
                return  # the loop has stopped: nothing to wake
            self._wake_pending = True
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:
                pass  # the pipe is full: it is awake already

    def _sync_watch(self) -> None:
        """Bring the persistent selector in line with the live pipes and sentinels. Only after
        a spawn, a death or a closed pipe: a fresh poll set per step cost a third of the loop.
        A pipe is watched for writing too while its slot's outbox holds something."""
        want: dict[int, tuple[Any, ...]] = {self._wake_r: ("wake", None, None)}
        for s in self.slots:
            if s.conn is not None:
                want[s.conn.fileno()] = ("conn", s, s.conn)
            if s.process is not None:
                want[s.process.sentinel] = ("exit", s, s.process)
        for fd, data in list(self._watched.items()):
            if want.get(fd) is not data and want.get(fd) != data:
                try:
                    self._selector.unregister(fd)
                except (KeyError, ValueError, OSError):
                    pass
                del self._watched[fd]
        for fd, data in want.items():
            if fd not in self._watched:
                self._selector.register(fd, _events(data), data)
                self._watched[fd] = data
        self._watch_dirty = False

    def _on_backlog(self, slot: Slot) -> None:
        """A slot's outbox holds what its pipe did not take: watch the pipe for writing."""
        self._set_writing(slot, True)

    def _flush(self, slot: Slot) -> None:
        """Its pipe is writable: write what waits; stop watching for writing once all is out."""
        if slot.flush():
            self._set_writing(slot, False)

    def _set_writing(self, slot: Slot, on: bool) -> None:
        if slot.conn is None:
            return
        fd = slot.conn.fileno()
        data = self._watched.get(fd)
        if data is None:
            self._watch_dirty = True  # registered with its outbox's events on the next sync
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if on else 0)
        if self._selector.get_key(fd).events != events:
            self._selector.modify(fd, events, data)

    def _forget(self, fd: int) -> None:
        """Unwatch an fd before it is closed (its number may be reused at once)."""
        if self._watched.pop(fd, None) is not None:
            try:
                self._selector.unregister(fd)
            except (KeyError, ValueError, OSError):
                pass
        self._watch_dirty = True

    def _forget_slot(self, slot: Slot) -> None:
        if slot.conn is not None:
            self._forget(slot.conn.fileno())
        if slot.process is not None:
            self._forget(slot.process.sentinel)

    def _close_wakeup(self) -> None:
        with self._wake_lock:
            if self._wake_closed:
                return
            self._wake_closed = True
            self._selector.close()
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)

    def close_resources(self) -> None:
        self._close_wakeup()

    def _maybe_retire(self, slot: Slot) -> None:
        cfg = self.cfg
        if not slot.retiring:
            too_many = cfg.max_tasks_per_worker is not None and slot.incarnation_done >= cfg.max_tasks_per_worker
            too_big = cfg.worker_memory_limit is not None and slot.rss > cfg.worker_memory_limit
            if too_many or too_big:
                slot.retiring = True
                log.info("retiring slot %d: %s", slot.index, "max_tasks_per_worker" if too_many else "worker_memory_limit")
        if slot.retiring and not slot.batches and slot.kill_reason is None:
            slot.move(SlotState.RETIRING)
            slot.kill_reason = KillReason.RETIRE
            slot.kill_escalate_at = time.monotonic() + 10.0
            slot.send(Shutdown())


def _unreported(start_method: str) -> str:
    """Why a worker exits with 1 before its handshake and sends no error: Python exits so on an
    exception nothing caught, and the worker reports every exception from its entry point on.
    So, unless user code called os._exit(1), it was raised while multiprocessing started the
    process, before slabpool's code ran there (its traceback only on the worker's stderr)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    name = getattr(getattr(main, "__spec__", None), "name", None)
    where = f"importing the main module {name or path!r} again (as __mp_main__), or " if name or path else ""
    return (f" No error came back: most likely an exception was raised while multiprocessing started it "
            f"(start_method={start_method!r}), before slabpool's code ran there: {where}unpickling the "
            "initializer's initargs. Its traceback is on the worker's stderr, above.")


def _events(data: tuple[Any, ...]) -> int:
    """What to watch an fd for: a slot's pipe also for writing while its outbox is not empty."""
    slot = data[1]
    if data[0] == "conn" and slot.outbox:
        return selectors.EVENT_READ | selectors.EVENT_WRITE
    return selectors.EVENT_READ
