"""One slot as the owner sees it, the same on every backend: its state (one table,
engine.core.states), the batches it holds in order, its counters and timers. How its worker
runs (a process and a pipe, a Ray actor) is the transport's (engine.core.transport).

The head of `batches` is the one running; the rest were sent ahead and wait at the worker.
A slot is rebuilt in place: same index, new incarnation.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from slabpool.engine.core.states import KillReason, SlotEvent, SlotState, slot_move
from slabpool.engine.core.task import Batch
from slabpool.workers.protocol import SessionInfo


class SlotRecord:
    def __init__(self, index: int, spec: Any) -> None:
        self.index = index
        self.state = SlotState.NEW
        self.spec = spec  # the SessionSpec its next incarnation is built on
        self.started_spec: Any = None  # ... and the one the current incarnation was started on
        self.incarnation = 0
        self.pid = 0
        self.node = ""
        self.info: SessionInfo | None = None
        self.model_version = ""
        self.batches: deque[Batch] = deque()
        self.tasks_done = 0  # over every incarnation
        self.incarnation_done = 0  # by the current incarnation (max_tasks_per_worker)
        self.restarts = 0
        self.startup_failures = 0
        self.rss = 0
        self.kill_reason: KillReason | None = None  # why we stop it (None: we do not)
        self.respawn_at: float | None = None  # DEAD after a start-up failure: rebuilt then
        self.ready_by: float | None = None  # STARTING: killed if not up by then (startup_timeout)
        self.stalled_at: float | None = None  # STALLED: since when (for the log)

    def fire(self, event: SlotEvent) -> None:
        """The one way its state changes (the table in engine.core.states)."""
        self.state = slot_move(self.state, event)

    def started(self, spec: Any, ready_by: float | None) -> None:
        """A new incarnation is being built on `spec`."""
        self.fire(SlotEvent.START)
        self.incarnation += 1
        self.started_spec = spec
        self.batches.clear()
        self.incarnation_done = 0
        self.kill_reason = self.respawn_at = self.stalled_at = None
        self.ready_by = ready_by

    @property
    def can_take(self) -> bool:
        return self.state.can_take

    @property
    def held(self) -> int:
        return sum(len(b.tasks) for b in self.batches)

    def __repr__(self) -> str:
        return f"<Slot {self.index} {self.state.name} pid={self.pid} holds={len(self.batches)}>"
