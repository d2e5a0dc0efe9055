"""The admission queue: accepted-but-not-running tasks, bounded, with a declared policy.

Callers put tasks in (blocking, rejecting or superseding the oldest when it is full); the
supervisor takes batches out. Replays of a dead slot's tasks wait here too, ahead of new
work, in acceptance order. One lock guards it; whoever removes a task from it under the lock
owns that task's ending.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from slabpool.engine.core.config import AdmissionPolicy
from slabpool.engine.core.task import Batch, Task
from slabpool.workers.errors import QueueFull, TaskCancelled

MAX_GROUP = 32  # tasks in one group (one message each way)
MIN_GROUP = 8  # tiny tasks per slot worth a message sent ahead to a busy slot


class Counter(StrEnum):
    """One of the engine's counters: a field of `Counters`, a field of `EngineStats`, a metric.
    Counting takes one (`ledger.count(Counter.REPLAYED)`): mypy refuses a bare name."""

    ACCEPTED = "accepted"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    REPLAYED = "replayed"
    QUARANTINED = "quarantined"
    TIMEOUTS = "timeouts"
    STACKED_BATCHES = "stacked_batches"
    OUTPUTS_IN_PLACE = "outputs_in_place"
    ITEMS_ACCEPTED = "items_accepted"
    ITEMS_COMPLETED = "items_completed"
    ITEMS_FAILED = "items_failed"
    ITEMS_CANCELLED = "items_cancelled"


@dataclass
class Counters:
    """The engine's own accounting, in tasks (what the engine runs) and in items (what the
    caller handed in: a submit() is one item, a map() item one, a row of
    infer(batch_size=) one). accepted == completed + failed + cancelled + in flight, for each.
    A task of a map() chunk or an infer() block counts no items itself: the caller's side
    counts its items as their outcomes are known (a block bisected after a failure is
    several tasks, its rows counted once)."""

    accepted: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    replayed: int = 0
    quarantined: int = 0
    timeouts: int = 0
    stacked_batches: int = 0
    outputs_in_place: int = 0  # tasks whose outputs the runtime wrote into shared memory itself
    items_accepted: int = 0
    items_completed: int = 0
    items_failed: int = 0
    items_cancelled: int = 0

    def add(self, counter: Counter, n: int = 1) -> None:
        """Add `n` to one counter (under the queue's lock). A name that is no counter raises
        KeyError (where setattr would have made a new attribute nobody reads)."""
        self.__dict__[counter] += n

    def snapshot(self) -> dict[str, int]:
        """Every counter by name (under the queue's lock): EngineStats' counter fields."""
        return {c.value: self.__dict__[c] for c in Counter}


class _Turn(threading.Condition):
    """A caller's place in the line (`TaskQueue.reserve`): what it waits on, and the input
    bytes it brings (the callers behind it count them as taken)."""

    def __init__(self, lock: threading.RLock, nbytes: int) -> None:
        super().__init__(lock)
        self.nbytes = nbytes


class TaskQueue:
    """The tasks accepted and not yet running, shared by caller threads (accept, reserve,
    discard) and the owner thread (take, push_replays, expire, drain_all), under one lock.
    Bounds what waits (`capacity` tasks, `max_bytes` of inputs) by the admission policy
    (block, reject, drop_oldest); replays go ahead of new work; it decides when a caller must
    wake the owner (`hungry`), and keeps the counters every backend reports."""

    def __init__(self, capacity: int, policy: AdmissionPolicy | str, wake: Callable[[], None],
                 max_bytes: int = 0) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes  # input bytes queued or reserved (0: no limit); one task always fits
        self._bytes = 0  # input bytes of the queued tasks and of the reservations
        self.policy = AdmissionPolicy.of(policy)
        self._wake = wake
        # one lock; `with` takes it directly (a Condition's own __enter__ and __exit__ are two
        # Python calls each time, ~16 a call on the fast path); each waiting caller waits on a
        # Condition of its own over it, in `_line`
        self._lock = threading.RLock()
        self._pending: dict[int, Task] = {}  # insertion (= acceptance) ordered
        self._replays: list[Batch] = []  # sorted by their first task id
        self._reserved = 0
        self._next_id = 0
        self._closed: BaseException | None = None
        # callers blocked for a place, in arrival order: a caller takes one only if there is
        # one for each caller ahead of it too, and room under max_bytes for their inputs and
        # its own, so a newcomer never passes the line (no barging) and small inputs never
        # pass a large one that waits for bytes; freed places wake that many callers, first
        # in line first
        self._line: deque[_Turn] = deque()
        self._deadlines = 0  # queued tasks with a deadline: no scan per step when there are none
        # False while every slot is full: a new task can wait for the next completion (the
        # supervisor takes from the queue then), so the caller does not wake the supervisor;
        # while only busy slots have room, it wakes it once `wake_at` tasks wait (a group)
        self.hungry = True
        self.wake_at = 1
        self.counters = Counters()
        self.lock = self._lock  # the counters' lock too

    def set_wake(self, wake: Callable[[], None]) -> None:
        """Who to wake when work arrives (the supervisor, once it exists)."""
        self._wake = wake

    # -- the caller's side --------------------------------------------------------------------

    def reserve(self, timeout: float | None, nbytes: int = 0) -> list[Task]:
        """Wait for a place (a task slot, and `nbytes` of input under max_bytes); return the
        tasks it superseded (drop_oldest), to be cancelled.

        The byte bound keeps large inputs from piling up in the queue: a deep queue of 8 MiB
        items cycles through hundreds of MiB of shared memory and runs ~3x slower (measured)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        superseded: list[Task] = []
        with self._lock:
            turn: _Turn | None = None  # this caller's place in the line
            placed = False
            try:
                while True:
                    self.raise_if_closed()
                    line = self._line
                    ahead = len(line) if turn is None else line.index(turn)
                    room = self.capacity - self._size()
                    over = bool(self.max_bytes) and (self._bytes > 0 or ahead > 0) and (
                        self._bytes + nbytes + (sum(t.nbytes for t in itertools.islice(line, ahead)) if ahead else 0)
                        > self.max_bytes)
                    if room > ahead and not over:  # a place for each caller ahead in line, and one for this
                        break
                    full = over or room <= 0
                    if full and self.policy is AdmissionPolicy.REJECT:
                        raise QueueFull(f"queue full ({len(self)} tasks, {self._bytes} bytes waiting); nothing accepted")
                    if full and self.policy is AdmissionPolicy.DROP_OLDEST and self._pending:
                        superseded.append(self._take_out(next(iter(self._pending))))
                        continue
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        if room <= 0:
                            why = f"queue still full ({self.capacity} tasks)"
                        elif room <= ahead:
                            why = f"{ahead} caller(s) still waiting for a place ahead of this one"
                        else:  # (over: the bytes bound)
                            why = (f"queue still full ({self._bytes} of {self.max_bytes} bytes of inputs waiting, "
                                   f"{ahead} caller(s) ahead in line; this one brings {nbytes})")
                        raise QueueFull(f"{why} after {timeout} s")
                    if turn is None:
                        turn = _Turn(self._lock, nbytes)
                        self._line.append(turn)
                    turn.wait(left)
                placed = True
            finally:
                if turn is not None:
                    self._line.remove(turn)
                    if not placed:
                        self._notify()  # (gave up: the place it was woken for goes to the next in line)
            self._reserved += 1
            self._bytes += nbytes
        return superseded

    def unreserve(self, nbytes: int = 0) -> None:
        with self._lock:
            self._reserved -= 1
            self._bytes -= nbytes
            self._notify()

    def accept(self, make: Callable[[int], Task]) -> Task:
        """Turn a reservation into an accepted task; its id is the acceptance sequence number."""
        with self._lock:
            self._reserved -= 1
            self.raise_if_closed()
            task = make(self._next_id)
            self._next_id += 1
            self._pending[task.id] = task
            self.counters.accepted += 1
            self.counters.items_accepted += task.units
            if task.deadline is not None:
                self._deadlines += 1
            wake = (self.hungry and len(self._pending) >= self.wake_at) or task.deadline is not None
        if wake:
            self._wake()
        return task

    def accept_running(self, make: Callable[[int], Task]) -> Task | None:
        """Accept a task that goes to an idle slot at once, never queued (engine.local.express):
        only while nothing waits here, so it passes no one; None (nothing accepted) otherwise.
        Raises as `accept` does once the queue is closed."""
        with self._lock:
            self.raise_if_closed()
            if self._pending or self._replays:
                return None
            task = make(self._next_id)
            self._next_id += 1
            self.counters.accepted += 1
            self.counters.items_accepted += task.units
        return task

    def discard(self, task: Task) -> bool:
        """Remove a still-queued task, new or waiting to replay (it was cancelled); True if
        it was here. Whoever removes it owns its ending: it will never be sent."""
        with self._lock:
            if task.id in self._pending:
                self._take_out(task.id)
            elif not self._discard_replay(task):
                return False
            self._notify()
            return True

    def _discard_replay(self, task: Task) -> bool:
        """Take a task out of the batch that waits to replay it (a batch left empty goes)."""
        for i, batch in enumerate(self._replays):
            if any(t is task for t in batch.tasks):
                batch.tasks = [t for t in batch.tasks if t is not task]
                if not batch.tasks:
                    del self._replays[i]
                else:
                    batch.stack = batch.stack and len(batch.tasks) > 1
                    self._replays.sort(key=lambda b: b.tasks[0].id)
                return True
        return False

    def close(self, error: BaseException) -> None:
        with self._lock:
            if self._closed is None:
                self._closed = error
            for turn in self._line:  # every caller in line ends with the error
                turn.notify()

    def _take_out(self, task_id: int) -> Task:
        task = self._pending.pop(task_id)
        self._bytes -= task.nbytes
        if task.deadline is not None:
            self._deadlines -= 1
        return task

    def _notify(self) -> None:
        """Places may have freed up: as many callers as there are places, first in line
        first, are woken (never the whole line: the rest would only wait again)."""
        line = self._line
        if line:
            for turn in itertools.islice(line, max(self.capacity - self._size(), 1)):
                turn.notify()

    def raise_if_closed(self) -> None:
        """Raise why the queue was closed (the engine's failure, or EngineClosed), if it was."""
        if self._closed is not None:
            raise self._closed

    def _size(self) -> int:
        return self._queued() + self._reserved

    def _queued(self) -> int:
        """Tasks waiting, new or to replay (the lock held; no generator when no replay waits:
        asked several times a call)."""
        n = len(self._pending)
        return n + sum(len(b.tasks) for b in self._replays) if self._replays else n

    # -- the supervisor's side ----------------------------------------------------------------

    def take(
        self, max_items: int, wait_s: float, now: float, spread: int = 1, max_tasks: int = MAX_GROUP,
        min_tasks: int = 1,
    ) -> Batch | float | None:
        """The next batch to dispatch; or the time to look again (a batch still filling); or
        None when fewer than `min_tasks` wait. Pure policy over the queue, under its lock.

        Without stacking (max_items 1), tasks are sent in groups of up to `max_tasks`, their
        fair share over the `spread` slots that take work: one message each way for the group
        instead of one per task. The worker runs them one by one. A task in a group counts as
        running (Future.cancel() is refused; eng.cancel() still drops its result), and its
        result arrives with the group's."""
        with self._lock:
            if self._replays:
                self._notify()  # replays count against capacity too: a place just freed up
                return self._replays.pop(0)
            if len(self._pending) < max(min_tasks, 1):
                # under the lock: the caller that brings the queue to min_tasks wakes us
                self.hungry, self.wake_at = True, max(min_tasks, 1)
                return None
            self.wake_at = 1
            first = next(iter(self._pending.values()))
            if max_items <= 1 or first.rows == 0:
                n = min(max_tasks, max(len(self._pending) // max(spread, 1), 1))
                return self._pop_batch(list(itertools.islice(self._pending.values(), n)), stack=False)
            mates: list[Task] = []
            count = 0
            for task in self._pending.values():  # the first always goes: alone if it is larger
                if task.shape_key != first.shape_key or (mates and count + task.rows > max_items):
                    continue
                mates.append(task)
                count += task.rows
                if count >= max_items or len(mates) >= max_tasks:
                    break
            if count < max_items and len(mates) < max_tasks and now < first.accepted_at + wait_s:
                self.hungry = True  # each new mate may fill the batch: wake on it
                return first.accepted_at + wait_s  # wait a little for more batch mates
            return self._pop_batch(mates, stack=len(mates) > 1)

    def _pop_batch(self, tasks: list[Task], stack: bool) -> Batch:
        for t in tasks:
            self._take_out(t.id)
        self._notify()
        return Batch(tasks, stack)

    def push_replays(self, batches: list[Batch], *, count: bool = True) -> None:
        """Batches back from a slot, ahead of new work (`count`: replays after a death)."""
        with self._lock:
            self._replays.extend(batches)
            self._replays.sort(key=lambda b: b.tasks[0].id)
            if count:
                self.counters.replayed += sum(len(b.tasks) for b in batches)
        self._wake()

    def expire(self, now: float) -> list[Task]:
        """Queued tasks past their deadline, removed: they end with TaskTimeout, never start."""
        with self._lock:
            if not self._deadlines:
                return []
            gone = [t for t in self._pending.values() if t.deadline is not None and t.deadline <= now]
            for t in gone:
                self._take_out(t.id)
            if gone:
                self._notify()
            return gone

    def next_deadline(self) -> float | None:
        with self._lock:
            if not self._deadlines:
                return None
            return min((t.deadline for t in self._pending.values() if t.deadline is not None), default=None)

    def drain_all(self) -> list[Task]:
        """Everything still waiting, removed (close with cancel_pending, or engine failure)."""
        with self._lock:
            tasks = list(self._pending.values()) + [t for b in self._replays for t in b.tasks]
            self._pending.clear()
            self._bytes = self._deadlines = 0
            self._replays.clear()
            self._notify()
            return tasks

    def __len__(self) -> int:
        with self._lock:
            return self._queued()


def superseded_error(task: Task) -> TaskCancelled:
    return TaskCancelled(
        f"task {task.id} was superseded by newer work (admission='drop_oldest')",
        task_id=task.id,
        reason="superseded",
    )
