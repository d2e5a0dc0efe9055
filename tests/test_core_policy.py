"""The owner core on its own, without processes: dispatch limits (engine.core.dispatch), the
owner thread's call bus (engine.core.owner) and the task ledger (engine.core.ledger)."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from slabpool.engine.core import dispatch
from slabpool.engine.core.admission import MAX_GROUP, MIN_GROUP, TaskQueue
from slabpool.engine.core.config import resolve
from slabpool.engine.core.ledger import Closing, TaskLedger
from slabpool.engine.core.metrics import Metrics
from slabpool.engine.core.owner import OwnerThread
from slabpool.engine.core.states import SlotEvent, SlotState, TaskState, slot_move
from slabpool.engine.core.task import Task
from slabpool.workers.errors import EngineClosed, EngineInternalError, TaskCancelled, TaskTimeout


def cfg(models, **kw):  # type: ignore[no-untyped-def]
    return resolve(models.mlp, workers=2, **kw)


# -- dispatch --------------------------------------------------------------------------------------


@pytest.mark.parametrize("task_s,want", [(None, 1), (1.0, 1), (0.001, 2), (0.0001, 20), (1e-7, MAX_GROUP)])
def test_groups_run_about_the_target_time(task_s, want) -> None:  # type: ignore[no-untyped-def]
    assert dispatch.group_limit(task_s) == want


def test_task_budget_follows_recycling_settings(models) -> None:  # type: ignore[no-untyped-def]
    assert dispatch.task_budget(cfg(models), 1000, 5, False) == MAX_GROUP
    assert dispatch.task_budget(cfg(models, max_tasks_per_worker=10), 6, 3, False) == 1
    assert dispatch.task_budget(cfg(models, max_tasks_per_worker=10), 8, 3, False) == 0
    assert dispatch.task_budget(cfg(models, worker_memory_limit=1 << 30), 0, 0, False) == 1
    assert dispatch.task_budget(cfg(models, worker_memory_limit=1 << 30), 0, 0, True) == 0


def test_groups_and_batches_fit_half_the_output_arena(models) -> None:  # type: ignore[no-untyped-def]
    mib = 1 << 20
    lim = dispatch.take_limits(cfg(models), budget=MAX_GROUP, task_s=1e-6, out_per_task=4 * mib,
                               out_per_item=0, capacity=16 * mib, busy=False, live_slots=2)
    assert lim.max_tasks == 2  # 8 MiB of a 16 MiB arena holds two tasks of 4 MiB
    stacked = dispatch.take_limits(cfg(models, max_batch_size=8), budget=MAX_GROUP, task_s=1e-6,
                                   out_per_task=0, out_per_item=3 * mib, capacity=16 * mib, busy=False,
                                   live_slots=2)
    assert stacked.max_items == 2  # 8 MiB holds two items of 3 MiB
    assert dispatch.fit_tasks(16 * mib, 0) == MAX_GROUP  # nothing seen yet


def test_a_busy_slot_is_sent_only_a_group_worth_its_message(models) -> None:  # type: ignore[no-untyped-def]
    kw = dict(budget=MAX_GROUP, out_per_task=0, out_per_item=0, capacity=1 << 28, live_slots=2)
    assert dispatch.take_limits(cfg(models), task_s=1e-5, busy=True, **kw).min_tasks == MIN_GROUP * 2
    assert dispatch.take_limits(cfg(models), task_s=1e-5, busy=False, **kw).min_tasks == 1
    assert dispatch.take_limits(cfg(models), task_s=0.01, busy=True, **kw).min_tasks == 1  # slow tasks


# -- slot states ---------------------------------------------------------------------------------


def test_a_slot_moves_only_by_its_table() -> None:
    """One (state, event) -> state table (h11's _state.py): retiring, stalled and exiting are
    states of it, not flags beside it; an event the table does not hold is a bug."""
    path = [(SlotEvent.START, SlotState.STARTING), (SlotEvent.UP, SlotState.READY), (SlotEvent.TAKE, SlotState.BUSY),
            (SlotEvent.STALL, SlotState.STALLED), (SlotEvent.PROGRESS, SlotState.BUSY),
            (SlotEvent.RETIRE, SlotState.RETIRING), (SlotEvent.EXIT, SlotState.EXITING), (SlotEvent.DIE, SlotState.DEAD),
            (SlotEvent.START, SlotState.STARTING), (SlotEvent.STOP, SlotState.STOPPED)]
    state = SlotState.NEW
    for event, want in path:
        state = slot_move(state, event)
        assert state is want
    for state, event in [(SlotState.STALLED, SlotEvent.TAKE), (SlotState.RETIRING, SlotEvent.TAKE),
                         (SlotState.STOPPED, SlotEvent.START), (SlotState.DEAD, SlotEvent.UP)]:
        with pytest.raises(EngineInternalError, match=f"illegal slot event {event.name} in state {state.name}"):
            slot_move(state, event)
    assert {s for s in SlotState if s.can_take} == {SlotState.READY, SlotState.BUSY}


def test_no_engine_module_moves_a_slot_past_the_table() -> None:
    """`slot.state = SlotState.X` anywhere (but a new slot's NEW) would be a move the table
    cannot see: the table's own `fire` assigns what `slot_move` returns."""
    import re
    from pathlib import Path

    engine = Path(__file__).resolve().parent.parent / "engine"
    moves = [f"{p.relative_to(engine)}:{i}" for p in sorted(engine.rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"\.state\s*=\s*(SlotState|_S)\.(?!NEW\b)", line)]  # (NEW: where each begins)
    assert not moves, moves


# -- the owner thread ------------------------------------------------------------------------------


class Body:
    """A loop body (engine.core.owner.LoopBody) that only runs the calls."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.stop = False
        self.failed: BaseException | None = None
        self.thread = OwnerThread("test-owner", self)

    def wake(self) -> None:
        self.go.set()

    def step(self) -> None:
        self.go.wait(5)
        self.go.clear()
        self.thread.run_calls()

    def finished(self) -> bool:
        return self.stop or self.failed is not None

    def fail(self, error: BaseException) -> None:
        self.failed = error

    def stopped(self) -> None:
        pass


def Loop() -> OwnerThread:
    return Body().thread


def test_calls_run_on_the_owner_thread_and_late_calls_fail() -> None:
    loop = Loop()
    loop.start_loop()
    assert loop.call(lambda: threading.current_thread().name).result(5) == "test-owner"
    loop.call(setattr, loop.body, "stop", True).result(5)
    assert loop.join(5)
    with pytest.raises(EngineClosed):
        loop.call(lambda: 1).result(5)


def test_a_call_that_raises_fails_the_loop_loudly() -> None:
    loop = Loop()
    loop.start_loop()
    fut = loop.call(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        fut.result(5)
    assert loop.join(5)
    failed = loop.body.failed  # type: ignore[attr-defined]
    assert isinstance(failed, EngineInternalError) and "ZeroDivisionError" in str(failed)


# -- the ledger ------------------------------------------------------------------------------------


def Ledger() -> TaskLedger:
    return TaskLedger(TaskQueue(capacity=100, policy="block", wake=lambda: None), Metrics())


def _task(q: TaskQueue, deadline: float | None = None) -> Task:
    q.reserve(None)
    return q.accept(lambda i: Task(i, Future(), None, ("k",), 1, None, 0, deadline, None))


def test_a_task_ends_once_and_its_future_completes_at_the_flush() -> None:
    led = Ledger()
    t = _task(led.queue)
    fut = t.future
    assert fut is not None
    led.queue.discard(t)
    led.finish(t, error=TaskTimeout("late", task_id=t.id))
    led.finish(t, error=RuntimeError("twice"))  # ignored: it has ended
    assert t.state is TaskState.FAILED and not fut.done()
    assert t.future is None  # the task let go of it (the completion holds it): no cycle with it
    led.flush()
    assert isinstance(fut.exception(), TaskTimeout)
    assert (led.queue.counters.failed, led.queue.counters.timeouts) == (1, 1)


def test_close_cancel_and_fail_all() -> None:
    led = Ledger()
    queued, held = _task(led.queue), _task(led.queue)
    futs = queued.future, held.future
    led.queue.discard(held)
    assert led.dispatchable(held)  # sent to a slot
    held.move(TaskState.RUNNING)
    led.close(cancel_pending=True)
    assert led.closing is Closing.CANCEL and queued.state is TaskState.CANCELLED
    led.fail_all(EngineInternalError("boom"))
    led.flush()
    assert isinstance(futs[0] and futs[0].exception(), TaskCancelled)
    assert isinstance(futs[1] and futs[1].exception(), EngineInternalError)


def test_fail_all_ends_a_dispatched_task_that_no_slot_holds() -> None:
    """An internal bug in the middle of a completion (the batch already out of its slot, not
    yet finished) fails the engine: the task it held ends with the failure too, no Future
    waits for ever."""
    led = Ledger()
    t = _task(led.queue)
    fut = t.future
    led.queue.discard(t)
    assert led.dispatchable(t)  # first dispatch
    t.move(TaskState.RUNNING)  # ... and then held by nothing the ledger can see
    led.fail_all(EngineInternalError("boom"))
    led.flush()
    assert isinstance(fut and fut.exception(), EngineInternalError)
    assert not led._unfinished  # nothing kept once it ended
