"""An item's result as rows of the OUTPUT: what a row may hold, the job's schema (set by the
first done item) and the check of every later row against it; blank rows for failed items."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from slabpool.engine.job import parquet as job_parquet
from slabpool.engine.job.parquet import INDEX_KEY, Schema
from slabpool.engine.job.sources import JobError

Array = npt.NDArray[Any]


class RowError(ValueError):
    """An item's result cannot be stored as a row of the output (ragged, not numeric)."""


# -- rows -----------------------------------------------------------------------------------------


def to_rows(outputs: Any, *, strip_batch: bool, parquet: bool = False,
            reserved: tuple[str, ...] = ()) -> dict[str, Any]:
    """One item's result as output rows. Model outputs carry a batch axis of 1, dropped here.

    A row is a numeric array; for a Parquet OUTPUT also any other value a postprocess returns
    (str, a Python number or list, ...), kept as it is. A non-numeric value bound for .npy/.npz
    stops the job (JobError: it would fail every item), pointing to .parquet."""
    if not isinstance(outputs, dict):
        outputs = {"output": outputs}
    rows: dict[str, Any] = {}
    taken = (INDEX_KEY, job_parquet.ERROR_KEY, *reserved) if parquet else (INDEX_KEY, *reserved)
    for key, value in outputs.items():
        name = key if type(key) is str else str(key)
        if name in taken:
            raise JobError(f"an output is named {name!r}, which the OUTPUT already uses for "
                           f"{'a --keep column' if name in reserved else 'its own column'}: rename it")
        if parquet and not isinstance(value, np.ndarray | np.generic):
            rows[name] = value  # stored as it is
            continue
        try:
            a = np.asarray(value)
        except ValueError as exc:  # ragged nested lists
            raise RowError(f"output {name!r} is not an array ({exc})") from exc
        if strip_batch:
            if a.ndim == 0 or a.shape[0] != 1:
                raise RowError(f"output {name!r} has shape {a.shape}; one item needs a batch axis of 1")
            a = np.asarray(a[0])  # one number a row: a 0-d array, not a numpy scalar
        if a.dtype.hasobject or a.dtype.kind in "USV":
            if not parquet:
                raise JobError(f"output {name!r} holds {a.dtype} values ({type(value).__name__}); .npy/.npz "
                               "and folder OUTPUTs keep numbers only: use -o OUT.parquet")
            rows[name] = a.tolist()
            continue
        rows[name] = a
    return rows


def schema_of(rows: dict[str, Any], var: frozenset[str] = frozenset()) -> Schema:
    """(dtype, shape) of each numeric row; ("py", ()) for a value stored as it is (Parquet);
    for an output of `var` (its shape may change from item to item: Parquet) ("var:" dtype,
    (ndim,)), the shape kept per row."""
    return {k: (a.dtype.str, tuple(a.shape)) if isinstance(a, np.ndarray) and k not in var else
            (job_parquet.VAR + a.dtype.str, (a.ndim,)) if isinstance(a, np.ndarray) else (job_parquet.PY, ())
            for k, a in rows.items()}


def check_rows(rows: dict[str, Any], schema: Schema) -> None:
    got = schema_of(rows, frozenset(k for k, (d, _) in schema.items() if d.startswith(job_parquet.VAR)))
    if got != schema:
        raise RowError(f"the result does not match the first item's outputs: {got} vs {schema}")


def blank(schema: Schema, count: int) -> dict[str, Array]:
    """Arrays for `count` rows: NaN where the dtype has it, zeros otherwise (failed rows)."""
    out: dict[str, Array] = {}
    for name, (dtype, shape) in schema.items():
        dt = np.dtype(dtype)
        fill: Any = np.nan if dt.kind in "fc" else 0
        out[name] = np.full((count, *shape), fill, dtype=dt)
    return out
