"""Contenders: one module per family, all behind the `Contender` protocol (base.py).

`lineup()` builds them without importing the heavy libraries (loky, pebble, ray): each
module imports its library in `setup`, so pool workers that unpickle
`bench.contenders.remote` stay light."""

from __future__ import annotations

from collections.abc import Callable

from bench.contenders.base import Contender, Done, Skipped
from bench.contenders.inproc import serial, threads
from bench.contenders.loky_pool import Loky
from bench.contenders.pebble_pool import Pebble
from bench.contenders.ray_pool import Ray
from bench.contenders.slabpool import Slabpool
from bench.contenders.stdlib import Executor, MpPool, MpPoolImap

__all__ = ["ALTERNATIVES", "MAPPED", "Contender", "Done", "Skipped", "lineup", "serial"]

BATCH = 32  # slabpool+batch: max_batch_size on tiny workloads

# Every contender the report compares slabpool against (serial is the reference, not one).
ALTERNATIVES = ("ort-threads", "ProcessPoolExecutor", "loky", "pebble", "mp.Pool", "ray")  # not slabpool-ray: ours
MAPPED = ("slabpool map", "mp.Pool imap")  # the whole iterable at once, in chunks: compared with each other


def lineup(window_per_worker: int, tiny: bool) -> list[Callable[[], Contender]]:
    """Factories of the contenders that run at a given worker count (serial runs once apart)."""
    makers: list[Callable[[], Contender]] = [threads, lambda: Slabpool(window_per_worker)]
    if tiny:  # also a whole iterable at once: map() with chunks vs Pool.imap with chunks
        makers += [lambda: Slabpool(window_per_worker, batch=BATCH), lambda: Slabpool(window_per_worker, use_map=True),
                   lambda: MpPoolImap(window_per_worker)]
    for cls in (Executor, Loky, Pebble, MpPool, Ray):
        makers.append(lambda cls=cls: cls(window_per_worker))  # type: ignore[misc]
    makers.append(lambda: Slabpool(window_per_worker, cluster="ray"))  # the Ray backend
    return makers

