"""Steps 3-4 of the task flow (which batch goes to which slot, sent with an output region)
and step 9's batch half (what a finished batch gives back). The limits come from the pure
policy in engine.core.dispatch; output regions from engine.local.regions.
"""

from __future__ import annotations

from collections.abc import Callable
from multiprocessing.context import BaseContext
from typing import Any

from slabpool.engine.core import dispatch
from slabpool.engine.core.admission import TaskQueue
from slabpool.engine.core.config import EngineConfig
from slabpool.engine.core.ledger import TaskLedger
from slabpool.engine.core.states import KillReason, SlotState, TaskState
from slabpool.engine.core.task import Batch, Task
from slabpool.engine.local.processes import SlotProcesses
from slabpool.engine.local.regions import OutputRegions
from slabpool.engine.local.slot import Slot
from slabpool.shm import Arena
from slabpool.workers import errors as E
from slabpool.workers.main import WorkerBoot
from slabpool.workers.protocol import OutputGrant, RunBatch, TaskSpec, encode
from slabpool.workers.session import SessionSpec


class Dispatcher(SlotProcesses, TaskLedger):
    """Feeds the slots from the admission queue and takes back what finished batches held."""

    def __init__(
        self,
        cfg: EngineConfig,
        queue: TaskQueue,
        metrics: Any,
        inputs: Arena,
        outputs: Arena,
        ctx: BaseContext,
        boot: Callable[[int, int, SessionSpec | None, int], WorkerBoot],
    ) -> None:
        SlotProcesses.__init__(self, cfg, inputs, outputs, ctx, boot)
        TaskLedger.__init__(self, queue, metrics)
        self.regions = OutputRegions(outputs, 64 * cfg.workers)
        self._task_s: float | None = None  # mean run time per task (EWMA), sizes groups
        self._batch_ready_at: float | None = None  # a stacked batch still filling: send it then

    def _dispatch(self, now: float) -> None:
        self._batch_ready_at = None
        depth = self.cfg.inflight_per_slot
        wait_s = self.cfg.max_batch_wait_ms / 1000.0
        while True:
            open_slots = [s for s in self.slots if s.can_take and len(s.batches) < depth]
            if not open_slots:
                self.queue.hungry = False  # new tasks wait for a completion, which dispatches
                return
            slot = min(open_slots, key=lambda s: len(s.batches))  # step 3: idle slots first
            budget = dispatch.task_budget(self.cfg, slot.incarnation_done,
                                          sum(len(b.tasks) for b in slot.batches), slot.retiring)
            if budget == 0:  # recycled after what it holds: no more work for this incarnation
                slot.retiring = True
                self._maybe_retire(slot)
                continue
            live = sum(s.can_take for s in self.slots)  # the queue is shared by every slot, not
            # only those open right now: a group sized for one open slot would starve the rest
            lim = dispatch.take_limits(
                self.cfg, budget=budget, task_s=self._task_s, out_per_task=self.regions.per_task,
                out_per_item=self.regions.per_item, capacity=self.outputs.capacity,
                busy=bool(slot.batches), live_slots=live)
            got = self.queue.take(lim.max_items, wait_s, now, live, lim.max_tasks, lim.min_tasks)
            if got is None:
                return
            if isinstance(got, float):
                self._batch_ready_at = got
                return
            self._send_batch(slot, got, now)

    def _send_batch(self, slot: Slot, batch: Batch, now: float) -> None:
        specs = []
        for task in batch.tasks:
            if not self.dispatchable(task):
                continue
            if task.state is TaskState.QUEUED:
                task.move(TaskState.RUNNING)  # step 4
            task.attempts += 1
            task.dispatched_at = task.dispatched_at or now
            task.in_batch = batch
            fault = task.fault if self.cfg.fault_injection else None
            specs.append(TaskSpec(task.id, task.attempts, task.seed, task.packed, task.wire_context, fault,
                                  task.deadline, task.step))
        batch.tasks = [t for t in batch.tasks if t.state is TaskState.RUNNING]
        if not batch.tasks:
            return
        slot.batches.append(batch)
        if batch.stack:
            self.count("stacked_batches")
        if slot.state is SlotState.READY:
            slot.move(SlotState.BUSY)
        out = self.regions.lease_predicted(batch, ahead=len(slot.batches) > 1)
        if len(slot.batches) == 1:
            batch.started_at = now
        msg = RunBatch(batch.id, tuple(specs), batch.stack, out.offset if out else -1, out.nbytes if out else 0)
        try:
            data = encode(msg)
        except Exception as exc:  # noqa: BLE001 - a task's data that will not pickle fails it alone
            self._unsendable(slot, batch, exc)
            return
        slot.send_bytes(data)  # the RunBatch: on a broken pipe the sentinel fires next and the batch replays

    def _unsendable(self, slot: Slot, batch: Batch, exc: Exception) -> None:
        """A RunBatch that would not pickle (user data submit() could not check, such as a
        dict key): take the batch back; several tasks go again one by one, one fails alone."""
        slot.batches.remove(batch)
        self.regions.release(batch)
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
        self.finish(task, error=E.TaskDataError(
            f"task {task.id} cannot be sent to a worker: {type(exc).__name__}: {exc}", task_id=task.id))

    def _promote(self, slot: Slot, now: float) -> None:
        """The next held batch starts running now: give it its output region ahead of time."""
        head = slot.batches[0]
        if head.revoked:
            return  # answered without a run: no region, no clock
        head.started_at = max(now, head.started_at or now)
        if head.out_lease is None:
            lease = self.regions.lease_predicted(head)
            if lease is not None:
                slot.send(OutputGrant(head.id, lease.offset, lease.nbytes))

    def _end_batch(self, batch: Batch) -> None:
        if self.regions.release(batch):
            for slot, grant in self.regions.grant_waiting([(s, b) for s in self.slots for b in s.batches]):
                slot.send(grant)
        self._unpin(batch)
        done = []
        for t in batch.tasks:
            t.in_batch = None
            if t.lease is not None and t.state.is_terminal:
                done.append(t.lease)
                t.lease = None
        self.inputs.release_many(done)  # one lock for the batch

    def _requeue_apart(self, batch: Batch, tasks: list[Task]) -> None:
        """Tasks whose outputs would not fit one region together go back to the queue, in
        halves, ahead of new work and uncharged (their outputs are sized anew each time)."""
        for t in tasks:
            t.move(TaskState.QUEUED)
        half = (len(tasks) + 1) // 2
        parts = [p for p in (tasks[:half], tasks[half:]) if p]
        self.queue.push_replays([Batch(p, stack=batch.stack and len(p) > 1) for p in parts], count=False)

    def _unpin(self, batch: Batch) -> None:
        if batch.pinned:
            self.inputs.release_many(batch.pinned)
            batch.pinned = []

    def _kill_running(self, task: Task) -> None:
        slot = next((s for s in self.slots if any(task in b.tasks for b in s.batches)), None)
        if slot is not None and slot.batches and task in slot.batches[0].tasks:
            slot.kill(KillReason.CANCEL)

    def _release(self, task: Task) -> None:
        if task.in_batch is None:  # a batch's inputs go back with the batch (_end_batch)
            self._release_input(task)

    def _release_input(self, task: Task) -> None:
        if task.lease is not None:
            self.inputs.release(task.lease)
            task.lease = None
