"""What an operator sees: the Prometheus text (parsed back by prometheus_client), the
prometheus_client collector, and worker log records (ids, never data)."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slabpool import Engine
from slabpool.engine.core.metrics import register
from slabpool.workers.errors import SessionRunError, TaskCancelled
from tests.ray_support.plugin import build

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

COUNTERS = ("accepted", "completed", "failed", "cancelled", "replayed", "quarantined", "timeouts")
HISTOGRAMS = ("queue_wait_seconds", "run_seconds", "end_to_end_seconds")
DEADLOCK_S = 60.0
SECRET = 1234.5  # the value of every input element: it must appear in no log record


def rows(n: int, value: float = 0.5) -> np.ndarray:
    return np.full((n, 16), value, dtype=np.float32)


def until(what: Any, why: str) -> None:
    deadline = time.monotonic() + DEADLOCK_S
    while not what():
        assert time.monotonic() < deadline, f"never happened: {why}"
        time.sleep(0.002)


def parsed(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict[str, Any], sample: str, **labels: str) -> float:
    family = re.sub(r"_(total|bucket|sum|count)$", "", sample)
    for s in families[family].samples:
        if s.name == sample and s.labels == labels:
            return float(s.value)
    raise KeyError((sample, labels))


def check_exposition(text: str) -> None:
    """The 0.0.4 text format beyond what the lenient parser checks: HELP then TYPE before a
    family's samples, each family once, counters end in _total, histograms end at +Inf."""
    assert text.endswith("\n")
    typed: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            current = line.split()[2]
            assert current not in typed, f"family {current} appears twice"
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert name == current, f"TYPE {name} without its HELP"
            typed[name] = kind
            if kind == "counter":
                assert name.endswith("_total"), name
            continue
        name = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line)
        assert name is not None, line
        assert re.fullmatch(r'[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_]\w*="[^"\\\n]*",?)*\})? \S+', line), line
        assert current is not None and name.group(0).startswith(current.removesuffix("_total")), line
    for name, kind in typed.items():
        if kind == "histogram":
            assert f'{name}_bucket{{le="+Inf"}}' in text, name


# -- metrics -------------------------------------------------------------------------------------


def test_metrics_text_parses_back_and_matches_stats(models: Any, backend: str) -> None:
    with build(backend, models.mlp, workers=2, preprocess="tests.async_hooks:log_and_feed") as eng:
        for _ in range(10):
            eng.infer({"x": rows(2)})
        for _ in range(2):
            with pytest.raises(SessionRunError):
                eng.infer({"x": rows(1), "fail": True})
        text = eng.metrics_text()
        st = eng.stats()
    check_exposition(text)
    fams = parsed(text)
    for name in COUNTERS:
        assert fams[f"slabpool_tasks_{name}"].type == "counter"
        assert value(fams, f"slabpool_tasks_{name}_total") == getattr(st, name), name
    assert (st.accepted, st.completed, st.failed) == (12, 10, 2)
    for s in st.slots:
        assert value(fams, "slabpool_worker_restarts_total", slot=str(s.slot)) == s.restarts == 0
        assert value(fams, "slabpool_worker_rss_bytes", slot=str(s.slot)) > 0
        labels = {"slot": str(s.slot), "runtime": "onnxruntime", "model_version": s.model_version}
        assert value(fams, "slabpool_slot_info", **labels) == 1
    assert value(fams, "slabpool_slots", state="READY") == 2
    assert value(fams, "slabpool_queue_depth") == 0
    assert value(fams, "slabpool_busy_slots") == 0
    assert value(fams, "slabpool_shm_leased_bytes", arena="inputs") == st.shm_inputs_used == 0
    assert value(fams, "slabpool_shm_capacity_bytes", arena="outputs") == st.shm_capacity
    for h in HISTOGRAMS:
        name = f"slabpool_{h}"
        assert fams[name].type == "histogram"
        buckets = [s for s in fams[name].samples if s.name == f"{name}_bucket"]
        counts = [s.value for s in buckets]
        assert counts == sorted(counts), "buckets are cumulative"
        assert buckets[-1].labels == {"le": "+Inf"}
        assert counts[-1] == value(fams, f"{name}_count") == st.completed
        assert value(fams, f"{name}_sum") > 0


