"""The foundation: one session per worker, results byte-identical to one in-process thread,
the public API's shapes, and nothing left behind."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import gc
import pickle
import threading

import numpy as np
import pytest

from slabpool import Engine, Result
from slabpool.engine.caller.handles import TaskFuture
from slabpool.engine.core.fastpath import Lend
from slabpool.engine.core.task import Batch, Task
from slabpool.engine.local.staged import Staged
from slabpool.engine.ray.transport import Staged as RayStaged
from slabpool.workers.errors import EngineClosed, InputContractError, SessionInitError
from tests import hooks
from tests.ray_support.plugin import RAY, build
from tests.reference import litert_run, ort_run

rng = np.random.default_rng(0)


def _x(n: int = 4, d: int = 16) -> np.ndarray:
    return rng.standard_normal((n, d)).astype(np.float32)


@pytest.mark.parametrize("model,runner", [("mlp", ort_run), ("tfl_mlp", litert_run)])
def test_outputs_byte_identical_to_one_thread_in_process(models, start_or_ray, model, runner):
    if start_or_ray == RAY and model != "mlp":
        pytest.skip("LiteRT in an actor: test_weights' tfl_mlp case (byte-identical too)")
    path = getattr(models, model)
    inputs = [_x(n) for n in (1, 3, 7, 1, 16)]
    with build(start_or_ray, path, workers=2) as eng:
        results = [f.result(timeout=60) for f in [eng.submit({"x": x}) for x in inputs]]
    for x, res in zip(inputs, results):
        want = runner(path, {"x": x})
        assert res.outputs.keys() == want.keys()
        for name in want:
            assert res.outputs[name].tobytes() == want[name].tobytes(), name


def test_result_is_a_frozen_record_of_who_computed_it(models, backend):
    with build(backend, models.mlp, workers=2) as eng:
        res = eng.submit({"x": _x()}).result(timeout=60)
        pids = {s.pid for s in eng.stats().slots}
    assert isinstance(res, Result)
    assert res.task_id == 0 and res.attempts == 1 and res.pid in pids and res.slot in (0, 1)
    assert res.model_version == eng.model_version and len(res.model_version) == 16
    assert min(dataclasses.astuple(res.timings)) >= 0 and res.timings.total >= res.timings.run
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.task_id = 5  # type: ignore[misc]


def test_outputs_are_caller_owned_and_inputs_may_be_reused_after_submit(models, backend):
    x = _x()
    want = ort_run(models.mlp, {"x": x.copy()})
    with build(backend, models.mlp, workers=1) as eng:
        fut = eng.submit({"x": x})
        x[:] = 0  # the caller may mutate its array the moment submit() returns
        out = fut.result(timeout=60).outputs
    assert out["probs"].tobytes() == want["probs"].tobytes()
    assert out["probs"].flags.writeable and out["probs"].flags.owndata


def test_bare_array_for_a_single_input_model_and_infer(models):
    x = _x()
    with Engine(models.mlp, workers=1) as eng:
        y = eng.infer(x)
    assert set(y) == {"probs", "logits"}
    assert y["probs"].tobytes() == ort_run(models.mlp, {"x": x})["probs"].tobytes()


def test_multi_input_mixed_dtypes(models, backend):
    feats = rng.standard_normal((5, 4)).astype(np.float32)
    ids = np.arange(5, dtype=np.int64)
    with build(backend, models.multi_io, workers=1) as eng:
        out = eng.infer({"feats": feats, "ids": ids})
        with pytest.raises(InputContractError, match="a dict"):
            eng.submit(feats)  # two inputs: a bare array is ambiguous
    want = ort_run(models.multi_io, {"feats": feats, "ids": ids})
    assert all(out[k].tobytes() == want[k].tobytes() for k in want)


def test_integer_outputs(models):
    x = np.arange(12, dtype=np.int32).reshape(3, 4)
    with Engine(models.int_model, workers=1) as eng:
        assert np.array_equal(eng.infer(x)["y"], x + np.array([1, 2, 3, 4], dtype=np.int32))


@pytest.mark.parametrize("chunk", [1, None])
def test_map_is_ordered_and_bounded(models, backend, chunk):
    if backend == RAY and chunk is None:
        pytest.skip("chunk=None is one task per item on Ray: the chunk=1 case is Ray's")
    xs = [_x(1) for _ in range(60)]
    with build(backend, models.mlp, workers=2) as eng:
        results = list(eng.map(({"x": x} for x in xs), chunk=chunk))
        accepted = eng.stats().accepted
    ids = [r.task_id for r in results]
    assert ids == list(range(60)) if chunk == 1 else ids == sorted(ids) and accepted == len(set(ids)) <= 60
    for x, r in zip(xs, results):  # byte-identical: chunks run their items one by one
        assert r.outputs["probs"].tobytes() == ort_run(models.mlp, {"x": x})["probs"].tobytes()


PER_CALL = (Task, TaskFuture, Lend, Batch, Staged, RayStaged)


def test_calls_leave_no_cycle_for_the_collector(models, backend):
    """Each call's records (its Task and Future, the Lend of a lent slot, the Batch, the staged
    inputs) are freed as their last reference goes, on every path: a thread's lent call, the
    owner thread's (submit, several threads at once), an event loop's lent call and a gather,
    map(). A cycle among them (the Task and its Future pointed at each other, an event loop's
    Lend held its own watcher) left them all to the cyclic collector: a gen-0 pass every ~25
    calls, and the gen-2 passes they led to stalled every thread (docs/latency.md)."""
    x = {"x": _x(1)}

    async def loop_calls() -> None:
        for _ in range(10):
            await eng.infer_async(x)
        await asyncio.gather(*(eng.infer_async(x) for _ in range(10)))

    def threads() -> None:
        ts = [threading.Thread(target=lambda: [eng.infer(x) for _ in range(10)]) for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    with build(backend, models.mlp, workers=2) as eng:
        want = eng.infer(x)["probs"]
        asyncio.run(loop_calls())  # (warm: the loop's own first-use objects)
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds goes to gc.garbage, kept
        try:
            got = [eng.infer(x)["probs"] for _ in range(10)]
            got += [eng.submit(x).result(60).outputs["probs"] for _ in range(10)]
            asyncio.run(loop_calls())
            threads()
            got += [r.outputs["probs"] for r in eng.map([x] * 10)]
            gc.collect()
            left = collections.Counter(type(o).__name__ for o in gc.garbage if type(o) in PER_CALL)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    assert not left, f"records freed only by the collector: {dict(left)}"
    assert all(g.tobytes() == want.tobytes() for g in got)


def test_describe_reports_dynamic_dims(models):
    with Engine(models.mlp, workers=1) as eng:
        d = eng.describe()
    assert [(s.name, s.dtype, s.shape) for s in d.inputs] == [("x", "<f4", (None, 16))]
    assert [s.name for s in d.outputs] == ["probs", "logits"]
    assert d.runtime == "onnxruntime" and d.batchable


def test_litert_describe_and_stats(models):
    with Engine(models.tfl_mlp, workers=2, backend="auto") as eng:
        d = eng.describe()
        st = eng.stats()
    assert d.runtime == "ai-edge-litert" and d.inputs[0].shape == (None, 16)
    assert all(s.applied == ("xnnpack",) and not s.degraded for s in st.slots)


def test_stats_snapshot(models, backend):
    with build(backend, models.mlp, workers=2) as eng:
        list(eng.map({"x": _x(1)} for _ in range(10)))
        st = eng.stats()
    assert st.state == "ACCEPTING" and len(st.slots) == 2
    assert (st.accepted, st.completed, st.failed, st.cancelled) == (10, 10, 0, 0)
    assert sum(s.tasks_done for s in st.slots) == 10
    for s in st.slots:
        assert s.pid > 0 and s.rss_bytes > 0 and s.runtime == "onnxruntime" and s.runtime_version
        assert s.requested == ("CPUExecutionProvider",) and s.applied == ("CPUExecutionProvider",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.accepted = 0  # type: ignore[misc]


def test_preprocess_and_postprocess_run_in_the_worker(models, backend):
    x = _x(3)
    with build(backend, models.mlp, workers=1, preprocess=hooks.to_feeds, postprocess=hooks.argmax_post) as eng:
        out = eng.infer({"x": x, "note": "not an array: pickled"})
    want = ort_run(models.mlp, {"x": x})["probs"].argmax(axis=-1)
    assert np.array_equal(out["label"], want) and out["n"] == 3


def test_a_pure_preprocessing_pool_without_model(start_or_ray):
    x = np.arange(6.0).reshape(2, 3)
    with build(start_or_ray, None, workers=2, preprocess="tests.hooks:double") as eng:
        outs = [r.outputs for r in eng.map({"x": x + i} for i in range(5))]
        assert eng.describe().inputs == ()
    assert all(np.array_equal(o["y"], (x + i) * 2) for i, o in enumerate(outs))


def test_worker_sees_read_only_input_views(models, backend):
    """Shared memory locally; Ray's object store (read zero-copy) on Ray."""
    with build(backend, None, workers=1, preprocess="tests.test_engine:_mutate") as eng:
        res = eng.submit({"x": np.ones(3)}).result(timeout=60)
    assert res.outputs == {"writeable": False}


