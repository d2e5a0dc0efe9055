"""Dynamic batching: tasks headed for one slot are stacked into one session call, outputs split
back per task. Tolerance: ONNX Runtime's output bits may depend on batch size and position
(measured: magika's rows differ by up to 1.4e-7 between batch 8 and batch 1), so batched results are compared with rtol=1e-5, atol=1e-6;
conv models and the LiteRT models used here are batch-invariant and compared byte for byte."""

from __future__ import annotations

import numpy as np
import pytest

from slabpool import Engine
from slabpool.engine.caller import faults
from slabpool.workers.errors import PoisonTask, SessionRunError
from slabpool.workers.protocol import FaultSpec
from tests.ray_support.plugin import RAY, build
from tests.reference import litert_run, ort_run

RNG = np.random.default_rng(0)
# what the batches are made of is the queue's (TaskQueue.take), one code for both backends
SAME_QUEUE = "the batches' composition is TaskQueue.take's, one code for both backends (Ray runs the stacking cases)"


def _submit_all(eng: Engine, feeds: list[dict]) -> list:
    futs = [eng.submit(f) for f in feeds]  # submitted back to back: they wait together
    return [f.result(timeout=60) for f in futs]


@pytest.mark.parametrize("model,runner,exact", [("mlp", ort_run, False), ("convnet", ort_run, True),
                                                ("tfl_mlp", litert_run, True)])
def test_batched_results_equal_unbatched_and_keep_each_tasks_identity(backend, models, model, runner, exact):
    if backend == RAY and model != "mlp":
        pytest.skip("stacking is the owner's and the actor's, one code for every model: Ray runs the mlp "
                    "(the other models are the local run's, to keep the confined run's time)")
    path = getattr(models, model)
    name = "image" if model == "convnet" else "x"
    shape = (3, 16, 16) if model == "convnet" else (16,)
    feeds = [{name: RNG.standard_normal((n, *shape)).astype(np.float32)} for n in [1, 2, 3, 1, 1, 4, 2, 1] * 4]
    with build(backend, path, workers=1, max_batch_size=8, max_batch_wait_ms=200, queue_capacity=64) as eng:
        results = _submit_all(eng, feeds)
        st = eng.stats()
    assert st.stacked_batches >= 1 and st.stacked_batches < len(feeds)
    assert [r.task_id for r in results] == list(range(len(feeds)))
    for f, r in zip(feeds, results, strict=True):
        want = runner(path, f)
        for k, v in want.items():
            assert r.outputs[k].shape == v.shape  # each task gets exactly its own rows back
            if exact:
                assert r.outputs[k].tobytes() == v.tobytes()
            else:
                np.testing.assert_allclose(r.outputs[k], v, rtol=1e-5, atol=1e-6)


def _dynamic_identity(path):
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "D"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "D"])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "dyn", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, str(path))
    return path


def test_tasks_with_other_trailing_shapes_are_not_stacked_together(backend, tmp_path):
    if backend == RAY:
        pytest.skip(SAME_QUEUE)
    """Only equal trailing shapes stack; the others wait for a batch of their own."""
    model = _dynamic_identity(tmp_path / "dyn.onnx")
    feeds = [{"x": RNG.standard_normal((n, d)).astype(np.float32)} for n, d in [(1, 4), (2, 7), (1, 4), (3, 7), (1, 4)]]
    with build(backend, model, workers=1, max_batch_size=8, max_batch_wait_ms=200) as eng:
        results = _submit_all(eng, feeds)
        st = eng.stats()
    assert st.stacked_batches == 2  # the 4-wide ones together, the 7-wide ones together
    for f, r in zip(feeds, results, strict=True):
        assert r.outputs["y"].tobytes() == f["x"].tobytes()


def test_a_task_larger_than_max_batch_size_runs_alone(backend, models):
    if backend == RAY:
        pytest.skip(SAME_QUEUE)
    """It used to wait forever: no batch could take it, and nothing else took it either."""
    sizes = [1, 10, 2, 9, 3, 1]  # max_batch_size 4: 10 and 9 run alone, the others stack
    feeds = [{"x": RNG.standard_normal((n, 16)).astype(np.float32)} for n in sizes]
    with build(backend, models.mlp, workers=1, max_batch_size=4, max_batch_wait_ms=50) as eng:
        results = _submit_all(eng, feeds)
        alone = eng.infer({"x": np.ones((7, 16), np.float32)})  # and with nothing else queued
    for f, r in zip(feeds, results, strict=True):
        np.testing.assert_allclose(r.outputs["probs"], ort_run(models.mlp, f)["probs"], rtol=1e-5, atol=1e-6)
    assert alone["probs"].shape == (7, 8)


def test_a_bad_item_fails_alone_its_batch_mates_do_not(backend, models):
    """The stacked call raises; the worker reruns the items one by one to find the culprit."""
    x = np.ones((1, 4), np.float32)
    idx = [np.array([i], np.int64) for i in (1, 2, 99, 3)]  # 99 is out of the table
    with build(backend, models.poison, workers=1, max_batch_size=4, max_batch_wait_ms=200) as eng:
        futs = [eng.submit({"idx": i, "x": x}) for i in idx]
        with pytest.raises(SessionRunError, match=r"out of|indices"):
            futs[2].result(timeout=60)
        good = [f.result(timeout=60) for k, f in enumerate(futs) if k != 2]
    assert [g.outputs["y"].shape for g in good] == [(1, 4)] * 3


def test_a_batch_that_kills_its_worker_replays_then_bisects_to_the_poison(backend, models):
    feeds = [{"x": RNG.standard_normal((1, 16)).astype(np.float32)} for _ in range(8)]
    with faults.injecting(), build(backend, models.mlp, workers=1, max_batch_size=8, max_batch_wait_ms=300, max_attempts=2) as eng:
        futs = [faults.submit(eng, f, FaultSpec("run", "sigkill") if i == 5 else None) for i, f in enumerate(feeds)]
        with pytest.raises(PoisonTask):
            futs[5].result(timeout=120)
        mates = [f.result(timeout=120) for i, f in enumerate(futs) if i != 5]
        st = eng.stats()
    assert st.quarantined == 1 and st.completed == 7 and st.failed == 1
    for f, r in zip([f for i, f in enumerate(feeds) if i != 5], mates, strict=True):
        np.testing.assert_allclose(r.outputs["probs"], ort_run(models.mlp, f)["probs"], rtol=1e-5, atol=1e-6)


def test_a_replayed_batch_keeps_its_composition_and_bytes(backend, models, tmp_path):
    if backend == RAY:
        pytest.skip("a replay keeps its batch (the owner's queue, one code): on Ray the batch that kills its "
                    "slot is replayed in the bisect case above")
    """One random death: the batch is recomputed with the same composition: same bits."""
    feeds = [{"x": RNG.standard_normal((1, 16)).astype(np.float32)} for _ in range(6)]
    kw = dict(workers=1, max_batch_size=6, max_batch_wait_ms=300)
    with build(backend, models.mlp, **kw) as eng:
        clean = _submit_all(eng, feeds)
    with faults.injecting(), build(backend, models.mlp, **kw) as eng:
        once = FaultSpec("run", "sigkill", str(tmp_path / "once"))
        futs = [faults.submit(eng, f, once if i == 0 else None) for i, f in enumerate(feeds)]
        replayed = [f.result(timeout=60) for f in futs]
    assert all(r.attempts == 2 for r in replayed)
    assert [r.outputs["probs"].tobytes() for r in replayed] == [c.outputs["probs"].tobytes() for c in clean]
