"""The supervisor: the owner thread of a local Engine (engine.core.owner), with its task
ledger (engine.core.ledger). Steps 3-4 and 8-9 of the task flow and the whole crash path (the
diagram in `engine/__init__.py`).

One thread waits on every worker's pipe, every worker's process sentinel and one wake-up pipe
in one selector; its timeout is the next timer (a task's time limit, a batch still filling, a
back-off, a stall), never a polling interval. Callers never touch slots: they put tasks in the
admission queue, hand the thread callables (`call`), and wake it.

What it decides with, kept apart: dispatch limits (engine.core.dispatch, pure), who is charged
after a death (engine.core.recovery, pure), output regions (engine.local.regions), overdue and
stalled work (engine.local.watchdog), the stop path (engine.local.stopping); each slot's
process and pipe: engine.local.slot.
"""

from __future__ import annotations

import logging
import os
import selectors
import time
from collections.abc import Callable
from multiprocessing.context import BaseContext
from typing import Any

from slabpool.engine.core import recovery
from slabpool.engine.core.admission import TaskQueue
from slabpool.engine.core.config import EngineConfig
from slabpool.engine.core.ledger import crash_error
from slabpool.engine.core.owner import OwnerThread
from slabpool.engine.core.states import KillReason, SlotState, TaskState
from slabpool.engine.core.task import Batch, Task
from slabpool.engine.local import stopping, watchdog
from slabpool.engine.local.dispatcher import Dispatcher
from slabpool.engine.local.reload import Reload
from slabpool.engine.local.slot import Slot
from slabpool.shm import Arena
from slabpool.workers import errors as E
from slabpool.workers import packing
from slabpool.workers.errors import Crash, crash_hint, describe_exit
from slabpool.workers.main import WorkerBoot
from slabpool.workers.pipeline import IDLE
from slabpool.workers.protocol import (
    SPLIT,
    BatchDone,
    FlatSkeleton,
    InitFailed,
    LogRecord,
    NeedOutput,
    Ready,
    Revoke,
    SessionInfo,
    decode,
    open_result,
)
from slabpool.workers.session import SessionSpec

log = logging.getLogger("slabpool.engine")
MAX_STARTUP_FAILURES = 5


