"""Ray's ActorPool, one actor (one session) per worker; skipped when `ray` is not importable."""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

from bench.contenders.base import Done, NoSample, Skipped


class Ray(NoSample):
    name = "ray"
    note = ("ray.util.ActorPool, one actor per worker (num_cpus=1), arrays via Ray's object store; "
            "ray.init once per bench run, not counted in start-up")

    def __init__(self, window_per_worker: int) -> None:
        self._per_worker = window_per_worker
        self._pool: Any = None
        self._window = 1
        self._actors: list[Any] = []

    def setup(self, model: str, workers: int) -> None:
        try:
            import ray
            from ray.util import ActorPool
        except ImportError as exc:
            raise Skipped(f"ray is not importable ({exc}); pip install 'slabpool[ray]' to include it") from None

        @ray.remote(num_cpus=1)
        class SessionActor:
            def __init__(self, path: str) -> None:
                from bench.contenders.remote import init_session

                init_session(path)

            def run(self, feeds: Any) -> Any:
                from bench.contenders.remote import run_item

                return run_item(feeds)

        global _init_s
        if not ray.is_initialized():
            t0 = time.perf_counter()
            # address="local": always a private instance, never another process's cluster
            ray.init(address="local", num_cpus=len(os.sched_getaffinity(0)), include_dashboard=False,
                     log_to_driver=False)
            _init_s = time.perf_counter() - t0
        self.note = f"{type(self).note}; ray.init took {_init_s:.1f} s"
        self._window = self._per_worker * workers
        self._actors = [SessionActor.remote(model) for _ in range(workers)]  # type: ignore[attr-defined]
        self._pool = ActorPool(self._actors)

    def run(self, items: Sequence[Any]) -> Iterator[Done]:
        pool, sent = self._pool, deque[float]()
        for item in items:
            sent.append(time.perf_counter())
            pool.submit(lambda actor, v: actor.run.remote(v), item)
            if len(sent) >= self._window:
                out = pool.get_next()
                yield Done(out, time.perf_counter() - sent.popleft())
        while sent:
            out = pool.get_next()
            yield Done(out, time.perf_counter() - sent.popleft())

    def close(self) -> None:
        self._pool = None
        if self._actors:
            import ray

            for actor in self._actors:
                ray.kill(actor)
            self._actors = []


_init_s = 0.0


def shutdown() -> None:
    """Stop the local Ray instance this run started (its processes go with it)."""
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
