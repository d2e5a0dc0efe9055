"""pebble's ProcessPool (keeps the pool when a worker dies, fails that task)."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator, Sequence
from typing import Any

from bench.contenders.base import Done, FutureHandle, NoSample, windowed
from bench.contenders.remote import init_session, run_item


class Pebble(NoSample):
    name = "pebble"
    note = "pebble.ProcessPool, forkserver, schedule per item, arrays pickled"

    def __init__(self, window_per_worker: int) -> None:
        self._per_worker = window_per_worker
        self._pool: Any = None
        self._window = 1

    def setup(self, model: str, workers: int) -> None:
        import pebble

        self._window = self._per_worker * workers
        self._pool = pebble.ProcessPool(max_workers=workers, initializer=init_session, initargs=(model,),
                                        context=multiprocessing.get_context("forkserver"))

    def run(self, items: Sequence[Any]) -> Iterator[Done]:
        pool = self._pool
        return windowed(lambda item, on_done: FutureHandle(pool.schedule(run_item, args=(item,)), on_done),
                        items, self._window)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool.join()
            self._pool = None
