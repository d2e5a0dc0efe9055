"""The task ledger both backends share: how a task ends, once, and what is counted.

It runs on the owner thread (engine.core.owner) and knows tasks, the admission queue, counters and
metrics; it knows nothing of processes or actors. It keeps every task dispatched and not yet
ended (`dispatchable` -> `finish`), wherever a slot holds it. The owner that holds it gives it,
as two callables, how to stop a running task (`kill_running`) and what a task gives back when
it ends (`release`).

Hot-path choices (measured, see CHANGELOG.md): counters are summed per step and published
under one lock (`count` -> `flush`), before the Futures complete, so the books balance when a
caller looks; Futures complete after the step's state changes, outside any decision.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

from slabpool.engine.core.admission import Counter, TaskQueue
from slabpool.engine.core.states import TaskState
from slabpool.engine.core.task import Result, Task, Timings
from slabpool.workers import errors
from slabpool.workers.errors import Crash


def _nothing(task: Task) -> None:
    """No inputs to give back, no computation to stop (the ledger on its own, in tests)."""


class Closing(enum.Enum):
    """How the engine is closing: finish what was accepted, or cancel what has not started."""

    DRAIN = "drain"
    CANCEL = "cancel"


class TaskLedger:
    """Finish once, cancel, close, quarantine, expire, fail; counters and histograms."""

    def __init__(self, queue: TaskQueue, metrics: Any, release: Callable[[Task], None] = _nothing,
                 kill_running: Callable[[Task], None] = _nothing) -> None:
        self.queue = queue
        self._release = release  # a task ended: give back what it holds that no slot reads
        self._kill_running = kill_running  # cancel(kill=True): stop its computation, if running
        self.metrics = metrics
        self.closing: Closing | None = None
        self.failure: BaseException | None = None
        self._completions: list[tuple[Future[Result], Result | None, BaseException | None]] = []
        self._due: dict[Counter, int] = {}  # counts not yet published (see count)
        # every task dispatched and not yet ended, wherever it is (a slot, the replay queue, or
        # a local variable of a step): an engine that fails ends each of them, none is lost
        self._unfinished: dict[int, Task] = {}

    # -- endings -----------------------------------------------------------------------------------

    def dispatchable(self, task: Task) -> bool:
        """Before a task's first dispatch (step 4): whether it may run. One the caller cancelled
        between the queue and here ends CANCELLED, counted, and gives back its inputs. One
        that has ended already (cancelled while it waited to replay) is never sent again: its
        inputs may be gone."""
        if task.state.is_terminal:
            return False
        if task.attempts:
            return True
        assert task.future is not None  # (not ended: it still has its Future)
        if task.future.set_running_or_notify_cancel():
            self._unfinished[task.id] = task
            return True
        task.move(TaskState.CANCELLED)
        self.count(Counter.CANCELLED)
        self.count(Counter.ITEMS_CANCELLED, task.units)
        self._release(task)
        return False

    def finish(self, task: Task, *, result: Result | None = None, error: BaseException | None = None) -> None:
        """End a task exactly once (step 9); its Future completes at the next flush()."""
        if task.state.is_terminal:
            return
        if error is None:
            new, counter, items = TaskState.DONE, Counter.COMPLETED, Counter.ITEMS_COMPLETED
        elif isinstance(error, errors.TaskCancelled):
            new, counter, items = TaskState.CANCELLED, Counter.CANCELLED, Counter.ITEMS_CANCELLED
        else:
            new, counter, items = TaskState.FAILED, Counter.FAILED, Counter.ITEMS_FAILED
        self._end(task, new, counter, items)
        if result is not None:
            self.metrics.observe(result.timings)  # only what is really delivered
        if isinstance(error, errors.TaskTimeout):
            self.count(Counter.TIMEOUTS)
        self._release(task)
        assert task.future is not None  # (not ended before: the check above)
        self._completions.append((task.future, result, error))
        task.future = None  # its Future is the completion's now (see Task.future)

    def delivered(self, task: Task, timings: Timings) -> None:
        """A running task whose outputs go straight to the one caller that waits on it
        (engine.local.express): it ends DONE, counted and observed as `finish` ends it; its
        Future, which nobody else holds, is not completed."""
        self._end(task, TaskState.DONE, Counter.COMPLETED, Counter.ITEMS_COMPLETED)
        self.metrics.observe(timings)
        self._release(task)
        task.future = None

    def _end(self, task: Task, new: TaskState, counter: Counter, items: Counter) -> None:
        task.move(new)
        self._unfinished.pop(task.id, None)
        due = self._due  # (count(), inlined: every task ends here)
        due[counter] = due.get(counter, 0) + 1
        if task.units:
            due[items] = due.get(items, 0) + task.units

    def count(self, counter: Counter, n: int = 1) -> None:
        """Count now, publish in flush(): one lock per step, before the Futures complete."""
        self._due[counter] = self._due.get(counter, 0) + n

    def flush(self) -> None:
        """Publish the step's counts, then complete its Futures (once each)."""
        if self._due:
            counters, due, self._due = self.queue.counters, self._due, {}
            with self.queue.lock:
                for counter, n in due.items():
                    counters.add(counter, n)
        done, self._completions = self._completions, []
        for fut, result, error in done:
            try:
                if error is not None:
                    fut.set_exception(error)
                else:
                    fut.set_result(result)  # type: ignore[arg-type]
            except InvalidStateError:
                pass  # the caller cancelled it first: it ends once, as cancelled

    # -- what callers ask for (through owner.call) -----------------------------------------------

    def cancel(self, task: Task, kill: bool, started: bool = True) -> bool:
        """Queued: it never runs. Running: its result is never delivered; `kill` stops it.
        (`started` False: it was sent ahead to a slot, which the owner takes it back from.)"""
        if task.state.is_terminal:
            return False
        if task.state is TaskState.QUEUED and self.queue.discard(task):
            where = "while it waited to run again" if task.attempts else "while queued"
            self.finish(task, error=cancelled(task, f"cancelled {where}"))
            return True
        if not started:
            self.finish(task, error=cancelled(task, "cancelled while sent ahead to a worker: taken back before it "
                                              "starts (begun meanwhile, its result is dropped)"))
            return True
        self.finish(task, error=cancelled(task, "cancelled while running; its result is dropped"))
        if kill:
            self._kill_running(task)
        return True

    def close(self, cancel_pending: bool) -> None:
        """Stop taking new work: drain what was accepted, or cancel what has not started."""
        self.closing = Closing.CANCEL if cancel_pending else (self.closing or Closing.DRAIN)
        if cancel_pending:
            for task in self.queue.drain_all():
                self.finish(task, error=cancelled(task, "the engine closed before it started", "closed"))

    def in_flight(self) -> int:
        """Tasks dispatched and not yet ended (cheap: the fast path asks on every call)."""
        return len(self._unfinished)

    def unfinished(self) -> list[Task]:
        """Every task dispatched and not yet ended (the stop path ends each)."""
        return list(self._unfinished.values())

    def pending_futures(self) -> list[Future[Result]]:
        """The Futures of every unfinished task and of every completion not yet flushed."""
        return [t.future for t in self._unfinished.values() if t.future is not None] + [c[0] for c in self._completions]

    def abort_in_hand(self, reason: str) -> None:
        """close() ran out of time: every task dispatched and not yet ended ends as cancelled now."""
        self.close(True)
        for task in list(self._unfinished.values()):
            self.finish(task, error=cancelled(task, reason, "closed"))

    def quarantine(self, task: Task, cause: BaseException | None) -> None:
        """A task charged with max_attempts deaths: PoisonTask, never retried again."""
        crashes = ", ".join(f"slot {c.slot} pid {c.pid}" + (f" {c.signal}" if c.exitcode is not None else "")
                            for c in task.crashes)
        self.count(Counter.QUARANTINED)
        error = errors.PoisonTask(
            f"task {task.id} was in hand when {len(task.crashes)} workers died ({crashes}); "
            "quarantined, not retried again", task_id=task.id, crashes=tuple(task.crashes))
        error.__cause__ = cause
        self.finish(task, error=error)

    def expire(self, now: float) -> None:
        """Queued tasks past their deadline end as TaskTimeout; they never started."""
        for task in self.queue.expire(now):
            self.finish(task, error=errors.TaskTimeout(
                f"task {task.id} was still queued at its deadline; it was not started", task_id=task.id))

    def fail_all(self, error: BaseException) -> None:
        """The engine cannot go on: every waiting and dispatched task fails with why."""
        self.failure = error
        self.queue.close(error)
        for task in self.queue.drain_all():
            self.finish(task, error=error)
        for task in list(self._unfinished.values()):  # held by a slot, or anywhere else
            self.finish(task, error=error)


def cancelled(task: Task, why: str, reason: str = "cancelled") -> errors.TaskCancelled:
    return errors.TaskCancelled(f"task {task.id}: {why}", task_id=task.id, reason=reason)


def crash_error(c: Crash) -> errors.WorkerCrashed:
    """The WorkerCrashed that stands for one recorded death (a PoisonTask's cause)."""
    return errors.WorkerCrashed(
        f"the worker of slot {c.slot} (pid {c.pid}) died with {c.signal}." + errors.crash_hint(c.exitcode),
        slot=c.slot, pid=c.pid, exitcode=c.exitcode)
