"""Shard files: the rows of one commit. A directory OUTPUT's shard is an uncompressed .npz
(one array per output, rows stacked, and `__index__`: the item of each row); a Parquet
OUTPUT's shard is a Parquet file of every settled item, failed ones too (engine.job.parquet).
Each is written atomically before its journal line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from slabpool.engine.job import parquet as job_parquet
from slabpool.engine.job.parquet import INDEX_KEY, Schema
from slabpool.engine.job.store.files import savez, write_atomic

Array = npt.NDArray[Any]


def write_npz(folder: Path, indices: Array, columns: dict[str, Any]) -> str:
    """The done rows of a commit as a .npz shard in `folder`, written atomically; its name."""
    name = f"shard-{int(indices[0]):09d}-{len(indices):06d}.npz"
    arrays = {**columns, INDEX_KEY: np.asarray(indices, dtype=np.int64)}
    write_atomic(folder / name, lambda f: savez(f, arrays))
    return name


def write_parquet(folder: Path, indices: Array, columns: dict[str, Any], failed: list[tuple[int, str]],
                  kept: dict[str, list[Any]], keep_types: dict[str, Any], schema: Schema) -> str:
    """Every settled item of a commit as a Parquet shard in `folder`: the done rows, then the
    failed ones as (index, error); its name."""
    count = len(indices) + len(failed)
    keep = {k: kept.get(k) or [None] * count for k in keep_types}
    first = min([*([int(np.min(indices))] if len(indices) else []), *(i for i, _ in failed)])
    name = f"shard-{first:09d}-{count:06d}.parquet"
    write_atomic(folder / name,
                 lambda f: job_parquet.write_shard(f, indices, columns, failed, keep, keep_types, schema))
    return name


def indices(path: Path, *, parquet: bool) -> Array:
    """The item index of each row of a shard."""
    if parquet:
        return job_parquet.shard_indices(path)
    with np.load(path) as z:
        return np.asarray(z[INDEX_KEY], dtype=np.int64)


def npz_schema(path: Path) -> Schema:
    """(dtype, row shape) of each output a .npz shard holds."""
    with np.load(path) as z:
        return {k: (z[k].dtype.str, tuple(z[k].shape[1:])) for k in z.files if k != INDEX_KEY}


def npz_rows(path: Path) -> tuple[Array, dict[str, Array]]:
    """(item indices, each output's rows) of a .npz shard."""
    with np.load(path) as z:
        return z[INDEX_KEY], {k: z[k] for k in z.files if k != INDEX_KEY}
