"""loky's reusable executor (joblib's process backend)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from bench.contenders.base import Done, FutureHandle, NoSample, windowed
from bench.contenders.remote import init_session, run_item


class Loky(NoSample):
    name = "loky"
    note = "loky.get_reusable_executor, initializer builds the session, arrays pickled"

    def __init__(self, window_per_worker: int) -> None:
        self._per_worker = window_per_worker
        self._pool: Any = None
        self._window = 1

    def setup(self, model: str, workers: int) -> None:
        import loky

        self._window = self._per_worker * workers
        self._pool = loky.get_reusable_executor(max_workers=workers, initializer=init_session,
                                                initargs=(model,), reuse=False)

    def run(self, items: Sequence[Any]) -> Iterator[Done]:
        pool = self._pool
        return windowed(lambda item, on_done: FutureHandle(pool.submit(run_item, item), on_done),
                        items, self._window)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, kill_workers=True)
            self._pool = None