class Supervisor(Dispatcher, OwnerThread):
    """Owns every slot of a local Engine and ends every task exactly once: the loop, the
    workers' messages, deaths, timers and what callers ask for. Its bases: `Dispatcher`
    (steps 3-4: what goes where; 9: what a batch gives back), itself on `SlotProcesses` (the
    processes: spawn, watch, rebuild, retire) and the task ledger; `OwnerThread` (the thread
    and its calls)."""

    def __init__(
        self,
        cfg: EngineConfig,
        queue: TaskQueue,
        inputs: Arena,
        outputs: Arena,
        ctx: BaseContext,
        boot: Callable[[int, int, SessionSpec | None, int], WorkerBoot],
        metrics: Any,
    ) -> None:
        OwnerThread.__init__(self, "slabpool-supervisor")
        Dispatcher.__init__(self, cfg, queue, metrics, inputs, outputs, ctx, boot)
        self.reload: Reload | None = None  # a hot model swap in progress
        self.on_stopped: Callable[[], None] = self.close_resources

    def start(self) -> None:
        """Every worker ready, then the loop: from here on only the owner thread acts."""
        self.start_slots()
        self.start_loop()

    # -- the loop ------------------------------------------------------------------------------

    def _stopped(self) -> None:
        stopping.stop(self)  # the stop path: engine.local.stopping

    def _step(self) -> None:
        now = time.monotonic()
        if self._watch_dirty:
            self._sync_watch()
        events = self._selector.select(self._next_timer(now))
        ready = {key.data for key, mask in events if mask & selectors.EVENT_READ}
        for key, mask in events:
            if mask & selectors.EVENT_WRITE:
                self._flush(key.data[1])  # what waits in its outbox, before anything new
        if ("wake", None, None) in ready:
            os.read(self._wake_r, 4096)
            self._wake_pending = False  # after the read: a wake() from here on writes again,
            # and one that saw True before it is served below (its work is already queued)
        self.run_calls()
        for slot in self.slots:
            if slot.conn is not None and ("conn", slot, slot.conn) in ready:
                self._drain(slot)
            if slot.process is not None and ("exit", slot, slot.process) in ready:
                self._on_death(slot)
        now = time.monotonic()
        self._timers(now)
        self._dispatch(now)
        self.flush()

    def _finished(self) -> bool:
        if self.failure is not None:
            return True
        if self.closing is None:
            return False
        # a batch taken back from a stalled worker holds no task: close() does not wait for it
        return len(self.queue) == 0 and all(b.revoked for s in self.slots for b in s.batches)

    # -- messages from workers (steps 8-9) ------------------------------------------------------

    def _drain(self, slot: Slot, to_end: bool = False) -> None:
        """Handle what the worker sent: one read() when its pipe is readable; everything
        that can be read when it is dead (`to_end`: what it sent before dying still counts)."""
        conn, reader = slot.conn, slot.reader
        assert conn is not None and reader is not None
        try:
            frames = reader.read_to_end() if to_end else reader.read()
        except (EOFError, OSError):
            frames = None
        for frame in frames or ():
            self._on_message(slot, decode(frame))
        if frames is None:
            slot.conn = None  # the worker is gone; its sentinel will fire
            self._forget(conn.fileno())
            conn.close()

    def _on_message(self, slot: Slot, msg: Any) -> None:
        if isinstance(msg, BatchDone):
            self._on_batch_done(slot, msg)
        elif isinstance(msg, NeedOutput):
            self._on_need_output(slot, msg)
        elif isinstance(msg, LogRecord):  # worker logs join the caller's logging
            logging.getLogger(None if msg.name == "root" else msg.name).log(
                msg.level, msg.message, extra=msg.fields
            )
        elif isinstance(msg, Ready):
            slot.move(SlotState.READY)
            slot.ready_by = None
            slot.pid = msg.pid
            slot.startup_failures = 0
            if msg.info is not None:
                self.info = self.info or msg.info
                slot.info = msg.info
                slot.model_version = msg.info.model_digest
            if self.reload is not None:
                self.reload.on_ready(self, slot)
        elif isinstance(msg, InitFailed):
            slot.init_error = msg.error

    def _on_batch_done(self, slot: Slot, msg: BatchDone) -> None:
        if not slot.batches or slot.batches[0].id != msg.batch_id:
            log.warning("dropped a stale completion of batch %d from slot %d", msg.batch_id, slot.index)
            return
        batch = slot.batches.popleft()
        now = time.monotonic()
        if slot.stalled_since is not None:
            log.warning("slot %d (pid %d) makes progress again, after %.1f s", slot.index, slot.pid,
                        now - slot.stalled_since)
            slot.stalled_since = None
        if batch.revoked:  # its tasks ran elsewhere: only what it held goes back
            self._end_batch(batch)
            self._after_batch(slot, now)
            return
        slot.tasks_done += len(batch.tasks)
        slot.incarnation_done += len(batch.tasks)
        slot.rss = msg.rss or slot.rss
        per_task = msg.run_s / max(len(batch.tasks), 1)
        self._task_s = per_task if self._task_s is None else 0.9 * self._task_s + 0.1 * per_task
        used = 0
        split: list[Task] = []
        tasks = {t.id: t for t in batch.tasks}
        for outcome in msg.outcomes:
            task = tasks[outcome.task_id]
            if task.state.is_terminal:
                continue  # cancelled while it ran: its result is dropped, its inputs go back below
            if outcome.error is not None:
                if outcome.error.kind == SPLIT:
                    split.append(task)  # its outputs did not fit beside the others': again, apart
                else:
                    self.finish(task, error=E.from_remote(outcome.error, task.id))
                continue
            packed = outcome.outputs
            assert packed is not None
            used += packing.region_size(packed)
            self._deliver(slot, task, packed, msg.run_s / len(batch.tasks), now)
        if not split:  # (a split batch's sizes were learnt from its NeedOutput)
            self.regions.observed(batch, used)
        if msg.in_place:
            self.count("outputs_in_place", msg.in_place)
        self._end_batch(batch)  # step 9: leases go back now that the run has really ended
        if split:
            self._requeue_apart(batch, split)
        self._after_batch(slot, now)

    def _deliver(self, slot: Slot, task: Task, packed: Any, run_s: float, now: float) -> None:
        """Step 8 for one task: open its result, copy its outputs out; what fails here (a
        result that does not unpickle, no memory left in this process for the copy) fails
        that task alone."""
        t0 = time.perf_counter()
        try:
            if type(packed.skeleton) is not FlatSkeleton:
                packed = open_result(packed)  # made by user code: it may not unpickle here
            outputs = packing.unpack(packed, self.outputs.array, copy=True, items=False)  # step 8
        except E.TaskDataError as exc:
            self.finish(task, error=E.TaskDataError(f"task {task.id}: {exc}", task_id=task.id))
            return
        except MemoryError:
            self.finish(task, error=E.TaskDataError(
                f"task {task.id}: this process ran out of memory copying its outputs "
                f"({packing.region_size(packed)} bytes) out of shared memory", task_id=task.id))
            return
        copy_s = time.perf_counter() - t0
        self.finish(task, result=task.result(outputs, slot.model_version, slot.index, slot.pid, run_s, copy_s, now))

    def _after_batch(self, slot: Slot, now: float) -> None:
        if slot.batches:
            self._promote(slot, now)
        elif slot.state is SlotState.BUSY:
            slot.move(SlotState.READY)
        self._maybe_retire(slot)

    def _on_need_output(self, slot: Slot, msg: NeedOutput) -> None:
        batch = next((b for b in slot.batches if b.id == msg.batch_id), None)
        if batch is None:
            return
        grant = self.regions.on_need(batch, msg.nbytes)
        if grant is not None:  # (None: it waits for the next release, _grant_waiting)
            slot.send(grant)

    # -- deaths (the crash path: a-d) ----------------------------------------------------------

    def _on_death(self, slot: Slot) -> None:
        if slot.conn is not None:
            self._drain(slot, to_end=True)  # what it sent before dying still counts
        expected = slot.kill_reason
        was_starting = slot.state is SlotState.STARTING
        pid = slot.pid
        self._forget_slot(slot)
        code = slot.reap()
        running_id = int(self.status[slot.index, 0])  # no writer is left: read what it was doing
        for b in slot.batches:  # a: the process is reaped: no stale writer can exist
            self.regions.release(b)
            self._unpin(b)
        held = list(slot.batches)
        slot.batches.clear()
        if slot.state is not SlotState.DEAD:
            slot.move(SlotState.DEAD)
        if was_starting and expected in (None, KillReason.STARTUP_FAILED):
            error = self._startup_error(slot, code, expected)
            if self.reload is not None and self.reload.on_start_failed(self, slot, error):
                return
            self._on_startup_death(slot, error)
            return
        if expected is not None and expected.planned:
            log.info("slot %d retired (pid %d)", slot.index, pid)
        else:
            slot.restarts += 1
            self.metrics.restart(slot.index)
            log.warning(
                "worker of slot %d (pid %d) died with %s holding %d batch(es)%s.%s",
                slot.index, pid, describe_exit(code), len(held), f" ({expected.value})" if expected else "",
                "" if expected else crash_hint(code),
            )
        replays = self._settle_held(held, expected, Crash(slot.index, pid, code), running_id)
        if replays:
            self.queue.push_replays(replays)  # c: in acceptance order, ahead of new work
        if self.failure is None and (self.closing is None or len(self.queue) > 0 or replays):
            self._spawn(slot)  # b: rebuild this slot alone
        elif self.closing is not None:
            slot.move(SlotState.STOPPED)

    def _settle_held(
        self, held: list[Batch], expected: KillReason | None, crash: Crash, running_id: int,
    ) -> list[Batch]:
        """Apply recovery.settle: time out, quarantine, free what ended, requeue the rest."""
        plan = recovery.settle(held, expected, crash, running_id, self.cfg.max_attempts)  # d: who is charged
        for batch in held:
            for t in batch.tasks:
                t.in_batch = None  # the process is reaped: nothing reads these inputs now
        for t in plan.timed_out:
            self.finish(t, error=E.TaskTimeout(
                f"task {t.id} ran past task_timeout={self.cfg.task_timeout} s; its slot was rebuilt", task_id=t.id))
        for t in plan.poisoned:
            self.quarantine(t, crash_error(t.crashes[-1]))
        for batch in held:
            for t in batch.tasks:
                if t.state.is_terminal and t.lease is not None:
                    self._release_input(t)
        for b in plan.replays:
            for t in b.tasks:
                t.move(TaskState.QUEUED)
        return plan.replays

    def _startup_error(self, slot: Slot, code: int | None, expected: KillReason | None) -> E.SessionInitError:
        if expected is KillReason.STARTUP_FAILED:
            return E.SessionInitError(
                f"slot {slot.index} (pid {slot.pid}) was not ready within startup_timeout="
                f"{self.cfg.startup_timeout} s (its initializer or session build did not finish); it was killed")
        return self._init_error(slot, code)

    def _on_startup_death(self, slot: Slot, error: E.SessionInitError) -> None:
        slot.startup_failures += 1
        slot.restarts += 1
        if slot.startup_failures >= MAX_STARTUP_FAILURES:
            self._fail(E.SessionInitError(
                f"slot {slot.index} failed to start {slot.startup_failures} times in a row; the engine "
                f"stopped. Last: {error}"))
            return
        delay = min(0.1 * 2 ** (slot.startup_failures - 1), 5.0)
        log.warning("slot %d failed to start (%s); retrying in %.1f s", slot.index, error, delay)
        slot.respawn_at = time.monotonic() + delay

    # -- timers ---------------------------------------------------------------------------------

    def _next_timer(self, now: float) -> float | None:
        times = [self.queue.next_deadline(), self._batch_ready_at]
        for s in self.slots:
            times += [s.respawn_at, s.kill_escalate_at, s.ready_by if s.state is SlotState.STARTING else None,
                      watchdog.time_limit(self.cfg, s, self.status[s.index]),
                      watchdog.stall_at(self.cfg, s)]
        due = [t for t in times if t is not None]
        return max(min(due) - now, 0.0) if due else None

    def _on_stall(self, slot: Slot, now: float) -> None:
        """No progress for stall_after: warn, send it nothing more, and run elsewhere what was
        sent ahead to it (on copies of the inputs: it may still read the originals)."""
        slot.stalled_since = now
        head = slot.batches[0]
        idle = int(self.status[slot.index, 0]) == IDLE  # it has not taken a task of its head yet
        held, ids, since = len(head.tasks), [t.id for t in head.tasks][:8], now - (head.started_at or now)
        moved = []
        for b in list(slot.batches)[0 if idle else 1 :]:
            if not b.revoked and self._revoke(slot, b):
                moved.append(len(b.pinned))
        if idle:
            log.warning(
                "slot %d (pid %d) has not taken the batch of %d task(s) sent to it %.1f s ago (task ids "
                "%s); it gets no more work, and the %d task(s) it held run elsewhere.", slot.index, slot.pid,
                held, since, ids, sum(moved))
            return
        log.warning(
            "slot %d (pid %d) has made no progress for %.1f s on its running batch of %d task(s) (task "
            "ids %s); it gets no more work, and the %d task(s) sent ahead to it run elsewhere. Set "
            "task_timeout to stop a task that runs too long.", slot.index, slot.pid, since, held, ids, sum(moved))

    def _revoke(self, slot: Slot, batch: Batch) -> bool:
        """Take back a batch sent ahead: its tasks to the queue with copies of their inputs."""
        live = watchdog.revoke(batch, self.inputs)
        if live is None:
            return False  # no room for the copies now: it stays (tried again on the next stall)
        slot.send(Revoke(batch.id))
        if live:
            self.queue.push_replays([Batch(live, stack=len(live) > 1 and batch.stack)], count=False)
        return True

    def _timers(self, now: float) -> None:
        self.expire(now)
        for slot in self.slots:
            if slot.kill_escalate_at is not None and now >= slot.kill_escalate_at:
                slot.escalate()
            if slot.state is SlotState.STARTING and slot.ready_by is not None and now >= slot.ready_by:
                slot.ready_by = None
                slot.kill(KillReason.STARTUP_FAILED, grace=0.5)  # its death is a start-up failure
            limit = watchdog.time_limit(self.cfg, slot, self.status[slot.index])
            if limit is not None and now >= limit:
                slot.kill(KillReason.TIMEOUT)
            stall = watchdog.stall_at(self.cfg, slot)
            if stall is not None and now >= stall:
                self._on_stall(slot, now)
            if slot.respawn_at is not None and now >= slot.respawn_at and slot.state is SlotState.DEAD:
                self._spawn(slot)

    # -- what callers ask for (through call(); the ledger's cancel and close too) ---------------

    def abort(self, reason: str) -> None:
        """close() ran out of time: cancel everything, stop every worker now."""
        self.abort_in_hand(reason)
        for slot in self.slots:
            slot.kill(KillReason.SHUTDOWN, grace=0.2)

    def start_reload(self, plan: Reload) -> None:
        if self.reload is not None:
            plan.abort(E.EngineError("a reload is already in progress"))
            return
        if self.closing is not None or self.failure is not None:
            plan.abort(E.EngineClosed("the engine is closing"))
            return
        self.reload = plan
        plan.start(self)

    def end_reload(self, plan: Reload, info: SessionInfo | None) -> None:
        """A swap ended: what callers describe() from now on (None: unchanged)."""
        if info is not None:
            self.info = info
        if self.reload is plan:
            self.reload = None

    def model_spec(self) -> SessionSpec | None:
        """The model the engine serves (what a reload replaces)."""
        return self.specs[0]

    def set_spec(self, slot: Slot, spec: SessionSpec | None) -> None:
        """The session a slot builds from its next incarnation on (a reload)."""
        self.specs[slot.index] = spec

    def _fail(self, error: BaseException) -> None:
        """The engine cannot go on (a slot cannot start): every waiting task fails with why."""
        self.fail_all(error)
        for slot in self.slots:
            if slot.process is not None:
                slot.kill(KillReason.SHUTDOWN, grace=0.0)
