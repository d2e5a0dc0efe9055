"""Rows on axis 0 through the engine as contiguous blocks: one block of rows is one task.

    rows [lo, hi) of every input (an array, a dict of arrays, a memory-mapped .npy/.npz)
      -> one copy into the input arena, straight from the source (a slice is a view)
      -> one session run in a worker (outputs written in place by the runtime when large)
      -> one copy out of the output arena, per block
    blocks come back in order; a block that fails is cut in two, again and again, down to the
    rows that fail alone (`bisect`), each with its own error

Used by `Engine.infer(feeds, batch_size=...)` and by the batch job (`slabpool run` on
.npy/.npz). The block size is the caller's, or "auto": a first block of PROBE_ROWS, then as
many rows as run in about BLOCK_TARGET_S (the measured run time per row), bounded so that
the blocks in flight take at most half of each arena.

A block task is never stacked with other tasks (it counts no items for dynamic batching), so
its outputs are byte-identical to one session call on those rows. A worker killed by a block
replays that block whole (the same rows: the engine's replay keeps the composition).
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

from slabpool.engine.core.task import Result
from slabpool.workers import errors as E

Array = npt.NDArray[Any]
BLOCK_TARGET_S = 0.01  # run time per block aimed at: ~10 ms, the per-task cost ~1-2% of it (larger
# blocks ran slower per row for an MLP 64->1024->10: its activations leave the caches)
PROBE_ROWS = 256  # the first block when the size is "auto" (the run time per row is not known)
MAX_BLOCK_ROWS = 1 << 20

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


def slice_rows(arrays: dict[str, Array], lo: int, hi: int) -> Any:
    """Rows [lo, hi) as views (a bare array stays bare)."""
    if list(arrays) == [""]:
        return arrays[""][lo:hi]
    return {k: a[lo:hi] for k, a in arrays.items()}


def row_bytes(arrays: dict[str, Array]) -> int:
    return sum(a.dtype.itemsize * math.prod(a.shape[1:]) for a in arrays.values())


class BlockSizer:
    """The next block's rows: fixed, or from the measured run time per row ("auto")."""

    def __init__(self, size: int | str | None, in_row_bytes: int, arena_bytes: int, in_flight: int) -> None:
        if size is not None and size != "auto" and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ValueError(f"batch_size must be a positive integer or 'auto', got {size!r}")
        self.fixed = size if isinstance(size, int) else None
        self.per_row: float | None = None
        self.out_row_bytes = 0
        self.in_row_bytes = in_row_bytes
        self.budget = max(arena_bytes // (2 * max(in_flight, 1)), 1)  # bytes per block per arena

    @property
    def probing(self) -> bool:
        return self.fixed is None and self.per_row is None

    def next(self) -> int:
        if self.fixed is not None:
            return self.fixed
        if self.per_row is None:
            return PROBE_ROWS
        rows = int(BLOCK_TARGET_S / max(self.per_row, 1e-9))
        widest = max(self.in_row_bytes, self.out_row_bytes, 1)
        return max(1, min(rows, MAX_BLOCK_ROWS, self.budget // widest))

    def observe(self, res: Result, rows: int) -> None:
        if rows <= 0:
            return
        per = res.timings.run / rows
        self.per_row = per if self.per_row is None else 0.7 * self.per_row + 0.3 * per
        if isinstance(res.outputs, dict):
            self.out_row_bytes = sum(int(np.asarray(v).nbytes) for v in res.outputs.values()) // rows


@dataclass
class Piece:
    """Rows [lo, hi) settled: `outputs` (a dict of arrays, rows on axis 0) or `error`."""

    lo: int
    hi: int
    outputs: dict[str, Array] | None = None
    error: BaseException | None = None


Submit = Callable[[int, int], "Future[Result]"]


def run_blocks(submit: Submit, runs: Iterable[tuple[int, int]], sizer: BlockSizer, window: int,
               stop: Callable[[], bool] | None = None) -> Generator[Piece, None, None]:
    """Pieces covering every run [lo, hi), in order, at most `window` blocks in flight.

    `submit(lo, hi)` hands one block to the engine (or raises RowsUnreadable: those rows fail
    with its error). A block that fails with a BISECT error is cut in two (both halves go to the head of the line: order holds), down to single rows; a
    row that still fails is a Piece with its error. An error of the engine itself (closed,
    broken) propagates. Once `stop()` is true no new block starts (those in flight finish).
    Abandoning the iterator cancels the blocks still queued."""
    pending: deque[tuple[int, int, Future[Result]]] = deque()
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
            lo, hi, fut = pending.popleft()
            try:
                res = fut.result()
            except RowsUnreadable as exc:
                yield Piece(lo, hi, error=exc.error)
                continue
            except BISECT as exc:
                if hi - lo == 1 or _whole(exc):
                    yield Piece(lo, hi, error=exc)
                    continue
                mid = (lo + hi) // 2
                pending.appendleft((mid, hi, _guarded(submit, mid, hi)))
                pending.appendleft((lo, mid, _guarded(submit, lo, mid)))
                continue
            sizer.observe(res, hi - lo)
            yield Piece(lo, hi, outputs=_block_outputs(res.outputs, hi - lo))
    finally:
        for _, _, f in pending:
            f.cancel()


def _cut(runs: Iterable[tuple[int, int]], sizer: BlockSizer) -> Iterator[tuple[int, int]]:
    for lo, hi in runs:
        while lo < hi:
            end = min(hi, lo + sizer.next())
            yield lo, end
            lo = end


def _guarded(submit: Submit, lo: int, hi: int) -> Future[Result]:
    """submit(lo, hi), or a Future holding the row error it raised at the door."""
    try:
        return submit(lo, hi)
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


def blank_like(outputs: dict[str, Array], rows: int) -> dict[str, Array]:
    """Arrays of `rows` rows shaped like `outputs`' rows: NaN where the dtype has it, else 0."""
    return {k: np.full((rows, *v.shape[1:]), np.nan if v.dtype.kind in "fc" else 0, dtype=v.dtype)
            for k, v in outputs.items()}
