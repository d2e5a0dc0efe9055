"""The engine's own accounting, rendered in the Prometheus text exposition format (0.0.4).

    eng.stats() (counters, gauges) --+
                                     +--> families(eng) --+--> render(eng)       text
    eng.histograms() ----------------+                    +--> register(eng, r)  prometheus_client

Counters and gauges are read from the engine's ledger (never sampled guesses); histograms are
observed by the supervisor as each task completes with a result. Both outputs are built from
one list of `Family` records, so they cannot disagree. prometheus_client is optional: only
`register` imports it.
"""

from __future__ import annotations

import bisect
import math
import threading
import weakref
from collections import defaultdict, deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from slabpool.engine.core.admission import Counter
from slabpool.engine.core.states import SlotState

if TYPE_CHECKING:
    from slabpool.engine.core.stats import EngineStats
    from slabpool.engine.core.task import Timings

BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PREFIX = "slabpool"


class Histogram:
    """Counts per bucket (not cumulative; the last one is +Inf), sum and count."""

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, value)] += 1  # bound b holds values <= b
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

    def copy(self) -> Histogram:
        h = Histogram()
        h.counts, h.sum, h.count = list(self.counts), self.sum, self.count
        return h

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= it), ending with (inf, count)."""
        out, seen = [], 0
        for bound, c in zip((*BUCKETS, math.inf), self.counts, strict=True):
            seen += c
            out.append((bound, seen))
        return out


class Metrics:
    """What the supervisor observes; thread-safe to read through `snapshot()`."""

    FOLD_EVERY = 4096  # observations kept raw before they go into the buckets

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.queue_wait = Histogram()
        self.run_time = Histogram()
        self.end_to_end = Histogram()
        self.restarts: dict[int, int] = defaultdict(int)
        self._raw: deque[Timings] = deque()  # append and popleft are atomic: no lock per task

    def observe(self, t: Timings) -> None:
        """Per task, on the supervisor's hot path: keep it raw; bucket it in bulk later."""
        self._raw.append(t)
        if len(self._raw) >= self.FOLD_EVERY:
            self._fold()

    def _fold(self) -> None:
        with self._lock:
            raw = self._raw
            for _ in range(len(raw)):
                t = raw.popleft()
                self.queue_wait.observe(t.queued)
                self.run_time.observe(t.run)
                self.end_to_end.observe(t.total)

    def restart(self, slot: int) -> None:
        with self._lock:
            self.restarts[slot] += 1

    def histograms(self) -> dict[str, Histogram]:
        """The live histograms by metric name (read them through `snapshot()` instead)."""
        self._fold()
        return {
            f"{PREFIX}_queue_wait_seconds": self.queue_wait,
            f"{PREFIX}_run_seconds": self.run_time,
            f"{PREFIX}_end_to_end_seconds": self.end_to_end,
        }

    def snapshot(self) -> dict[str, Histogram]:
        """Copies taken under the lock: each histogram's buckets, sum and count agree."""
        hists = self.histograms()
        with self._lock:
            return {name: h.copy() for name, h in hists.items()}


_HISTOGRAM_HELP = {
    f"{PREFIX}_queue_wait_seconds": "Seconds from acceptance to dispatch, per completed task.",
    f"{PREFIX}_run_seconds": "Seconds in the worker (preprocess, run, postprocess), per completed task.",
    f"{PREFIX}_end_to_end_seconds": "Seconds from acceptance to result, per completed task.",
}

_COUNTERS = {  # exposed as slabpool_tasks_<name>_total
    Counter.ACCEPTED: "Tasks accepted.",
    Counter.COMPLETED: "Tasks that ended with a result.",
    Counter.FAILED: "Tasks that ended with an error.",
    Counter.CANCELLED: "Tasks cancelled (by the caller, by close, or superseded).",
    Counter.REPLAYED: "Task replays after a worker died.",
    Counter.QUARANTINED: "Tasks quarantined as poison.",
    Counter.TIMEOUTS: "Tasks that hit their deadline or task_timeout.",
}
_ITEM_COUNTERS = {  # exposed as slabpool_items_<name>_total
    Counter.ITEMS_ACCEPTED: "Items the caller handed in (a submit, a map() item, a row of infer(batch_size=)).",
    Counter.ITEMS_COMPLETED: "Items that ended with a result.",
    Counter.ITEMS_FAILED: "Items that ended with an error.",
    Counter.ITEMS_CANCELLED: "Items cancelled or never run.",
}


