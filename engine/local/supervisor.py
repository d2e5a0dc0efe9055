"""The supervisor: one thread that owns every slot and every running task. Steps 3-4, 8-9
of the task flow and the whole crash path (see the diagram in `engine/__init__.py`).

It waits on every worker's pipe, every worker's process sentinel and one wake-up pipe in a
single `multiprocessing.connection.wait()`; its timeout is the next timer (a task's
time limit, a batch still filling, a backoff), never a polling interval. Callers never touch
slots: they put tasks in the admission queue and commands in `_commands`, and wake it.
"""

from __future__ import annotations

import logging
import os
import selectors
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.context import BaseContext
from typing import Any

import numpy as np

from slabpool.engine.core import recovery
from slabpool.engine.core.admission import MAX_GROUP, MIN_GROUP, TaskQueue
from slabpool.engine.core.config import EngineConfig
from slabpool.engine.core.recovery import IDLE
from slabpool.engine.core.states import SlotState, TaskState
from slabpool.engine.core.task import Batch, Result, Task, Timings
from slabpool.engine.local.reload import Reload
from slabpool.engine.local.slot import Slot
from slabpool.shm import Arena
from slabpool.shm.alloc import align_up
from slabpool.workers import errors as E
from slabpool.workers import packing
from slabpool.workers.errors import Crash, crash_hint, describe_exit
from slabpool.workers.main import SPLIT, WorkerBoot
from slabpool.workers.protocol import (
    BatchDone,
    FlatSkeleton,
    InitFailed,
    LogRecord,
    NeedOutput,
    OutputGrant,
    Ready,
    RemoteError,
    Revoke,
    RunBatch,
    SessionInfo,
    Shutdown,
    TaskSpec,
    decode,
    encode,
    open_result,
)
from slabpool.workers.session import SessionSpec

log = logging.getLogger("slabpool.engine")
GROUP_TARGET_S = 0.002  # a group of tiny tasks runs about this long
MAX_STARTUP_FAILURES = 5


@dataclass(frozen=True)
class Command:
    """A caller's request, applied by the supervisor thread: cancel, close, reload, ..."""

    kind: str
    arg: Any = None
    reply: list[Any] | None = None
    done: threading.Event | None = None


