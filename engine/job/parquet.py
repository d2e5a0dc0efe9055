"""Parquet output for the batch job: shards as Parquet files, then OUT.parquet in input order.

    OUT.parquet.parts/shards/shard-*.parquet   one per commit: every settled item of it, done
                                               or failed: `__index__`, the outputs, the --keep
                                               columns, `error` (null when done)
    OUT.parquet                                the shards' rows in input order, row groups of
                                               up to ROW_GROUP rows, written when all are settled

Each shard is a complete Parquet file written atomically before its journal line (engine.job.store),
so the job stays durable and resumable. A cell is stored as it came: a numeric array of the
job's shape (`Schema`, set by the first done item) becomes a fixed-size list (nested for
tensors), a 0-d one a number; a model output whose shape varies (dynamic axes past the batch
axis) a list of its values plus NAME.shape, each row's shape; Python values a postprocess returns (str, int, float, lists,
dicts) go to pyarrow as they are. Failed rows have null outputs and the error's class and
message in `error`.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt

from slabpool.engine.job.sources import JobError, require_pyarrow
from slabpool.engine.job.sources.base import arrow_opened

Array = npt.NDArray[Any]
Schema = dict[str, tuple[str, tuple[int, ...]]]  # output name -> (dtype str, row shape); "py": as is
INDEX_KEY = "__index__"
ERROR_KEY = "error"
SCHEMA_KEY = b"slabpool.schema"
ROW_GROUP = 65_536
PY = "py"
VAR = "var:"  # a schema dtype "var:<f4": an output whose shape may differ from item to item
SHAPE_SUFFIX = ".shape"  # beside a variable-shape output NAME: NAME.shape, each row's shape


def arrow_type(pa: Any, dtype: str, shape: tuple[int, ...]) -> Any:
    """The arrow type of one row of a numeric output: nested fixed-size lists for a tensor."""
    t = pa.from_numpy_dtype(np.dtype(dtype))
    for n in reversed(shape):
        t = pa.list_(t, n)
    return t


def numeric_column(pa: Any, done: Array | list[Array], failed: int, dtype: str, shape: tuple[int, ...]) -> Any:
    """Rows of one numeric output (the done rows, then `failed` nulls) as an arrow array, built
    from the numbers' buffer (no Python object per number)."""
    block = np.asarray(done, dtype=np.dtype(dtype)).reshape((-1, *shape)) if len(done) else np.zeros((0, *shape), dtype)
    n = len(block) + failed
    block = np.concatenate([block, np.zeros((failed, *shape), dtype=block.dtype)])
    valid = np.arange(n) < n - failed
    if not shape:
        return pa.array(block, mask=~valid)
    child = pa.array(block.reshape(-1))
    for d in reversed(shape[1:]):
        child = pa.FixedSizeListArray.from_arrays(child, d)
    validity = pa.py_buffer(np.packbits(valid, bitorder="little"))
    return pa.Array.from_buffers(arrow_type(pa, dtype, shape), n, [validity], children=[child])


def variable_columns(pa: Any, done: list[Array], failed: int, dtype: str) -> tuple[Any, Any]:
    """Rows of an output whose shape varies (the done rows, then `failed` nulls): its values,
    row-major, as a list<dtype> column, and each row's shape as a list<int64> column; row i is
    `np.reshape(values[i], shape[i])` (docs/cli.md)."""
    dt = np.dtype(dtype.removeprefix(VAR))
    rows = [np.ascontiguousarray(a, dtype=dt) for a in done]
    sizes = np.asarray([a.size for a in rows] + [0] * failed, dtype=np.int32)
    offsets = pa.array(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32))
    flat = np.concatenate([a.reshape(-1) for a in rows]) if rows else np.zeros(0, dt)
    mask = pa.array(np.arange(len(sizes)) >= len(rows))
    values = pa.ListArray.from_arrays(offsets, pa.array(flat), mask=mask)
    dims = pa.array([list(a.shape) for a in rows] + [None] * failed, type=pa.list_(pa.int64()))
    return values, dims


def python_column(pa: Any, name: str, values: list[Any]) -> Any:
    try:
        return pa.array([_plain(v) for v in values])
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as exc:
        raise JobError(f"output {name!r}: its values do not form one Parquet column ({exc})") from exc


def _plain(v: Any) -> Any:
    return v.tolist() if isinstance(v, np.ndarray | np.generic) else v


