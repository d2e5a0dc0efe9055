"""The harness: start a contender, warm it up, time it, check its outputs, close it.

Start-up (construction to first results) is timed apart from throughput. The warm-up runs
every distinct item once or more and checks each output in full against the serial
reference; the timed run then checks a sample of its outputs after the clock stops, so
checking never slows a contender down, and a contender that skips work cannot pass.
"""

from __future__ import annotations

import math
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psutil

from bench.contenders import Contender, Skipped
from bench.workloads import Feeds, Outputs, Workload, check

SAMPLED_CHECKS = 32  # outputs of the timed run kept and checked after the clock stops
MAX_ITEMS = 2_000_000
STALL_S = 30.0  # no item completed for this long: a hang (only a hang reaches it)


@dataclass
class Measurement:
    workload: str
    contender: str
    workers: int
    status: str = "ok"  # ok | skipped | failed
    items: int = 0
    seconds: float = 0.0
    items_per_s: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    startup_s: float = 0.0  # construction to the first result of every worker
    peak_rss_bytes: int = 0  # sum over the bench's process tree, sampled every 0.1 s
    added_rss_bytes: int = 0  # that peak minus the tree's RSS just before setup: this contender's own
    checked: int = 0  # outputs compared with the serial reference
    other_cores: float = 0.0  # CPU busy outside the bench's process tree during the timed run
    caller_cpu_us: float = 0.0  # CPU per item of the bench's own process: caller + the pool's threads
    workers_cpu_us: float = 0.0  # CPU per item of every other process of the tree (workers, Ray)
    note: str = ""
    error: str = ""
    extras: dict[str, float] = field(default_factory=dict)  # peaks of contender.sample()


def tree_rss() -> int:
    """RSS of this process and all its descendants (shared pages count once per process)."""
    me = psutil.Process()
    total = me.memory_info().rss
    for p in me.children(recursive=True):
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def tree_cpu() -> float:
    """CPU seconds of this process tree: live processes, plus children already reaped. This
    process's own part is `time.process_time()` (nanoseconds; /proc's clock ticks are 10 ms,
    which a quick run of a fast contender can fall under: its CPU read 0)."""
    me = psutil.Process()
    t = me.cpu_times()
    total = time.process_time() + t.children_user + t.children_system
    for p in me.children(recursive=True):
        try:
            c = p.cpu_times()
            total += c.user + c.system
        except psutil.Error:
            pass
    return total


def _own_cpu() -> float:
    """This process's CPU seconds, every thread (`time.process_time()`: see tree_cpu)."""
    return time.process_time()


class OtherLoad:
    """Cores kept busy by processes outside the bench's tree over a window: on a shared
    machine they steal from whoever runs then, so the report shows them next to each number."""

    def __init__(self) -> None:
        self._sys, self._ours = _busy(), tree_cpu()

    def cores(self, wall: float) -> float:
        other = (_busy() - self._sys) - (tree_cpu() - self._ours)
        return max(other, 0.0) / wall if wall > 0 else 0.0


def _busy() -> float:
    t = psutil.cpu_times()
    return float(sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "steal", 0.0)
                 - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0))


class Sampler:
    """A thread that keeps the peak tree RSS and the peaks of `contender.sample()`."""

    def __init__(self, contender: Contender, every: float = 0.1) -> None:
        self.contender, self.every = contender, every
        self.peak_rss = self.baseline = 0
        self.peaks: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self.baseline = tree_rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            self.take()
            if self._stop.wait(self.every):
                return

    def take(self) -> None:
        self.peak_rss = max(self.peak_rss, tree_rss())
        try:
            values = self.contender.sample()
        except Exception:  # not set up yet, or already closed
            return
        for k, v in values.items():
            self.peaks[k] = max(self.peaks.get(k, 0), v)


