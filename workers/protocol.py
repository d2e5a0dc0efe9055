"""Messages on the pipe between the supervisor and one worker incarnation.

On the wire the hot messages (RunBatch, BatchDone, OutputGrant, NeedOutput) are flattened
to plain tuples by `encode`: pickling a tuple of ints and strings costs well under a
microsecond, a tree of dataclasses tens of microseconds (measured; it was the dispatch
bottleneck). Everything else is pickled as is.

Named after their stage (a `Task` in the engine is a `TaskSpec` inside a `RunBatch` on the
pipe, and comes back as an `Outcome` inside a `BatchDone`). Every message is small and
immutable: names, offsets, dtypes and shapes; array bytes never travel here. Those made on
every call (TaskSpec, RunBatch, Outcome, BatchDone) are NamedTuples, the rest frozen
dataclasses: a frozen dataclass's `__init__` runs ~8 opcodes a field (`object.__setattr__`
each), a NamedTuple's one tuple build (docs/latency.md, "Python a call").

    supervisor -> worker: RunBatch, OutputGrant, Revoke, Shutdown
    worker -> supervisor: Ready | InitFailed (once), NeedOutput, BatchDone, LogRecord
"""

from __future__ import annotations

import functools
import pickle
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

from slabpool.workers.errors import ErrorKind, TaskDataError


class ArrayRef(NamedTuple):
    """An array in an arena: where, what type, what shape."""

    offset: int
    dtype: str
    shape: tuple[int, ...]


class Packed(NamedTuple):
    """A structure whose arrays were moved into shared memory.

    `skeleton` is the structure with each array replaced by `Hole(i)`; `arrays[i]` says where
    array i lives. A dict of arrays (the common case) has a dict skeleton.
    """

    skeleton: Any
    arrays: tuple[ArrayRef, ...]


class Hole(NamedTuple):
    at: int  # the array's index in Packed.arrays


class Chunk(list):  # type: ignore[type-arg]
    """The items of one chunk task (`Engine.map` with chunks): one task to the engine, run
    together in one worker; in the Result, one outcome per item, in order (its outputs, or the
    RemoteError of that item alone).

    A chunk unpacked from stacked rows (see Rows) keeps them in `stacked`: (the Rows, its
    arrays), every item's rows in one block, for a reader that takes the chunk whole. Its
    items may not be made yet (the supervisor leaves that to whoever asks: packing.chunk_items,
    packing.chunk_count)."""

    stacked: tuple[Rows, list[Any]] | None = None


class Rows(NamedTuple):
    """The skeleton of a chunk whose items are stacked: every item a flat dict of the same
    names, dtypes and trailing shapes. Array i of the Packed holds input `names[i]` of every
    item concatenated on axis 0; item k owns the next `counts[k]` rows. One copy each way for
    the whole chunk, one ArrayRef per name (not per item)."""

    names: tuple[Any, ...]
    counts: tuple[int, ...]


@dataclass(frozen=True)
class TensorSpec:
    """One model input or output: dtype is a numpy dtype string, None marks a dynamic dim.
    `dim0` is the name the model gives a dynamic axis 0 (ONNX's dim_param; "" for none, or one
    an exporter made up per input): two inputs that name different dims there take sizes that
    may differ (workers.contract). Not part of the signature (a reload may rename it)."""

    name: str
    dtype: str
    shape: tuple[int | None, ...]
    dim0: str = field(default="", compare=False)


@dataclass(frozen=True)
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
    weights: str = ""  # what was loaded and why: shared (prepacked, mapped) or as given (workers.weights)


@dataclass(frozen=True)
class FaultSpec:
    """Test-only fault injection: die at `stage` in the way `action` says (see workers.faults)."""

    stage: str
    action: str
    once_file: str | None = None


# -- supervisor -> worker ---------------------------------------------------------------------


class TaskSpec(NamedTuple):
    task_id: int
    attempt: int
    seed: int
    item: Packed
    context: Sealed | dict[str, Any] | None = None  # sealed at submit(); a dict once opened
    fault: FaultSpec | None = None
    deadline: float | None = None  # time.monotonic() (one clock for the host): not started after
    step: int = 0  # a block of rows: session calls of at most this many rows each (0: one call)