def write_shard(f: IO[bytes], indices: Array, columns: dict[str, Any], failed: list[tuple[int, str]],
                keep: dict[str, list[Any]], keep_types: dict[str, Any], schema: Schema) -> None:
    """One shard: the done items (`indices`, row k of each column is item indices[k]), then the
    failed ones as (index, error) with null outputs. `keep` holds both, in that order."""
    pa = require_pyarrow("a .parquet OUTPUT")
    import pyarrow.parquet as pq

    every = [*np.asarray(indices, dtype=np.int64).tolist(), *(i for i, _ in failed)]
    cols: dict[str, Any] = {INDEX_KEY: pa.array(every, type=pa.int64())}
    for name, (dtype, shape) in schema.items():
        if dtype == PY:
            cols[name] = python_column(pa, name, [*columns.get(name, []), *([None] * len(failed))])
        elif dtype.startswith(VAR):
            cols[name], cols[name + SHAPE_SUFFIX] = variable_columns(pa, list(columns.get(name, [])), len(failed), dtype)
        else:
            cols[name] = numeric_column(pa, columns.get(name, []), len(failed), dtype, shape)
    for name, values in keep.items():
        cols[name] = pa.array(values, type=keep_types.get(name))
    cols[ERROR_KEY] = pa.array([*([None] * len(indices)), *(e for _, e in failed)], type=pa.string())
    table = pa.table(cols).replace_schema_metadata({SCHEMA_KEY: json.dumps(schema).encode()})
    pq.write_table(table, f)


def shard_schema(path: Path) -> Schema | None:
    """The job's output schema as recorded in a shard (None if it holds failures only)."""
    meta = _read_schema(path).metadata or {}
    raw = json.loads(meta.get(SCHEMA_KEY, b"{}"))
    return {k: (d, tuple(s)) for k, (d, s) in raw.items()} or None


def _read_schema(path: Path) -> Any:
    """A shard's schema (its path may be no UTF-8 text: arrow_opened)."""
    import pyarrow.parquet as pq

    with arrow_opened(path) as name:
        return pq.read_schema(name)


def shard_indices(path: Path) -> Array:
    import pyarrow.parquet as pq

    with arrow_opened(path) as name:
        return np.asarray(pq.read_table(name, columns=[INDEX_KEY]).column(INDEX_KEY).to_numpy())


def assemble(shards: list[Path], count: int, keep: tuple[str, ...], f: IO[bytes],
             check: Callable[[], None] | None = None) -> None:
    """Write OUT.parquet to `f`: the shards' rows in input order (every index 0..count-1 once).
    `check` is called before each row group (it raises to stop: a signal)."""
    pa = require_pyarrow("a .parquet OUTPUT")
    import pyarrow.parquet as pq

    schemas = [_read_schema(p) for p in shards]
    try:
        unified = pa.unify_schemas([s.remove_metadata() for s in schemas], promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise JobError(f"the shards' columns do not agree ({exc}); a postprocess returned values of "
                       "different types for the same key") from exc
    outputs = [n for n in unified.names if n not in (INDEX_KEY, ERROR_KEY, *keep)]
    order = [*keep, *outputs, ERROR_KEY]
    schema = pa.schema([unified.field(n) for n in order])
    where = _where(shards, count)

    @lru_cache(maxsize=4)
    def table(k: int) -> Any:
        with arrow_opened(shards[k]) as name:
            t = pq.read_table(name)
        for name in order:  # a shard of failures only has no output columns
            if name not in t.column_names:
                t = t.append_column(schema.field(name), pa.nulls(t.num_rows, schema.field(name).type))
        return t.select(order).cast(schema)

    with pq.ParquetWriter(f, schema) as writer:
        for start in range(0, count, ROW_GROUP):
            if check is not None:
                check()
            pieces = [table(k).slice(pos, n) for k, pos, n in _runs(where, start, min(start + ROW_GROUP, count))]
            writer.write_table(pa.concat_tables(pieces), row_group_size=ROW_GROUP)


def _where(shards: list[Path], count: int) -> Array:
    """(shard, row) of every item index, as an array of shape (count, 2)."""
    where = np.full((count, 2), -1, dtype=np.int64)
    for k, p in enumerate(shards):
        idx = shard_indices(p)
        where[idx, 0] = k
        where[idx, 1] = np.arange(len(idx))
    missing = np.flatnonzero(where[:, 0] < 0)
    if len(missing):
        raise JobError(f"item {int(missing[0])} is in no shard ({len(missing)} missing); cannot assemble")
    return where


def _runs(where: Array, start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """Consecutive items held in consecutive rows of one shard, as (shard, first row, length)."""
    seg = where[start:end]
    breaks = np.flatnonzero((seg[1:, 0] != seg[:-1, 0]) | (seg[1:, 1] != seg[:-1, 1] + 1)) + 1
    bounds = [0, *breaks.tolist(), len(seg)]
    for a, b in itertools.pairwise(bounds):
        yield int(seg[a, 0]), int(seg[a, 1]), b - a
