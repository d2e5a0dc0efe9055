"""One contract suite, two backends: `Engine(model, workers=2)` and `RayEngine(model, workers=2)`,
and the Ray-only cases (Ray Data, placement, node loss, the Ray docs).

Each `backend` case runs twice: test_x[local] here, test_x[ray] in the confined Ray run
(tests/ray_support/plugin.py draws how; inner.py starts it, beside the rest of the suite). The
other test modules run their behaviour cases on both backends the same way (tests/backends.py
says which, and why the rest do not apply). Skipped, with the reason, when Ray, `unshare`,
`ip` or `mount` is missing, or without root.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import psutil
import pytest

from slabpool import Engine, RayEngine, SignatureChanged
from slabpool.engine.core.states import EngineState
from slabpool.workers import errors as E
from tests.models import onnx_models
from tests.ray_support.plugin import build
from tests.reference import ort_run

HOOK = "tests.ray_support.hooks:staged"


def rows(seed: int, n: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 16)).astype(np.float32)


def assert_mlp(outputs: dict[str, np.ndarray], x: np.ndarray) -> None:
    ref = onnx_models.mlp_reference(x)
    assert set(outputs) == {"probs", "logits"}
    for name, want in ref.items():
        np.testing.assert_allclose(outputs[name], want, rtol=1e-5, atol=1e-5, err_msg=name)


def completions(futs: list[Future[Any]]) -> list[int]:
    """Count how often each Future completes: exactly-once means 1 each."""
    counts = [0] * len(futs)
    for i, f in enumerate(futs):
        f.add_done_callback(lambda _f, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts


def test_results_equal(backend: str, models: SimpleNamespace) -> None:
    xs = [rows(i, n=1 + i % 4) for i in range(12)]
    with build(backend, models.mlp) as eng:
        assert eng.state is EngineState.ACCEPTING
        desc = eng.describe()
        assert [s.name for s in desc.inputs] == ["x"] and desc.batchable
        results = [eng.submit({"x": x}).result(60) for x in xs[:4]] + list(eng.map({"x": x} for x in xs[4:]))
        assert np.array_equal(eng.infer(xs[0])["probs"], results[0].outputs["probs"])  # a bare array
        stats = eng.stats()
    assert eng.state is EngineState.CLOSED
    for x, res in zip(xs, results, strict=True):
        assert_mlp(res.outputs, x)
        assert res.outputs["probs"].flags.writeable  # the caller owns its outputs
    assert [r.task_id for r in results] == list(range(12))
    assert {r.attempts for r in results} == {1}
    assert {r.model_version for r in results} == {desc.model_version} and desc.model_version
    assert all(r.pid > 0 and r.slot in (0, 1) and r.timings.total >= r.timings.run for r in results)
    assert (stats.accepted, stats.completed, stats.failed, stats.replayed) == (13, 13, 0, 0)


def test_blocks_of_many_calls_equal_the_same_blocks_run_serially(backend: str, models: SimpleNamespace) -> None:
    """infer(batch_size=) on either backend: tasks of several session calls of 50 rows each,
    byte-identical to those blocks run one after another (a model whose every output row
    depends on the rows it ran with)."""
    x = np.random.default_rng(7).standard_normal((3001, 16)).astype(np.float32)
    with build(backend, models.centered) as eng:
        eng.infer(x[:1000], batch_size=50)  # the run time per row is known from here on
        before = eng.stats().completed
        got = eng.infer(x, batch_size=50)
        tasks = eng.stats().completed - before
    blocks = [ort_run(models.centered, {"x": x[lo : lo + 50]})["y"] for lo in range(0, 3001, 50)]
    assert got["y"].tobytes() == np.concatenate(blocks).tobytes()
    assert tasks < len(blocks)  # several blocks to a task


def test_metrics_are_the_same_families(backend: str, models: SimpleNamespace) -> None:
    """Both backends share the task ledger: the same counters, the same histograms, the same
    exposition, and prometheus_client registration works on each."""
    import prometheus_client
    from prometheus_client.parser import text_string_to_metric_families

    from slabpool.engine.core.metrics import register

    registry = prometheus_client.CollectorRegistry()
    with build(backend, models.mlp) as eng:
        handle = register(eng, registry, labels={"backend": backend})
        for i in range(5):
            eng.infer({"x": rows(i)})
        fams = {f.name: f for f in text_string_to_metric_families(eng.metrics_text())}
        assert registry.get_sample_value("slabpool_tasks_completed_total", {"backend": backend}) == 5
        assert registry.get_sample_value("slabpool_end_to_end_seconds_count", {"backend": backend}) == 5
        assert set(eng.histograms()) == {"slabpool_queue_wait_seconds", "slabpool_run_seconds",
                                         "slabpool_end_to_end_seconds"}
        handle.unregister()
    counted = {s.name: s.value for s in fams["slabpool_end_to_end_seconds"].samples}
    assert counted["slabpool_end_to_end_seconds_count"] == 5
    from slabpool import Engine as Local

    with Local(models.mlp, workers=1, start_method="spawn") as local:  # no forkserver left in a netns
        expected = {f.name: f.type for f in text_string_to_metric_families(local.metrics_text())}
    assert {name: f.type for name, f in fams.items()} == expected


def test_the_backends_offer_the_same_methods() -> None:
    public = lambda cls: {n for n in dir(cls) if not n.startswith("_")}  # noqa: E731
    assert public(Engine) - public(RayEngine) == set()
    assert public(RayEngine) - public(Engine) == {"placement"}  # where Ray put each actor


def test_input_contract_errors_at_submit(backend: str, models: SimpleNamespace) -> None:
    with build(backend, models.mlp) as eng:
        with pytest.raises(E.InputContractError, match="dtype"):
            eng.submit({"x": rows(0).astype(np.float64)})
        with pytest.raises(E.InputContractError, match="input names"):
            eng.submit({"y": rows(0)})
        with pytest.raises(ValueError, match="axis 1 must be 16"):
            eng.submit({"x": np.zeros((2, 15), np.float32)})
        assert eng.stats().accepted == 0


def test_submit_after_close(backend: str, models: SimpleNamespace) -> None:
    eng = build(backend, models.mlp)
    eng.close()
    eng.close()  # idempotent
    assert eng.state is EngineState.CLOSED
    with pytest.raises(E.EngineClosed):
        eng.submit({"x": rows(0)})
    assert repr(eng).split()[1] == "CLOSED"


def test_cancel_queued_task(backend: str, models: SimpleNamespace, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    with build(backend, models.mlp, preprocess=HOOK, inflight_per_slot=2) as eng:
        blockers = [eng.submit({"x": rows(i), "gate": str(gate)}) for i in range(4)]  # fill 2 slots x 2
        victim = eng.submit({"x": rows(9)})
        assert eng.cancel(victim)
        assert victim.cancelled()
        gate.touch()
        for i, f in enumerate(blockers):
            assert_mlp(f.result(60).outputs, rows(i))
        stats = eng.stats()
    assert (stats.accepted, stats.completed, stats.cancelled) == (5, 4, 1)


def test_cancel_running_task_with_kill(backend: str, models: SimpleNamespace, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    with build(backend, models.mlp, preprocess=HOOK, inflight_per_slot=1) as eng:
        futs = [eng.submit({"x": rows(i), "gate": str(gate)}) for i in range(3)]  # 2 running, 1 queued
        wait_until(lambda: eng.stats().queued == 1)
        assert eng.cancel(futs[0], kill=True)
        with pytest.raises(E.TaskCancelled):
            futs[0].result(60)
        gate.touch()
        for i in (1, 2):
            assert_mlp(futs[i].result(60).outputs, rows(i))
        wait_until(lambda: eng.stats().restarts == 1)  # the killed slot is rebuilt, asynchronously
        stats = eng.stats()
    assert (stats.completed, stats.cancelled, stats.failed, stats.restarts) == (2, 1, 0, 1)


def wait_until(cond: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout  # only a deadlock reaches it
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_sigkill_mid_task_is_replayed_once(backend: str, models: SimpleNamespace, tmp_path: Path) -> None:
    xs = [rows(i) for i in range(8)]
    with build(backend, models.mlp, preprocess=HOOK) as eng:
        futs = [eng.submit({"x": x, "kill_once": str(tmp_path / "killed")} if i == 3 else {"x": x})
                for i, x in enumerate(xs)]
        counts = completions(futs)
        results = [f.result(60) for f in futs]
        stats = eng.stats()
    assert (tmp_path / "killed").exists()
    for x, res in zip(xs, results, strict=True):
        assert_mlp(res.outputs, x)
    assert results[3].attempts == 2
    assert {r.attempts for r in results} <= {1, 2}
    assert counts == [1] * 8
    assert [r.task_id for r in results] == list(range(8))
    assert (stats.accepted, stats.completed, stats.failed, stats.restarts) == (8, 8, 0, 1)
    assert stats.replayed >= 1


def test_poison_task_is_quarantined(backend: str, models: SimpleNamespace) -> None:
    xs = [rows(i) for i in range(6)]
    with build(backend, models.mlp, preprocess=HOOK, max_attempts=2) as eng:
        futs = [eng.submit({"x": x, "poison": True} if i == 2 else {"x": x}) for i, x in enumerate(xs)]
        with pytest.raises(E.PoisonTask) as info:
            futs[2].result(60)
        others = [f.result(60) for i, f in enumerate(futs) if i != 2]
        stats = eng.stats()
    assert info.value.task_id == 2
    assert len(info.value.crashes) == 2 and all(isinstance(c, E.Crash) for c in info.value.crashes)
    for x, res in zip(xs[:2] + xs[3:], others, strict=True):
        assert_mlp(res.outputs, x)
    assert (stats.completed, stats.failed, stats.quarantined) == (5, 1, 1)


def test_an_engine_dropped_without_close_is_collected_and_stops(backend: str, models: SimpleNamespace) -> None:
    """Nothing the owner thread keeps refers to the engine: dropped, it is collected at once
    (a Future kept by the caller refers to it weakly), says so, and stops its workers/actors."""
    import gc
    import warnings
    import weakref

    eng = build(backend, models.mlp)
    kept = eng.submit({"x": rows(0)})
    kept.result(60)
    pids = [s.pid for s in eng.stats().slots]
    ref = weakref.ref(eng)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del eng
        gc.collect()
    assert ref() is None and kept.done()
    assert any(issubclass(w.category, ResourceWarning) and "without close()" in str(w.message) for w in caught)
    wait_until(lambda: not any(_running(p) for p in pids), timeout=60)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# -- hot model swaps --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def v2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return onnx_models.mlp(tmp_path_factory.mktemp("v2") / "mlp_v2.onnx", seed=1)


def _load(eng: Any, xs: list[np.ndarray], out: list[tuple[np.ndarray, Future[Any]]], stop: threading.Event) -> None:
    i = 0
    while not stop.is_set():
        out.append((xs[i % len(xs)], eng.submit({"x": xs[i % len(xs)]})))
        i += 1
        time.sleep(0.002)  # a steady stream, not a queue that grows for the whole swap


@pytest.mark.parametrize("drain", [True, False])
def test_reload_under_load_loses_nothing_and_tags_every_result(
    backend: str, models: SimpleNamespace, v2: Path, drain: bool
) -> None:
    xs = [rows(i, n=2) for i in range(8)]
    with build(backend, models.mlp) as eng:
        v1 = eng.model_version
        submitted: list[tuple[np.ndarray, Future[Any]]] = []
        stop = threading.Event()
        t = threading.Thread(target=_load, args=(eng, xs, submitted, stop))
        t.start()
        try:
            new = eng.reload(v2, drain_slot=drain, timeout=120)
        finally:
            stop.set()
            t.join()
        after = eng.submit({"x": xs[0]}).result(timeout=60)
        st = eng.stats()
    assert new != v1 and eng.model_version == new and after.model_version == new
    assert {s.model_version for s in st.slots} == {new} and st.failed == 0
    refs = {v1: models.mlp, new: v2}
    versions = set()
    for x, fut in submitted:
        res = fut.result(timeout=60)
        versions.add(res.model_version)
        assert res.outputs["probs"].tobytes() == ort_run(refs[res.model_version], {"x": x})["probs"].tobytes()
    assert versions <= {v1, new} and submitted


def test_a_model_that_does_not_load_leaves_the_old_one_serving(
    backend: str, models: SimpleNamespace, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"garbage")
    with build(backend, models.mlp) as eng:
        v1 = eng.model_version
        with pytest.raises(E.SessionInitError, match="old model keeps serving"):
            eng.reload(bad, timeout=120)
        results = [eng.submit({"x": rows(i)}).result(timeout=60) for i in range(20)]
        st = eng.stats()
    assert {r.model_version for r in results} == {v1} and eng.model_version == v1
    assert {s.model_version for s in st.slots} == {v1} and st.failed == 0


def test_a_rollback_whose_slot_fails_once_still_puts_the_old_model_back_everywhere(
    backend: str, models: SimpleNamespace, v2: Path, tmp_path: Path
) -> None:
    """Starts 1-2 build the engine; 3 swaps slot 0 to v2; 4 refuses v2 on slot 1 (the swap
    fails); 5 refuses slot 1's start back on v1 once. The rollback goes on to slot 0 all the
    same (it stopped there, and slot 0 served v2 for good while reload() said the old model
    serves), and slot 1 starts on v1 after its back-off."""
    with build(backend, models.mlp, initializer="tests.owner_hooks:refuse_rebuilt",
               initargs=(str(tmp_path), 4, 5)) as eng:
        v1 = eng.model_version
        with pytest.raises(E.SessionInitError, match="old model keeps serving"):
            eng.reload(v2, timeout=120)
        assert (tmp_path / "started-5").exists()  # the rollback's refused start happened
        wait_until(lambda: [(s.state, s.model_version) for s in eng.stats().slots] == [("READY", v1)] * 2)
        results = [eng.submit({"x": rows(i)}).result(timeout=60) for i in range(20)]
        assert eng.model_version == v1
    assert {r.model_version for r in results} == {v1}
    for i, res in enumerate(results):
        assert res.outputs["probs"].tobytes() == ort_run(models.mlp, {"x": rows(i)})["probs"].tobytes()


def test_signature_change_is_refused_unless_allowed(backend: str, models: SimpleNamespace) -> None:
    image = np.ones((1, 3, 16, 16), np.float32)
    with build(backend, models.mlp) as eng:
        v1 = eng.model_version
        with pytest.raises(SignatureChanged, match="signature differs"):
            eng.reload(models.convnet, timeout=120)
        assert eng.model_version == v1 and {s.model_version for s in eng.stats().slots} == {v1}
        assert_mlp(eng.infer({"x": rows(1)}), rows(1))
        new = eng.reload(models.convnet, allow_signature_change=True, timeout=120)
        out = eng.submit({"image": image}).result(timeout=60)
        with pytest.raises(E.InputContractError):
            eng.submit({"x": rows(1)})  # the old model's inputs are refused at the door now
    assert new != v1 and out.model_version == new and out.outputs["probs"].shape == (1, 10)


def test_a_slot_rebuilt_after_a_reload_runs_the_new_model(
    backend: str, models: SimpleNamespace, v2: Path, tmp_path: Path
) -> None:
    """A worker (an actor) that dies after the swap comes back on the new model."""
    with build(backend, models.mlp, preprocess=HOOK) as eng:
        new = eng.reload(v2, timeout=120)
        res = eng.submit({"x": rows(3), "kill_once": str(tmp_path / "killed")}).result(60)
        wait_until(lambda: eng.stats().restarts == 1)
        later = [eng.submit({"x": rows(i)}).result(60) for i in range(6)]
        st = eng.stats()
    assert res.attempts == 2 and res.model_version == new
    assert {r.model_version for r in later} == {new} and {s.model_version for s in st.slots} == {new}
    assert res.outputs["probs"].tobytes() == ort_run(v2, {"x": rows(3)})["probs"].tobytes()


def test_a_reload_that_outlives_its_timeout_still_takes_effect(backend: str, models: SimpleNamespace) -> None:
    """reload(timeout=) stops waiting, the swap goes on, and when it ends the engine takes the
    new model: its inputs at submit(), its version."""
    image = np.ones((1, 3, 16, 16), np.float32)
    with build(backend, models.mlp) as eng:
        v1 = eng.model_version
        with pytest.raises(TimeoutError, match="it goes on"):
            eng.reload(models.convnet, allow_signature_change=True, timeout=0.001)  # a slot takes longer
        wait_until(lambda: eng.model_version != v1, timeout=120)
        out = eng.submit({"image": image}).result(timeout=60)
        assert [s.name for s in eng.describe().inputs] == ["image"]
        assert {s.model_version for s in eng.stats().slots} == {eng.model_version}
    assert out.model_version == eng.model_version and out.outputs["probs"].shape == (1, 10)


def test_reload_after_close_is_refused(backend: str, models: SimpleNamespace, v2: Path) -> None:
    eng = build(backend, models.mlp)
    eng.close()
    with pytest.raises(E.EngineClosed):
        eng.reload(v2, timeout=60)
    with pytest.raises(FileNotFoundError, match="model file not found"):
        eng.reload(v2.parent / "missing.onnx")


def test_task_timeout_and_recycling_hold_on_both_backends(backend: str, models: SimpleNamespace,
                                                           tmp_path: Path) -> None:
    """The owner's timers and recycling are the same code on both backends (engine.core):
    a task past task_timeout fails alone with TaskTimeout and its slot is rebuilt; every
    incarnation serves max_tasks_per_worker tasks at most, then is replaced."""
    with build(backend, models.mlp, preprocess=HOOK, task_timeout=1.0, max_tasks_per_worker=3) as eng:
        hung = eng.submit({"x": rows(0), "gate": str(tmp_path / "never")})  # holds its slot for good
        with pytest.raises(E.TaskTimeout, match=r"task_timeout=1\.0"):
            hung.result(60)
        results = [eng.submit({"x": rows(i)}).result(60) for i in range(8)]
        st = eng.stats()
    for i, res in enumerate(results):
        assert_mlp(res.outputs, rows(i))
    assert (st.timeouts, st.failed, st.completed) == (1, 1, 8)
    assert len({r.pid for r in results}) >= 3  # 8 tasks, 3 an incarnation: recycled


def test_batching_and_the_byte_bound_hold_on_both_backends(backend: str, models: SimpleNamespace,
                                                            tmp_path: Path) -> None:
    """Dynamic batching and admission's byte bound are the owner's and the queue's, the same
    on both backends: with both slots held, a second large input waiting is refused
    (admission="reject", queue_bytes), and small ones that wait run stacked, with each
    task's own outputs."""
    gate = tmp_path / "gate"
    big = np.zeros((6000, 16), np.float32)  # 384 KB
    with build(backend, models.mlp, preprocess=HOOK, max_batch_size=4, inflight_per_slot=1,
               admission="reject", queue_bytes=600_000) as eng:
        held = []
        for i in range(2):  # one on each slot (submitted together, they would run stacked on one)
            held.append(eng.submit({"x": rows(i), "gate": str(gate)}))
            wait_until(lambda: eng.stats().queued == 0)
        waiting = eng.submit({"x": big})
        with pytest.raises(E.QueueFull, match="bytes waiting"):
            eng.submit({"x": big})
        small = [eng.submit({"x": rows(10 + i, n=1)}) for i in range(8)]
        gate.touch()
        results = [f.result(60) for f in held + small]
        assert waiting.result(60).outputs["probs"].shape == (6000, 8)
        st = eng.stats()
    for i, res in enumerate(results[2:]):
        assert_mlp(res.outputs, rows(10 + i, n=1))
    assert st.stacked_batches >= 1 and st.failed == 0