class RunBatch(NamedTuple):
    """Run these tasks, stacked into one session call when `stack` is true.

    `out_offset`/`out_nbytes` is an output region leased ahead (-1: none; ask with NeedOutput).
    """

    batch_id: int
    tasks: tuple[TaskSpec, ...]
    stack: bool
    out_offset: int = -1
    out_nbytes: int = 0
    # seconds to poll for the next batch after answering this one, before sleeping: a caller
    # waits on this answer alone (its slot lent on an idle engine; EngineConfig.spin_us)
    spin: float = 0.0
    # the engine's own tasks that poll beside it as it is sent (other lent calls' callers and
    # workers, callers not lent: wire.polling_peers), not counted as the host's crowd
    peers: int = 0


SPLIT: Final = ErrorKind.SPLIT  # an OutputGrant's error and then that batch's RemoteError kind: its outputs
# do not fit one region together; the supervisor sends its tasks again apart, uncharged


@dataclass(frozen=True)
class OutputGrant:
    """Answer to NeedOutput: the region to write into, or offset -1 and the reason."""

    batch_id: int
    offset: int
    nbytes: int
    error: str = ""


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Revoke:
    """Do not start this batch (sent ahead to a worker that stalled): it runs elsewhere.
    Answered by an empty BatchDone, so that the supervisor frees what the batch held."""

    batch_id: int


# -- worker -> supervisor ---------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteError:
    """An exception in the worker, as data: never a pickled runtime exception object."""

    kind: ErrorKind
    type_name: str
    message: str
    traceback: str
    needed: int = 0  # kind "capacity": the bytes asked for, and the most that could ever fit
    available: int = 0


@dataclass(frozen=True)
class Ready:
    pid: int
    info: SessionInfo | None  # None for a pure preprocessing pool (model=None)


@dataclass(frozen=True)
class InitFailed:
    error: RemoteError


@dataclass(frozen=True)
class NeedOutput:
    batch_id: int
    nbytes: int


class Outcome(NamedTuple):
    """One task's result inside a BatchDone: outputs (arrays in the output region) or error."""

    task_id: int
    outputs: Packed | None
    error: RemoteError | None = None


class BatchDone(NamedTuple):
    batch_id: int
    outcomes: tuple[Outcome, ...]
    run_s: float
    rss: int
    in_place: int = 0  # tasks whose outputs the runtime wrote straight into the output region


@dataclass(frozen=True)
class LogRecord:
    """A worker's log record, data only: name, level, message, and the task fields."""

    name: str
    level: int
    message: str
    fields: dict[str, Any]


# -- user data, sealed ---------------------------------------------------------------------------


class Sealed(bytes):
    """User data pickled on its own (a context; the non-array parts of an input or a result):
    whoever opens it fails for that task alone. A whole message that would not pickle, or not
    unpickle, would take the pipe (and the supervisor) down with it."""


