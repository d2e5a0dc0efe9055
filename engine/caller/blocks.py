"""Rows on axis 0 through the engine as contiguous blocks: one block of rows is one task.

    rows [lo, hi) of every input (an array, a dict of arrays, a memory-mapped .npy/.npz)
      -> one copy into the input arena, straight from the source (a slice is a view)
      -> session calls of `step` rows in a worker, one after another (outputs written in
         place by the runtime when large)
      -> one copy out of the output arena, per task
    tasks come back in order; a task that fails is cut in two, again and again, down to the
    rows that fail alone (`bisect`), each with its own error

Used by `Engine.infer(feeds, batch_size=...)` and by the batch job (`slabpool run` on
.npy/.npz and tables). The step (rows a session call) is the caller's batch size, or "auto":
a first call of PROBE_ROWS (a few rows: the runtime's memory follows the largest call), then
calls of about STEP_TARGET_S. A task holds as many steps as
run in about BLOCK_TARGET_S (the measured run time per row), bounded so that the tasks in
flight take at most half of each arena: the engine's cost per task is paid once for many
calls, and each call stays small enough for the caches (`BlockSizer`).

A block task is never stacked with other tasks (it counts no items for dynamic batching), so
its outputs are byte-identical to running its steps, one session call each, one after another.
A worker killed by a task replays that task whole (the same rows: the engine's replay keeps
the composition).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from slabpool.engine.caller.handles import refuse_wait_here
from slabpool.engine.caller.request import JobEngine, Outputs, Request
from slabpool.engine.core.task import Result
from slabpool.workers import errors as E
from slabpool.workers.protocol import TensorSpec

Array = npt.NDArray[Any]
BLOCK_TARGET_S = 0.03  # run time per task (a block of several session calls) aimed at
STEP_TARGET_S = 0.002  # run time per session call aimed at when the size is "auto"
# the first call when the size is "auto" (the run time per row is not known): small, because
# ONNX Runtime's CPU arena keeps what its largest call needed for good. 256 rows grew each demo
# worker (a CNN, 2 ms a row) from ~110 to ~970 MiB and ran alone for half a second; 8 rows
# cost what the smallest size a user would try costs, and time a row well enough to size the
# calls (the time per row it measures is at most too high: calls come out smaller, never larger)
PROBE_ROWS = 8
PROBE_CALLS = 4  # ... in one task of this many calls: one call of 8 rows is too short to time alone
MAX_BLOCK_ROWS = 1 << 20
# "auto" then tries calls twice as long, while that makes a row at least this much cheaper (a
# model whose weights do not fit the caches streams them once a call: longer calls share that;
# a 48-layer 512-wide MLP chose 8 rows a call at 2 ms, and ran 3x slower than in calls of 300),
# up to CLIMB_MAX times the step it chose from the run time. Only from a step of at most
# CLIMB_FROM rows (a row of 15 us or more): a model's first tasks run faster and faster as it
# warms up, which a climb from a large step read as longer calls paying (the 2M-row job's MLP,
# 1,000 rows a call, climbed and ran 20% slower)
CLIMB_GAIN = 0.9
CLIMB_MAX = 64
CLIMB_FROM = 128

# a block failing with one of these is cut in two: the failure may belong to some rows only
BISECT = (E.SessionRunError, E.PoisonTask, E.WorkerCrashed, E.TaskTimeout, E.ShmCapacityError,
          E.InputContractError)


class RowsUnreadable(Exception):
    """Raised by a block's `submit` when its rows cannot be read (a null table cell): those
    rows fail with `error`, not cut further (the reader already gave them a block of their own)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def rows_of(feeds: Any) -> tuple[dict[str, Array], int]:
    """The inputs as a dict of arrays sharing their length on axis 0, and that length."""
    arrays = {"": feeds} if isinstance(feeds, np.ndarray) else feeds
    if not isinstance(arrays, dict) or not arrays:
        raise TypeError(f"rows go as an array or a dict of arrays with rows on axis 0, got {type(feeds).__name__}")
    lengths = {}
    for name, a in arrays.items():
        if not isinstance(a, np.ndarray):
            raise TypeError(f"input {name!r}: expected a numpy array with rows on axis 0, got {type(a).__name__}")
        if a.ndim == 0:
            raise ValueError(f"input {name!r} is a scalar: rows must lie on axis 0")
        lengths[name] = a.shape[0]
    if len(set(lengths.values())) != 1:
        raise ValueError(f"every input needs the same number of rows on axis 0, got {lengths}")
    return arrays, next(iter(lengths.values()))


