"""Messages on the pipe between the supervisor and one worker incarnation.

Named after their stage (a `Task` in the engine is a `TaskSpec` inside a `RunBatch` on the
pipe, and comes back as an `Outcome` inside a `BatchDone`). Every message is a small frozen
dataclass: names, offsets, dtypes and shapes; array bytes never travel here.

    supervisor -> worker: RunBatch, OutputGrant, Shutdown
    worker -> supervisor: Ready | InitFailed (once), NeedOutput, BatchDone, LogRecord
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True, slots=True)
class ArrayRef:
    """An array in an arena: where, what type, what shape."""

    offset: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Packed:
    """A structure whose arrays were moved into shared memory.

    `skeleton` is the structure with each array replaced by `Hole(i)`; `arrays[i]` says where
    array i lives. A dict of arrays (the common case) has a dict skeleton.
    """

    skeleton: Any
    arrays: tuple[ArrayRef, ...]


@dataclass(frozen=True, slots=True)
class Hole:
    index: int


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One model input or output: dtype is a numpy dtype string, None marks a dynamic dim."""

    name: str
    dtype: str
    shape: tuple[int | None, ...]


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """What the worker really built, reported in its Ready message."""

    runtime: str
    runtime_version: str
    requested: tuple[str, ...]
    applied: tuple[str, ...]
    degraded: bool
    model_digest: str
    load_s: float
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """Test-only fault injection: die at `stage` in the way `action` says (see workers.faults)."""

    stage: str
    action: str
    once_file: str | None = None


# -- supervisor -> worker ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TaskSpec:
    task_id: int
    attempt: int
    seed: int
    item: Packed
    context: dict[str, Any] | None = None
    fault: FaultSpec | None = None


@dataclass(frozen=True, slots=True)
class RunBatch:
    """Run these tasks, stacked into one session call when `stack` is true.

    `out_offset`/`out_nbytes` is an output region leased ahead (-1: none; ask with NeedOutput).
    """

    batch_id: int
    tasks: tuple[TaskSpec, ...]
    stack: bool
    out_offset: int = -1
    out_nbytes: int = 0


@dataclass(frozen=True, slots=True)
class OutputGrant:
    """Answer to NeedOutput: the region to write into, or offset -1 and the reason."""

    batch_id: int
    offset: int
    nbytes: int
    error: str = ""


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


# -- worker -> supervisor ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RemoteError:
    """An exception in the worker, as data: never a pickled runtime exception object."""

    kind: Literal["contract", "run", "timeout"]
    type_name: str
    message: str
    traceback: str


@dataclass(frozen=True, slots=True)
class Ready:
    pid: int
    info: SessionInfo | None  # None for a pure preprocessing pool (model=None)


@dataclass(frozen=True, slots=True)
class InitFailed:
    error: RemoteError


@dataclass(frozen=True, slots=True)
class NeedOutput:
    batch_id: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Outcome:
    """One task's result inside a BatchDone: outputs (arrays in the output region) or error."""

    task_id: int
    outputs: Packed | None
    error: RemoteError | None = None


@dataclass(frozen=True, slots=True)
class BatchDone:
    batch_id: int
    outcomes: tuple[Outcome, ...]
    run_s: float
    rss: int


@dataclass(frozen=True, slots=True)
class LogRecord:
    """A worker's log record, data only: name, level, message, and the task fields."""

    name: str
    level: int
    message: str
    fields: dict[str, Any]