# -- one model of what is exposed ---------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    labels: tuple[tuple[str, str], ...]
    value: float


@dataclass(frozen=True)
class Family:
    """One metric family. `name` is the family name: a counter's samples add `_total`."""

    name: str
    kind: str  # "counter", "gauge", "histogram"
    help: str
    samples: tuple[Sample, ...] = ()
    histogram: Histogram | None = None


class Observed(Protocol):
    """What the metrics read of an engine (either backend): its stats and its histograms."""

    def stats(self) -> EngineStats: ...

    def histograms(self) -> dict[str, Histogram]: ...


def families(engine: Observed) -> list[Family]:
    """Every family, from one `stats()` snapshot and one histogram snapshot."""
    st = engine.stats()
    counts = st.counts()
    out = [_family(f"tasks_{c}", "counter", help_, [((), counts[c])]) for c, help_ in _COUNTERS.items()]
    out += [_family(c, "counter", help_, [((), counts[c])]) for c, help_ in _ITEM_COUNTERS.items()]
    out += _slot_families(st)
    out += [
        _family("queue_depth", "gauge", "Tasks accepted and not yet running.", [((), st.queued)]),
        _family("busy_slots", "gauge", "Slots holding work.", [((), sum(s.state == "BUSY" for s in st.slots))]),
        _family("shm_leased_bytes", "gauge", "Shared memory leased, by arena.",
                [((("arena", "inputs"),), st.shm_inputs_used), ((("arena", "outputs"),), st.shm_outputs_used)]),
        _family("shm_capacity_bytes", "gauge", "Shared memory capacity, by arena.",
                [((("arena", "inputs"),), st.shm_capacity), ((("arena", "outputs"),), st.shm_capacity)]),
    ]
    for name, h in engine.histograms().items():
        out.append(Family(name, "histogram", _HISTOGRAM_HELP.get(name, "Seconds per task."), histogram=h))
    return out


def _slot_families(st: EngineStats) -> list[Family]:
    def per_slot(attr: str) -> list[tuple[tuple[tuple[str, str], ...], float]]:
        return [((("slot", str(s.slot)),), getattr(s, attr)) for s in st.slots]

    return [
        _family("worker_restarts", "counter", "Worker restarts per slot (crashes, timeouts, kills, failed starts).",
                per_slot("restarts")),
        _family("worker_rss_bytes", "gauge", "Resident memory of each slot's worker process.", per_slot("rss_bytes")),
        _family("slot_info", "gauge", "1 per slot, labelled with its runtime and the version of its model.",
                [((("slot", str(s.slot)), ("runtime", s.runtime), ("model_version", s.model_version)), 1)
                 for s in st.slots]),
        _family("slots", "gauge", "Slots by lifecycle state.",
                [((("state", state.name),), sum(s.state == state.name for s in st.slots)) for state in SlotState]),
    ]


def _family(name: str, kind: str, help_: str, samples: list[tuple[tuple[tuple[str, str], ...], float]]) -> Family:
    return Family(f"{PREFIX}_{name}", kind, help_, tuple(Sample(labels, value) for labels, value in samples))


# -- the text format ------------------------------------------------------------------------------


def render(engine: Observed) -> str:
    """The Prometheus text format (version 0.0.4) for one engine."""
    lines: list[str] = []
    for fam in families(engine):
        lines.extend(_render_family(fam))
    return "\n".join(lines) + "\n"


def _render_family(fam: Family) -> Iterator[str]:
    exposed = f"{fam.name}_total" if fam.kind == "counter" else fam.name
    yield f"# HELP {exposed} {_escape_help(fam.help)}"
    yield f"# TYPE {exposed} {fam.kind}"
    for s in fam.samples:
        yield f"{exposed}{_labels(s.labels)} {_number(s.value)}"
    if fam.histogram is not None:
        for bound, seen in fam.histogram.cumulative():
            yield f"{fam.name}_bucket{_labels((('le', _number(bound)),))} {seen}"
        yield f"{fam.name}_sum {_number(fam.histogram.sum)}"
        yield f"{fam.name}_count {fam.histogram.count}"


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels) + "}"


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _number(value: float) -> str:
    """A sample value as Prometheus reads it: integers as such, +Inf/-Inf/NaN spelled out."""
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


