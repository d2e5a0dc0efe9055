"""/metrics: the Prometheus text of every model's engine and of the server's requests.

    one CollectorRegistry
      slabpool_*{model="name"}       each engine's own families (engine.core.metrics.register:
                                     tasks, replays, worker restarts per slot, queue, shm, latency)
      slabpool_serve_requests_total{model, transport, code}     answered requests
      slabpool_serve_request_seconds{model, transport}          their latency, as the server saw it
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from slabpool.engine.core import metrics as engine_metrics

BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class RequestMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._requests = Counter("slabpool_serve_requests", "Requests answered, by model, transport and status code.",
                                 ["model", "transport", "code"], registry=self.registry)
        self._latency = Histogram("slabpool_serve_request_seconds",
                                  "Seconds from a request's arrival to its answer, by model and transport.",
                                  ["model", "transport"], buckets=BUCKETS, registry=self.registry)
        self._children: dict[tuple[str, str, str], tuple[Any, Any]] = {}

    def add_engine(self, name: str, engine: Any) -> None:
        engine_metrics.register(engine, self.registry, labels={"model": name})

    def observe(self, model: str, transport: str, code: str, seconds: float) -> None:
        key = (model, transport, code)
        pair = self._children.get(key)
        if pair is None:  # labels() looks the child up under a lock: once per key, not per request
            pair = self._children[key] = (self._requests.labels(*key), self._latency.labels(model, transport))
        pair[0].inc()
        pair[1].observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
