"""Crash and recovery figures (issue 3): what a SIGKILL of a worker costs.

- cold start: `Engine(model, workers=1)` construction, i.e. one worker from nothing to READY;
- recovery: SIGKILL the worker of an idle one-worker engine and submit one task at once;
  time until `stats()` shows the slot READY on a new pid, and until that task's result lands
  (it can only be served by the rebuilt worker);
- throughput of one engine over the same items with no kills, then with a background thread
  that SIGKILLs a busy worker every second; every output of both runs is checked.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from bench.contenders.base import FutureHandle, windowed
from bench.workloads import Feeds, Outputs, Workload, check

DEADLINE_S = 120.0  # only a hung engine reaches it


@dataclass
class CrashFigures:
    workload: str
    workers: int
    cold_start_s: list[float] = field(default_factory=list)
    recovery_ready_s: list[float] = field(default_factory=list)  # kill -> slot READY, new pid
    recovery_serving_s: list[float] = field(default_factory=list)  # kill -> first result of it
    items: int = 0
    items_per_s_no_kills: float = 0.0
    items_per_s_kill_per_s: float = 0.0
    kills: int = 0
    restarts: int = 0
    replayed: int = 0
    checked: int = 0  # every output of both runs
    error: str = ""

    @property
    def summary(self) -> dict[str, float]:
        med = statistics.median
        return {
            "cold_start_s": med(self.cold_start_s) if self.cold_start_s else 0.0,
            "recovery_ready_s": med(self.recovery_ready_s) if self.recovery_ready_s else 0.0,
            "recovery_serving_s": med(self.recovery_serving_s) if self.recovery_serving_s else 0.0,
            "kill_throughput_ratio": (self.items_per_s_kill_per_s / self.items_per_s_no_kills
                                      if self.items_per_s_no_kills else 0.0),
        }


class _Current:
    """The engine in use, so that the watchdog can abort it if the figures hang."""

    name = "crash figures"
    engine: Any = None
    dog: Any = None

    def abort(self) -> None:
        if self.engine is not None:
            self.engine.close(cancel_pending=True, timeout=5.0)


def crash_figures(w: Workload, model: str, workers: int, distinct: list[Feeds], refs: list[Outputs],
                  seconds: float, trials: int) -> CrashFigures:
    from bench.measure import Watchdog

    fig = CrashFigures(w.name, workers)
    current = _Current()
    with Watchdog(current) as dog:
        current.dog = dog
        try:
            _cold_and_recovery(fig, current, model, distinct, refs, trials)
            _kill_per_second(fig, current, w, model, workers, distinct, refs, seconds)
        except Exception as exc:
            fig.error = f"{type(exc).__name__}: {exc}"
    if dog.fired:
        fig.error = f"hung ({fig.error})"
    return fig


def _cold_and_recovery(fig: CrashFigures, current: _Current, model: str, distinct: list[Feeds], refs: list[Outputs],
                       trials: int) -> None:
    from slabpool import Engine

    for _ in range(trials):
        t0 = time.perf_counter()
        eng = Engine(model, workers=1, start_method="forkserver")
        fig.cold_start_s.append(time.perf_counter() - t0)
        eng.close()
        current.dog.beat()
    with Engine(model, workers=1, start_method="forkserver", max_attempts=10) as eng:
        current.engine = eng
        check(eng.infer(distinct[0]), refs[0], "recovery warm-up")
        for _ in range(trials):
            ready, serving = _one_recovery(eng, distinct[0], refs[0])
            fig.recovery_ready_s.append(ready)
            fig.recovery_serving_s.append(serving)
            current.dog.beat()


def _one_recovery(eng: Any, item: Feeds, ref: Outputs) -> tuple[float, float]:
    old = eng.stats().slots[0].pid
    landed: list[float] = []
    t0 = time.perf_counter()
    os.kill(old, signal.SIGKILL)
    fut: Future[Any] = eng.submit(item)
    fut.add_done_callback(lambda _: landed.append(time.perf_counter()))
    ready = 0.0
    while not (ready and fut.done()):
        if time.perf_counter() - t0 > DEADLINE_S:
            raise TimeoutError("the killed slot did not serve again")
        if not ready:
            slot = eng.stats().slots[0]
            if slot.pid != old and slot.state in ("READY", "BUSY"):
                ready = time.perf_counter() - t0
        time.sleep(0.0005)
    res = fut.result()
    if res.pid == old:
        raise AssertionError("the task after the kill was served by the killed worker")
    check(res.outputs, ref, "recovery task")
    return ready, landed[0] - t0


def _kill_per_second(fig: CrashFigures, current: _Current, w: Workload, model: str, workers: int, distinct: list[Feeds],
                     refs: list[Outputs], seconds: float) -> None:
    from slabpool import Engine

    window = w.window_per_worker * workers
    with Engine(model, workers=workers, start_method="forkserver", max_attempts=50) as eng:
        current.engine = eng
        t0 = time.perf_counter()
        _run_checked(eng, current, distinct, refs, w, window, len(distinct))
        rate = len(distinct) / (time.perf_counter() - t0)
        n = max(int(rate * seconds), 2 * window)
        fig.items = n
        fig.items_per_s_no_kills, checked = _run_checked(eng, current, distinct, refs, w, window, n)
        before = eng.stats()
        killer = _Killer(eng)
        with killer:
            fig.items_per_s_kill_per_s, checked2 = _run_checked(eng, current, distinct, refs, w, window, n)
        after = eng.stats()
        fig.kills = killer.kills
        fig.restarts = after.restarts - before.restarts
        fig.replayed = after.replayed - before.replayed
        fig.checked = checked + checked2


def _run_checked(eng: Any, current: _Current, distinct: list[Feeds], refs: list[Outputs], w: Workload,
                 window: int, n: int) -> tuple[float, int]:
    """Items/s of n items through the engine; every output is checked (after the clock stops)."""
    outs = []
    t0 = time.perf_counter()
    for done in windowed(lambda item, on_done: FutureHandle(eng.submit(item), on_done),
                         w.cycle(distinct, n), window):
        current.dog.beat()
        outs.append(done.outputs.outputs)
    rate = n / (time.perf_counter() - t0)
    for i, out in enumerate(outs):
        check(out, refs[i % len(distinct)], f"kill run item {i}")
    return rate, len(outs)


class _Killer:
    """A thread that SIGKILLs one busy worker every `every` seconds while the block runs."""

    def __init__(self, eng: Any, every: float = 1.0) -> None:
        self.eng, self.every, self.kills = eng, every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-killer", daemon=True)
        self._rng = random.Random(0)

    def __enter__(self) -> _Killer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            busy = [s.pid for s in self.eng.stats().slots if s.state == "BUSY" and s.pid]
            if not busy:
                continue
            try:
                os.kill(self._rng.choice(busy), signal.SIGKILL)
                self.kills += 1
            except ProcessLookupError:
                pass
