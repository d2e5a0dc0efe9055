"""Lifecycles as enums with explicit transition tables. An illegal move is a bug.

    Engine: ACCEPTING -> DRAINING -> CLOSED
    Task:   QUEUED -> RUNNING -> DONE | FAILED | CANCELLED;  RUNNING -> QUEUED only on replay
    Slot:   one table of (state, event) -> new state, every move in one place (h11's
            `_state.py`): no flag beside the enum says what the slot may do.

        NEW --START--> STARTING --UP--> READY <--TAKE / IDLE--> BUSY
        BUSY --STALL--> STALLED (no progress for stall_after: no new work) --PROGRESS--> BUSY
        READY | BUSY | STALLED --RETIRE--> RETIRING (finishes what it holds: recycle, reload)
        READY | BUSY | STALLED | RETIRING --EXIT--> EXITING (told to exit, or killed)
        any live state --DIE--> DEAD --START--> STARTING ...;  any state --STOP--> STOPPED
"""

from __future__ import annotations

import enum

from slabpool.workers.errors import EngineInternalError


class _Lifecycle(enum.Enum):
    # identity, as their equality is: Enum's own __hash__ is a Python call (hash of the name),
    # and a task's or a slot's move looks its state up in a table several times a call
    __hash__ = object.__hash__

    def check(self, new: _Lifecycle) -> None:
        if new not in _ALLOWED[self]:
            raise EngineInternalError(f"illegal {type(self).__name__} transition {self.name} -> {new.name}")

    def __repr__(self) -> str:
        return self.name


class EngineState(_Lifecycle):
    ACCEPTING = "accepting"
    DRAINING = "draining"
    CLOSED = "closed"


class TaskState(_Lifecycle):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    def __init__(self, value: str) -> None:
        # a field, not a property: read several times a task on the hot path
        self.is_terminal = value in ("done", "failed", "cancelled")


_ALLOWED: dict[_Lifecycle, set[_Lifecycle]] = {
    EngineState.ACCEPTING: {EngineState.DRAINING},
    EngineState.DRAINING: {EngineState.CLOSED},
    EngineState.CLOSED: set(),
    TaskState.QUEUED: {TaskState.RUNNING, TaskState.CANCELLED, TaskState.FAILED},
    TaskState.RUNNING: {TaskState.DONE, TaskState.FAILED, TaskState.CANCELLED, TaskState.QUEUED},
    TaskState.DONE: set(),
    TaskState.FAILED: set(),
    TaskState.CANCELLED: set(),
}


class SlotState(enum.Enum):
    NEW = "new"
    STARTING = "starting"  # building its session; bounded by startup_timeout
    READY = "ready"  # idle, can take work
    BUSY = "busy"  # holds at least one batch, can take more
    STALLED = "stalled"  # its running batch made no progress for stall_after: no new work
    RETIRING = "retiring"  # finishing what it holds, then exits and is rebuilt (recycle, reload)
    EXITING = "exiting"  # told to exit (or killed): its death is expected
    DEAD = "dead"  # gone, waiting to be rebuilt
    STOPPED = "stopped"

    __hash__ = object.__hash__  # (see _Lifecycle)

    def __init__(self, value: str) -> None:
        # fields, not properties: the dispatcher reads them for every slot on every dispatch
        self.can_take = value in ("ready", "busy")
        self.live = value not in ("new", "dead", "stopped")  # started and not yet dead: its death is to come

    def __repr__(self) -> str:
        return self.name


class SlotEvent(enum.Enum):
    START = "start"  # a (new) incarnation is being built
    UP = "up"  # its Ready arrived
    TAKE = "take"  # it was sent a batch
    IDLE = "idle"  # its last batch ended
    STALL = "stall"  # no progress for stall_after
    PROGRESS = "progress"  # a batch ended on a stalled slot that still holds others
    RETIRE = "retire"  # no new work: finish what it holds, then exit
    EXIT = "exit"  # told to exit, or killed
    DIE = "die"  # its process (actor) is gone
    STOP = "stop"  # the engine stopped it for good

    __hash__ = object.__hash__  # (see _Lifecycle: the slot table is keyed by (state, event))


_S, _E = SlotState, SlotEvent
_LIVE = (_S.STARTING, _S.READY, _S.BUSY, _S.STALLED, _S.RETIRING, _S.EXITING)
SLOT_TABLE: dict[tuple[SlotState, SlotEvent], SlotState] = {
    (_S.NEW, _E.START): _S.STARTING,
    (_S.DEAD, _E.START): _S.STARTING,
    (_S.STARTING, _E.UP): _S.READY,
    (_S.READY, _E.TAKE): _S.BUSY,
    (_S.BUSY, _E.TAKE): _S.BUSY,
    (_S.BUSY, _E.IDLE): _S.READY,
    (_S.STALLED, _E.IDLE): _S.READY,
    (_S.BUSY, _E.STALL): _S.STALLED,
    (_S.STALLED, _E.PROGRESS): _S.BUSY,
    **{(s, _E.RETIRE): _S.RETIRING for s in (_S.READY, _S.BUSY, _S.STALLED, _S.RETIRING)},
    **{(s, _E.EXIT): _S.EXITING for s in (_S.READY, _S.BUSY, _S.STALLED, _S.RETIRING, _S.EXITING)},
    **{(s, _E.DIE): _S.DEAD for s in _LIVE},
    **{(s, _E.STOP): _S.STOPPED for s in (_S.NEW, _S.DEAD, *_LIVE, _S.STOPPED)},
}


def slot_move(state: SlotState, event: SlotEvent) -> SlotState:
    """The one place a slot's state changes: the table, or EngineInternalError."""
    try:
        return SLOT_TABLE[state, event]
    except KeyError:
        raise EngineInternalError(f"illegal slot event {event.name} in state {state.name}") from None


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
