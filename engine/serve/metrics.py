"""/metrics: the Prometheus text of every model's engine and of the server's requests.

    one CollectorRegistry
      slabpool_*{model="name"}       each engine's own families (engine.core.metrics.register:
                                     tasks, replays, worker restarts per slot, queue, shm, latency)
      slabpool_serve_requests_total{model, transport, code}     answered requests
      slabpool_serve_request_seconds{model, transport}          their latency, as the server saw it

The request families are counted here, not in prometheus_client's Counter and Histogram: an
answered request adds to a plain list (a bucket found by bisect), and the families are built
from those lists when /metrics is read (a custom collector, prometheus_client's documented
way). prometheus_client's own types take a lock and walk their buckets per observation, about
15 us a request on the 2-core host under load (docs/serve.md); this is ~1 us. Both transports
run on the one event loop thread, which is the only thread that counts or renders, so nothing
here needs a lock.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import metrics as client_metrics
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample

from slabpool.engine.core import metrics as engine_metrics

BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LE = [repr(float(b)) for b in BUCKETS] + ["+Inf"]


class _Latency:
    """One (model, transport)'s histogram: counts per bucket (the last is +Inf), their sum, and
    when the series began (its `_created` sample, as prometheus_client's own types give)."""

    __slots__ = ("counts", "created", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum = 0.0
        self.created = time.time()


class RequestMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._requests: dict[tuple[str, str, str], list[float]] = {}  # [count, created]
        self._latency: dict[tuple[str, str], _Latency] = {}
        self.registry.register(self)

    def add_engine(self, name: str, engine: Any) -> None:
        engine_metrics.register(engine, self.registry, labels={"model": name})

    def observe(self, model: str, transport: str, code: str, seconds: float) -> None:
        """One answered request (on the event loop thread)."""
        key = (model, transport, code)
        count = self._requests.get(key)
        if count is None:
            count = self._requests[key] = [0, time.time()]
        count[0] += 1
        hist = self._latency.get((model, transport))
        if hist is None:
            hist = self._latency[(model, transport)] = _Latency()
        hist.counts[bisect.bisect_left(BUCKETS, seconds)] += 1  # bound b holds values <= b
        hist.sum += seconds

    def collect(self) -> Iterator[Metric]:
        """The request families, for prometheus_client's registry (read at /metrics); with
        their `_created` series unless prometheus_client's own are off
        (PROMETHEUS_DISABLE_CREATED_SERIES, disable_created_metrics())."""
        created = getattr(client_metrics, "_use_created", True)
        requests = CounterMetricFamily("slabpool_serve_requests",
                                       "Requests answered, by model, transport and status code.",
                                       labels=["model", "transport", "code"])
        for key, (n, since) in self._requests.items():  # in the order first seen
            requests.add_metric(list(key), n, created=since if created else None)
        yield requests
        latency = HistogramMetricFamily("slabpool_serve_request_seconds",
                                        "Seconds from a request's arrival to its answer, by model and transport.",
                                        labels=["model", "transport"])
        for pair, hist in self._latency.items():
            total, buckets = 0, []
            for le, c in zip(_LE, hist.counts, strict=True):
                total += c
                buckets.append((le, total))
            latency.add_metric(list(pair), buckets, hist.sum)
            if created:
                labels = dict(zip(("model", "transport"), pair, strict=True))
                latency.samples.append(Sample("slabpool_serve_request_seconds_created", labels, hist.created))
        yield latency

    def describe(self) -> list[Metric]:
        return []  # families known only when read: the registry calls collect() on each scrape

    def render(self) -> bytes:
        return generate_latest(self.registry)