def test_a_stalled_slot_hands_on_what_it_was_sent_on_both_backends(
    backend: str, models: SimpleNamespace, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """stall_after is the owner's watchdog on both backends: a slot whose running task makes
    no progress gets no more work, and what was sent ahead to it runs on the other slot
    (locally on copies of its inputs; on Ray the stalled call's answer is dropped)."""
    gate = tmp_path / "gate"
    with caplog.at_level("WARNING", logger="slabpool.engine"), \
            build(backend, models.mlp, preprocess=HOOK, stall_after=1.0, inflight_per_slot=2) as eng:
        held = eng.submit({"x": rows(0), "gate": str(gate)})
        others = [eng.submit({"x": rows(i)}) for i in range(1, 7)]  # some sent ahead behind it
        results = [f.result(30) for f in others]  # (behind it, they would wait for the gate: 60 s)
        assert not held.done()
        gate.touch()
        assert_mlp(held.result(60).outputs, rows(0))
        st = eng.stats()
    for i, res in enumerate(results, 1):
        assert_mlp(res.outputs, rows(i))
    assert "has made no progress for" in caplog.text and (st.completed, st.failed) == (7, 0)


# -- Ray only -----------------------------------------------------------------------------------


def test_ray_data_adapter(ray_only: SimpleNamespace | None, models: SimpleNamespace) -> None:
    import ray.data

    from slabpool.engine.ray.data import SlabpoolPredictor

    x = rows(7, n=48)
    ds = ray.data.from_items([{"id": i, "x": x[i]} for i in range(48)])
    out = ds.map_batches(
        SlabpoolPredictor,
        fn_constructor_kwargs={"model": str(models.mlp)},
        compute=ray.data.ActorPoolStrategy(size=2), num_cpus=0.5, batch_size=16, batch_format="numpy",
    ).take_all()
    got = sorted(out, key=lambda r: int(r["id"]))
    assert [int(r["id"]) for r in got] == list(range(48))
    assert set(got[0]) == {"id", "probs", "logits"}
    assert_mlp({"probs": np.stack([r["probs"] for r in got]), "logits": np.stack([r["logits"] for r in got])}, x)


def _read_back(ds: Any, models: SimpleNamespace, x: np.ndarray, batch_format: str) -> None:
    """Run the adapter over `ds` (columns id, x) and check every row against the reference."""
    import ray.data

    from slabpool.engine.ray.data import SlabpoolPredictor

    out = ds.map_batches(
        SlabpoolPredictor, fn_constructor_kwargs={"model": str(models.mlp)},
        compute=ray.data.ActorPoolStrategy(size=1), num_cpus=0.5, batch_size=16, batch_format=batch_format,
    ).take_all()
    got = sorted(out, key=lambda r: int(r["id"]))
    assert [int(r["id"]) for r in got] == list(range(len(x)))
    assert_mlp({"probs": np.stack([r["probs"] for r in got]), "logits": np.stack([r["logits"] for r in got])}, x)


@pytest.mark.parametrize(("layout", "batch_format"), [
    ("fixed_size_list", "numpy"), ("list", "pandas"), ("tensor", "numpy"), ("fixed_size_list", "pandas"),
])  # fmt: skip
def test_ray_data_reads_vector_columns_of_parquet(
    ray_only: SimpleNamespace | None, models: SimpleNamespace, tmp_path: Path, layout: str, batch_format: str
) -> None:
    """A Parquet column of lists, fixed-size lists (what docs/cli.md describes for vector
    inputs) or Ray's tensor extension feeds input x [N, 16], in numpy and pandas batches."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray.data

    x = rows(11, n=40)
    path = tmp_path / "in.parquet"
    if layout == "tensor":  # Ray writes its own tensor extension type
        ray.data.from_items([{"id": i, "x": x[i]} for i in range(40)]).write_parquet(str(path))
    else:
        flat = pa.array(x.reshape(-1), pa.float32())
        column = (pa.FixedSizeListArray.from_arrays(flat, 16) if layout == "fixed_size_list"
                  else pa.ListArray.from_arrays(pa.array(np.arange(0, 16 * 41, 16), pa.int32()), flat))
        pq.write_table(pa.table({"id": np.arange(40), "x": column}), path)
    _read_back(ray.data.read_parquet(str(path)), models, x, batch_format)


def test_ray_data_takes_pandas_frames(ray_only: SimpleNamespace | None, models: SimpleNamespace) -> None:
    import pandas as pd
    import ray.data

    x = rows(12, n=24)  # (lists of Python floats are float64: refused, see the plain-callable cases)
    frame = pd.DataFrame({"id": np.arange(24), "x": list(x)})  # an object column of float32 arrays
    _read_back(ray.data.from_pandas(frame), models, x, "pandas")


def test_ray_data_predictor_is_a_plain_callable(models: SimpleNamespace) -> None:
    """The adapter needs no Ray to be called: session, contract check and hooks, per batch."""
    from slabpool.engine.ray.data import SlabpoolPredictor

    x = rows(3, n=5)
    batch = {"id": np.arange(5), "x": x}
    labelled = SlabpoolPredictor(models.mlp, postprocess="tests.ray_support.hooks:label")(batch)
    assert np.array_equal(labelled["id"], batch["id"])
    assert np.array_equal(labelled["label"], onnx_models.mlp_reference(x)["probs"].argmax(axis=-1))
    plain = SlabpoolPredictor(models.mlp)(batch)
    assert list(plain) == ["id", "probs", "logits"]
    with pytest.raises(E.InputContractError, match="dtype"):
        SlabpoolPredictor(models.mlp)({"x": x.astype(np.float64)})


@pytest.mark.parametrize("form", ["object column", "pandas", "pandas of lists", "pyarrow fixed_size_list"])
def test_ray_data_predictor_stacks_columns_of_vectors(models: SimpleNamespace, form: str) -> None:
    """Batches as Ray Data hands them over for list columns: an object array of arrays, a
    DataFrame (arrays or lists in the cells), a pyarrow Table: one [N, 16] input each."""
    import pandas as pd
    import pyarrow as pa

    from slabpool.engine.ray.data import SlabpoolPredictor

    x = rows(5, n=6)
    cells = np.empty(6, object)
    cells[:] = list(x)
    batch: Any = {"object column": {"id": np.arange(6), "x": cells},
                  "pandas": pd.DataFrame({"id": np.arange(6), "x": list(x)}),
                  "pandas of lists": pd.DataFrame({"id": np.arange(6), "x": [np.float32(r).tolist() for r in x]}),
                  "pyarrow fixed_size_list": pa.table({"id": np.arange(6), "x": pa.FixedSizeListArray.from_arrays(
                      pa.array(x.reshape(-1)), 16)})}[form]
    if form == "pandas of lists":  # Python floats: float64 values, refused for a float32 input
        with pytest.raises(E.InputContractError, match=r"input 'x': expected dtype <f4 \(float32\), got <f8"):
            SlabpoolPredictor(models.mlp)(batch)
        return
    out = SlabpoolPredictor(models.mlp)(batch)
    assert np.array_equal(np.asarray(out["id"]), np.arange(6))
    assert_mlp({"probs": out["probs"], "logits": out["logits"]}, x)


@pytest.mark.parametrize(("cells", "error"), [
    ([np.zeros(16, np.float32), np.zeros(15, np.float32)], r"ragged column: row 0 has shape \(16,\), row 1 has \(15,\)"),
    ([np.zeros(16, np.float32), np.zeros(16, np.float64)], "row 0 holds float32, row 1 holds float64"),
    ([np.zeros(16, np.float32), ["a"] * 16], "row 1"),
])  # fmt: skip
def test_ray_data_predictor_refuses_ragged_columns(models: SimpleNamespace, cells: list[Any], error: str) -> None:
    from slabpool.engine.ray.data import SlabpoolPredictor

    column = np.empty(len(cells), object)
    column[:] = cells
    with pytest.raises(E.InputContractError, match=f"input 'x': .*{error}"):
        SlabpoolPredictor(models.mlp)({"id": np.arange(len(cells)), "x": column})
    with pytest.raises(TypeError, match="SlabpoolPredictor\\(\\) got an unexpected setting 'max_workers'"):
        SlabpoolPredictor(models.mlp, max_workers=2)


@pytest.mark.parametrize("setting", [{"start_method": "spawn"}, {"shm_capacity": 1 << 26},
                                     {"shm_backend": "posix"}, {"in_place_min_bytes": 0}, {"spin_us": 0}])
def test_a_setting_that_means_nothing_on_ray_is_refused_by_name(
    ray_only: SimpleNamespace | None, models: SimpleNamespace, setting: dict[str, Any]
) -> None:
    name = next(iter(setting))
    with pytest.raises(ValueError, match=f"{name}=.* does not apply to the Ray backend: "):
        RayEngine(models.mlp, **setting)


@pytest.mark.parametrize("options", [{"max_restarts": 0}, {"max_task_retries": -1}, {"max_concurrency": 4}])
def test_actor_options_that_would_take_over_recovery_are_refused(
    ray_only: SimpleNamespace | None, models: SimpleNamespace, options: dict[str, Any]
) -> None:
    """Was: merged over the engine's own, so max_restarts=0 left a crashed slot STARTING with
    every Future hung, and max_task_retries=-1 had Ray retry a poison task for ever."""
    name = next(iter(options))
    with pytest.raises(ValueError, match=rf"actor_options \['{name}'\] are the engine's"):
        RayEngine(models.mlp, actor_options=options)  # (before Ray starts; a function's: at each actor)
    from slabpool.engine.ray.transport import check_actor_options

    assert check_actor_options({"num_gpus": 1, "resources": {"x": 1}}) == {"num_gpus": 1, "resources": {"x": 1}}


def test_outputs_in_a_postprocess_object_come_back_writable_on_both(
    backend: str, models: SimpleNamespace
) -> None:
    """A postprocess's own object holding an output large enough for Ray's zero-copy read (was:
    read-only on Ray, a view into the object store; writable locally)."""
    x = rows(5, n=20_000)
    with build(backend, models.mlp, workers=1, postprocess="tests.ray_support.hooks:boxed") as eng:
        got = eng.infer({"x": x})
    assert type(got).__name__ == "Boxed" and got.probs.flags.writeable
    got.probs[0, 0] = 1.0


def test_inputs_that_do_not_pickle_are_refused_at_submit_on_both(backend: str, models: SimpleNamespace) -> None:
    """With a preprocess the inputs' objects cross as they are: one plain pickle cannot take
    (a lambda) is refused at submit, as locally (was: taken by Ray's cloudpickle, and run)."""
    with build(backend, models.mlp, workers=1, preprocess=HOOK) as eng:
        with pytest.raises(E.TaskDataError, match="the inputs"):
            eng.submit({"x": rows(0), "how": lambda: 1})
        assert eng.stats().accepted == 0
        assert_mlp(eng.infer({"x": rows(1)}), rows(1))


def test_more_slots_than_local_cpus_is_no_local_warning_on_ray(
    ray_only: SimpleNamespace | None, models: SimpleNamespace
) -> None:
    """RayEngine(workers=3) on a 2-CPU host whose cluster holds them (0.5 CPU a slot): no
    warning about this process's CPUs, which is the local engine's (its workers share them).
    Was: "workers=3 but this process may use 2 CPUs" for actors that run on the cluster's."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with RayEngine(models.mlp, workers=3, cpus_per_slot=0.5) as eng:
            assert_mlp(eng.infer({"x": rows(0)}), rows(0))
    assert not [w for w in seen if "this process may use" in str(w.message)]


def test_a_slot_that_cannot_be_placed_stays_starting(
    ray_only: SimpleNamespace | None, models: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    """3 slots of 1 CPU on a 2-CPU cluster: the engine starts with the 2 that fit, says which
    resource the third lacks, and serves; the third stays STARTING (docs/ray.md)."""
    with caplog.at_level("WARNING", logger="slabpool.engine.ray"), \
            RayEngine(models.mlp, workers=3, cpus_per_slot=1, startup_timeout=60) as eng:
        states = sorted(s.state for s in eng.stats().slots)
        results = list(eng.map({"x": rows(i)} for i in range(6)))
    assert states == ["READY", "READY", "STARTING"]
    assert "holds 2 of 3 slots: each asks CPU=1, the cluster has CPU=2 in all" in caplog.text
    for i, res in enumerate(results):
        assert_mlp(res.outputs, rows(i))
        assert res.index == i


def test_a_slot_whose_actor_is_ray_killed_comes_back(ray_only: SimpleNamespace | None, models: SimpleNamespace) -> None:
    """ray.kill() of a slot's actor (Ray's default: no restart): the next task's call fails,
    the slot is rebuilt with a new actor and the task replays, once. Was: the slot pinged the
    dead actor for ever, STARTING for good, and its tasks never ended."""
    import ray

    with RayEngine(models.mlp, workers=1) as eng:
        assert_mlp(eng.infer({"x": rows(0)}), rows(0))
        ray.kill(eng._transport._actors[0].handle)  # type: ignore[attr-defined]
        fut = eng.submit({"x": rows(1)})
        counts = completions([fut])
        res = fut.result(120)
        assert_mlp(eng.infer({"x": rows(2)}), rows(2))
        st = eng.stats()
    assert_mlp(res.outputs, rows(1))
    assert counts == [1] and st.failed == 0 and [s.state for s in st.slots] == ["READY"]


def test_an_actor_that_dies_as_it_starts_is_not_blamed_on_resources(
    ray_only: SimpleNamespace | None, models: SimpleNamespace
) -> None:
    """An initializer that kills its actor (Ray restarts it for ever, each time dying again):
    at startup_timeout the error says the actors died or hung as they started, with room for
    them. Was: "the cluster lacks the resources", with CPUs free."""
    with pytest.raises(E.SessionInitError, match="died or hung as it started") as info:
        RayEngine(models.mlp, workers=1, initializer="os:_exit", initargs=(3,), startup_timeout=5)
    assert "lacks the resources" not in str(info.value)


RAY_UNDER = """
import json, os, sys, time
import numpy as np
import ray
from slabpool import RayEngine

if __name__ == "__main__":
    model, log, gate = sys.argv[1:4]
    init = {"num_cpus": 2, "log_to_driver": False}
    a = RayEngine(model, workers=1, address="local", ray_init_kwargs=init, preprocess="tests.hooks:gated")
    x = {"x": np.ones((1, 16), np.float32), "gate": gate, "log": log}
    held = [a.submit(x) for _ in range(2)]
    while not os.path.exists(log):
        time.sleep(0.01)
    ray.shutdown()  # the user's, under the engine, with a task running and one queued
    errors = [str(f.exception(timeout=120)) for f in held]
    try:
        a.submit(x)
        later = "accepted"
    except Exception as exc:
        later = type(exc).__name__
    started = ray.is_initialized()  # (a submit must not start a new local Ray)
    ray.init(address="local", include_dashboard=False, **init)  # the user's own Ray now
    a.close(timeout=60)
    kept_a = ray.is_initialized()
    with RayEngine(model, workers=1) as b:  # on the user's Ray
        shape = list(b.infer({"x": np.ones((1, 16), np.float32)})["probs"].shape)
    kept_b = ray.is_initialized()
    ray.shutdown()
    print(json.dumps({"errors": errors, "later": later, "started": started, "state": a.state.name,
                      "kept_a": kept_a, "kept_b": kept_b, "shape": shape}))
"""


@pytest.mark.slow
def test_ray_shut_down_under_the_engine_and_the_users_ray_after_it(
    ray_only: SimpleNamespace | None, models: SimpleNamespace, tmp_path: Path
) -> None:
    """ray.shutdown() under a RayEngine that started Ray: its task running and its task queued
    fail with a WorkerError that says so, a later submit is refused without starting a new
    local Ray; then the user's own ray.init(): the engine's close() leaves that Ray running,
    and an engine made on it leaves it running too. Was: the tasks never ended, the submit
    started a Ray, and close() shut the user's Ray down (every fresh local Ray gives its first
    driver the same job id, 01000000, which was all that told two instances apart)."""
    import json
    import os

    script = tmp_path / "under.py"
    script.write_text(RAY_UNDER)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, str(script), str(models.mlp), str(tmp_path / "ran"), str(tmp_path / "gate")],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1])
    assert all("Ray was shut down under this engine" in e for e in seen["errors"]), seen
    assert seen["later"] == "WorkerError" and seen["started"] is False and seen["state"] == "CLOSED"
    assert seen["kept_a"] is True and seen["kept_b"] is True and seen["shape"] == [1, 8]


@pytest.mark.slow
def test_the_ray_docs_run_as_written(
    ray_only: SimpleNamespace | None, models: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/ray.md's examples (marked skip for tests/test_docs.py, which has no Ray), each a
    script run as written in a folder with model.onnx (the demo) and mlp.onnx; `ray.init()`
    finds this cluster through RAY_ADDRESS, as it would find a laptop's `ray start --head`."""
    from tests.test_docs import REPO as DOCS_REPO
    from tests.test_docs import blocks, run_block

    examples = [b for b in blocks(DOCS_REPO / "docs" / "ray.md") if b.lang == "python"]
    assert len(examples) == 2 and all("tests/test_ray.py" in (b.skip or "") for b in examples)
    shutil.copy(models.mlp, tmp_path / "mlp.onnx")
    monkeypatch.setenv("RAY_ADDRESS", ray_only.gcs)
    outs = []
    for block in examples:
        done = run_block(block, tmp_path)
        assert done.returncode == 0, f"{block.where}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        outs.append(done.stdout)
    assert [int(ln.split()[0]) for ln in outs[0].splitlines()] == list(range(16))  # res.index, in order
    import pyarrow.parquet as pq

    labels = pq.read_table(tmp_path / "labels")
    assert labels.num_rows == 1000 and {"id", "probs", "logits"} <= set(labels.column_names)


