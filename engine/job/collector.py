"""Step 3-4 of the job: settled items (a block's rows, or one item at a time) buffered in any
order, every row with its index, and committed to the Store as one shard (or into the direct/
files) when due."""

from __future__ import annotations

import itertools
import re
import time
from typing import Any

import numpy as np

from slabpool.engine.caller.blocks import Piece
from slabpool.engine.caller.mapping import MapPart
from slabpool.engine.core.task import Result
from slabpool.engine.job import parquet as job_parquet
from slabpool.engine.job.parquet import Schema
from slabpool.engine.job.signals import hold
from slabpool.engine.job.sources import JobError
from slabpool.engine.job.store import Failure, Store
from slabpool.engine.job.store.files import Array
from slabpool.engine.job.store.rows import RowError, check_rows, schema_of, to_rows
from slabpool.workers import errors as E
from slabpool.workers import packing
from slabpool.workers.protocol import Chunk, RemoteError

MAX_SHARD_ITEMS = 10_000  # parts (items, blocks) a shard holds at most: it also closes then

ITEM_ERRORS = (E.InputContractError, E.SessionRunError, E.PoisonTask, E.TaskTimeout, E.ShmCapacityError,
               RowError, OSError, ValueError)
MAX_SHARD_BYTES = 64 * 1024 * 1024  # output bytes a shard holds at most (bounds memory)

# "task 99 failed: ValueError: ..." -> "ValueError: ...": a task id is the engine's, not the
# input's, and differs between a run and its resume (the row's index is the item's identity)
_TASK_ID = re.compile(r"^task \d+(?: failed:|:)? ?")


