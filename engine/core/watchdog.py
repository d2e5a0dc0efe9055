"""The owner's timers, the same on every backend: when a slot's work is overdue, and what
is done then. Decisions are pure functions over a slot and what its worker has in hand
(`time_limit`, `stall_at`); `Watchdog` applies them.

    time_limit  when the task in hand passes task_timeout: its own time, whatever the size of
                its group (the transport says since when it has it: a local worker's status
                word 1); its slot is killed (KillReason.TIMEOUT), the task fails alone
    stall_at    when the running batch counts as stalled: no progress for stall_after; the
                slot gets no more work and what was sent ahead to it (its current batch too,
                if it took no task of it) is revoked and runs elsewhere
    ready_by    a slot still STARTING then is killed: a start-up failure, retried after a back-off
    respawn_at  the end of that back-off
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from slabpool.engine.core.admission import TaskQueue
from slabpool.engine.core.config import EngineConfig
from slabpool.engine.core.slots import SlotRecord
from slabpool.engine.core.states import KillReason, SlotEvent, SlotState, TaskState
from slabpool.engine.core.task import Batch
from slabpool.engine.core.transport import InHand, SlotTransport
from slabpool.workers.pipeline import IDLE

log = logging.getLogger("slabpool.engine")


def time_limit(cfg: EngineConfig, slot: SlotRecord, hand: InHand | None) -> float | None:
    """When the task in hand passes task_timeout (monotonic seconds); None: no limit runs.
    With no task in hand yet, one taken from now on cannot pass it before now + task_timeout:
    that is when to look again."""
    if cfg.task_timeout is None or not slot.batches or slot.kill_reason or hand is None:
        return None
    head = slot.batches[0]
    if head.started_at is None or hand.waiting:
        return None  # not started, or waiting for output memory: no task's time runs
    grace = min(2.0, cfg.task_timeout) if slot.info and slot.info.runtime == "onnxruntime" else 0.0
    if hand.task == IDLE or hand.since is None:
        return time.monotonic() + cfg.task_timeout + grace
    return hand.since + cfg.task_timeout + grace


def stall_at(cfg: EngineConfig, slot: SlotRecord, waiting: bool) -> float | None:
    """When the slot's running batch counts as stalled (None: not running, or stalled already)."""
    if slot.state is not SlotState.BUSY or not slot.batches or slot.kill_reason:
        return None
    head = slot.batches[0]
    return None if head.started_at is None or waiting else head.started_at + cfg.stall_after


class Watchdog:
    """Every slot's timers: the next one due (the owner's wait ends then), and what is done."""

    def __init__(
        self, cfg: EngineConfig, queue: TaskQueue, slots: list[SlotRecord], transport: SlotTransport,
        kill: Callable[[SlotRecord, KillReason, float], None], respawn: Callable[[SlotRecord], None],
    ) -> None:
        self.cfg, self.queue, self.slots, self.transport = cfg, queue, slots, transport
        self._kill, self._respawn = kill, respawn

    def _limits(self, slot: SlotRecord) -> tuple[float | None, float | None]:
        """(time limit, stall time) of a slot that holds batches."""
        if self.cfg.task_timeout is not None:
            hand = self.transport.in_hand(slot.index)
            return time_limit(self.cfg, slot, hand), stall_at(self.cfg, slot, hand.waiting)
        if slot.state is not SlotState.BUSY:
            return None, None
        return None, stall_at(self.cfg, slot, self.transport.waiting(slot.index))

    def next_timer(self, now: float, *others: float | None) -> float | None:
        """Seconds to the next timer due (None: none runs)."""
        due = [t for t in (self.queue.next_deadline(), *others) if t is not None]
        for s in self.slots:
            if s.respawn_at is not None:
                due.append(s.respawn_at)
            if s.state is SlotState.STARTING and s.ready_by is not None:
                due.append(s.ready_by)
            if s.batches:
                limit, stall = self._limits(s)
                if limit is not None:
                    due.append(limit)
                if stall is not None:
                    due.append(stall)
        return max(min(due) - now, 0.0) if due else None

    def run(self, now: float) -> None:
        for slot in self.slots:
            if slot.state is SlotState.STARTING and slot.ready_by is not None and now >= slot.ready_by:
                slot.ready_by = None
                self._kill(slot, KillReason.STARTUP_FAILED, 0.5)  # its death is a start-up failure
            limit, stall = self._limits(slot) if slot.batches else (None, None)
            if limit is not None and now >= limit:
                self._kill(slot, KillReason.TIMEOUT, 0.5)
            elif stall is not None and now >= stall:
                self._on_stall(slot, now)
            if slot.respawn_at is not None and now >= slot.respawn_at and slot.state is SlotState.DEAD:
                self._respawn(slot)

    def _on_stall(self, slot: SlotRecord, now: float) -> None:
        """No progress for stall_after: warn, send it nothing more, and run elsewhere what was
        sent ahead to it (on copies of the inputs where it may still read the originals)."""
        slot.fire(SlotEvent.STALL)
        slot.stalled_at = now
        head = slot.batches[0]
        idle = self.transport.in_hand(slot.index).task == IDLE  # it has taken no task of its head yet
        held, ids, since = len(head.tasks), [t.id for t in head.tasks][:8], now - (head.started_at or now)
        moved = sum(self.revoke(slot, b) for b in list(slot.batches)[0 if idle else 1 :] if not b.revoked)
        if idle:
            log.warning(
                "slot %d (pid %d) has not taken the batch of %d task(s) sent to it %.1f s ago (task ids "
                "%s); it gets no more work, and the %d task(s) it held run elsewhere.", slot.index, slot.pid,
                held, since, ids, moved)
            return
        log.warning(
            "slot %d (pid %d) has made no progress for %.1f s on its running batch of %d task(s) (task "
            "ids %s); it gets no more work, and the %d task(s) sent ahead to it run elsewhere. Set "
            "task_timeout to stop a task that runs too long.", slot.index, slot.pid, since, held, ids, moved)

    def revoke(self, slot: SlotRecord, batch: Batch) -> int:
        """Take back a batch sent ahead: its live tasks to the queue (the transport gave them
        copies of their inputs). 0 if it could not now (tried again on the next stall)."""
        live = [t for t in batch.tasks if t.state is TaskState.RUNNING]
        if not self.transport.revoke(slot.index, batch):
            return 0
        for t in batch.tasks:
            t.in_batch = None
        for t in live:
            t.move(TaskState.QUEUED)
        batch.revoked, batch.tasks = True, []
        if live:
            self.queue.push_replays([Batch(live, stack=len(live) > 1 and batch.stack)], count=False)
        return len(live)
