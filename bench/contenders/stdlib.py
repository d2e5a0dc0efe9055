"""The standard library's pools: concurrent.futures.ProcessPoolExecutor and multiprocessing.Pool.

Both use forkserver; the worker initializer builds the session; arrays travel pickled."""

from __future__ import annotations

import math
import multiprocessing
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from bench.contenders.base import Done, FutureHandle, NoSample, windowed
from bench.contenders.remote import init_session, run_item


class Executor(NoSample):
    name = "ProcessPoolExecutor"
    note = "concurrent.futures, forkserver, initializer builds the session, arrays pickled"

    def __init__(self, window_per_worker: int) -> None:
        self._per_worker = window_per_worker
        self._pool: ProcessPoolExecutor | None = None
        self._window = 1

    def setup(self, model: str, workers: int) -> None:
        self._window = self._per_worker * workers
        self._pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("forkserver"),
                                         initializer=init_session, initargs=(model,))

    def run(self, items: Sequence[Any]) -> Iterator[Done]:
        pool = self._pool
        assert pool is not None
        return windowed(lambda item, on_done: FutureHandle(pool.submit(run_item, item), on_done),
                        items, self._window)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


class MpPool(NoSample):
    name = "mp.Pool"
    note = "multiprocessing.Pool, forkserver, apply_async per item, arrays pickled"

    def __init__(self, window_per_worker: int) -> None:
        self._per_worker = window_per_worker
        self._pool: Any = None
        self._window = 1

    def setup(self, model: str, workers: int) -> None:
        self._window = self._per_worker * workers
        self._pool = multiprocessing.get_context("forkserver").Pool(workers, init_session, (model,))

    def run(self, items: Sequence[Any]) -> Iterator[Done]:
        pool = self._pool

        def start(item: Any, on_done: Any) -> Any:
            return pool.apply_async(run_item, (item,), callback=on_done, error_callback=on_done)

        return windowed(start, items, self._window)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool.join()
            self._pool = None


class MpPoolImap(MpPool):
    name = "mp.Pool imap"
    note = "multiprocessing.Pool.imap, chunksize as Pool.map picks it (items / (4 x workers))"

    def setup(self, model: str, workers: int) -> None:
        super().setup(model, workers)
        self._workers = workers

    def run(self, items: Sequence[Any]) -> Iterator[Done]:
        chunksize = max(1, len(items) // (4 * self._workers))  # Pool.map's own default
        for out in self._pool.imap(run_item, items, chunksize=chunksize):
            yield Done(out, math.nan)  # the pool submits: no per-item latency
