"""The admission queue's dispatch policy, on its own: groups, and when a caller wakes the
supervisor (every wake-up costs a thread switch per task: see engine/core/admission.py)."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest

from slabpool.engine.core.admission import TaskQueue
from slabpool.engine.core.task import Batch, Task
from slabpool.workers.errors import QueueFull


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


def _until(cond: Any, what: str) -> None:
    deadline = time.monotonic() + 30  # a deadlock guard, not a timing
    while not cond():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.001)


def test_callers_waiting_for_a_place_get_it_in_arrival_order_and_no_newcomer_passes_them() -> None:
    """A full queue: five callers block, one after another. Each freed place goes to the
    first in line (woken alone), never to a caller that arrives as it frees up (with 256
    callers on 32 places, a caller that lost that race went to the back, and p99 was 2.7x
    ProcessPoolExecutor's: bench.latency)."""
    q = TaskQueue(capacity=1, policy="block", wake=Wakes())
    _submit(q)
    ids: dict[int, int] = {}

    def caller(i: int) -> None:
        ids[i] = _submit(q).id

    threads = []
    for i in range(5):
        threads.append(threading.Thread(target=caller, args=(i,)))
        threads[-1].start()
        _until(lambda i=i: len(q._line) == i + 1, f"caller {i} in line")

    def take_one() -> None:
        assert isinstance(q.take(1, 0.0, 0.0, spread=1, max_tasks=1, min_tasks=1), Batch)

    with q._lock:  # a place frees up: the first in line is woken, and cannot run before...
        take_one()
        with pytest.raises(QueueFull, match=re.escape("5 caller(s) still waiting for a place ahead")):
            q.reserve(0)  # ...a newcomer, which does not take the place
    for n in range(5):
        _until(lambda: len(q) == 1, f"admission {n}")
        take_one()
    for t in threads:
        t.join(30)
    assert sorted(ids, key=ids.__getitem__) == [0, 1, 2, 3, 4]
    assert not q._line


def test_small_inputs_do_not_pass_a_large_one_that_waits_for_bytes() -> None:
    """Places to spare, but the bytes bound (queue_bytes) is reached: a caller with a large
    input waits; a caller with a smaller input that would fit arrives after it. It waits behind
    it (the bytes of the callers ahead count as taken), and so is a newcomer refused, with
    why. Once bytes free up the large one goes, and the smaller one only when its bytes fit
    beside what is held (a reservation counts, not only what is queued)."""
    q = TaskQueue(capacity=1000, policy="block", wake=Wakes(), max_bytes=100)
    q.reserve(None, 60)
    q.accept(lambda i: Task(i, Future(), None, ("k",), 1, None, 0, None, None, nbytes=60))
    order: list[str] = []

    def caller(name: str, nbytes: int) -> None:
        with q._lock:  # (its wait lets go of it; held again at the place: the order recorded is the places')
            q.reserve(None, nbytes)
            order.append(name)

    large = threading.Thread(target=caller, args=("large", 80))
    large.start()
    _until(lambda: len(q._line) == 1, "the large input in line")
    small = threading.Thread(target=caller, args=("small", 30))
    small.start()
    _until(lambda: len(q._line) == 2, "the small input in line behind it")
    with pytest.raises(QueueFull, match=re.escape("60 of 100 bytes of inputs waiting, 2 caller(s) ahead")):
        q.reserve(0, 1)  # a newcomer whose byte would fit: it does not pass either
    assert order == []
    assert isinstance(q.take(1, 0.0, 0.0, spread=1, max_tasks=1, min_tasks=1), Batch)  # the 60 bytes leave
    large.join(30)
    assert order == ["large"] and q._bytes == 80  # 80 + 30 would be over: the smaller one waits on
    _until(lambda: len(q._line) == 1, "the smaller input still in line")
    q.unreserve(80)  # (the large one gave up its reservation)
    small.join(30)
    assert order == ["large", "small"]
    assert not q._line and q._bytes == 30


def test_a_caller_that_gives_up_waiting_leaves_the_line_and_the_next_one_gets_the_place() -> None:
    """The first in line times out: it leaves, and the place that frees next goes to the one
    behind it; a closed queue wakes the whole line, one after another, each with the error."""
    q = TaskQueue(capacity=1, policy="block", wake=Wakes())
    _submit(q)
    out: dict[str, Any] = {}

    def waiter(name: str, timeout: float | None) -> None:
        try:
            q.reserve(timeout)
            out[name] = "placed"
        except Exception as exc:  # (the test looks at it)
            out[name] = exc

    first = threading.Thread(target=waiter, args=("first", 0.05))
    first.start()
    _until(lambda: len(q._line) == 1, "the first in line")
    second = threading.Thread(target=waiter, args=("second", None))
    second.start()
    first.join(30)
    assert isinstance(out["first"], QueueFull)
    _until(lambda: len(q._line) == 1, "the second, now first")
    assert isinstance(q.take(1, 0.0, 0.0, spread=1, max_tasks=1, min_tasks=1), Batch)
    second.join(30)
    assert out["second"] == "placed"
    q.accept(lambda i: Task(i, Future(), None, ("k",), 1, None, 0, None, None))

    rest = [threading.Thread(target=waiter, args=(f"w{i}", None)) for i in range(3)]
    for i, t in enumerate(rest):
        t.start()
        _until(lambda i=i: len(q._line) == i + 1, f"w{i} in line")
    q.close(RuntimeError("closed for the test"))
    for t in rest:
        t.join(30)
    assert all(isinstance(out[f"w{i}"], RuntimeError) for i in range(3)) and not q._line