def slice_rows(arrays: dict[str, Array], lo: int, hi: int | None) -> Any:
    """Rows [lo, hi) as views (a bare array stays bare)."""
    if list(arrays) == [""]:
        return arrays[""][lo:hi]
    return {k: a[lo:hi] for k, a in arrays.items()}


def row_bytes(arrays: dict[str, Array]) -> int:
    return sum(a.dtype.itemsize * math.prod(a.shape[1:]) for a in arrays.values())


class BlockSizer:
    """How rows go: `step`, the rows of one session call, and `next()`, the rows of one task
    (a whole number of steps, so that a task is those calls one after another).

    A fixed size N is the step; "auto" probes PROBE_CALLS calls of PROBE_ROWS, then takes
    calls of about STEP_TARGET_S (small calls keep a model's activations in the caches: an MLP
    64->1024->10 ran 1.85 us a row in calls of 1024 rows, 2.3 in 4096, 2.75 in 8192) and
    fixes that step for the rest (it may grow once, timed on the first task of such calls: a
    probe slowed down by the host must not keep the calls small); then it tries calls twice as
    long, one task each, and keeps them while a row gets at least 1 - CLIMB_GAIN cheaper (a model
    whose weights stream from memory once a call). A task holds as many steps
    as run in about BLOCK_TARGET_S
    (the engine's cost per task, ~1 ms of the caller's CPU, stays a few %; a quarter of
    `task_timeout` at most, which holds for a whole task), bounded so that the tasks in flight
    take at most half of each arena. Not `group`: one step a task (a preprocess or postprocess
    sees a task's rows at once, so a task must be exactly one block for them)."""

    def __init__(self, size: int | str | None, in_row_bytes: int, arena_bytes: int, in_flight: int,
                 task_timeout: float | None = None, *, group: bool = True) -> None:
        if isinstance(size, np.integer):
            size = int(size)  # (a numpy integer is an integer: np.int64(64) was refused as not one)
        if size is not None and size != "auto" and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ValueError(f"batch_size must be a positive integer or 'auto', got {size!r}")
        self.fixed = size if isinstance(size, int) else None
        self.step = self.fixed or 0  # 0: not chosen yet ("auto" while probing)
        self._rechosen = self.fixed is not None  # "auto": the step may grow once, from a real task
        self._climbing = self.fixed is None  # "auto": then calls twice as long while they pay
        self._base: tuple[int, float] | None = None  # (step, run time a row) the climb compares with
        self._missed = False  # the step tried did not pay once: one more task at it decides
        self._ceiling = 0
        self.per_row: float | None = None
        self.out_row_bytes = 0
        self.in_row_bytes = in_row_bytes
        self.budget = max(arena_bytes // (2 * max(in_flight, 1)), 1)  # bytes per block per arena
        # a task's run time aimed at: well inside a task_timeout, which holds for the whole task
        self.target_s = BLOCK_TARGET_S if task_timeout is None else min(BLOCK_TARGET_S, task_timeout / 4)
        self.group = group  # several steps to a task (not when hooks see the whole task's rows)

    @property
    def probing(self) -> bool:
        """"auto" before its first call has been timed: one task at a time."""
        return self.fixed is None and self.per_row is None

    def _cap(self) -> int:
        """Rows a task may hold: the tasks in flight fit in half of each arena."""
        return max(1, min(MAX_BLOCK_ROWS, self.budget // max(self.in_row_bytes, self.out_row_bytes, 1)))

    def next(self) -> int:
        """Rows of the next task: a whole number of steps (at least one)."""
        if self.per_row is None:
            return self.step or min(PROBE_ROWS * PROBE_CALLS, self._cap())  # calls of PROBE_ROWS, timed
        if not self.group:
            return self.step
        steps = int(self.target_s / max(self.per_row * self.step, 1e-9))
        return max(1, min(steps, self._cap() // self.step)) * self.step

    def observe(self, res: Result, rows: int, step: int | None = None) -> None:
        """A task of `rows` ended well, run `step` rows a call (None: not known; no climb)."""
        if rows <= 0:
            return
        per = res.timings.run / rows
        self.per_row = per if self.per_row is None else 0.7 * self.per_row + 0.3 * per
        if isinstance(res.outputs, dict):
            self.out_row_bytes = sum(int(np.asarray(v).nbytes) for v in res.outputs.values()) // rows
        if not self.step:  # "auto": the step, from the probe's time a row
            self.step = self._chosen(self.per_row)
        elif not self._rechosen:  # and once more from this task's own time: only ever larger, in
            self._rechosen = True  # case the probe was slowed down (its calls are short); ~2 ms a call at most
            self.step = max(self.step, self._chosen(per))
        elif self._climbing and step == self.step:  # (a task cut before the step last changed: not evidence)
            self._climb(step, per)

    def _climb(self, step: int, per: float) -> None:
        """The climb: this step's run time a row against the last kept step's. Cheaper by
        enough: kept, and calls twice as long tried next; not, twice in a row: back to the last
        kept, for good."""
        if self._base is None:
            if step > CLIMB_FROM:
                self._climbing = False
                return
            self._base, self._ceiling = (step, per), step * CLIMB_MAX
        elif per <= CLIMB_GAIN * self._base[1]:
            self._base, self._missed = (step, per), False
        elif not self._missed:  # once more at this step: one task's time may be the host's, not the size's
            self._missed = True
            return
        else:
            self.step, self._climbing = self._base[0], False
            return
        longer = min(2 * step, self._cap(), self._ceiling)
        if longer > step:
            self.step = longer
        else:
            self._climbing = False

    def _chosen(self, per_row: float) -> int:
        return max(1, min(int(STEP_TARGET_S / max(per_row, 1e-9)), self._cap()))


@dataclass
class Piece:
    """Rows [lo, hi) settled: `outputs` (a dict of arrays, rows on axis 0) or `error`."""

    lo: int
    hi: int
    outputs: dict[str, Array] | None = None
    error: BaseException | None = None
    version: str | None = None  # the model version that computed `outputs`


Submit = Callable[[int, int, int], "Future[Result]"]  # (lo, hi, step): rows [lo, hi) as one task


def run_blocks(submit: Submit, runs: Iterable[tuple[int, int]], sizer: BlockSizer, window: int,
               stop: Callable[[], bool] | None = None) -> Generator[Piece, None, None]:
    """Pieces covering every run [lo, hi), in order, at most `window` blocks in flight.

    `submit(lo, hi, step)` hands one task to the engine, rows [lo, hi) run `step` rows a
    session call (or raises RowsUnreadable: those rows fail with its error). A task that fails
    with a BISECT error is cut in two, on a step's edge while it holds several (both halves go
    to the head of the line: order holds), then within its one call, down to single rows; a
    row that still fails is a Piece with its error. An error of the engine itself (closed,
    broken) propagates. Once `stop()` is true no new task starts (those in flight finish).
    Abandoning the iterator cancels the tasks still queued."""
    pending: deque[tuple[int, int, int, Future[Result]]] = deque()
    cuts = _cut(runs, sizer)
    try:
        while True:
            while len(pending) < (1 if sizer.probing else window) and not (stop and stop()):
                block = next(cuts, None)
                if block is None:
                    break
                pending.append((*block, _guarded(submit, *block)))
            if not pending:
                return
            lo, hi, step, fut = pending.popleft()
            try:
                res = fut.result()
            except RowsUnreadable as exc:
                yield Piece(lo, hi, error=exc.error)
                continue
            except BISECT as exc:
                if hi - lo == 1 or _whole(exc):
                    yield Piece(lo, hi, error=exc)
                    continue
                calls = -(-(hi - lo) // step) if step else 1
                mid, step = (lo + calls // 2 * step, step) if calls > 1 else ((lo + hi) // 2, 0)
                pending.appendleft((mid, hi, step, _guarded(submit, mid, hi, step)))
                pending.appendleft((lo, mid, step, _guarded(submit, lo, mid, step)))
                continue
            sizer.observe(res, hi - lo, step)
            yield Piece(lo, hi, outputs=_block_outputs(res.outputs, hi - lo), version=res.model_version)
    finally:
        for *_, f in pending:
            f.cancel()


def _cut(runs: Iterable[tuple[int, int]], sizer: BlockSizer) -> Iterator[tuple[int, int, int]]:
    """(lo, hi, step) of each task; the step is read when the task is cut (fixed once chosen)."""
    for lo, hi in runs:
        while lo < hi:
            end = min(hi, lo + sizer.next())
            yield lo, end, sizer.step or PROBE_ROWS  # while "auto" probes: calls of PROBE_ROWS
            lo = end


def _guarded(submit: Submit, lo: int, hi: int, step: int) -> Future[Result]:
    """submit(lo, hi, step), or a Future holding the row error it raised at the door."""
    try:
        return submit(lo, hi, step)
    except (*BISECT, RowsUnreadable) as exc:
        fut: Future[Result] = Future()
        fut.set_exception(exc)
        return fut


def _whole(exc: BaseException) -> bool:
    """An error that every row of the block would meet alike: no use cutting it."""
    return isinstance(exc, E.InputContractError) and getattr(exc, "task_id", None) is None


def _block_outputs(outputs: Any, rows: int) -> dict[str, Array]:
    if not isinstance(outputs, dict) or not all(isinstance(v, np.ndarray) for v in outputs.values()):
        raise E.EngineError(f"a block's outputs must be a dict of arrays with rows on axis 0, got "
                            f"{type(outputs).__name__}")
    for name, v in outputs.items():
        if v.ndim == 0 or v.shape[0] != rows:
            raise E.EngineError(f"output {name!r} of a block of {rows} rows has shape {v.shape}: rows must "
                                "lie on axis 0 (a model whose outputs have no batch axis cannot go by blocks)")
    return outputs


def gather(pieces: Iterable[Piece], n: int, tally: Callable[..., None],
           again: Callable[[list[tuple[int, int]]], Iterable[Piece]] | None = None,
           version: Callable[[], str | None] | None = None) -> dict[str, Array]:
    """Infer's rows put back together: each piece's outputs copied into place as it comes back
    (while the workers run the next ones), `tally` told what the rows came to. The outputs of
    all `n` rows, or RowsFailed with each failed row's own error and the other rows' outputs
    (failed rows NaN, 0 for integer outputs).

    Every row's outputs are one model's: a reload() while the call ran computes some blocks on
    the old model and some on the new (was, a hostile run: 4 of 2,427 calls gave arrays mixing
    both, and an array names no version). Until they agree, the blocks of the other versions than
    the one most rows have (on a tie, the engine's now: `version()`) run `again`. A reload's
    slots swap one by one to the new model and a failed one rolls them back, so each round moves
    rows to the version the serving slots run (the majority, not the engine's version: that one
    changes only when the swap has ended, and a slot that hangs in its start could hold it
    back for minutes while every block ran again on the slots already swapped)."""
    outputs: dict[str, Any] | None = None  # every row's outputs, filled as the blocks come back
    errors: dict[int, BaseException] = {}
    done: list[tuple[int, int, str | None]] = []  # rows with outputs, and the version that computed them
    try:
        for piece in pieces:
            outputs = _put(piece, n, outputs, errors, done)
        while again is not None and version is not None and len({v for *_, v in done}) > 1:
            held: dict[str | None, int] = {}  # rows of each version
            for lo, hi, v in done:
                held[v] = held.get(v, 0) + hi - lo
            engine_now = version()
            keep = max(held, key=lambda v: (held[v], v == engine_now))
            stale = [(lo, hi) for lo, hi, v in done if v != keep]
            done = [d for d in done if d[2] == keep]
            for piece in again(stale):
                outputs = _put(piece, n, outputs, errors, done)
    finally:
        failed = len(errors)
        completed = sum(hi - lo for lo, hi, _ in done)
        tally(completed=completed, failed=failed, cancelled=n - completed - failed)
    if not errors:
        assert outputs is not None
        return outputs
    rows = sorted(errors)
    if outputs is not None:  # failed rows: NaN, 0 for integers
        for v in outputs.values():
            v[rows] = np.nan if v.dtype.kind in "fc" else 0
    first = errors[rows[0]]
    raise E.RowsFailed(
        f"{len(rows)} of {n} rows failed (first: row {rows[0]}, {type(first).__name__}: "
        f"{(str(first).splitlines() or [''])[0]}); .rows, .errors and .outputs hold the rest",
        rows=rows, errors=errors, outputs=outputs)


def _put(piece: Piece, n: int, outputs: dict[str, Any] | None, errors: dict[int, BaseException],
         done: list[tuple[int, int, str | None]]) -> dict[str, Any] | None:
    """One piece into `outputs` (made at the first: the piece's own arrays when it is every row)
    or `errors`; the outputs."""
    if piece.error is not None:
        errors.update((i, piece.error) for i in range(piece.lo, piece.hi))
        return outputs
    assert piece.outputs is not None
    if outputs is None:
        if piece.hi - piece.lo == n:
            outputs = piece.outputs  # one block: its arrays as they are
        else:  # copied in as blocks come back, while the workers run the next ones
            outputs = {k: np.empty((n, *v.shape[1:]), v.dtype) for k, v in piece.outputs.items()}
    if outputs is not piece.outputs:
        for k, v in piece.outputs.items():
            outputs[k][piece.lo : piece.hi] = v
    done.append((piece.lo, piece.hi, piece.version))
    return outputs


def infer_rows(eng: JobEngine, specs: tuple[TensorSpec, ...], inputs: Any, batch_size: int | str,
               context: dict[str, Any] | None, block_timeout: float | None) -> Outputs:
    """`infer(batch_size=)`: the rows on axis 0 as blocks, their outputs concatenated."""
    refuse_wait_here(eng, "infer(batch_size=...)")
    arrays, n = rows_of(inputs)
    check_blockable(eng, specs, arrays)
    window = eng.config.workers * max(eng.config.inflight_per_slot, 2)
    hooks = eng.config.preprocess is not None or eng.config.postprocess is not None
    sizer = BlockSizer(batch_size, row_bytes(arrays), eng.config.shm_capacity, window,
                       eng.config.task_timeout, group=not hooks)
    if n == 0:
        empty: Outputs = eng.submit(inputs, context=context, block_timeout=block_timeout).result().outputs
        return empty

    def submit(lo: int, hi: int, step: int) -> Future[Result]:
        # a block counts no items (its rows are counted here), `step` rows a session call
        return eng._submit(Request(slice_rows(arrays, lo, hi), context, None, block_timeout, 0, step))

    eng._tally(accepted=n)
    return gather(run_blocks(submit, [(0, n)], sizer, window), n, eng._tally,
                  again=lambda runs: run_blocks(submit, runs, sizer, window), version=lambda: eng.model_version)


def check_blockable(eng: JobEngine, specs: tuple[TensorSpec, ...], arrays: dict[str, Any]) -> None:
    """Rows can go in blocks when every model input has a dynamic axis 0 (or a preprocess
    takes the block); the contract is checked here, once, for every block."""
    if eng.config.preprocess is not None or not specs:
        return
    fixed = [s for s in specs if not s.shape or s.shape[0] is not None]
    if fixed:
        raise ValueError(f"infer(batch_size=...): input {fixed[0].name!r} has shape {fixed[0].shape}, not a "
                         "dynamic axis 0; rows of this model cannot go in blocks")
    try:
        eng._admit(slice_rows(arrays, 0, 0))  # InputContractError here, not per block
    except E.InputContractError:
        eng._admit(slice_rows(arrays, 0, None))  # the same mistake in the caller's own shapes (was: "got (0, 8)")
        raise
