"""Lifecycles as enums with explicit transition tables. An illegal move is a bug.

    Engine: ACCEPTING -> DRAINING -> CLOSED
    Slot:   NEW -> STARTING -> READY <-> BUSY -> DEAD -> STARTING ...; any -> STOPPED
    Task:   QUEUED -> RUNNING -> DONE | FAILED | CANCELLED;  RUNNING -> QUEUED only on replay
"""

from __future__ import annotations

import enum

from slabpool.workers.errors import EngineInternalError


class _Lifecycle(enum.Enum):
    def check(self, new: _Lifecycle) -> None:
        if new not in _ALLOWED[self]:
            raise EngineInternalError(f"illegal {type(self).__name__} transition {self.name} -> {new.name}")

    def __repr__(self) -> str:
        return self.name


class EngineState(_Lifecycle):
    ACCEPTING = "accepting"
    DRAINING = "draining"
    CLOSED = "closed"


class SlotState(_Lifecycle):
    NEW = "new"
    STARTING = "starting"
    READY = "ready"  # idle, can take work
    BUSY = "busy"  # holds at least one batch
    RETIRING = "retiring"  # finishing what it holds, then exits and is rebuilt (recycle, reload)
    DEAD = "dead"  # process gone, waiting to be rebuilt
    STOPPED = "stopped"


class TaskState(_Lifecycle):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in (TaskState.DONE, TaskState.FAILED, TaskState.CANCELLED)


E, S, T = EngineState, SlotState, TaskState
_ALLOWED: dict[_Lifecycle, set[_Lifecycle]] = {
    E.ACCEPTING: {E.DRAINING},
    E.DRAINING: {E.CLOSED},
    E.CLOSED: set(),
    S.NEW: {S.STARTING, S.STOPPED},
    S.STARTING: {S.READY, S.DEAD, S.STOPPED},
    S.READY: {S.BUSY, S.RETIRING, S.DEAD, S.STOPPED},
    S.BUSY: {S.READY, S.RETIRING, S.DEAD, S.STOPPED},
    S.RETIRING: {S.DEAD, S.STOPPED},
    S.DEAD: {S.STARTING, S.STOPPED},
    S.STOPPED: set(),
    T.QUEUED: {T.RUNNING, T.CANCELLED, T.FAILED},
    T.RUNNING: {T.DONE, T.FAILED, T.CANCELLED, T.QUEUED},
    T.DONE: set(),
    T.FAILED: set(),
    T.CANCELLED: set(),
}
