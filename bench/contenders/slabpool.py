"""slabpool itself: `Engine.submit` per item, with or without dynamic batching."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

from bench.contenders.base import Done, FutureHandle, Skipped, windowed


class Slabpool:
    def __init__(self, window_per_worker: int, batch: int = 1, cluster: str = "local", use_map: bool = False) -> None:
        self.name = "slabpool+batch" if batch > 1 else "slabpool"
        self.note = (f"Engine(forkserver, max_batch_size={batch}, max_batch_wait_ms=2)" if batch > 1
                     else "Engine(forkserver), no batching")
        self._map = use_map
        if use_map:
            self.name, self.note = "slabpool map", "Engine.map(items): chunks sized from the measured run time"
        if cluster == "ray":
            self.name, self.note = "slabpool-ray", "RayEngine: slots are Ray actors, our ledger replays"
        self._per_worker, self._batch, self._cluster = window_per_worker, batch, cluster
        self.engine: Any = None
        self._window = 1

    def setup(self, model: str, workers: int) -> None:
        from slabpool import Engine

        self._window = self._per_worker * workers
        kw: dict[str, Any] = {}
        if self._batch > 1:  # the queue must hold enough tasks to fill batches
            kw = {"max_batch_size": self._batch, "max_batch_wait_ms": 2.0, "queue_capacity": self._window}
        if self._cluster == "ray":
            try:
                import ray  # noqa: F401
            except ImportError as exc:
                raise Skipped(f"ray is not importable ({exc}); pip install 'slabpool[ray]'") from exc
            from slabpool import RayEngine

            self.engine = RayEngine(model, workers=workers, address="local", **kw)  # a private Ray instance
            return
        self.engine = Engine(model, workers=workers, start_method="forkserver", **kw)

    def run(self, items: Sequence[Any]) -> Iterator[Done]:
        if self._map:  # the engine submits; no per-item submission time: latency not measured
            # map() as a user calls it: its own window (a bench window of tasks, counted in
            # items, capped its chunks at ~30 items)
            for res in self.engine.map(items):
                yield Done(res.outputs, math.nan)
            return
        submit = self.engine.submit

        def start(item: Any, on_done: Any) -> FutureHandle:
            return FutureHandle(submit(item), on_done)

        for done in windowed(start, items, self._window):
            yield Done(done.outputs.outputs, done.latency)

    def sample(self) -> dict[str, float]:
        if self._cluster == "ray":
            return {}
        st = self.engine.stats()
        rss = [_rss(s.pid) for s in st.slots if s.pid]
        return {
            "shm_in_use_bytes": st.shm_inputs_used + st.shm_outputs_used,
            "shm_capacity_bytes": 2 * st.shm_capacity,
            "worker_private_rss_bytes": max((r[0] - r[1] for r in rss), default=0),
            "worker_rss_shmem_bytes": max((r[1] for r in rss), default=0),  # arena pages it touched
        }

    def abort(self) -> None:
        """From the watchdog's thread: fail what is blocked, drop what is queued."""
        if self.engine is not None:
            self.engine.close(cancel_pending=True, timeout=5.0)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def _rss(pid: int) -> tuple[int, int]:
    """(VmRSS, RssShmem) of a process, in bytes; zeros if it is gone."""
    fields: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssShmem"):
                    fields[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        return 0, 0
    return fields.get("VmRSS", 0), fields.get("RssShmem", 0)

