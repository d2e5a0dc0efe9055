"""Memory: what a slabpool worker holds beyond the session itself.

The session's own cost is measured in a fresh process (spawn): RSS after importing numpy and
onnxruntime, then after building the session and running a few items. A slabpool worker's RSS
(sampled during the timed run) minus that process's RSS is slabpool's per-worker overhead.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any


@dataclass
class MemoryFigures:
    workload: str
    bare_process_bytes: int = 0  # python + numpy + onnxruntime imported, no session
    session_bytes: int = 0  # RSS growth from building the session and running 3 items
    slabpool_worker_bytes: int = 0  # peak RSS of one slabpool worker, arena pages excluded
    slabpool_worker_shm_bytes: int = 0  # peak of the arena pages counted in that worker's RSS
    overhead_bytes: int = 0  # slabpool worker (arena pages excluded) - (bare process + session)
    shm_in_use_peak_bytes: int = 0  # both arenas, peak during the timed run
    shm_capacity_bytes: int = 0  # both arenas: the configured bound
    workers: int = 0
    error: str = ""


def session_cost(model: str, item: Any) -> tuple[int, int]:
    """(bare process RSS, session RSS growth), measured in a fresh spawned process."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        return ex.submit(_session_cost, model, item).result()  # type: ignore[no-any-return]


def _session_cost(model: str, item: Any) -> tuple[int, int]:
    import onnxruntime  # noqa: F401  (part of the bare process)
    import psutil

    from bench.contenders.remote import init_session, run_item

    me = psutil.Process()
    bare = me.memory_info().rss
    init_session(model)
    for _ in range(3):
        run_item(item)
    return bare, me.memory_info().rss - bare


def memory_figures(workload: str, model: str, item: Any, slabpool_extras: dict[str, float],
                   workers: int) -> MemoryFigures:
    fig = MemoryFigures(workload, workers=workers)
    try:
        fig.bare_process_bytes, fig.session_bytes = session_cost(model, item)
    except Exception as exc:
        fig.error = f"{type(exc).__name__}: {exc}"
        return fig
    fig.slabpool_worker_shm_bytes = int(slabpool_extras.get("worker_rss_shmem_bytes", 0))
    fig.slabpool_worker_bytes = int(slabpool_extras.get("worker_private_rss_bytes", 0))
    if fig.slabpool_worker_bytes:
        fig.overhead_bytes = fig.slabpool_worker_bytes - fig.bare_process_bytes - fig.session_bytes
    fig.shm_in_use_peak_bytes = int(slabpool_extras.get("shm_in_use_bytes", 0))
    fig.shm_capacity_bytes = int(slabpool_extras.get("shm_capacity_bytes", 0))
    return fig
