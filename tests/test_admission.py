"""The admission queue's dispatch policy, on its own: groups, and when a caller wakes the
supervisor (every wake-up costs a thread switch per task: see engine/core/admission.py)."""

from __future__ import annotations

from concurrent.futures import Future

from slabpool.engine.core.admission import TaskQueue
from slabpool.engine.core.task import Batch, Task


class Wakes:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


def _queue() -> tuple[TaskQueue, Wakes]:
    wakes = Wakes()
    return TaskQueue(capacity=1000, policy="block", wake=wakes), wakes


def _submit(q: TaskQueue, deadline: float | None = None) -> Task:
    q.reserve(None)
    return q.accept(lambda i: Task(i, Future(), None, ("k",), 1, None, 0, deadline, None))


def test_a_full_engine_is_not_woken_for_each_new_task() -> None:
    q, wakes = _queue()
    _submit(q)
    assert wakes.count == 1  # hungry at first: the supervisor may have a slot free
    q.hungry = False  # what the supervisor sets when every slot is full
    for _ in range(5):
        _submit(q)
    assert wakes.count == 1  # the next completion takes them
    _submit(q, deadline=1e12)
    assert wakes.count == 2  # a deadline must be seen by the supervisor's timers


def test_a_busy_slot_waits_for_a_group_and_the_caller_that_completes_it_wakes_the_supervisor() -> None:
    q, wakes = _queue()
    for _ in range(3):
        _submit(q)
    assert q.take(1, 0.0, 0.0, spread=1, max_tasks=32, min_tasks=8) is None
    assert q.wake_at == 8 and q.hungry
    before = wakes.count
    for _ in range(4):
        _submit(q)  # 7 waiting: not yet a group
    assert wakes.count == before
    _submit(q)  # the 8th
    assert wakes.count == before + 1
    got = q.take(1, 0.0, 0.0, spread=1, max_tasks=32, min_tasks=8)
    assert isinstance(got, Batch) and [t.id for t in got.tasks] == list(range(8)) and not got.stack
    assert q.wake_at == 1


def test_groups_are_a_fair_share_over_the_slots_and_capped() -> None:
    q, _ = _queue()
    for _ in range(10):
        _submit(q)
    first = q.take(1, 0.0, 0.0, spread=2, max_tasks=32)
    assert isinstance(first, Batch) and len(first.tasks) == 5  # half of 10, for 2 slots
    capped = q.take(1, 0.0, 0.0, spread=1, max_tasks=3)
    assert isinstance(capped, Batch) and [t.id for t in capped.tasks] == [5, 6, 7]  # in order
    single = q.take(1, 0.0, 0.0, spread=4, max_tasks=32)
    assert isinstance(single, Batch) and len(single.tasks) == 1  # 2 left over 4 slots: one each
    assert len(q) == 1
