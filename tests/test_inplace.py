"""Outputs that ONNX Runtime writes straight into shared memory (IO binding, workers/inplace.py).

Results must be byte-identical to a plain in-process run whatever happens: shapes learned
per input signature, shapes that depend on the data (fall back, never bind again), several
tasks in one group, a crash inside a bound run, runtimes or settings where it cannot apply."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from slabpool import Engine
from slabpool.engine.caller import faults
from slabpool.workers.protocol import FaultSpec
from tests.test_cancel_replay import wait_until


def _plain(model, feeds):  # type: ignore[no-untyped-def]
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))


def _same(got, want) -> None:  # type: ignore[no-untyped-def]
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and got[k].tobytes() == v.tobytes(), k


def _items(name: str, rng: np.random.Generator):  # type: ignore[no-untyped-def]
    if name == "mlp":
        return [{"x": rng.standard_normal((n, 16)).astype(np.float32)} for n in (1, 3, 1, 3, 1)]
    if name == "multi_io":
        return [{"feats": rng.standard_normal((n, 4)).astype(np.float32), "ids": np.arange(n, dtype=np.int64)}
                for n in (2, 2, 5, 2, 5)]
    if name == "int_model":
        return [{"x": rng.integers(-9, 9, (n, 4), dtype=np.int32)} for n in (1, 1, 7, 7, 1)]
    return [{"x": rng.standard_normal((1, 256 * 1024)).astype(np.float32)} for _ in range(5)]


@pytest.mark.parametrize("name", ["mlp", "multi_io", "int_model", "payload"])
def test_outputs_written_in_place_equal_a_plain_run(models, name) -> None:  # type: ignore[no-untyped-def]
    model = getattr(models, name)
    items = _items(name, np.random.default_rng(1)) * 3
    with Engine(model, workers=1, in_place_min_bytes=0) as eng:
        results = [eng.submit(it).result(timeout=60) for it in items]  # one at a time: one per run
        st = eng.stats()
    for it, res in zip(items, results, strict=True):
        _same(res.outputs, _plain(model, it))
        for arr in res.outputs.values():
            assert arr.flags.owndata and arr.flags.writeable  # still the caller's own copy
    signatures = len({tuple((k, v.shape) for k, v in it.items()) for it in items})
    assert st.outputs_in_place == len(items) - signatures  # the first of each signature learns


def test_shapes_that_depend_on_the_data_fall_back_and_are_never_bound_again(models) -> None:  # type: ignore[no-untyped-def]
    a = {"x": np.array([[0, 1, 0, 2, 0, 0, 3, 0]], dtype=np.float32)}  # 3 nonzero
    b = {"x": np.array([[4, 1, 0, 2, 5, 0, 3, 0]], dtype=np.float32)}  # 5 nonzero, same input shape
    order = [a, a, b, a, b, a]
    with Engine(models.nonzero, workers=1, in_place_min_bytes=0) as eng:
        results = [eng.submit(it).result(timeout=60) for it in order]
        st = eng.stats()
    for it, res in zip(order, results, strict=True):
        _same(res.outputs, _plain(models.nonzero, it))
    assert st.failed == 0 and st.completed == len(order)
    assert st.outputs_in_place == 1  # the second a; b's bound run failed, then a plain one ran


def test_a_group_of_tasks_is_laid_out_in_place_one_after_another(models, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A deep queue goes in groups whose sizes are the queue's depth at the time: a group of a
    size never seen still gets a region ahead, the sum of its tasks' alone, and every task of
    it is written in place (was: a group of an unseen size ran plainly, 14 to 30 of 40 in
    place from run to run). The worker is held until all are queued, so groups form."""
    rng = np.random.default_rng(2)
    gate, ran = tmp_path / "gate", tmp_path / "ran"
    items = [{"x": rng.standard_normal((1, 256 * 1024)).astype(np.float32), "gate": str(gate), "log": str(ran)}
             for _ in range(40)]
    with Engine(models.payload, workers=1, queue_capacity=64, preprocess="tests.hooks:gated") as eng:
        gate.touch()
        eng.infer(items[0])  # learn the shapes
        gate.unlink()
        futs = [eng.submit(it) for it in items]  # the first is held in its worker
        wait_until(lambda: len(ran.read_text().split()) == 2, "the first task held in its worker")
        gate.touch()
        results = [f.result(timeout=60) for f in futs]
        st = eng.stats()
    for it, res in zip(items, results, strict=True):
        assert res.outputs["y"].tobytes() == (it["x"] * 2).tobytes()
    assert st.outputs_in_place == len(items)


@pytest.mark.parametrize("stage", ["run", "write_outputs"])
def test_a_crash_during_an_in_place_task_replays_it(models, tmp_path, stage) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(3)
    items = [{"x": rng.standard_normal((1, 256 * 1024)).astype(np.float32)} for _ in range(6)]
    fault = FaultSpec(stage, "sigkill", str(tmp_path / "once"))
    with faults.build(Engine, models.payload, workers=1) as eng:
        eng.infer(items[0])
        eng.infer(items[0])
        assert eng.stats().outputs_in_place == 1  # the faulty task below runs bound
        futs = [faults.submit(eng, it, fault if i == 2 else None) for i, it in enumerate(items)]
        results = [f.result(timeout=60) for f in futs]
        st = eng.stats()
    for it, res in zip(items, results, strict=True):
        assert res.outputs["y"].tobytes() == (it["x"] * 2).tobytes()
    assert results[2].attempts == 2 and st.restarts == 1 and st.failed == 0


@pytest.mark.parametrize("case", ["litert", "postprocess", "small outputs", "turned off"])
def test_no_in_place_where_it_cannot_apply_or_does_not_pay(models, case) -> None:  # type: ignore[no-untyped-def]
    x = {"x": np.ones((2, 16), np.float32)}
    if case == "litert":
        eng = Engine(models.tfl_mlp, workers=1, in_place_min_bytes=0)
    elif case == "postprocess":
        eng = Engine(models.mlp, workers=1, postprocess="tests.hooks:argmax_post", in_place_min_bytes=0)
    elif case == "small outputs":  # the default: below 1 MiB a copy is cheaper than binding
        eng = Engine(models.mlp, workers=1)
    else:
        x = {"x": np.ones((1, 256 * 1024), np.float32)}
        eng = Engine(models.payload, workers=1, in_place_min_bytes=None)
    with eng:
        for _ in range(3):
            eng.infer(x)
        assert eng.stats().outputs_in_place == 0