def test_register_exposes_the_same_through_a_registry(models: Any, backend: str) -> None:
    registry = prometheus_client.CollectorRegistry()
    with build(backend, models.mlp, workers=1) as eng:
        collector = register(eng, registry, labels={"engine": "mlp"})
        for _ in range(3):
            eng.infer({"x": rows(1)})
        got = registry.get_sample_value
        assert got("slabpool_tasks_completed_total", {"engine": "mlp"}) == 3
        assert got("slabpool_worker_restarts_total", {"engine": "mlp", "slot": "0"}) == 0
        assert got("slabpool_end_to_end_seconds_count", {"engine": "mlp"}) == 3
        assert got("slabpool_end_to_end_seconds_bucket", {"engine": "mlp", "le": "+Inf"}) == 3
        arena = eng.config.shm_capacity if backend == "local" else 0  # Ray has no arenas (its object store)
        assert got("slabpool_shm_capacity_bytes", {"engine": "mlp", "arena": "inputs"}) == arena
        exposed = parsed(prometheus_client.generate_latest(registry).decode())
        ours = parsed(eng.metrics_text())
        assert set(exposed) == set(ours)
        for name, fam in ours.items():
            assert exposed[name].type == fam.type, name
            mine = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in fam.samples}
            theirs = {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "engine"))): s.value
                      for s in exposed[name].samples if not s.name.endswith("_created")}
            if name == "slabpool_worker_rss_bytes":
                continue  # read twice, a moment apart
            assert theirs == mine, name
        with pytest.raises(ValueError, match="Duplicated"):
            register(eng, registry, labels={"engine": "mlp"})  # the same labels twice: samples would collide
        collector.unregister()
        assert registry.get_sample_value("slabpool_tasks_completed_total", {"engine": "mlp"}) is None


def test_several_labelled_engines_share_one_registry(models: Any, backend: str) -> None:
    registry = prometheus_client.CollectorRegistry()
    with build(backend, models.mlp, workers=1) as a, build(backend, models.tfl_mlp, workers=1) as b:
        ca = register(a, registry, labels={"engine": "a"})
        cb = register(b, registry, labels={"engine": "b"})
        a.infer({"x": rows(1)})
        for _ in range(2):
            b.infer({"x": rows(1)})
        got = registry.get_sample_value
        assert got("slabpool_tasks_completed_total", {"engine": "a"}) == 1
        assert got("slabpool_tasks_completed_total", {"engine": "b"}) == 2
        assert got("slabpool_end_to_end_seconds_count", {"engine": "b"}) == 2
        text = prometheus_client.generate_latest(registry).decode()
        assert text.count("# TYPE slabpool_tasks_completed_total ") == 1  # each family once
        fams = parsed(text)  # the whole exposition parses
        samples = [s for s in fams["slabpool_tasks_completed"].samples if s.name.endswith("_total")]
        assert sorted(s.labels["engine"] for s in samples) == ["a", "b"]
        with pytest.raises(ValueError, match="same label names"):
            register(a, registry, labels={"model": "x"})
        ca.unregister()
        assert got("slabpool_tasks_completed_total", {"engine": "a"}) is None
        assert got("slabpool_tasks_completed_total", {"engine": "b"}) == 2
        cb.unregister()
        assert not list(registry.collect())


