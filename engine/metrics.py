"""The engine's own accounting, rendered in the Prometheus text exposition format.

Counters and gauges are read from the engine's ledger (never sampled guesses); histograms are
observed by the supervisor as each task ends. `register(engine, registry)` exposes the same
through prometheus_client when it is installed.
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.api import Engine
    from engine.task import Timings

BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, value)] += 1
        self.sum += value
        self.count += 1

    def quantile(self, q: float) -> float:
        """An upper bound of the q-quantile from the buckets (inf past the last)."""
        if not self.count:
            return 0.0
        rank, seen = q * self.count, 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank:
                return BUCKETS[i] if i < len(BUCKETS) else float("inf")
        return float("inf")


class Metrics:
    """What the supervisor observes; thread-safe to read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.queue_wait = Histogram()
        self.run_time = Histogram()
        self.end_to_end = Histogram()
        self.restarts: dict[int, int] = defaultdict(int)

    def observe(self, t: Timings) -> None:
        with self._lock:
            self.queue_wait.observe(t.queued)
            self.run_time.observe(t.run)
            self.end_to_end.observe(t.total)

    def restart(self, slot: int) -> None:
        with self._lock:
            self.restarts[slot] += 1

    def histograms(self) -> dict[str, Histogram]:
        return {
            "slabpool_queue_wait_seconds": self.queue_wait,
            "slabpool_run_seconds": self.run_time,
            "slabpool_end_to_end_seconds": self.end_to_end,
        }


def render(engine: Engine) -> str:
    """The Prometheus text format (version 0.0.4) for one engine."""
    st = engine.stats()
    out: list[str] = []

    def family(name: str, kind: str, help_: str, samples: list[tuple[str, Any]]) -> None:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(f"{name}{labels} {value}" for labels, value in samples)

    for field, help_ in (
        ("accepted", "Tasks accepted."),
        ("completed", "Tasks that ended with a result."),
        ("failed", "Tasks that ended with an error."),
        ("cancelled", "Tasks cancelled (by the caller, by close, or superseded)."),
        ("replayed", "Task replays after a worker died."),
        ("quarantined", "Tasks quarantined as poison."),
        ("timeouts", "Tasks that hit their deadline or task_timeout."),
    ):
        family(f"slabpool_tasks_{field}_total", "counter", help_, [("", getattr(st, field))])
    family("slabpool_worker_restarts_total", "counter", "Worker restarts per slot.",
           [(f'{{slot="{s.slot}"}}', s.restarts) for s in st.slots])
    family("slabpool_queue_depth", "gauge", "Tasks accepted and not yet running.", [("", st.queued)])
    family("slabpool_busy_slots", "gauge", "Slots holding work.", [("", sum(s.state == "BUSY" for s in st.slots))])
    family("slabpool_shm_leased_bytes", "gauge", "Shared memory leased, by arena.",
           [('{arena="inputs"}', st.shm_inputs_used), ('{arena="outputs"}', st.shm_outputs_used)])
    family("slabpool_shm_capacity_bytes", "gauge", "Shared memory capacity, by arena.",
           [('{arena="inputs"}', st.shm_capacity), ('{arena="outputs"}', st.shm_capacity)])
    family("slabpool_worker_rss_bytes", "gauge", "Resident memory per slot.",
           [(f'{{slot="{s.slot}"}}', s.rss_bytes) for s in st.slots])
    for name, h in engine._metrics.histograms().items():
        samples, cum = [], 0
        for bound, c in zip((*BUCKETS, float("inf")), h.counts):
            cum += c
            le = "+Inf" if bound == float("inf") else repr(bound)
            samples.append((f'_bucket{{le="{le}"}}', cum))
        out.append(f"# HELP {name} Seconds per task.")
        out.append(f"# TYPE {name} histogram")
        out.extend(f"{name}{suffix} {v}" for suffix, v in samples)
        out.append(f"{name}_sum {h.sum}")
        out.append(f"{name}_count {h.count}")
    return "\n".join(out) + "\n"