def _mutate(item):
    return {"writeable": bool(item["x"].flags.writeable)}


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"start_method": "fork"}, ValueError, "fork.*refused"),
        ({"start_method": "threads"}, ValueError, "start_method"),
        ({"workers": 0}, ValueError, "workers"),
        ({"admission": "maybe"}, ValueError, "admission"),
        ({"backend": "tensorflow"}, ValueError, "backend"),
        ({"preprocess": lambda x: x}, TypeError, "importable"),
        ({"preprocess": "tests.hooks"}, ValueError, "module:function"),
        ({"in_place_min_bytes": -1}, ValueError, "in_place_min_bytes"),
        ({"in_place_min_bytes": 1.5}, ValueError, "in_place_min_bytes"),
    ],
)
def test_bad_settings_fail_at_construction(models, kwargs, error, match):
    with pytest.raises(error, match=match):
        Engine(models.mlp, **kwargs)


def test_missing_and_corrupt_model(models, tmp_path, backend):
    with pytest.raises(FileNotFoundError):
        build(backend, tmp_path / "nope.onnx")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model at all")
    with pytest.raises(SessionInitError, match="could not build its session") as info:
        build(backend, bad, workers=2)
    assert "Traceback" in str(info.value.__cause__)


def test_close_is_idempotent_and_submit_after_close_raises(models):
    eng = Engine(models.mlp, workers=1)
    eng.close()
    eng.close()
    assert eng.state.name == "CLOSED" and "CLOSED" in repr(eng)
    with pytest.raises(EngineClosed):
        eng.submit(_x())


