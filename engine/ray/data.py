"""Ray Data adapter: our worker session as the callable class of `Dataset.map_batches`.

    from ray.data import ActorPoolStrategy
    from slabpool.engine.ray.data import SlabpoolPredictor

    out = ds.map_batches(
        SlabpoolPredictor,
        fn_constructor_kwargs={"model": "model.onnx", "postprocess": "mypkg.hooks:label"},
        compute=ActorPoolStrategy(size=2), num_cpus=0.5, batch_size=256, batch_format="numpy",
    )

One actor of the pool builds one session (`slabpool.workers.session.load_session`), once. Each batch
(dict column -> array, N rows) is one task: `preprocess(batch)` -> feeds (default: the columns
named like the model's inputs), the input contract is checked, `session.run`, then
`postprocess(outputs, batch)` -> the output columns (default: the other columns of the batch,
then the model's outputs). Fault tolerance is Ray Data's own (block-level retries, at-least-once
execution): this adapter has no ledger, no PoisonTask, no exactly-once replay; use
`RayEngine(...)` for those.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from slabpool.engine.core.config import resolve
from slabpool.workers import context as task_context
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
        cfg = resolve(model, workers=1, **settings)
        spec = cfg.session_spec()
        assert spec is not None  # resolve() refuses model=None without preprocess; a model is required here
        if cfg.initializer is not None:
            cfg.initializer(*cfg.initargs)
        self._session: ModelSession = load_session(spec)
        self._pipeline = TaskPipeline(self._session, cfg.preprocess, cfg.postprocess)
        self._context = context
        self.info = self._session.info

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        """One Ray Data batch: the same pipeline as a worker's task (workers.pipeline). Without
        preprocess, the columns named after the model's inputs feed it; the others pass through."""
        names = {s.name for s in self.info.inputs}
        item: Any = batch
        if self._pipeline.preprocess is None:
            item = {n: np.ascontiguousarray(a) for n, a in batch.items() if n in names}
        with task_context.bind(self._context):
            outputs = self._pipeline.run(self._pipeline.prepare(item))
            if self._pipeline.postprocess is not None:
                return dict(self._pipeline.finish(outputs, batch))
        return {**{k: v for k, v in batch.items() if k not in names}, **outputs}

    def __del__(self) -> None:
        session = getattr(self, "_session", None)
        if session is not None:
            session.close()
