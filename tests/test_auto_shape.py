"""Memory that follows the work, and a pool shape chosen by measurement (issue 23, items 2-3).

- batch_size="auto" must not grow the workers beyond what the smallest fixed size costs: its
  first, timed call is small (ONNX Runtime's CPU arena keeps what its largest call needed).
- workers="auto" probes the model on this host: one worker of one thread per usable CPU when the
  memory holds them, fewer workers with threads when it does not, and it says why.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from slabpool import Engine
from slabpool.engine.core.config import usable_cpus
from slabpool.engine.core.shape import WORKER_EXTRA, decide
from slabpool.workers.probe import Probe
from tests.reference import ort_run

DEMO = Path(__file__).resolve().parents[1] / "engine" / "data" / "demo.onnx"
MiB = 1 << 20


def _worker_rss_after(batch_size: int | str, x: np.ndarray) -> tuple[int, np.ndarray]:
    with Engine(DEMO, workers=1) as eng:
        got = eng.infer({"image": x}, batch_size=batch_size)["probs"]
        return eng.stats().slots[0].rss_bytes, got


@pytest.mark.slow
def test_auto_batch_size_costs_no_more_memory_than_batch_8():
    """The demo CNN (2.4 MB of activations a row): a first call of 256 rows grew the worker by
    about 900 MiB for good. The auto size must stay within what batch_size=8 costs."""
    x = np.random.default_rng(0).standard_normal((300, 3, 112, 112)).astype(np.float32)
    fixed, want = _worker_rss_after(8, x)
    auto, got = _worker_rss_after("auto", x)
    assert auto <= fixed * 1.15 + 20 * MiB, (auto / MiB, fixed / MiB)
    np.testing.assert_allclose(got, ort_run(DEMO, {"image": x})["probs"], rtol=1e-5, atol=1e-6)
    assert np.array_equal(got, want) or np.allclose(got, want, rtol=1e-5, atol=1e-6)


# -- workers="auto": the decision, a pure function of the CPUs, the memory and the probe ---------

PER_WORKER = 100 * MiB - WORKER_EXTRA  # a probe's private bytes: a worker costs 100 MiB


def _probe(private: int = PER_WORKER, shared: int = 0, row_s: dict[int, float] | None = None) -> Probe:
    return Probe(private, shared, row_s if row_s is not None else {1: 1e-3}, 8)


@pytest.mark.parametrize(("cpus", "budget", "probe", "threads", "want", "says"), [
    (8, 10_000 * MiB, _probe(), None, (8, 1), "one worker per usable CPU (8)"),
    (8, 250 * MiB, _probe(row_s={1: 4e-3, 4: 1e-3}), None, (2, 4), "4 threads make a call 4.00x faster"),
    (8, 250 * MiB, _probe(row_s={1: 1e-3, 4: 0.95e-3}), None, (2, 1), "1.05x faster, under 1.2x"),
    (8, 50 * MiB, _probe(), None, (1, 1), "not even one"),
    (8, 10_000 * MiB, _probe(), 2, (4, 2), "threads given"),
    (8, 450 * MiB, _probe(shared=400 * MiB), None, (1, 1), "400 MiB of shared weights once: 0 fit"),
    # shared weights are counted once: 4 workers of 100 MiB + 300 MiB of weights fit in 700 MiB,
    # where 4 private copies (400 MiB each) would not
    (4, 700 * MiB, _probe(shared=300 * MiB), None, (4, 1), "4 fit"),
    (4, 700 * MiB, _probe(private=PER_WORKER + 300 * MiB), None, (1, 1), "1 fit"),
    (8, 250 * MiB, _probe(row_s={}), None, (2, 1), "4 threads not timed"),
    (3, 250 * MiB, _probe(), None, (2, 1), "no spare CPU for threads"),
])
def test_the_shape_follows_cpus_memory_and_the_probe(cpus, budget, probe, threads, want, says):
    shape = decide(cpus, budget, probe, threads)
    assert (shape.workers, shape.threads) == want, shape.why
    assert says in shape.why and shape.why.startswith(f"workers={want[0]} x threads={want[1]}")


def test_auto_workers_respect_the_cpus_this_process_may_use(models):
    """Affinity limited to one CPU (as a cgroup quota or taskset would): one worker; the choice
    is in stats() and the outputs are those of the model."""
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(saved)})
    try:
        with Engine(models.mlp, workers="auto") as eng:
            x = np.ones((3, 16), np.float32)
            res = eng.submit({"x": x}).result(timeout=60)
            st = eng.stats()
    finally:
        os.sched_setaffinity(0, saved)
    assert len(st.slots) == 1 and eng.config.threads_per_worker == 1
    assert st.pool_shape.startswith("workers=1 x threads=1: one worker per usable CPU (1)"), st.pool_shape
    assert res.outputs["probs"].tobytes() == ort_run(models.mlp, {"x": x})["probs"].tobytes()


def test_auto_workers_on_every_cpu_when_memory_holds_them(models):
    with Engine(models.slow, workers="auto") as eng:
        st = eng.stats()
    cpus = usable_cpus()
    assert len(st.slots) == cpus and "shared weights once" in st.pool_shape, st.pool_shape


def _model(tmp: Path, kind: str) -> Path:
    """A model the probe's made-up inputs do not suit: an integer index into a one-row table
    (only 0 is in range), or a scalar input listed first."""
    import onnx
    from onnx import TensorProto, helper

    if kind == "index":
        table = helper.make_tensor("table", TensorProto.FLOAT, [1, 4], [1, 2, 3, 4])
        g = helper.make_graph([helper.make_node("Gather", ["table", "idx"], ["y"])], "g",
                              [helper.make_tensor_value_info("idx", TensorProto.INT64, ["N"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], [table])
    else:
        g = helper.make_graph([helper.make_node("Mul", ["x", "scale"], ["y"])], "g",
                              [helper.make_tensor_value_info("scale", TensorProto.FLOAT, []),
                               helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    path = tmp / f"{kind}.onnx"
    onnx.save(m, str(path))
    return path


@pytest.mark.parametrize("kind", ["index", "scalar first"])
def test_auto_workers_on_a_model_the_probes_inputs_do_not_suit(tmp_path, kind):
    """workers="auto" builds for a model that serves fine with workers=2: one that refuses the
    probe's made-up values (the shape is then chosen untimed), or whose first input is a scalar. Was: onnxruntime's own error out of Engine(), or an IndexError."""
    model = _model(tmp_path, kind)
    feeds = ({"idx": np.zeros(10, np.int64)} if kind == "index"
             else {"scale": np.array(2.0, np.float32), "x": np.ones((3, 4), np.float32)})
    with Engine(model, workers="auto") as eng:
        got = eng.infer(feeds)["y"]
        shape = eng.stats().pool_shape
    assert got.tobytes() == ort_run(model, feeds)["y"].tobytes()
    assert shape.startswith("workers=")


def test_auto_workers_without_a_model():
    with Engine(None, workers="auto", preprocess="tests.hooks:double") as eng:
        st = eng.stats()
    assert len(st.slots) == usable_cpus() and "no model to probe" in st.pool_shape


class _R:  # a Result's two fields the sizer reads
    def __init__(self, run: float, rows: int) -> None:
        self.timings = type("T", (), {"run": run})()
        self.outputs = {"y": np.zeros((rows, 1), np.float32)}


def test_auto_block_size_probes_small_and_grows_once_from_a_real_task():
    from slabpool.engine.caller.blocks import PROBE_CALLS, PROBE_ROWS, BlockSizer, _cut

    s = BlockSizer("auto", in_row_bytes=4, arena_bytes=1 << 30, in_flight=4)
    assert s.next() == PROBE_ROWS * PROBE_CALLS and next(_cut([(0, 100)], s))[2] == PROBE_ROWS  # calls of 8 rows
    s.observe(_R(0.0032, 32), 32)  # a probe slowed down (100 us a row): calls of 20 rows
    assert s.step == 20
    s.observe(_R(0.0002, 200), 200)  # the first real task: 1 us a row -> calls of ~2 ms, once
    assert s.step == 2000
    s.observe(_R(0.02, 200), 200)  # much slower later: the step never shrinks, nor grows again
    s.observe(_R(0.00002, 200), 200)
    assert s.step == 2000
    quiet = BlockSizer("auto", 4, 1 << 30, 4)
    quiet.observe(_R(0.000032, 32), 32)  # a true probe: 1 us a row
    quiet.observe(_R(0.004, 2000), 2000)  # 2 us a row in calls of 2000: the step stays
    assert quiet.step == 2000