@pytest.mark.slow
def test_node_loss_replays_on_the_surviving_node(
    ray_only: SimpleNamespace | None, models: SimpleNamespace, tmp_path: Path
) -> None:
    ray = ray_only.ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = subprocess.Popen(  # a second node on this machine, in the same namespace
        [str(Path(sys.executable).with_name("ray")), "start", f"--address={ray_only.gcs}", "--num-cpus=1",
         "--block", "--disable-usage-stats"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        second = wait_for_node(ray, ray_only.head)
        where = {0: ray_only.head, 1: second}

        def place(slot: int) -> dict[str, Any]:
            return {"scheduling_strategy": NodeAffinitySchedulingStrategy(where[slot], soft=True)}

        gate = tmp_path / "gate"
        xs = [rows(i) for i in range(8)]
        with build("ray", models.mlp, preprocess=HOOK, actor_options=place) as eng:
            assert [n for _, n, _ in eng.placement()] == [ray_only.head, second]
            survivor = eng.placement()[0][2]
            futs = [eng.submit({"x": x, "gate": str(gate)}) for x in xs]
            counts = completions(futs)
            kill_tree(node)  # the whole second node: raylet, agents, our actor
            gate.touch()
            results = [f.result(120) for f in futs]
            stats = eng.stats()
        for x, res in zip(xs, results, strict=True):
            assert_mlp(res.outputs, x)
        replayed = [r for r in results if r.attempts == 2]
        assert replayed and all(r.pid == survivor for r in replayed)
        assert counts == [1] * 8
        assert (stats.completed, stats.failed) == (8, 0)
    finally:
        kill_tree(node)


def wait_for_node(ray: Any, head: str) -> str:
    deadline = time.monotonic() + 60  # only a broken start reaches it
    while time.monotonic() < deadline:
        alive = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head]
        if alive:
            return str(alive[0])
        time.sleep(0.2)
    raise AssertionError("the second Ray node did not join within 60 s")


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    try:
        tree = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
    except psutil.Error:
        tree = []
    for p in tree:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    proc.wait()
    psutil.wait_procs(tree, timeout=10)
