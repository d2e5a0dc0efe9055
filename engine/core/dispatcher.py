"""Steps 3-4 of the task flow (which batch goes to which slot) and steps 8-9 on the owner's
side (a Done's outcomes end their tasks; what a batch held goes back), the same for every
backend. The limits come from the pure policy in engine.core.dispatch; the I/O is the
transport's (engine.core.transport).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from slabpool.engine.core import dispatch
from slabpool.engine.core.admission import Counter, TaskQueue
from slabpool.engine.core.config import EngineConfig
from slabpool.engine.core.ledger import TaskLedger
from slabpool.engine.core.slots import SlotRecord
from slabpool.engine.core.states import KillReason, SlotEvent, SlotState, TaskState
from slabpool.engine.core.task import Batch, Task, Timings
from slabpool.engine.core.transport import Done, SlotTransport, Unsendable
from slabpool.workers import errors as E

log = logging.getLogger("slabpool.engine")
_RECYCLABLE = (SlotState.READY, SlotState.BUSY, SlotState.STALLED)


class Dispatcher:
    """Feeds the slots from the admission queue; ends what their Dones report."""

    def __init__(
        self, cfg: EngineConfig, queue: TaskQueue, ledger: TaskLedger, transport: SlotTransport,
        slots: list[SlotRecord], kill: Callable[[SlotRecord, KillReason, float], None],
    ) -> None:
        self.cfg, self.queue, self.ledger, self.transport, self.slots = cfg, queue, ledger, transport, slots
        self._kill = kill
        self.lent: dict[int, Any] = {}  # slot index -> its lend (engine.core.fastpath): no more work there
        self.before_send: Callable[[SlotRecord, Batch], None] = _nothing  # a caller may wait on it (fastpath)
        self.task_s: float | None = None  # mean run time per task (EWMA), sizes groups
        self.batch_ready_at: float | None = None  # a stacked batch still filling: send it then

    # -- steps 3-4 ---------------------------------------------------------------------------------

    def dispatch(self, now: float, once: bool = False) -> None:
        """Steps 3-4 until no slot takes more (`once`: after the first batch sent; a caller's
        own task, engine.core.fastpath: the queue held it alone, and what is accepted meanwhile
        wakes the owner, the queue still hungry)."""
        self.batch_ready_at = None
        depth = self.cfg.inflight_per_slot
        wait_s = self.cfg.max_batch_wait_ms / 1000.0
        room = self.transport.room()  # (sizes are learnt from completions, not while dispatching)
        while True:
            slot, live = self._open_slot(depth)
            if slot is None:
                self.queue.hungry = False  # new tasks wait for a completion, which dispatches
                return
            held = sum(len(b.tasks) for b in slot.batches) if slot.batches else 0
            budget = dispatch.task_budget(self.cfg, slot.incarnation_done, held, False)
            if budget == 0:  # recycled after what it holds: no more work for this incarnation
                slot.fire(SlotEvent.RETIRE)
                self.retire_if_due(slot)
                continue
            lim = dispatch.take_limits(
                self.cfg, budget=min(budget, room.max_tasks), task_s=self.task_s, out_per_task=room.per_task,
                out_per_item=room.per_item, capacity=room.capacity, busy=bool(slot.batches), live_slots=live)
            got = self.queue.take(lim.max_items, wait_s, now, live, lim.max_tasks, lim.min_tasks)
            if got is None:
                return
            if isinstance(got, float):
                self.batch_ready_at = got
                return
            self.send_batch(slot, got, now)
            if once:
                return

    def _open_slot(self, depth: int) -> tuple[SlotRecord | None, int]:
        """Step 3 in one pass over the slots: the open slot (takes work, holds fewer than
        `depth` batches, not lent) that holds the fewest batches, the first of them (idle
        slots first); and how many slots take work (`live`: the queue is shared by every
        slot, not only those open right now, and a group sized for one open slot would
        starve the rest)."""
        best: SlotRecord | None = None
        live = 0
        for s in self.slots:
            if s.state.can_take:
                live += 1
                n = len(s.batches)
                if n < depth and (best is None or n < len(best.batches)) and s.index not in self.lent:
                    best = s
        return best, live

    def send_batch(self, slot: SlotRecord, batch: Batch, now: float) -> None:
        for task in batch.tasks:
            if not self.ledger.dispatchable(task):
                continue
            if task.state is TaskState.QUEUED:
                task.move(TaskState.RUNNING)  # step 4
            task.attempts += 1
            task.dispatched_at = task.dispatched_at or now
            task.in_batch = batch
        batch.tasks = [t for t in batch.tasks if t.state is TaskState.RUNNING]
        if not batch.tasks:
            return
        slot.batches.append(batch)
        if batch.stack:
            self.ledger.count(Counter.STACKED_BATCHES)
        if slot.state is SlotState.READY:
            slot.fire(SlotEvent.TAKE)
        if len(slot.batches) == 1:
            batch.started_at = now
        self.before_send(slot, batch)  # (the answer must not reach the owner's selector first)
        try:
            self.transport.send(slot.index, batch)
        except Unsendable as exc:
            self._unsendable(slot, batch, exc)

    def _unsendable(self, slot: SlotRecord, batch: Batch, exc: Unsendable) -> None:
        """A batch that would not pickle (user data submit() could not check, such as a dict
        key): take it back; several tasks go again one by one, one fails alone."""
        slot.batches.remove(batch)
        if not slot.batches and slot.state is SlotState.BUSY:
            slot.fire(SlotEvent.IDLE)
        for t in batch.tasks:
            t.in_batch = None
        if len(batch.tasks) > 1:
            for t in batch.tasks:
                t.move(TaskState.QUEUED)
            self.queue.push_replays([Batch([t], stack=False) for t in batch.tasks], count=False)
            return
        task = batch.tasks[0]
        self.ledger.finish(task, error=E.TaskDataError(
            f"task {task.id} cannot be sent to a worker: {exc}", task_id=task.id))

    # -- steps 8-9 -----------------------------------------------------------------------------------

    def on_done(self, ev: Done, now: float) -> None:
        slot = self.slots[ev.slot]
        if not slot.batches or slot.batches[0].id != ev.batch_id:
            log.warning("dropped a stale completion of batch %d from slot %d", ev.batch_id, ev.slot)
            return
        batch = slot.batches.popleft()
        if slot.state is SlotState.STALLED and slot.stalled_at is not None:
            log.warning("slot %d (pid %d) makes progress again, after %.1f s", slot.index, slot.pid,
                        now - slot.stalled_at)
        if not batch.revoked:  # (a revoked one's tasks ran elsewhere: only what it held goes back)
            self._ended(slot, batch, ev, now)
        self.end_batch(batch)  # step 9: inputs go back now that the run has really ended
        self._after_batch(slot, now)

    def delivered(self, slot: SlotRecord, timings: Timings, rss: int, in_place: int, now: float) -> None:
        """Steps 8-9 of a lent one-task batch whose outputs its caller copied out itself
        (engine.local.express): the batch ends as `on_done` ends it, the task through
        `TaskLedger.delivered` (no Result, no Future)."""
        batch = slot.batches.popleft()
        self._account(slot, 1, timings.run, rss)
        self.ledger.delivered(batch.tasks[0], timings)
        if in_place:
            self.ledger.count(Counter.OUTPUTS_IN_PLACE, in_place)
        self.end_batch(batch)
        self._after_batch(slot, now)

    def _account(self, slot: SlotRecord, n: int, run_s: float, rss: int) -> float:
        """A slot's counts after a batch of `n` tasks, and the mean run time per task (EWMA)."""
        slot.tasks_done += n
        slot.incarnation_done += n
        slot.rss = rss or slot.rss
        per_task = run_s / max(n, 1)
        self.task_s = per_task if self.task_s is None else 0.9 * self.task_s + 0.1 * per_task
        return per_task

    def _ended(self, slot: SlotRecord, batch: Batch, ev: Done, now: float) -> None:
        per_task = self._account(slot, len(batch.tasks), ev.run_s, ev.rss)
        finish, version, pid = self.ledger.finish, slot.model_version, ev.pid or slot.pid
        split: list[Task] = []
        for o in ev.outcomes:  # (a task cancelled meanwhile ends once: finish() drops the rest)
            task = o.task
            if o.split:
                if not task.state.is_terminal:
                    split.append(task)
            elif o.error is not None:
                finish(task, error=o.error)
            else:  # step 9
                finish(task, result=task.result(o.outputs, version, slot.index, pid, task.timings(per_task, o.copy_s, now)))
        if ev.in_place:
            self.ledger.count(Counter.OUTPUTS_IN_PLACE, ev.in_place)
        if split:
            self._requeue_apart(batch, split)

    def end_batch(self, batch: Batch) -> None:
        """A batch's run has ended: the inputs of its tasks that have ended go back."""
        for t in batch.tasks:
            t.in_batch = None
        self.transport.release([t for t in batch.tasks if t.state.is_terminal])

    def _after_batch(self, slot: SlotRecord, now: float) -> None:
        if slot.batches:
            head = slot.batches[0]
            if not head.revoked:  # the next batch starts running now (a revoked one runs not)
                head.started_at = max(now, head.started_at or now)
            if slot.state is SlotState.STALLED:
                slot.fire(SlotEvent.PROGRESS)
        elif slot.state in (SlotState.BUSY, SlotState.STALLED):
            slot.fire(SlotEvent.IDLE)
        slot.stalled_at = None if slot.state is not SlotState.STALLED else slot.stalled_at
        self.retire_if_due(slot)

    def _requeue_apart(self, batch: Batch, tasks: list[Task]) -> None:
        """Tasks whose outputs would not fit one region together go back to the queue, in
        halves, ahead of new work and uncharged (their outputs are sized anew each time)."""
        for t in tasks:
            t.move(TaskState.QUEUED)
        half = (len(tasks) + 1) // 2
        parts = [p for p in (tasks[:half], tasks[half:]) if p]
        self.queue.push_replays([Batch(p, stack=batch.stack and len(p) > 1) for p in parts], count=False)

    # -- recycling -----------------------------------------------------------------------------------

    def retire_if_due(self, slot: SlotRecord) -> None:
        """max_tasks_per_worker, worker_memory_limit: no more work for this incarnation; once
        it holds nothing, it is asked to exit (and then rebuilt)."""
        cfg = self.cfg
        if slot.state in _RECYCLABLE:
            too_many = cfg.max_tasks_per_worker is not None and slot.incarnation_done >= cfg.max_tasks_per_worker
            too_big = cfg.worker_memory_limit is not None and slot.rss > cfg.worker_memory_limit
            if too_many or too_big:
                slot.fire(SlotEvent.RETIRE)
                log.info("retiring slot %d: %s", slot.index, "max_tasks_per_worker" if too_many else "worker_memory_limit")
        if slot.state is SlotState.RETIRING and not slot.batches and slot.kill_reason is None:
            slot.fire(SlotEvent.EXIT)
            slot.kill_reason = KillReason.RETIRE
            self.transport.retire(slot.index)

    def kill_running(self, task: Task) -> None:
        """cancel(kill=True): the slot whose running batch holds the task is rebuilt."""
        for slot in self.slots:
            if slot.batches and task in slot.batches[0].tasks:
                self._kill(slot, KillReason.CANCEL, 0.5)
                return


def _nothing(slot: SlotRecord, batch: Batch) -> None:
    """No caller waits on a slot of this transport (engine.core.fastpath sets its own)."""