def test_exception_in_with_block_still_cleans_up(models, backend):
    if backend == RAY:
        pytest.skip("`with` is BaseEngine's __exit__ -> close(), one code; on Ray close() runs in every case")
    with pytest.raises(KeyError), build(backend, models.mlp, workers=2) as eng:
        eng.submit(_x())
        raise KeyError("boom")
    assert eng.state.name == "CLOSED"


def test_importing_engine_loads_no_runtime():
    import subprocess
    import sys

    code = "import sys, slabpool; from slabpool import Engine; print('onnxruntime' in sys.modules, 'ai_edge_litert' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_errors_pickle_round_trip():
    err = InputContractError("input 'x': bad", task_id=3)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is InputContractError and back.task_id == 3 and str(back) == str(err)


@pytest.mark.parametrize("model,runner", [("mlp", ort_run), ("tfl_mlp", litert_run)])
def test_many_tasks_of_varied_sizes_stay_byte_identical(models, model, runner):
    """Output regions are granted per batch; a stale or small grant must never be written."""
    path = getattr(models, model)
    r = np.random.default_rng(1)
    xs = [r.standard_normal((int(n), 16)).astype(np.float32) for n in r.integers(1, 40, 300)]
    with Engine(path, workers=2) as eng:
        results = [f.result(timeout=60) for f in [eng.submit({"x": x}) for x in xs]]
    for x, res in zip(xs, results):
        assert res.outputs["probs"].tobytes() == runner(path, {"x": x})["probs"].tobytes()


@pytest.mark.parametrize(("how", "value", "error", "words"), [
    ("deadline", float("nan"), ValueError, "deadline must be a number of seconds or None, got nan"),
    ("deadline", True, TypeError, "deadline must be a number of seconds or None, got True"),
    ("deadline", "1", TypeError, "deadline must be a number of seconds or None, got '1'"),
    ("block_timeout", float("nan"), ValueError, "block_timeout must be a number of seconds or None, got nan"),
    ("close", float("nan"), ValueError, "timeout must be a number of seconds >= 0 or None, got nan"),
    ("reload", float("nan"), ValueError, "timeout must be a number of seconds >= 0 or None, got nan"),
    ("reload", -1, ValueError, "timeout must be a number of seconds >= 0 or None, got -1"),
])
def test_a_time_that_is_no_number_of_seconds_is_refused_where_it_is_given(backend, models, how, value, error, words):
    """Was (a hostile run): deadline=nan was accepted, and once its task waited in the queue the
    owner thread's wait raised on it: the engine stopped, every other caller's task failed with
    it. deadline=True ran as 1 s; close(timeout=nan) raised after it had stopped accepting;
    reload(timeout=nan) said "still in progress after nan s" at once."""
    x = {"x": np.ones((2, 16), np.float32)}
    with build(backend, models.mlp, workers=1, max_batch_size=4, max_batch_wait_ms=5) as eng:
        held = [eng.submit(x) for _ in range(4)]  # (a task refused while others wait: they are untouched)
        with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
            if how == "close":
                eng.close(timeout=value)
            elif how == "reload":
                eng.reload(models.mlp, timeout=value)
            else:
                eng.submit(x, **{how: value})
        assert eng.stats().state == "ACCEPTING"
        want = ort_run(models.mlp, x)["probs"]
        for f in held:  # (stacked: ORT's bits may depend on the batch's rows, see test_batching)
            np.testing.assert_allclose(f.result(timeout=60).outputs["probs"], want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(eng.infer(x, deadline=5.0)["probs"], want, rtol=1e-5, atol=1e-6)