class Collector:
    """Buffers settled items (in any order: every row keeps its index); commits them to the
    Store as one shard. A block of rows is kept as the block's arrays, not row by row."""

    def __init__(self, store: Store, strip_batch: bool, schema: Schema | None) -> None:
        self.store, self.strip_batch, self.schema = store, strip_batch, schema
        self.keep_names = tuple(store.keep_types)
        # (item indices, outputs with rows on axis 0, --keep values of those items)
        self.parts: list[tuple[Array, dict[str, Any], dict[str, list[Any]]]] = []
        self.failures: list[Failure] = []
        self.failed_kept: dict[str, list[Any]] = {k: [] for k in self.keep_names}  # --keep of the failures
        self.first_failure: Failure | None = None
        self.latencies: list[float] = []
        self.done = self.failed = 0
        self.quarantined = 0  # items that failed as PoisonTask (their task killed worker after worker)
        self.pending_rows = self.pending_bytes = 0
        self.last_commit = time.monotonic()
        self.commits = 0  # durable commits this run (a test may hold the job after one: engine.job.signals)
        # items settled one by one, gathered as columns until the next block or commit (a part)
        self.item_indices: list[int] = []
        self.item_cols: dict[str, list[Any]] = {}
        self.item_keep: dict[str, list[Any]] = {k: [] for k in self.keep_names}
        self.item_bytes = 0  # bytes of one item's rows (from the schema)
        # model outputs whose shape may vary from item to item (dynamic axes past the batch
        # axis): a Parquet OUTPUT keeps each row's shape (`var`); for others a change of
        # shape stops the job (engine.job.run sets both once the model is known)
        self.var: frozenset[str] = frozenset()
        self.dynamic: frozenset[str] = frozenset()
        self._expect: tuple[Schema, list[tuple[str, np.dtype[Any], tuple[int, ...]]]] | None = None

    def add(self, index: int, outcome: Result | BaseException, kept: dict[str, Any] | None = None) -> None:
        """One item's outcome (a task of one item, or an item of a chunk)."""
        if isinstance(outcome, Result):
            self._add_outputs(index, outcome.outputs, outcome.attempts, outcome.timings.total, kept)
        elif isinstance(outcome, ITEM_ERRORS):
            self._fail(index, outcome, len(getattr(outcome, "crashes", ())) or 1, self._kept_one(kept))
        else:  # the pool itself broke (or a bug): not an item's fault
            raise outcome

    def add_part(self, entries: list[tuple[int, dict[str, Any]]], part: MapPart) -> None:
        """The outcomes of one task of map() (engine.caller.mapping.MapPart): `entries` holds
        (index, kept values) of its items, in order. A chunk whose outputs came back stacked
        (one block of rows per output, as the first item's) is kept as that block, with no
        Python per item; otherwise item by item."""
        res = part.result
        if res is None or type(res.outputs) is not Chunk:
            for (index, kept), outcome in zip(entries, part.each(return_exceptions=True), strict=True):
                self.add(index, outcome, kept)
            return
        outs: Chunk = res.outputs
        cols = self._stacked_rows(outs)
        if cols is not None:
            keep = {k: [kept.get(k) for _, kept in entries] for k in self.keep_names}
            self._keep(np.fromiter((i for i, _ in entries), np.int64, len(entries)), cols, keep)
            self.latencies.extend(itertools.repeat(res.timings.total, len(entries)))
            return
        for (index, kept), out in zip(entries, packing.chunk_items(outs), strict=True):
            if type(out) is RemoteError:
                self.add(index, E.from_remote(out, res.task_id), kept)
            else:
                self._add_outputs(index, out, res.attempts, res.timings.total, kept)

    def _stacked_rows(self, outs: Chunk) -> dict[str, Array] | None:
        """A chunk's outputs as one block of rows per output, when they came back stacked with
        one row per item, as the first item's (names, dtypes, shapes); else None."""
        if outs.stacked is None or not self.strip_batch or self.schema is None:
            return None
        rows, arrays = outs.stacked
        expect = self._expected()
        if expect is None or len(expect) != len(arrays):
            return None
        count = len(rows.counts)
        if rows.counts.count(1) != count:
            return None  # an item of 0 or 2 rows: each is checked (and refused) on its own
        cols = dict(zip(rows.names, arrays, strict=True))
        for name, dtype, shape in expect:
            a = cols.get(name)
            if a is None or a.dtype != dtype or a.shape != (count, *shape[1:]):
                return None
        return cols

    def _add_outputs(self, index: int, outputs: Any, attempts: int, latency: float,
                     kept: dict[str, Any] | None) -> None:
        rows = self._fast_rows(outputs)
        if rows is None:
            try:
                rows = to_rows(outputs, strip_batch=self.strip_batch, parquet=self.store.parquet,
                               reserved=self.keep_names)  # numeric unless Parquet: checked there
                if self.schema is None:
                    self.schema = schema_of(rows, self.var)
                self._check_shapes(rows)
            except RowError as exc:
                return self._fail(index, exc, attempts, self._kept_one(kept))
        if not self.item_indices:
            self.item_cols = {k: [] for k in rows}
            self.item_bytes = sum(getattr(v, "nbytes", 64) for v in rows.values())
        self.item_indices.append(index)
        for k, v in rows.items():
            self.item_cols[k].append(v)
        for k, values in self.item_keep.items():
            values.append(kept.get(k) if kept else None)
        self.done += 1
        self.pending_rows += 1
        self.pending_bytes += self.item_bytes
        self.latencies.append(latency)
        return None

    def _expected(self) -> list[tuple[str, np.dtype[Any], tuple[int, ...]]] | None:
        """(name, dtype, shape with its batch axis) of each output of the schema, when every
        one is numeric; None otherwise."""
        schema = self.schema
        if schema is None:
            return None
        if self._expect is None or self._expect[0] is not schema:
            lead = (1,) if self.strip_batch else ()
            self._expect = (schema, [(k, np.dtype(d), (*lead, *sh)) for k, (d, sh) in schema.items()
                                     if d != job_parquet.PY and not d.startswith(job_parquet.VAR)])
        expect = self._expect[1]
        return expect if len(expect) == len(schema) else None

    def _fast_rows(self, outputs: Any) -> dict[str, Array] | None:
        """What to_rows + check_rows give, for the common case only (a dict of the first item's
        names, numeric arrays of its dtypes and shapes); None: take the general path."""
        if type(outputs) is not dict:
            return None
        expect = self._expected()
        if expect is None or len(outputs) != len(expect):
            return None
        rows = {}
        for name, dtype, shape in expect:
            a = outputs.get(name)
            if type(a) is not np.ndarray or a.shape != shape or a.dtype != dtype:
                return None
            rows[name] = a[0] if self.strip_batch else a
        return rows

    def _kept_one(self, kept: dict[str, Any] | None) -> dict[str, list[Any]]:
        return {k: [kept.get(k) if kept else None] for k in self.keep_names}

    def _flush_items(self) -> None:
        """The items gathered one by one become one part: each output's rows stacked (a
        Parquet OUTPUT's non-numeric values stay a list)."""
        if not self.item_indices:
            return
        schema = self.schema or {}
        cols = {k: v if _kept_as_list(schema.get(k, (job_parquet.PY, ()))[0]) else np.stack(v)
                for k, v in self.item_cols.items()}
        self.parts.append((np.asarray(self.item_indices, dtype=np.int64), cols, self.item_keep))
        self.item_indices, self.item_cols = [], {}
        self.item_keep = {k: [] for k in self.keep_names}

    def add_block(self, piece: Piece, latency: float, kept: dict[str, list[Any]] | None = None) -> None:
        """Rows [lo, hi) of a block: its outputs, or one failure per row (a row cut alone).
        `kept`: the rows' --keep values, one list per column."""
        keep = {k: (kept or {}).get(k) or [None] * (piece.hi - piece.lo) for k in self.keep_names}
        error: BaseException | None = piece.error
        if error is None:
            assert piece.outputs is not None
            cols = {str(k): np.asarray(v) for k, v in piece.outputs.items()}
            try:
                self._check({k: np.asarray(v[0]) for k, v in cols.items()} if piece.hi > piece.lo else {})
            except RowError as exc:
                error = exc
            else:
                self._keep(np.arange(piece.lo, piece.hi, dtype=np.int64), cols, keep)
                self.latencies.append(latency)
                return
        if not isinstance(error, ITEM_ERRORS):
            raise error
        attempts = len(getattr(error, "crashes", ())) or 1
        for j, i in enumerate(range(piece.lo, piece.hi)):
            self._fail(i, error, attempts, {k: v[j : j + 1] for k, v in keep.items()})

    def _check(self, rows: dict[str, Array]) -> None:
        for name, a in rows.items():
            if a.dtype.hasobject or a.dtype.kind in "USV":
                raise RowError(f"output {name!r} is not a numeric array (dtype {a.dtype})")
        if self.schema is None:
            self.schema = schema_of(rows, self.var)
        self._check_shapes(rows)

    def _check_shapes(self, rows: dict[str, Any]) -> None:
        """check_rows; a model output declared with dynamic axes whose shape changed stops the
        job (every later item would be computed and thrown away) when OUTPUT cannot keep it."""
        assert self.schema is not None
        try:
            check_rows(rows, self.schema)
        except RowError:
            for name in self.dynamic - self.var:
                a, want = rows.get(name), self.schema.get(name)
                if isinstance(a, np.ndarray) and want is not None and a.shape != want[1]:
                    raise JobError(
                        f"model output {name!r} has shape {a.shape} for this item, {want[1]} for the first: the "
                        "model declares dynamic axes on it, and a .npy/.npz/folder OUTPUT holds rows of one "
                        "shape; use -o OUT.parquet (each row with its shape: docs/cli.md)") from None
            raise

    def _keep(self, indices: Array, cols: dict[str, Any], keep: dict[str, list[Any]]) -> None:
        self._flush_items()  # parts stay in the order they settled
        self.parts.append((indices, cols, keep))
        self.done += len(indices)
        self.pending_rows += len(indices)
        self.pending_bytes += sum(getattr(v, "nbytes", 64 * len(v)) for v in cols.values())

    def _fail(self, index: int, exc: BaseException, attempts: int, keep: dict[str, list[Any]]) -> None:
        message = _TASK_ID.sub("", (str(exc).strip().splitlines() or [""])[0], count=1)
        failure = Failure(index, type(exc).__name__, message, attempts)
        self.failures.append(failure)
        for k, v in keep.items():
            self.failed_kept[k].extend(v)
        self.first_failure = self.first_failure or failure
        self.failed += 1
        self.quarantined += isinstance(exc, E.PoisonTask)

    def due(self, every: float) -> bool:
        pending = self.pending_rows + len(self.failures)
        if not pending:
            return False
        full = (len(self.parts) + len(self.item_indices) + len(self.failures) >= MAX_SHARD_ITEMS
                or self.pending_bytes >= MAX_SHARD_BYTES)
        return full or time.monotonic() - self.last_commit >= every

    def commit(self) -> None:  # step 4
        self._flush_items()
        settled = bool(self.parts or self.failures)
        if settled:
            self._commit()
        self.parts, self.failures = [], []
        self.failed_kept = {k: [] for k in self.keep_names}
        self.pending_rows = self.pending_bytes = 0
        self.last_commit = time.monotonic()
        if settled:
            self.commits += 1
            hold("commit", self.commits)

    def _commit(self) -> None:
        if self.store.direct:
            self.store.commit_direct([(i, c) for i, c, _ in self.parts], self.failures, self.schema)
        else:
            parts = self.parts
            indices = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64)
            cols = ({k: _join([p[1][k] for p in parts]) for k in parts[0][1]}
                    if len(parts) > 1 else parts[0][1] if parts else {})
            kept = {k: [*(v for p in parts for v in p[2][k]), *self.failed_kept[k]] for k in self.keep_names}
            self.store.commit(indices, cols, self.failures, kept=kept, schema=self.schema)


def _kept_as_list(dtype: str) -> bool:
    """Rows of this output are gathered as a list, not stacked: Python values, or arrays whose
    shape changes from item to item (Parquet)."""
    return dtype == job_parquet.PY or dtype.startswith(job_parquet.VAR)


def _join(pieces: list[Any]) -> Any:
    """One column from the pieces of a shard: arrays concatenated (when their rows agree in
    shape); else lists (Parquet) of rows joined."""
    if all(isinstance(p, np.ndarray) for p in pieces) and len({p.shape[1:] for p in pieces}) == 1:
        return np.concatenate(pieces)
    return [row for p in pieces for row in p]