def test_histograms_count_only_completed_tasks(models: Any, tmp_path: Path, backend: str) -> None:
    with build(backend, models.mlp, workers=1, inflight_per_slot=1, preprocess="tests.async_hooks:gated") as eng:
        fut = eng.submit({"x": rows(1), "dir": str(tmp_path), "tag": "a", "wait": True})
        until(lambda: (tmp_path / "started-a").exists(), "a running")
        assert eng.cancel(fut)
        with pytest.raises(TaskCancelled):
            fut.result()
        (tmp_path / "open").touch()
        until(lambda: eng.stats().slots[0].tasks_done == 1, "a's run ended")
        fams = parsed(eng.metrics_text())
        assert eng.stats().completed == 0
        assert value(fams, "slabpool_end_to_end_seconds_count") == 0


# -- logs ---------------------------------------------------------------------------------------


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def logs() -> Iterator[Collect]:
    """A handler on the root logger of the test process, at INFO (workers take the level
    the root logger has when the engine starts)."""
    root = logging.getLogger()
    handler, level = Collect(), root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield handler
    root.removeHandler(handler)
    root.setLevel(level)


def no_data(record: logging.LogRecord) -> None:
    """No input data in the record: not in its text (the message, every field's repr), and no
    number field that is the input's value. A number field is compared, not searched for digits:
    clocks and ids (`created`, a pid, Ray's `_ray_timestamp_ns`) hold '1234' by chance (a CI run
    failed on a timestamp ending ...75031234)."""
    for name, value in [("message", record.getMessage()), *sorted(record.__dict__.items())]:
        if isinstance(value, int | float) and not isinstance(value, bool):
            assert value != SECRET, f"input data in a log record's {name}: {value}"
        else:
            assert "1234" not in repr(value), f"input data in a log record's {name}: {value!r}"


def test_user_hook_log_reaches_the_caller_with_ids_and_no_data(models: Any, logs: Collect) -> None:
    ctx = {"tenant": "t-1", "request_id": "r-42", "secret": "s3cr3t"}
    with Engine(models.mlp, workers=1, preprocess="tests.async_hooks:log_and_feed") as eng:
        res = eng.submit({"x": rows(2, SECRET)}, context=ctx).result()
        fut = eng.submit({"x": rows(1, SECRET), "fail": True}, context=ctx)
        with pytest.raises(SessionRunError, match="1234"):  # the caller gets its own data back
            fut.result()
    hook = [r for r in logs.records if r.name == "userhook"]
    assert [r.getMessage() for r in hook] == ["preprocess saw 2 rows", "preprocess saw 1 rows"]
    for r in hook:
        assert r.levelno == logging.WARNING
        assert (r.slot, r.pid, r.tenant, r.request_id) == (0, res.pid, "t-1", "r-42")  # type: ignore[attr-defined]
        assert not hasattr(r, "secret"), "only tenant and request_id leave the context"
    failed = [r for r in logs.records if r.name == "slabpool.workers" and "failed" in r.getMessage()]
    assert len(failed) == 1
    assert (failed[0].task_id, failed[0].slot, failed[0].pid) == (1, 0, res.pid)  # type: ignore[attr-defined]
    for r in logs.records:
        no_data(r)


def test_user_hook_log_carries_task_id_attempt_and_stage(models: Any, logs: Collect) -> None:
    with Engine(models.mlp, workers=1, preprocess="tests.async_hooks:log_and_feed") as eng:
        res = eng.submit({"x": rows(1)}).result()
    (r,) = [r for r in logs.records if r.name == "userhook"]
    assert (r.task_id, r.attempt, r.stage) == (res.task_id, 1, "preprocess")  # type: ignore[attr-defined]


def test_worker_failure_record_carries_attempt_stage_and_error(models: Any, logs: Collect) -> None:
    with Engine(models.mlp, workers=1, preprocess="tests.async_hooks:log_and_feed") as eng:
        with pytest.raises(SessionRunError):
            eng.infer({"x": rows(1), "fail": True}, context={"tenant": "t-1"})
    (r,) = [r for r in logs.records if r.name == "slabpool.workers"]
    assert r.task_id == 0  # type: ignore[attr-defined]
    assert (r.attempt, r.stage, r.error, r.tenant) == (1, "preprocess", "RuntimeError", "t-1")  # type: ignore[attr-defined]
