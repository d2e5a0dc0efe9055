"""The owner of every slot, the same for every backend: a coordinator of parts it holds.

    Coordinator
      thread      engine.core.owner.OwnerThread: the one thread that acts; callers hand it
                  callables (`call`)
      ledger      engine.core.ledger.TaskLedger: each task ends once (step 9), counters
      dispatcher  engine.core.dispatcher.Dispatcher: steps 3-4, and 8-9's owner side
      watchdog    engine.core.watchdog.Watchdog: task_timeout, stall, start-up bound, back-off
      transport   engine.core.transport.SlotTransport: the backend (processes, or Ray actors)
      slots       engine.core.slots.SlotRecord: each slot's state (one table), its batches

The owner is a role (engine.core.fastpath): whoever holds `thread.lock` acts. The thread
holds it for its step except while it waits in the transport; an idle engine's caller that
finds it free dispatches its own task and, where the transport lends the slot, reads the
answer itself with the same code (`fast`, `handle`).

One step: wait on the transport until its next event or the next timer; run the callers'
calls; handle each event (Ready, Done, Died: the crash path a-d is here, `_on_died`); the
timers; dispatch; publish counts and complete Futures. Who is charged after a death is the
pure engine.core.recovery; a reload is engine.core.reload's plan, driven from here; the stop
path is engine.core.stopping.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from slabpool.engine.core import recovery, stopping
from slabpool.engine.core.admission import TaskQueue
from slabpool.engine.core.config import EngineConfig
from slabpool.engine.core.dispatcher import Dispatcher
from slabpool.engine.core.fastpath import FastPath
from slabpool.engine.core.ledger import TaskLedger, crash_error
from slabpool.engine.core.owner import OwnerThread
from slabpool.engine.core.reload import ReloadPlan
from slabpool.engine.core.slots import SlotRecord
from slabpool.engine.core.states import KillReason, SlotEvent, SlotState, TaskState
from slabpool.engine.core.task import Batch, Task
from slabpool.engine.core.transport import Died, Done, Event, Ready, SlotTransport, TransportLost
from slabpool.engine.core.watchdog import Watchdog
from slabpool.workers import errors as E
from slabpool.workers.errors import Crash, crash_hint, describe_exit
from slabpool.workers.protocol import SessionInfo
from slabpool.workers.session import SessionSpec

T = TypeVar("T")
log = logging.getLogger("slabpool.engine")
MAX_STARTUP_FAILURES = 5
_EXITABLE = (SlotState.READY, SlotState.BUSY, SlotState.STALLED, SlotState.RETIRING)


class Coordinator:
    """Owns every slot of an engine and ends every task exactly once. See the module docstring."""

    def __init__(self, cfg: EngineConfig, queue: TaskQueue, metrics: Any, transport: SlotTransport, name: str) -> None:
        self.cfg, self.queue, self.metrics, self.transport = cfg, queue, metrics, transport
        self.slots = [SlotRecord(i, cfg.session_spec()) for i in range(cfg.workers)]
        self.dispatcher: Dispatcher  # (the ledger's hooks are the dispatcher's)
        self.ledger = TaskLedger(queue, metrics, release=self._release, kill_running=self._kill_running)
        self.dispatcher = Dispatcher(cfg, queue, self.ledger, transport, self.slots, self.kill)
        self.watchdog = Watchdog(cfg, queue, self.slots, transport, self.kill, self.spawn)
        self.thread = OwnerThread(name, self)
        self.fast = FastPath(self)  # callers acting as the owner, and the slots lent to them
        self.info: SessionInfo | None = None  # the session's description, from the first Ready
        self.reload: ReloadPlan | None = None  # a hot model swap in progress
        self.on_stopped: Callable[[], None] = _nothing  # the backend's last step (free the memory)

    # -- what callers use (engine.caller.base.Owner) ------------------------------------------------

    def call(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        return self.thread.call(fn, *args)

    @property
    def on_thread(self) -> bool:
        return self.thread.on_thread

    def join(self, timeout: float | None) -> bool:
        return self.thread.join(timeout)

    def forsake(self, why: str) -> None:
        self.thread.forsake(why)
        self.fast.forsake()

    def close(self, cancel_pending: bool) -> None:
        """Stop taking work; every lend goes back to the owner thread, which reads what is in
        flight (was: a lent call's answer waited for its lender, and a close() made by that very
        thread, from a signal handler that interrupted its call, waited for the stall watchdog)."""
        self.ledger.close(cancel_pending)
        self.fast.end_all()

    def cancel(self, task: Task, kill: bool) -> bool:
        """Queued: it never runs. Sent ahead to a slot, alone in its batch, and not started: taken
        back (a Revoke: the worker skips it), so it never runs either (was: it ran, its result
        dropped, while the calls behind it waited). Running: its result is dropped, `kill` stops it."""
        ahead = self._sent_ahead_alone(task)
        cancelled = self.ledger.cancel(task, kill and ahead is None, started=ahead is None)
        if cancelled and ahead is not None:
            self.watchdog.revoke(*ahead)  # (its inputs stay pinned until the worker answers)
        self.fast.review(time.monotonic())  # a lent task's caller goes back to its Future now
        return cancelled

    def _sent_ahead_alone(self, task: Task) -> tuple[SlotRecord, Batch] | None:
        """The slot and batch of a task sent ahead (behind its slot's running batch), if no other
        task of that batch is still to end (taking it back then re-runs nothing elsewhere)."""
        batch = task.in_batch
        if batch is None or task.state is not TaskState.RUNNING or not self.transport.takes_back:
            return None
        for slot in self.slots:
            if batch in slot.batches:
                alone = all(t is task or t.state.is_terminal for t in batch.tasks)
                return (slot, batch) if alone and not batch.revoked and slot.batches[0] is not batch else None
        return None

    def abort(self, reason: str) -> None:
        """close() ran out of time: cancel everything, stop every worker now. Its callers are
        told before this returns (close() waits for it: every Future done when it returns)."""
        self.ledger.abort_in_hand(reason)
        self.ledger.flush()
        for slot in self.slots:
            self.kill(slot, KillReason.SHUTDOWN, 0.2)

    def model_spec(self) -> SessionSpec | None:
        """The model the engine serves (what a reload replaces)."""
        return self.slots[0].spec  # type: ignore[no-any-return]

    # -- start ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Every slot started, `transport.quorum` of them up, then the loop: from here on only
        the owner thread acts. On any exception (KeyboardInterrupt too) every worker started
        is stopped, and nothing is left."""
        try:
            for slot in self.slots:
                self.spawn(slot, retry=False)
            self._wait_quorum(time.monotonic() + self.cfg.startup_timeout)
        except BaseException:
            self.transport.abort()
            raise
        self.thread.start_loop()

    def _wait_quorum(self, deadline: float) -> None:
        while (up := sum(s.state is SlotState.READY for s in self.slots)) < self.transport.quorum:
            now = time.monotonic()
            if deadline - now <= 0:
                error = self.transport.startup_timeout_error(self.cfg.startup_timeout, up)
                if error is None:
                    return
                raise error
            waits = [deadline - now]
            for slot in self.slots:  # (a start killed from outside, retried after its back-off)
                if slot.respawn_at is not None and slot.state is SlotState.DEAD:
                    if slot.respawn_at <= now:
                        slot.respawn_at = None
                        self.spawn(slot, retry=False)
                    else:
                        waits.append(slot.respawn_at - now)
            try:
                events = self.transport.wait(min(waits))
            except TransportLost as lost:
                raise lost.error from None
            for ev in events:
                if type(ev) is Died:
                    self._died_starting(ev)
                if type(ev) is Ready:
                    self._on_ready(ev)
            if self.ledger.failure is not None:
                raise self.ledger.failure

    def _died_starting(self, ev: Died) -> None:
        """A worker died before the engine's first quorum (starting, or up while another starts:
        it holds no task yet). Its session said why (a model or an
        initializer that fails: every start would), or it exited before slabpool's code ran:
        raised at once. Killed by a signal (from outside: the OOM killer): retried after the
        back-off, as a start-up death once the engine runs (was: Engine() failed, saying the
        model failed to load), and raised after MAX_STARTUP_FAILURES in a row."""
        slot = self.slots[ev.slot]
        cause = ev.cause or (describe_exit(ev.exitcode) if ev.exitcode is not None else "an unknown cause")
        error = ev.startup_error or E.SessionInitError(f"slot {ev.slot} died during start-up: {cause}")
        by_signal = ev.exitcode is not None and ev.exitcode < 0  # (an exit of its own, before slabpool's
        # code ran: an import of the main module that raises, say; every start would do the same)
        if (slot.state not in (SlotState.STARTING, SlotState.READY) or ev.reported or not by_signal
                or slot.startup_failures + 1 >= MAX_STARTUP_FAILURES):
            if slot.startup_failures:
                error.add_note(f"(its start had failed {slot.startup_failures} time(s) before, each retried)")
            raise error
        slot.fire(SlotEvent.DIE)
        self._on_startup_death(slot, error)  # (under MAX_STARTUP_FAILURES: its back-off; _wait_quorum respawns)

    def spawn(self, slot: SlotRecord, retry: bool = True) -> None:
        """A new incarnation of the slot, on its spec (the crash path's b; a reload's swap).

        A worker process the OS refuses (OSError: this process out of file descriptors, the
        host out of processes or memory; a server near its limit on open files when a worker
        dies) is a start-up that failed, retried after the back-off as one whose worker died
        starting: the other slots serve on meanwhile. At the engine's own start (`retry`
        False) it raises, as SessionInitError naming the limit."""
        bound = time.monotonic() + self.cfg.startup_timeout if self.transport.startup_bound else None
        slot.started(slot.spec, bound)
        try:
            slot.pid = self.transport.start(slot.index, slot.spec) or slot.pid
        except OSError as exc:
            slot.fire(SlotEvent.DIE)
            error = E.unstartable(slot.index, exc)
            if not retry:
                raise error from exc
            self._start_failed(slot, error, reported=False)

    def kill(self, slot: SlotRecord, reason: KillReason, grace: float) -> None:
        """Stop a slot's worker with a reason (its death then charges no task, but TIMEOUT's)."""
        if not slot.state.live or slot.kill_reason is not None:
            return
        slot.kill_reason = reason
        if slot.state in _EXITABLE:
            slot.fire(SlotEvent.EXIT)  # no new work
        self.transport.kill(slot.index, reason, grace)

    # -- the loop (engine.core.owner.LoopBody) --------------------------------------------------------

    def wake(self) -> None:
        self.transport.wake()

    def step(self) -> None:
        """One step, holding the owner lock (a lending transport lets go of it around its
        wait: a caller may act meanwhile, engine.core.fastpath)."""
        with self.thread.lock.owning():
            now = time.monotonic()
            timeout = self.fast.owner_timeout(self.next_timer(now, self.fast.reclaim_at()))
            self.fast.sleep_until = float("inf") if timeout is None else now + timeout
            try:
                events = self.transport.wait(timeout)
            except TransportLost as lost:  # (every task held fails with why; the loop then ends)
                events = []
                self.fail(lost.error)
            self.fast.sleep_until = 0.0  # awake: a caller's dispatch need not wake it
            self.thread.run_calls()
            now = time.monotonic()
            self.handle(events, now)
            self.ledger.expire(now)
            self.watchdog.run(now)
            self.fast.review(now)
            self.dispatcher.dispatch(now)
            self.ledger.flush()

    def handle(self, events: list[Event], now: float) -> None:
        """What the transport reported, in order (the owner thread's, or a lender's read)."""
        for ev in events:
            if type(ev) is Done:
                self.dispatcher.on_done(ev, now)
            elif type(ev) is Ready:
                self._on_ready(ev)
            else:
                self._on_died(ev)  # type: ignore[arg-type]

    def next_timer(self, now: float, *others: float | None) -> float | None:
        """Seconds to the next timer of the owner's (None: none runs)."""
        return self.watchdog.next_timer(now, self.dispatcher.batch_ready_at, *others)

    def finished(self) -> bool:
        if self.ledger.failure is not None:
            return True
        if self.ledger.closing is None:
            return False
        with self.thread.lock.owning():  # (a lender may be ending a batch right now)
            # a batch taken back from a stalled worker holds no task: close() does not wait for it
            return len(self.queue) == 0 and all(b.revoked for s in self.slots for b in s.batches)

    def fail(self, error: BaseException) -> None:
        """The engine cannot go on (a slot cannot start, a bug): every waiting task fails with why."""
        self.ledger.fail_all(error)
        for slot in self.slots:
            self.kill(slot, KillReason.SHUTDOWN, 0.0)

    def stopped(self) -> None:
        with self.thread.lock.owning():
            self.fast.end_all()  # a caller waiting on a lent slot goes back to its Future
            stopping.stop(self)  # the stop path: engine.core.stopping

    # -- events --------------------------------------------------------------------------------------

    def _on_ready(self, ev: Ready) -> None:
        slot = self.slots[ev.slot]
        if slot.state is not SlotState.STARTING:
            return  # an incarnation killed while it started: its death follows
        slot.fire(SlotEvent.UP)
        slot.ready_by = None
        slot.pid, slot.node = ev.pid, ev.node
        slot.startup_failures = 0
        if ev.info is not None:
            self.info = self.info or ev.info
            slot.info = ev.info
            slot.model_version = ev.info.model_digest
        if self.reload is not None:
            self.reload.on_ready(self, slot)

    def _on_died(self, ev: Died) -> None:
        """The crash path: a (the transport has reaped it), b, c, d."""
        slot = self.slots[ev.slot]
        expected = slot.kill_reason
        was_starting = slot.state is SlotState.STARTING
        held = list(slot.batches)
        slot.batches.clear()
        slot.fire(SlotEvent.DIE)
        if was_starting and expected in (None, KillReason.STARTUP_FAILED):
            self._start_failed(slot, self._startup_error(slot, ev, expected), ev.reported)
            return
        self._log_death(slot, ev, expected, held)
        replays = self._settle(held, expected, Crash(slot.index, ev.pid, ev.exitcode), ev.running)
        if replays:
            self.queue.push_replays(replays)  # c: in acceptance order, ahead of new work
        if self.ledger.failure is None and (self.ledger.closing is None or len(self.queue) > 0 or replays):
            self.spawn(slot)  # b: rebuild this slot alone
        elif self.ledger.closing is not None:
            slot.fire(SlotEvent.STOP)

    def _log_death(self, slot: SlotRecord, ev: Died, expected: KillReason | None, held: list[Batch]) -> None:
        if expected is not None and expected.planned:
            log.info("slot %d retired (pid %d)", slot.index, ev.pid)
            return
        slot.restarts += 1
        self.metrics.restart(slot.index)
        how = describe_exit(ev.exitcode) if ev.exitcode is not None else f"{ev.cause or 'an unknown cause'}"
        log.warning("worker of slot %d (pid %d) died with %s holding %d batch(es)%s.%s", slot.index, ev.pid, how,
                    len(held), f" ({expected.value})" if expected else "", "" if expected else crash_hint(ev.exitcode))

    def _settle(self, held: list[Batch], expected: KillReason | None, crash: Crash, running: int) -> list[Batch]:
        """Apply recovery.settle: time out, quarantine, free what ended, requeue the rest."""
        plan = recovery.settle(held, expected, crash, running, self.cfg.max_attempts)  # d: who is charged
        for batch in held:
            for t in batch.tasks:
                t.in_batch = None  # the worker is gone: nothing reads these inputs now
        for t in plan.timed_out:
            self.ledger.finish(t, error=E.TaskTimeout(
                f"task {t.id} ran past task_timeout={self.cfg.task_timeout} s; its slot was rebuilt", task_id=t.id))
        for t in plan.poisoned:
            self.ledger.quarantine(t, crash_error(t.crashes[-1]))
        self.transport.release([t for b in held for t in b.tasks if t.state.is_terminal])
        for b in plan.replays:
            for t in b.tasks:
                t.move(TaskState.QUEUED)
        return plan.replays

    def _startup_error(self, slot: SlotRecord, ev: Died, expected: KillReason | None) -> E.SessionInitError:
        if expected is KillReason.STARTUP_FAILED:
            return E.SessionInitError(
                f"slot {slot.index} (pid {ev.pid}) was not ready within startup_timeout="
                f"{self.cfg.startup_timeout} s (its initializer or session build did not finish); it was killed")
        return ev.startup_error or E.SessionInitError(f"slot {slot.index} died during start-up: {ev.cause}")

    def _start_failed(self, slot: SlotRecord, error: E.SessionInitError, reported: bool) -> None:
        """A start that failed (its worker died starting, or the OS refused it): a reload's
        to handle if it started it, else retried after the back-off."""
        if self.reload is not None and self.reload.on_start_failed(self, slot, error, reported):
            return
        self._on_startup_death(slot, error)

    def _on_startup_death(self, slot: SlotRecord, error: E.SessionInitError) -> None:
        """A start-up that died: retried after a back-off (0.1 s, doubling, at most 5 s). After
        MAX_STARTUP_FAILURES in a row the engine stops once every slot is there (none serves, and
        none is still starting with fewer failures in a row): a model that cannot load fails
        loudly, each slot having failed that often, but one slot whose starts keep dying (killed
        from outside, say by the OOM killer, while the host is short of memory) does not take
        the others down with it; it goes on being retried, at most 5 s apart."""
        slot.startup_failures += 1
        slot.restarts += 1
        delay = min(0.1 * 2 ** (slot.startup_failures - 1), 5.0)
        if slot.startup_failures < MAX_STARTUP_FAILURES:
            log.warning("slot %d failed to start (%s); retrying in %.1f s", slot.index, error, delay)
        elif any(s.state.can_take or s.startup_failures < MAX_STARTUP_FAILURES for s in self.slots):
            log.error("slot %d failed to start %d times in a row (%s); the other slots serve on (or start), and "
                      "it is retried (a back-off of at most 5 s)", slot.index, slot.startup_failures, error)
        else:
            self.fail(E.SessionInitError(
                f"slot {slot.index} failed to start {slot.startup_failures} times in a row, and no "
                f"other slot serves or is yet to fail as often; the engine stopped. Last: {error}"))
            return
        slot.respawn_at = time.monotonic() + delay

    # -- the ledger's hooks ---------------------------------------------------------------------------

    def _release(self, task: Task) -> None:
        """A task ended: its inputs go back now, unless a batch in a slot still holds it (they
        go back with the batch, Dispatcher.end_batch)."""
        if task.in_batch is None:
            self.transport.release((task,))

    def _kill_running(self, task: Task) -> None:
        self.dispatcher.kill_running(task)

    # -- hot model swaps (engine.core.reload) --------------------------------------------------------

    def start_reload(self, plan: ReloadPlan) -> None:
        if self.reload is not None:
            plan.abort(E.EngineError("a reload is already in progress"))
        elif self.ledger.closing is not None or self.ledger.failure is not None:
            plan.abort(E.EngineClosed("the engine is closing"))
        else:
            self.reload = plan
            plan.start(self)

    def end_reload(self, plan: ReloadPlan, info: SessionInfo | None) -> None:
        """A swap ended: what callers describe() from now on (None: unchanged)."""
        if info is not None:
            self.info = info
        if self.reload is plan:
            self.reload = None

    def replace(self, slot: SlotRecord, *, drain: bool) -> None:
        """Rebuild a live slot on its (new) spec: after what it holds (drain), or at once,
        handing its tasks back to the queue uncharged."""
        if slot.state is SlotState.DEAD:
            self.spawn(slot)  # (a start-up back-off is cut short: the spec has changed)
        elif slot.state is SlotState.STARTING:  # holds nothing yet: restart it on the new spec
            self.kill(slot, KillReason.RELOAD, 1.0)
        elif slot.state in (SlotState.READY, SlotState.BUSY, SlotState.STALLED):
            slot.fire(SlotEvent.RETIRE)
            if drain:
                self.dispatcher.retire_if_due(slot)
            else:
                self.kill(slot, KillReason.RELOAD, 1.0)


def _nothing() -> None:
    """Until the backend says what to do once every slot has stopped."""