def seal(obj: Any, what: str) -> Sealed:
    """`obj` pickled; TaskDataError (a TypeError) naming `what` if it cannot be."""
    try:
        return Sealed(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception as exc:
        raise TaskDataError(f"{what} cannot be pickled to cross to another process: {type(exc).__name__}: {exc}") from exc


def unseal(blob: Sealed, what: str) -> Any:
    """The object back; TaskDataError naming `what` if it cannot be unpickled here."""
    try:
        return pickle.loads(blob)
    except Exception as exc:
        raise TaskDataError(
            f"{what}: pickled, but cannot be unpickled in this process: {type(exc).__name__}: {exc} "
            "(for example an exception class whose __init__ takes other arguments than its args, "
            "or a class defined in __main__ under the spawn start method)") from exc


def open_result(packed: Packed) -> Packed:
    """A result whose skeleton (or a chunk's item) is sealed, opened. TaskDataError if the whole
    result cannot be unpickled; a chunk item that cannot becomes that item's RemoteError."""
    sk = packed.skeleton
    if type(sk) is Sealed:
        return Packed(unseal(sk, "the result"), packed.arrays)
    if type(sk) is Chunk:
        return Packed(Chunk(_open_item(v) for v in sk), packed.arrays)
    return packed


def _open_item(item: Any) -> Any:
    if type(item) is not Sealed:
        return item
    try:
        return unseal(item, "the result of this item")
    except TaskDataError as exc:
        return RemoteError(ErrorKind.DATA, "TypeError", str(exc), "")


# -- the wire -----------------------------------------------------------------------------------

_RUN, _DONE, _GRANT, _NEED, _OTHER = range(5)


def encode(msg: Any) -> bytes:
    kind = type(msg)
    if kind is RunBatch:
        tasks = tuple([  # (a list comprehension: a generator is a Python call per element)
            (t.task_id, t.attempt, t.seed, *_flat_packed(t.item), t.context, t.fault, t.deadline, t.step)
            for t in msg.tasks
        ])
        wire: tuple[Any, ...] = (_RUN, msg.batch_id, msg.stack, msg.out_offset, msg.out_nbytes, tasks, msg.spin, msg.peers)
    elif kind is BatchDone:
        outs = tuple([outcome_wire(o) for o in msg.outcomes])
        wire = (_DONE, msg.batch_id, msg.run_s, msg.rss, outs, msg.in_place)
    elif kind is OutputGrant:
        wire = (_GRANT, msg.batch_id, msg.offset, msg.nbytes, msg.error)
    elif kind is NeedOutput:
        wire = (_NEED, msg.batch_id, msg.nbytes)
    else:
        wire = (_OTHER, msg)
    return pickle.dumps(wire, protocol=pickle.HIGHEST_PROTOCOL)


def outcome_wire(o: Outcome) -> tuple[Any, ...]:
    """An Outcome as `encode` puts it on the wire."""
    return (o.task_id, *(_flat_packed(o.outputs) if o.outputs is not None else (None, None, None)), o.error)


def packed_wire(p: Packed) -> tuple[Any, ...]:
    """A Packed as `encode` puts it in an outcome on the wire (outcome_wire without task and error)."""
    return _flat_packed(p)


def encode_done(batch_id: int, outcome: tuple[Any, ...], run_s: float, rss: int, in_place: int) -> bytes:
    """encode(BatchDone(batch_id, (o,), run_s, rss, in_place)), the same bytes, for the one
    outcome o given as `outcome_wire(o)` (the worker's lean path keeps parts of it made)."""
    return pickle.dumps((_DONE, batch_id, run_s, rss, (outcome,), in_place), protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Any:
    wire = pickle.loads(data)
    kind = wire[0]
    if kind == _RUN:  # (tuple.__new__: a NamedTuple's own __new__ is a Python call each)
        _, batch_id, stack, off, nbytes, tasks, spin, peers = wire
        specs = tuple([_new(TaskSpec, (i, a, s, _unflat(f, sk, r), c, fs, d, st))
                       for i, a, s, f, sk, r, c, fs, d, st in tasks])
        return _new(RunBatch, (batch_id, specs, stack, off, nbytes, spin, peers))
    if kind == _DONE:
        _, batch_id, run_s, rss, outs, in_place = wire
        outcomes = tuple([
            _new(Outcome, (o[0], None if o[2] is None else _unflat(o[1], o[2], o[3]), o[4])) for o in outs
        ])
        return _new(BatchDone, (batch_id, outcomes, run_s, rss, in_place))
    if kind == _GRANT:
        return OutputGrant(*wire[1:])
    if kind == _NEED:
        return NeedOutput(*wire[1:])
    return wire[1]


def _flat_packed(p: Packed) -> tuple[bool, Any, tuple[tuple[Any, ...], ...]]:
    """(flat, names or skeleton, refs as plain tuples): a dict of arrays sends only its names."""
    sk = p.skeleton
    refs = tuple(map(tuple, p.arrays))
    if type(sk) is FlatSkeleton:
        return True, tuple(sk), refs
    if type(sk) is dict and all(type(v) is Hole for v in sk.values()):
        if [v.at for v in sk.values()] == list(range(len(sk))):
            return True, tuple(sk), refs
    return False, sk, refs


def _unflat(flat: bool, sk: Any, refs: tuple[tuple[Any, ...], ...]) -> Packed:
    arrays = tuple(map(_ref, refs))  # each ArrayRef(*r), made in C
    return _new(Packed, (flat_skeleton(sk) if flat else sk, arrays))


# A NamedTuple made from a tuple of all its fields by tuple.__new__ (C, no Python frame): what
# its own __new__ makes, for a tuple of exactly its fields (decode's own, from encode's)
_new = tuple.__new__
_ref = functools.partial(_new, ArrayRef)


class FlatSkeleton(dict[Any, Hole]):
    """The skeleton of a flat dict of arrays, {name: Hole(i)} in order: known by its type."""


@functools.lru_cache(maxsize=256)
def flat_skeleton(names: tuple[Any, ...]) -> FlatSkeleton:
    """One shared (never modified) FlatSkeleton per tuple of names."""
    return FlatSkeleton((name, Hole(i)) for i, name in enumerate(names))