# -- prometheus_client ------------------------------------------------------------------------------


class EngineCollector:
    """One engine's part of a registry's slabpool metrics: the engine (held weakly: a dropped
    engine exposes nothing and is not kept alive) and the labels added to its samples.
    `unregister()` takes it out of the registry again."""

    def __init__(self, engine: Observed, labels: Mapping[str, str], shared: _RegistryCollector) -> None:
        self._engine = weakref.ref(engine)
        self.labels = dict(labels)
        self._shared = shared

    def families(self) -> Iterator[Any]:
        """This engine's families as prometheus_client metric families (none once it is gone)."""
        engine = self._engine()
        if engine is not None:
            for fam in families(engine):
                yield self._convert(fam)

    def unregister(self) -> None:
        self._shared.remove(self)

    def _convert(self, fam: Family) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        const_names, const_values = list(self.labels), list(self.labels.values())
        if fam.histogram is not None:
            h = fam.histogram
            out: Any = HistogramMetricFamily(fam.name, fam.help, labels=const_names)
            buckets = [(_number(bound), seen) for bound, seen in h.cumulative()]
            out.add_metric(const_values, buckets, h.sum)
            return out
        names = const_names + ([k for k, _ in fam.samples[0].labels] if fam.samples else [])
        cls = CounterMetricFamily if fam.kind == "counter" else GaugeMetricFamily
        out = cls(fam.name, fam.help, labels=names)
        for s in fam.samples:
            out.add_metric(const_values + [v for _, v in s.labels], s.value)
        return out


class _RegistryCollector:
    """The one collector a registry holds for every slabpool engine registered in it: each
    family is exposed once, with the samples of every engine (told apart by their labels).
    One collector per engine would expose each family several times, which the exposition
    format forbids and prometheus_client's name check refuses."""

    def __init__(self, registry: Any) -> None:
        self._registry = registry
        self._members: list[EngineCollector] = []
        self._lock = threading.RLock()  # registering reads collect() on this thread

    def add(self, engine: Observed, labels: Mapping[str, str]) -> EngineCollector:
        with self._lock:
            for m in self._members:
                if m.labels == dict(labels):
                    raise ValueError(
                        f"Duplicated slabpool metrics: an engine with labels {dict(labels)} is already "
                        "registered here; give each engine distinct labels, e.g. labels={'engine': 'name'}")
                if set(m.labels) != set(labels):
                    raise ValueError(f"every engine in one registry needs the same label names: "
                                     f"{sorted(m.labels)} registered, got {sorted(labels)}")
            member = EngineCollector(engine, labels, self)
            self._members.append(member)
            if len(self._members) == 1:
                self._registry.register(self)
            return member

    def remove(self, member: EngineCollector) -> None:
        with self._lock:
            self._members.remove(member)
            if not self._members:
                self._registry.unregister(self)
                _SHARED.pop(self._registry, None)

    def collect(self) -> Iterator[Any]:
        with self._lock:
            members = list(self._members)
        merged: dict[str, Any] = {}
        for member in members:
            for fam in member.families():
                if fam.name in merged:
                    merged[fam.name].samples.extend(fam.samples)
                else:
                    merged[fam.name] = fam
        yield from merged.values()


_SHARED: weakref.WeakKeyDictionary[Any, _RegistryCollector] = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()


def register(engine: Observed, registry: Any = None, *, labels: Mapping[str, str] | None = None) -> EngineCollector:
    """Expose `engine` through prometheus_client: the same families as `render`, read from the
    engine's accounting at each scrape. `registry` defaults to prometheus_client's global one.
    Several engines share a registry when each has its own `labels` (e.g. {"engine": "resnet"}),
    added to every sample of that engine. Undo with `.unregister()` on what this returns."""
    if registry is None:
        from prometheus_client import REGISTRY

        registry = REGISTRY
    with _SHARED_LOCK:
        shared = _SHARED.get(registry)
        if shared is None:
            shared = _SHARED[registry] = _RegistryCollector(registry)
    return shared.add(engine, labels or {})