class Watchdog:
    """Unblocks a hung measurement: when no item has completed for `stall_s` (the harness
    calls `beat()` per item and per phase), abort the contender from this thread, so the run
    reports the hang as a failure instead of stalling forever."""

    def __init__(self, contender: Any, stall_s: float = STALL_S) -> None:
        self.fired = False
        self._contender, self._stall_s = contender, stall_s
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-watchdog", daemon=True)

    def beat(self) -> None:
        self._last = time.monotonic()

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            if time.monotonic() - self._last > self._stall_s:
                self._fire()
                return

    def _fire(self) -> None:
        self.fired = True
        print(f"  watchdog: {self._contender.name} made no progress for {self._stall_s:.0f} s; aborting it",
              flush=True)
        try:
            getattr(self._contender, "abort", self._contender.close)()
        except Exception:
            traceback.print_exc()

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def measure(
    contender: Contender,
    workload: Workload,
    model: str,
    workers: int,
    distinct: list[Feeds],
    refs: list[Outputs],
    seconds: float,
    warm_s: float,
) -> Measurement:
    m = Measurement(workload.name, contender.name, workers, note=contender.note)
    with Sampler(contender) as sampler, Watchdog(contender) as dog:
        try:
            _measure(m, contender, workload, model, workers, distinct, refs, seconds, warm_s, dog)
            sampler.take()
        except Skipped as exc:
            m.status, m.error = "skipped", str(exc)
        except Exception as exc:
            m.status, m.error = "failed", f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        finally:
            contender.close()
        if dog.fired:
            m.status, m.error = "failed", f"hung: no progress for {STALL_S:.0f} s ({m.error})"
    m.peak_rss_bytes, m.extras = sampler.peak_rss, dict(sampler.peaks)
    m.added_rss_bytes = max(sampler.peak_rss - sampler.baseline, 0)
    return m


def _measure(
    m: Measurement, c: Contender, w: Workload, model: str, workers: int,
    distinct: list[Feeds], refs: list[Outputs], seconds: float, warm_s: float, dog: Watchdog,
) -> None:
    k = len(distinct)
    t0 = time.perf_counter()
    c.setup(model, workers)
    first = [i % k for i in range(workers)]
    for i, done in zip(first, c.run([distinct[i] for i in first]), strict=True):
        check(done.outputs, refs[i], f"{c.name} start-up item {i}")
    m.startup_s = time.perf_counter() - t0
    dog.beat()
    rate = _warm_up(m, c, distinct, refs, warm_s, dog)
    n = int(min(max(rate * seconds, 2 * w.window_per_worker * workers, 20), MAX_ITEMS))
    items = w.cycle(distinct, n)
    stride = max(1, n // SAMPLED_CHECKS)
    latencies = np.empty(n)
    kept: list[tuple[int, Any]] = []
    count = 0
    load = OtherLoad()
    own0, tree0 = _own_cpu(), tree_cpu()
    t0 = time.perf_counter()
    beat = dog.beat
    for i, done in enumerate(c.run(items)):
        beat()
        latencies[i] = done.latency
        if i % stride == 0:
            kept.append((i, done.outputs))
        count += 1
    m.seconds = time.perf_counter() - t0
    own, tree = _own_cpu() - own0, tree_cpu() - tree0
    m.other_cores = load.cores(m.seconds)
    m.caller_cpu_us, m.workers_cpu_us = own / max(n, 1) * 1e6, max(tree - own, 0.0) / max(n, 1) * 1e6
    if count != n:
        raise AssertionError(f"{c.name}: {count} results for {n} items")
    for i, out in kept:
        check(out, refs[i % k], f"{c.name} item {i}")
    m.checked += len(kept)
    m.items, m.items_per_s = n, n / m.seconds
    if np.isnan(latencies).all():  # the pool submits by itself (map, imap): no latency per item
        m.p50_ms = m.p99_ms = math.nan
    else:
        m.p50_ms, m.p99_ms = (float(v) * 1e3 for v in np.percentile(latencies, [50, 99]))


def _warm_up(m: Measurement, c: Contender, distinct: list[Feeds], refs: list[Outputs], warm_s: float,
             dog: Watchdog) -> float:
    """Run every distinct item once, checking each output; then run unchecked rounds until
    `warm_s` has passed. Return the items/s of the unchecked rounds (to size the timed run)."""
    t0 = time.perf_counter()
    for i, done in enumerate(c.run(distinct)):
        dog.beat()
        check(done.outputs, refs[i], f"{c.name} warm-up item {i}")
    m.checked += len(distinct)
    rate = len(distinct) / (time.perf_counter() - t0)
    done_items, t1 = 0, time.perf_counter()
    while time.perf_counter() - t0 < warm_s:
        for _ in c.run(distinct):
            dog.beat()
        done_items += len(distinct)
    if done_items:
        rate = done_items / (time.perf_counter() - t1)
    return rate
