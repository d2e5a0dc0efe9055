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


_ALLOWED: dict[_Lifecycle, set[_Lifecycle]] = {
    EngineState.ACCEPTING: {EngineState.DRAINING},
    EngineState.DRAINING: {EngineState.CLOSED},
    EngineState.CLOSED: set(),
    SlotState.NEW: {SlotState.STARTING, SlotState.STOPPED},
    SlotState.STARTING: {SlotState.READY, SlotState.DEAD, SlotState.STOPPED},
    SlotState.READY: {SlotState.BUSY, SlotState.RETIRING, SlotState.DEAD, SlotState.STOPPED},
    SlotState.BUSY: {SlotState.READY, SlotState.RETIRING, SlotState.DEAD, SlotState.STOPPED},
    SlotState.RETIRING: {SlotState.DEAD, SlotState.STOPPED},
    SlotState.DEAD: {SlotState.STARTING, SlotState.STOPPED},
    SlotState.STOPPED: set(),
    TaskState.QUEUED: {TaskState.RUNNING, TaskState.CANCELLED, TaskState.FAILED},
    TaskState.RUNNING: {TaskState.DONE, TaskState.FAILED, TaskState.CANCELLED, TaskState.QUEUED},
    TaskState.DONE: set(),
    TaskState.FAILED: set(),
    TaskState.CANCELLED: set(),
}


class KillReason(enum.Enum):
    """Why the engine itself stopped a worker: a death with a reason charges no task, except
    TIMEOUT (the task in hand ran past task_timeout). A death without one is a crash."""

    TIMEOUT = "timeout"
    CANCEL = "cancel"  # cancel(kill=True)
    RETIRE = "retire"  # max_tasks_per_worker, worker_memory_limit
    RELOAD = "reload"  # a hot model swap
    SHUTDOWN = "shutdown"
    STARTUP_FAILED = "startup failed"

    @property
    def planned(self) -> bool:
        """A replacement, not a failure: nothing to count as a restart."""
        return self in (KillReason.RETIRE, KillReason.RELOAD, KillReason.SHUTDOWN)
