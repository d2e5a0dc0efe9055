"""Ray Data adapter: our worker session as the callable class of `Dataset.map_batches`.

    from ray.data import ActorPoolStrategy
    from slabpool.engine.ray.data import SlabpoolPredictor

    out = ds.map_batches(
        SlabpoolPredictor,
        fn_constructor_kwargs={"model": "model.onnx", "postprocess": "mypkg.hooks:label"},
        compute=ActorPoolStrategy(size=2), num_cpus=0.5, batch_size=256, batch_format="numpy",
    )

One actor of the pool builds one session (`slabpool.workers.session.load_session`), once. Each batch
(dict column -> array, a pandas DataFrame, or a pyarrow Table; N rows) is one task:
`preprocess(batch)` -> feeds (default: the columns named like the model's inputs; a column of
lists, fixed-size lists or tensors becomes one [N, ...] array, ragged lists are refused), the
input contract is checked, `session.run`, then
`postprocess(outputs, batch)` -> the output columns (default: the other columns of the batch,
then the model's outputs). Fault tolerance is Ray Data's own (block-level retries, at-least-once
execution): this adapter has no ledger, no PoisonTask, no exactly-once replay; use
`RayEngine(...)` for those.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from slabpool.engine.core.config import EngineConfig, check_settings, resolve
from slabpool.workers import context as task_context
from slabpool.workers.errors import InputContractError
from slabpool.workers.pipeline import TaskPipeline
from slabpool.workers.session import ModelSession, load_session


class SlabpoolPredictor:
    """`ds.map_batches(SlabpoolPredictor, fn_constructor_kwargs={"model": path, ...}, ...)`.

    Settings are validated by `slabpool.engine.core.config.resolve`, as for `Engine`: `backend`, `providers`,
    `delegate`, `delegate_options`, `allow_fallback`, `threads_per_worker`, `preprocess`,
    `postprocess`, `initializer`, `initargs` (hooks as callables or 'module:function').
    `context` is bound while each batch runs (`slabpool.workers.context.current()`).
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        context: dict[str, Any] | None = None,
        **settings: Any,
    ) -> None:
        check_settings("SlabpoolPredictor()", settings,
                       {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "workers"})
        cfg = resolve(model, workers=1, **settings)
        spec = cfg.session_spec()
        assert spec is not None  # resolve() refuses model=None without preprocess; a model is required here
        if cfg.initializer is not None:
            cfg.initializer(*cfg.initargs)
        self._session: ModelSession = load_session(spec)
        self._pipeline = TaskPipeline(self._session, cfg.preprocess, cfg.postprocess)
        self._context = context
        self.info = self._session.info

    def __call__(self, batch: Any) -> dict[str, Any]:
        """One Ray Data batch: the same pipeline as a worker's task (workers.pipeline). Without
        preprocess, the columns named after the model's inputs feed it (see `columns`); the
        others pass through. Hooks get the batch as Ray gave it (batch_format)."""
        names = [s.name for s in self.info.inputs]
        item: Any = batch
        if self._pipeline.preprocess is None:
            table = columns(batch)
            item = {n: feed(n, table[n]) for n in names if n in table}
            passed = {k: v for k, v in table.items() if k not in names}
        with task_context.bind(self._context):
            outputs = self._pipeline.run(self._pipeline.prepare(item))
            if self._pipeline.postprocess is not None:
                return dict(self._pipeline.finish(outputs, batch))
        if self._pipeline.preprocess is not None:
            passed = {k: v for k, v in columns(batch).items() if k not in names}
        return {**passed, **outputs}

    def __del__(self) -> None:
        session = getattr(self, "_session", None)
        if session is not None:
            session.close()


def columns(batch: Any) -> dict[str, Any]:
    """A Ray Data batch as dict column -> array: batch_format "numpy" (a dict already),
    "pandas" (a DataFrame) or "pyarrow" (a Table, read through pandas)."""
    if isinstance(batch, dict):
        return batch
    if hasattr(batch, "column_names") and hasattr(batch, "to_pandas"):  # a pyarrow Table
        batch = batch.to_pandas()
    if hasattr(batch, "columns") and hasattr(batch, "__getitem__"):  # a pandas DataFrame
        return {str(c): batch[c].to_numpy() for c in batch.columns}
    raise TypeError(f"a Ray Data batch must be a dict of arrays, a pandas DataFrame or a pyarrow Table, "
                    f"got {type(batch).__name__}")


def feed(name: str, column: Any) -> np.ndarray:
    """A column as one model input: a numeric array as it is; a column of lists or arrays (a
    Parquet list or fixed-size-list column, an object column of a DataFrame) stacked to
    [rows, ...], each row's values in their own dtype (nothing is cast: the input contract
    then checks it). Rows of different shapes are refused, naming the first that differs."""
    arr = np.asarray(column)
    if arr.dtype != object:
        return np.ascontiguousarray(arr)
    rows = [np.asarray(v) for v in arr]
    if not rows:
        raise InputContractError(f"input {name!r}: an empty column of objects; its dtype is unknown")
    first = rows[0]
    for i, row in enumerate(rows):
        if row.dtype == object:
            raise InputContractError(f"input {name!r}: row {i} holds {type(arr[i]).__name__} values of "
                                     "mixed or non-numeric types, not numbers")
        if row.shape != first.shape:
            raise InputContractError(
                f"input {name!r}: a ragged column: row 0 has shape {first.shape}, row {i} has {row.shape}; "
                "a model input needs the same shape on every row (pad the lists, or pass preprocess= to "
                "build the feeds)")
        if row.dtype != first.dtype:
            raise InputContractError(f"input {name!r}: row 0 holds {first.dtype}, row {i} holds {row.dtype}; "
                                     "nothing is cast silently")
    return np.stack(rows)