class Supervisor:
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
        self.cfg, self.queue, self.inputs, self.outputs = cfg, queue, inputs, outputs
        self.ctx, self.boot, self.metrics = ctx, boot, metrics
        self.slots = [Slot(i) for i in range(cfg.workers)]
        self.specs: list[SessionSpec | None] = [cfg.session_spec()] * cfg.workers  # per slot
        self.reload: Reload | None = None  # a hot model swap in progress
        # one cache line per slot, at the start of the output arena: the id of the task its
        # worker is in (IDLE, or STACKED for a whole stacked batch), read after a death
        self._status_lease = outputs.lease(64 * cfg.workers)
        self.status = outputs.array(self._status_lease.offset, np.dtype(np.int64), (cfg.workers, 8))
        self.status[:, 0] = IDLE
        # the largest output region one task can ever have; a batch of several tasks gets at
        # most half the arena (the rest is kept for the running batches): split beyond that
        self._max_region = outputs.capacity - align_up(64 * cfg.workers)
        self._out_task = 0  # the most output bytes per task seen (a group's average), and per
        self._out_item = 0  # item of a stacked batch: groups and batches are sized to fit
        self.info: SessionInfo | None = None
        self.failure: BaseException | None = None
        self.closing: str | None = None  # None, "drain", "cancel"
        self._commands: deque[Command] = deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._wake_pending = False
        self._selector = selectors.DefaultSelector()
        self._watched: dict[int, tuple[Any, ...]] = {}
        self._watch_dirty = True  # set whenever a pipe or a process comes or goes
        self._completions: list[tuple[Future[Result], Any, BaseException | None]] = []
        self._due: dict[str, int] = {}  # counts not yet published (see _count)
        self._predicted: dict[tuple[Any, ...], int] = {}  # output bytes by batch shape
        self._task_s: float | None = None  # mean run time per task (EWMA), sizes groups
        self._thread = threading.Thread(target=self._run, name="slabpool-supervisor", daemon=True)
        self._stopped = threading.Event()
        self.on_stopped: Callable[[], None] = self.close_resources

    # -- start ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Spawn every slot, wait until all are READY; SessionInitError if one cannot start.
        On any exception (KeyboardInterrupt too) every worker started is killed and reaped."""
        try:
            for slot in self.slots:
                self._spawn(slot)
            self._wait_ready(time.monotonic() + self.cfg.startup_timeout)
        except BaseException:
            self._abort_startup()
            raise
        self._thread.start()

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
                slot.kill("startup failed", grace=0.0)
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
            + crash_hint(code)
        )

    def status_offset(self, slot: int) -> int:
        return self._status_lease.offset + 64 * slot

    def _spawn(self, slot: Slot) -> None:
        self._watch_dirty = True
        self.status[slot.index, 0:2] = IDLE, 0
        boot = self.boot(slot.index, slot.incarnation + 1, self.specs[slot.index], self.status_offset(slot.index))
        slot.spawn(self.ctx, boot, self.inputs.fd, self.outputs.fd)

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
            slot.kill("reload", grace=1.0)
            return
        slot.retiring = True
        if drain:
            self._maybe_retire(slot)
        else:
            slot.kill("reload", grace=1.0)

    # -- the caller's side ---------------------------------------------------------------------

    def wake(self) -> None:
        if self._wake_pending:
            return  # a byte is already on its way: one wake-up serves every caller before it
        self._wake_pending = True
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # already awake, or shutting down

    def command(self, kind: str, arg: Any = None, *, wait_reply: bool = True) -> Any:
        """Hand a command to the supervisor thread; wait for its reply unless called from it."""
        on_thread = threading.current_thread() is self._thread
        done = threading.Event() if wait_reply and not on_thread else None
        reply: list[Any] = []
        if on_thread:
            self._apply(Command(kind, arg, reply))
            return reply[0] if reply else None
        self._commands.append(Command(kind, arg, reply, done))
        self.wake()
        if done is not None:
            while not done.wait(0.5):
                if self._stopped.is_set():
                    break
        return reply[0] if reply else None

    def join(self, timeout: float | None) -> bool:
        if threading.current_thread() is self._thread:
            return False
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    # -- the loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._finished():
                self._step()
        except BaseException as exc:
            log.exception("supervisor failed")
            self._fail(E.EngineInternalError(f"supervisor thread failed: {exc!r}"))
        finally:
            if self.reload is not None:
                self.reload.abort(E.EngineClosed("the engine closed during the reload"))
            self._shutdown_slots()
            self._flush()
            del self.status  # the last view into an arena: they can be unmapped now
            self.on_stopped()
            self._stopped.set()

    def _step(self) -> None:
        now = time.monotonic()
        if self._watch_dirty:
            self._sync_watch()
        events = self._selector.select(self._next_timer(now))
        ready = {key.data for key, _ in events}
        if ("wake", None, None) in ready:
            os.read(self._wake_r, 4096)
            self._wake_pending = False  # after the read: a wake() from here on writes again,
            # and one that saw True before it is served below (its work is already queued)
        while self._commands:
            self._apply(self._commands.popleft())
        for slot in self.slots:
            if slot.conn is not None and ("conn", slot, slot.conn) in ready:
                self._drain(slot)
            if slot.process is not None and ("exit", slot, slot.process) in ready:
                self._on_death(slot)
        now = time.monotonic()
        self._timers(now)
        self._dispatch(now)
        self._flush()

    def _sync_watch(self) -> None:
        """Bring the persistent selector in line with the live pipes and sentinels. Only after
        a spawn, a death or a closed pipe: a fresh poll set per step cost a third of the loop."""
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
                self._selector.register(fd, selectors.EVENT_READ, data)
                self._watched[fd] = data
        self._watch_dirty = False

    def _finished(self) -> bool:
        if self.failure is not None:
            return True
        if self.closing is None:
            return False
        return len(self.queue) == 0 and all(not s.batches for s in self.slots)

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
            if outcome.error is not None:
                if outcome.error.kind == "split":
                    split.append(task)  # its outputs did not fit beside the others': again, apart
                else:
                    self._finish(task, error=E.from_remote(outcome.error, task.id))
                continue
            packed = outcome.outputs
            assert packed is not None
            used += packing.region_size(packed)
            if type(packed.skeleton) is not FlatSkeleton:
                try:  # made by user code: it may not unpickle here; that task alone fails
                    packed = open_result(packed)
                except E.TaskDataError as exc:
                    self._finish(task, error=E.TaskDataError(f"task {task.id}: {exc}", task_id=task.id))
                    continue
            t0 = time.perf_counter()
            outputs = packing.unpack(packed, self.outputs.array, copy=True)  # step 8
            copy_s = time.perf_counter() - t0
            self._finish(task, result=self._result(task, slot, outputs, msg.run_s / len(batch.tasks), copy_s, now))
        if not split:  # (a split batch's sizes were learnt from its NeedOutput)
            self._predicted[_batch_key(batch)] = used
            if used > self._out_task * len(batch.tasks):
                self._learn_outputs(batch, used)
        if msg.in_place:
            self._count("outputs_in_place", msg.in_place)
        self._end_batch(batch)  # step 9: leases go back now that the run has really ended
        if split:
            self._requeue_apart(batch, split)
        self._after_batch(slot, now)

    def _after_batch(self, slot: Slot, now: float) -> None:
        if slot.batches:
            self._promote(slot, now)
        elif slot.state is SlotState.BUSY:
            slot.move(SlotState.READY)
        self._maybe_retire(slot)

    def _learn_outputs(self, batch: Batch, nbytes: int) -> None:
        """Output bytes per task and per item, as seen: later groups and batches fit them."""
        self._out_task = max(self._out_task, nbytes // len(batch.tasks))
        if batch.stack:
            self._out_item = max(self._out_item, nbytes // max(sum(t.items for t in batch.tasks), 1))

    def _requeue_apart(self, batch: Batch, tasks: list[Task]) -> None:
        """Tasks whose outputs would not fit one region together go back to the queue, in
        halves, ahead of new work and uncharged (their outputs are sized anew each time)."""
        for t in tasks:
            t.move(TaskState.QUEUED)
        half = (len(tasks) + 1) // 2
        parts = [p for p in (tasks[:half], tasks[half:]) if p]
        self.queue.push_replays([Batch(p, stack=batch.stack and len(p) > 1) for p in parts], count=False)

    def _fit_tasks(self) -> int:
        """Tasks of the largest outputs seen that one group's region holds (half the arena)."""
        return max(1, self.outputs.capacity // 2 // self._out_task) if self._out_task else MAX_GROUP

    def _result(self, task: Task, slot: Slot, outputs: Any, run_s: float, copy_s: float, now: float) -> Result:
        timings = Timings(
            queued=max(task.dispatched_at - task.accepted_at, 0.0),
            transfer=task.copy_in_s + copy_s,
            run=run_s,
            total=now - task.accepted_at,
        )
        return Result(task.id, outputs, slot.model_version, slot.index, slot.pid, task.attempts, timings, task.context)

    def _on_need_output(self, slot: Slot, msg: NeedOutput) -> None:
        batch = next((b for b in slot.batches if b.id == msg.batch_id), None)
        if batch is None:
            return
        if batch.out_lease is not None and batch.out_lease.nbytes >= msg.nbytes:
            slot.send(OutputGrant(batch.id, batch.out_lease.offset, batch.out_lease.nbytes))
            return
        if batch.out_lease is not None:
            self.outputs.release(batch.out_lease)
            batch.out_lease = None
        self._learn_outputs(batch, msg.nbytes)
        if len(batch.tasks) > 1 and msg.nbytes > self.outputs.capacity // 2:
            slot.send(OutputGrant(batch.id, -1, 0, SPLIT))  # its tasks come back, to go apart
            return
        if msg.nbytes > self._max_region:  # one task's outputs, larger than the whole arena
            slot.send(OutputGrant(batch.id, -1, self._max_region, (
                f"its outputs take {msg.nbytes} bytes, more than the output arena can ever hold "
                f"({self._max_region} bytes; shm_capacity={self.outputs.capacity}); raise shm_capacity")))
            return
        lease = self.outputs.try_lease(msg.nbytes)
        if lease is None:  # full: the grant waits for the next release (no lease is held here)
            batch.out_wanted = msg.nbytes
            return
        batch.out_lease = lease
        slot.send(OutputGrant(batch.id, lease.offset, lease.nbytes))

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
            if b.out_lease is not None:
                self.outputs.release(b.out_lease)
                b.out_lease = None
            self._unpin(b)
        held = list(slot.batches)
        slot.batches.clear()
        if slot.state is not SlotState.DEAD:
            slot.move(SlotState.DEAD)
        if was_starting and expected is None:
            if self.reload is not None and self.reload.on_start_failed(self, slot, self._init_error(slot, code)):
                return
            self._on_startup_death(slot, code)
            return
        if expected in ("retire", "shutdown", "reload"):
            log.info("slot %d retired (pid %d)", slot.index, pid)
        else:
            slot.restarts += 1
            self.metrics.restart(slot.index)
            log.warning(
                "worker of slot %d (pid %d) died with %s holding %d batch(es)%s.%s",
                slot.index, pid, describe_exit(code), len(held), f" ({expected})" if expected else "",
                "" if expected else crash_hint(code),
            )
        replays = self._settle_held(held, expected, Crash(slot.index, pid, code), running_id)
        if replays:
            self.queue.push_replays(replays)  # c: in acceptance order, ahead of new work
        if self.failure is None and (self.closing is None or len(self.queue) > 0 or replays):
            self._spawn(slot)  # b: rebuild this slot alone
        elif self.closing is not None:
            slot.move(SlotState.STOPPED)

    def _settle_held(self, held: list[Batch], expected: str | None, crash: Crash, running_id: int) -> list[Batch]:
        """Apply recovery.settle: time out, quarantine, free what ended, requeue the rest."""
        plan = recovery.settle(held, expected, crash, running_id, self.cfg.max_attempts)
        for batch in held:
            for t in batch.tasks:
                t.in_batch = None  # the process is reaped: nothing reads these inputs now
        for t in plan.timed_out:
            self._finish(t, error=E.TaskTimeout(
                f"task {t.id} ran past task_timeout={self.cfg.task_timeout} s; its slot was rebuilt", task_id=t.id))
        for t in plan.poisoned:
            self._quarantine(t)
        for batch in held:
            for t in batch.tasks:
                if t.state.is_terminal and t.lease is not None:
                    self._release_input(t)
        for b in plan.replays:
            for t in b.tasks:
                t.move(TaskState.QUEUED)
        return plan.replays

    def _quarantine(self, task: Task) -> None:
        crashes = ", ".join(f"slot {c.slot} pid {c.pid} {c.signal}" for c in task.crashes)
        self._count("quarantined")
        error = E.PoisonTask(
            f"task {task.id} was in hand when {len(task.crashes)} workers died ({crashes}); "
            "quarantined, not retried again", task_id=task.id, crashes=tuple(task.crashes))
        error.__cause__ = _crashed(task.crashes[-1])
        self._finish(task, error=error)

    def _on_startup_death(self, slot: Slot, code: int | None) -> None:
        slot.startup_failures += 1
        slot.restarts += 1
        error = self._init_error(slot, code)
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
            times += [s.respawn_at, s.kill_escalate_at, self._time_limit(s), self._stall_at(s)]
        due = [t for t in times if t is not None]
        return max(min(due) - now, 0.0) if due else None

    def _time_limit(self, slot: Slot) -> float | None:
        """When the task in hand passes task_timeout: its own time, whatever the group's size
        (the worker writes when it took the task into its status word 1; workers.main._hand).
        With no task in hand yet, one taken from now on cannot pass it before now + task_timeout:
        that is when to look again (a limit the caller of this never reaches first)."""
        if self.cfg.task_timeout is None or not slot.batches or slot.kill_reason:
            return None
        head = slot.batches[0]
        if head.started_at is None or head.out_wanted:
            return None  # not started, or waiting for output memory: no task's time runs
        grace = min(2.0, self.cfg.task_timeout) if slot.info and slot.info.runtime == "onnxruntime" else 0.0
        words = self.status[slot.index]
        task_id, began = int(words[0]), int(words[1])
        if task_id == IDLE or int(words[0]) != task_id:  # (word 1 is written first: a pair read
            return time.monotonic() + self.cfg.task_timeout + grace  # across a change waits)
        return began / 1e9 + self.cfg.task_timeout + grace

    def _stall_at(self, slot: Slot) -> float | None:
        """When the slot's running batch counts as stalled (not yet warned about)."""
        if slot.stalled_since is not None or not slot.batches or slot.kill_reason:
            return None
        head = slot.batches[0]
        return None if head.started_at is None or head.out_wanted else head.started_at + self.cfg.stall_after

    def _on_stall(self, slot: Slot, now: float) -> None:
        """No progress for stall_after: warn, send it nothing more, and run elsewhere what was
        sent ahead to it (on copies of the inputs: it may still read the originals)."""
        slot.stalled_since = now
        head = slot.batches[0]
        moved = []
        for b in list(slot.batches)[1:]:
            if not b.revoked and self._revoke(slot, b):
                moved.append(len(b.pinned))
        log.warning(
            "slot %d (pid %d) has made no progress for %.1f s on its running batch of %d task(s) (task "
            "ids %s); it gets no more work, and the %d task(s) sent ahead to it run elsewhere. Set "
            "task_timeout to stop a task that runs too long.", slot.index, slot.pid, now - (head.started_at or now),
            len(head.tasks), [t.id for t in head.tasks][:8], sum(moved))

    def _revoke(self, slot: Slot, batch: Batch) -> bool:
        """Take back a batch sent ahead: its tasks to the queue with copies of their inputs."""
        live = [t for t in batch.tasks if t.state is TaskState.RUNNING]
        fresh = [self.inputs.try_lease(t.lease.nbytes) if t.lease is not None else None for t in live]
        if any(n is None and t.lease is not None for n, t in zip(fresh, live, strict=True)):
            self.inputs.release_many([n for n in fresh if n is not None])
            return False  # no room for the copies now: it stays (tried again on the next stall)
        for t, new in zip(live, fresh, strict=True):
            old = t.lease
            if old is not None and new is not None:
                src = self.inputs.array(old.offset, np.dtype(np.uint8), (old.nbytes,))
                self.inputs.array(new.offset, np.dtype(np.uint8), (old.nbytes,))[:] = src
                refs = tuple(r._replace(offset=r.offset - old.offset + new.offset) for r in t.packed.arrays)
                t.packed, t.lease = t.packed._replace(arrays=refs), new
                batch.pinned.append(old)
            t.move(TaskState.QUEUED)
            t.in_batch = None
        for t in batch.tasks:  # tasks that ended meanwhile keep their inputs till the answer
            if t.state.is_terminal and t.lease is not None:
                batch.pinned.append(t.lease)
                t.lease = None
        batch.revoked, batch.tasks = True, []
        slot.send(Revoke(batch.id))
        if live:
            self.queue.push_replays([Batch(live, stack=len(live) > 1 and batch.stack)], count=False)
        return True

    def _unpin(self, batch: Batch) -> None:
        if batch.pinned:
            self.inputs.release_many(batch.pinned)
            batch.pinned = []

    def _timers(self, now: float) -> None:
        for task in self.queue.expire(now):
            self._finish(task, error=E.TaskTimeout(
                f"task {task.id} was still queued at its deadline; it was not started", task_id=task.id))
        for slot in self.slots:
            if slot.kill_escalate_at is not None and now >= slot.kill_escalate_at:
                slot.escalate()
            limit = self._time_limit(slot)
            if limit is not None and now >= limit:
                slot.kill("timeout")
            stall = self._stall_at(slot)
            if stall is not None and now >= stall:
                self._on_stall(slot, now)
            if slot.respawn_at is not None and now >= slot.respawn_at and slot.state is SlotState.DEAD:
                self._spawn(slot)

    # -- dispatch (steps 3-4) -------------------------------------------------------------------

    _batch_ready_at: float | None = None

    def _dispatch(self, now: float) -> None:
        self._batch_ready_at = None
        depth = self.cfg.inflight_per_slot
        wait_s = self.cfg.max_batch_wait_ms / 1000.0
        while True:
            open_slots = [s for s in self.slots if s.can_take and len(s.batches) < depth]
            if not open_slots:
                self.queue.hungry = False  # new tasks wait for a completion, which dispatches
                return
            slot = min(open_slots, key=lambda s: len(s.batches))  # idle slots first
            budget = self._task_budget(slot)
            if budget == 0:  # recycled after what it holds: no more work for this incarnation
                slot.retiring = True
                self._maybe_retire(slot)
                continue
            live = sum(s.can_take for s in self.slots)  # the queue is shared by every slot, not
            # only those open right now: a group sized for one open slot would starve the rest
            min_tasks = 1
            budget = min(budget, self._fit_tasks())
            max_items = self.cfg.max_batch_size
            if self._out_item and max_items > 1:  # a stacked batch's outputs share one region
                max_items = max(1, min(max_items, self.outputs.capacity // 2 // self._out_item))
            if self.cfg.max_batch_size <= 1:  # unstacked groups; a stacked batch is sized in items
                limit = self._group_limit()
                budget = min(budget, limit)
                if slot.batches and limit >= MIN_GROUP:  # tiny tasks, a busy slot: send ahead
                    min_tasks = MIN_GROUP * live  # only a group worth its message (measured:
                    # half the groups were of one task, at 1.6x the messages per task)
            got = self.queue.take(max_items, wait_s, now, live, budget, min_tasks)
            if got is None:
                return
            if isinstance(got, float):
                self._batch_ready_at = got
                return
            self._send_batch(slot, got, now)

    def _group_limit(self) -> int:
        """Tasks per group: as many as run in about GROUP_TARGET_S (the measured mean run
        time per task). Grouping saves ~100 us of messages per task: worth it for tiny tasks,
        pointless (and unfair to the other slots) for tasks of milliseconds."""
        if self._task_s is None:
            return 1
        return max(1, min(MAX_GROUP, int(GROUP_TARGET_S / max(self._task_s, 1e-6))))

    def _task_budget(self, slot: Slot) -> int:
        """How many tasks the next batch of this incarnation may hold: max_tasks_per_worker
        caps the total; worker_memory_limit is checked after every task, so one at a time."""
        if self.cfg.worker_memory_limit is not None:
            return 1 if not slot.retiring else 0
        if self.cfg.max_tasks_per_worker is None:
            return MAX_GROUP
        held = sum(len(b.tasks) for b in slot.batches)
        return max(0, min(MAX_GROUP, self.cfg.max_tasks_per_worker - slot.incarnation_done - held))

    def _send_batch(self, slot: Slot, batch: Batch, now: float) -> None:
        specs = []
        for task in batch.tasks:
            if task.attempts == 0 and not task.future.set_running_or_notify_cancel():
                task.state = TaskState.CANCELLED  # the caller cancelled it between queue and here
                self._count("cancelled")
                self._count("items_cancelled", task.units)
                self._release_input(task)
                continue
            if task.state is TaskState.QUEUED:
                task.move(TaskState.RUNNING)
            task.attempts += 1
            task.dispatched_at = task.dispatched_at or now
            task.in_batch = batch
            fault = task.fault if self.cfg.fault_injection else None
            specs.append(TaskSpec(task.id, task.attempts, task.seed, task.packed, task.wire_context, fault,
                                  task.deadline))
        batch.tasks = [t for t in batch.tasks if t.state is TaskState.RUNNING]
        if not batch.tasks:
            return
        slot.batches.append(batch)
        if batch.stack:
            self._count("stacked_batches")
        if slot.state is SlotState.READY:
            slot.move(SlotState.BUSY)
        out = self._lease_predicted(batch, ahead=len(slot.batches) > 1)
        if len(slot.batches) == 1:
            batch.started_at = now
        msg = RunBatch(batch.id, tuple(specs), batch.stack, out.offset if out else -1, out.nbytes if out else 0)
        try:
            data = encode(msg)
        except Exception as exc:  # noqa: BLE001 - a task's data that will not pickle fails it alone
            self._unsendable(slot, batch, exc)
            return
        slot.send_bytes(data)  # step 4: on a broken pipe the sentinel fires next and the batch replays

    def _unsendable(self, slot: Slot, batch: Batch, exc: Exception) -> None:
        """A RunBatch that would not pickle (user data submit() could not check, such as a
        dict key): take the batch back; several tasks go again one by one, one fails alone."""
        slot.batches.remove(batch)
        if batch.out_lease is not None:
            self.outputs.release(batch.out_lease)
            batch.out_lease = None
        if not slot.batches and slot.state is SlotState.BUSY:
            slot.move(SlotState.READY)
        for t in batch.tasks:
            t.in_batch = None
        if len(batch.tasks) > 1:
            for t in batch.tasks:
                t.move(TaskState.QUEUED)
            self.queue.push_replays([Batch([t], stack=False) for t in batch.tasks], count=False)
            return
        task = batch.tasks[0]
        self._finish(task, error=E.TaskDataError(
            f"task {task.id} cannot be sent to a worker: {type(exc).__name__}: {exc}", task_id=task.id))

    def _lease_predicted(self, batch: Batch, *, ahead: bool = False) -> Any:
        """An output region sized like the last outputs of a batch of the same shapes, so the
        worker never has to ask. Batches sent ahead of the running one may hold at most half
        the arena: the other half is always there for a running batch's NeedOutput."""
        want = self._predicted.get(_batch_key(batch))
        if not want:
            return None
        if ahead and self.outputs.used + want > self.outputs.capacity // 2:
            return None
        lease = self.outputs.try_lease(want)
        batch.out_lease = lease
        return lease

    def _promote(self, slot: Slot, now: float) -> None:
        """The next held batch starts running now: give it its output region ahead of time."""
        head = slot.batches[0]
        if head.revoked:
            return  # answered without a run: no region, no clock
        head.started_at = max(now, head.started_at or now)
        if head.out_lease is None:
            lease = self._lease_predicted(head)
            if lease is not None:
                slot.send(OutputGrant(head.id, lease.offset, lease.nbytes))

    def _end_batch(self, batch: Batch) -> None:
        if batch.out_lease is not None:
            self.outputs.release(batch.out_lease)
            batch.out_lease = None
            self._grant_waiting()
        self._unpin(batch)
        done = []
        for t in batch.tasks:
            t.in_batch = None
            if t.lease is not None and t.state.is_terminal:
                done.append(t.lease)
                t.lease = None
        self.inputs.release_many(done)  # one lock for the batch

    def _grant_waiting(self) -> None:
        for slot in self.slots:
            for b in slot.batches:
                want = b.out_wanted
                if want and b.out_lease is None:
                    lease = self.outputs.try_lease(want)
                    if lease is None:
                        return
                    b.out_lease, b.out_wanted = lease, 0
                    slot.send(OutputGrant(b.id, lease.offset, lease.nbytes))

    # -- recycling ------------------------------------------------------------------------------

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
            slot.kill_reason = "retire"
            slot.kill_escalate_at = time.monotonic() + 10.0
            slot.send(Shutdown())

    # -- commands -------------------------------------------------------------------------------

    def _apply(self, cmd: Command) -> None:
        try:
            handler = getattr(self, f"_cmd_{cmd.kind}")
            result = handler(cmd.arg)
            if cmd.reply is not None:
                cmd.reply.append(result)
        finally:
            if cmd.done is not None:
                cmd.done.set()

    def _cmd_cancel(self, arg: tuple[Task, bool]) -> bool:
        task, kill = arg
        if task.state.is_terminal:
            return False
        if task.state is TaskState.QUEUED and self.queue.discard(task):
            self._finish(task, error=_cancelled(task, "cancelled while queued"))
            return True
        self._finish(task, error=_cancelled(task, "cancelled while running; its result is dropped"))
        if kill:
            slot = next((s for s in self.slots if any(task in b.tasks for b in s.batches)), None)
            if slot is not None and slot.batches and task in slot.batches[0].tasks:
                slot.kill("cancel")
        return True

    def _cmd_close(self, cancel_pending: bool) -> None:
        self.closing = "cancel" if cancel_pending else (self.closing or "drain")
        if cancel_pending:
            for task in self.queue.drain_all():
                self._finish(task, error=_cancelled(task, "the engine closed before it started", "closed"))

    def _cmd_abort(self, reason: str) -> None:
        """close() ran out of time: cancel everything, stop every worker now."""
        self._cmd_close(True)
        for slot in self.slots:
            for b in slot.batches:
                for t in b.tasks:
                    self._finish(t, error=_cancelled(t, reason, "closed"))
            slot.kill("shutdown", grace=0.2)

    def _cmd_reload(self, plan: Reload) -> None:
        if self.reload is not None:
            plan.abort(E.EngineError("a reload is already in progress"))
            return
        if self.closing is not None or self.failure is not None:
            plan.abort(E.EngineClosed("the engine is closing"))
            return
        self.reload = plan
        plan.start(self)

    # -- endings --------------------------------------------------------------------------------

    def _finish(self, task: Task, *, result: Result | None = None, error: BaseException | None = None) -> None:
        """End a task exactly once; its Future completes after this step's state changes."""
        if task.state.is_terminal:
            return
        if error is None:
            new, counter = TaskState.DONE, "completed"
        elif isinstance(error, E.TaskCancelled):
            new, counter = TaskState.CANCELLED, "cancelled"
        else:
            new, counter = TaskState.FAILED, "failed"
        task.move(new)
        self._count(counter)
        if task.units:
            self._count("items_" + counter, task.units)
        if result is not None:
            self.metrics.observe(result.timings)  # only what is really delivered
        if isinstance(error, E.TaskTimeout):
            self._count("timeouts")
        if task.in_batch is None:
            self._release_input(task)
        self._completions.append((task.future, result, error))

    def _count(self, counter: str, n: int = 1) -> None:
        """Count now, publish in _flush: one lock per step, before the Futures complete."""
        self._due[counter] = self._due.get(counter, 0) + n

    def _release_input(self, task: Task) -> None:
        if task.lease is not None:
            self.inputs.release(task.lease)
            task.lease = None

    def _flush(self) -> None:
        if self._due:
            counters, due, self._due = self.queue.counters, self._due, {}
            with self.queue.lock:
                for counter, n in due.items():
                    setattr(counters, counter, getattr(counters, counter) + n)
        done, self._completions = self._completions, []
        for fut, result, error in done:
            try:
                if error is not None:
                    fut.set_exception(error)
                else:
                    fut.set_result(result)
            except InvalidStateError:
                pass  # the caller cancelled it first: it ends once, as cancelled

    def _fail(self, error: BaseException) -> None:
        """The engine cannot go on (a slot cannot start): every waiting task fails with why."""
        self.failure = error
        self.queue.close(error)
        for task in self.queue.drain_all():
            self._finish(task, error=error)
        for slot in self.slots:
            for b in slot.batches:
                for t in b.tasks:
                    self._finish(t, error=error)
            if slot.process is not None:
                slot.kill("shutdown", grace=0.0)

    def _shutdown_slots(self) -> None:
        """Stop every worker: Shutdown, a grace, then SIGKILL; reap all; release every lease."""
        for slot in self.slots:
            if slot.process is not None and slot.kill_reason is None:
                slot.kill_reason = "shutdown"
                slot.send(Shutdown())
        deadline = time.monotonic() + 5.0
        for slot in self.slots:
            if slot.process is None:
                continue
            slot.process.join(max(deadline - time.monotonic(), 0.0))
            if slot.process.exitcode is None:
                slot.escalate()
            self._on_death_final(slot)

    def _on_death_final(self, slot: Slot) -> None:
        if slot.conn is not None:
            self._drain(slot, to_end=True)
        self._forget_slot(slot)
        slot.reap()
        for b in slot.batches:
            if b.out_lease is not None:
                self.outputs.release(b.out_lease)
                b.out_lease = None
            self._unpin(b)
            for t in b.tasks:
                t.in_batch = None
                self._finish(t, error=_cancelled(t, "the engine closed while it ran", "closed"))
                self._release_input(t)
        slot.batches.clear()
        slot.state = SlotState.STOPPED

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
        self._selector.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def close_resources(self) -> None:
        self._close_wakeup()


def _crashed(c: Crash) -> E.WorkerCrashed:
    return E.WorkerCrashed(
        f"the worker of slot {c.slot} (pid {c.pid}) died with {c.signal}." + crash_hint(c.exitcode),
        slot=c.slot, pid=c.pid, exitcode=c.exitcode)


def _cancelled(task: Task, why: str, reason: str = "cancelled") -> E.TaskCancelled:
    return E.TaskCancelled(f"task {task.id}: {why}", task_id=task.id, reason=reason)


def _batch_key(batch: Batch) -> tuple[Any, ...]:
    """Batches with equal keys had outputs of equal size so far (sizes predicted from it)."""
    return tuple((t.shape_key, t.items) for t in batch.tasks)

