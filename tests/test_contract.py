"""The caller's contract: lifecycle, bounded admission, cancellation, deadlines, the input
contract at the door, and per-task context. Every scenario ends with every Future done and
the books balanced: accepted == completed + failed + cancelled."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from slabpool import Engine
from slabpool.workers.errors import (
    EngineClosed,
    InputContractError,
    QueueFull,
    SessionRunError,
    ShmCapacityError,
    TaskCancelled,
    TaskTimeout,
)
from tests.ray_support.plugin import RAY, build

X = np.ones((1, 16), np.float32)


def wait_until(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout  # only a deadlock reaches it
    while not cond():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.002)


class Gate:
    """A file the `gated` hook waits for, and a log of which tasks started."""

    def __init__(self, tmp: Path) -> None:
        self.path, self.log = tmp / "gate", tmp / "ran.log"

    def item(self, i: int, **kw) -> dict:
        return {"x": X, "id": i, "gate": str(self.path), "log": str(self.log), **kw}

    def open(self) -> None:
        self.path.touch()

    def ran(self) -> list[int]:
        return [int(x) for x in self.log.read_text().split()] if self.log.exists() else []


def gated_engine(models, backend="local", **kw) -> Engine:
    kw.setdefault("workers", 1)
    kw.setdefault("inflight_per_slot", 1)
    return build(backend, models.mlp, preprocess="tests.hooks:gated", **kw)


def balanced(eng: Engine) -> None:
    st = eng.stats()
    assert st.accepted == st.completed + st.failed + st.cancelled, st


# -- admission ---------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["reject", "block", "drop_oldest"])
def test_queue_full_under_each_policy(models, tmp_path, backend, policy):
    gate = Gate(tmp_path)
    with gated_engine(models, backend, queue_capacity=2, admission=policy) as eng:
        running = eng.submit(gate.item(0))
        wait_until(running.running)
        queued = [eng.submit(gate.item(i)) for i in (1, 2)]
        if policy == "reject":
            with pytest.raises(QueueFull):
                eng.submit(gate.item(3))
        elif policy == "block":
            t0 = time.monotonic()
            with pytest.raises(QueueFull):
                eng.submit(gate.item(3), block_timeout=0.2)
            assert time.monotonic() - t0 >= 0.2
        else:
            newest = eng.submit(gate.item(3))
            with pytest.raises(TaskCancelled) as info:
                queued[0].result(timeout=5)
            assert info.value.reason == "superseded"
            queued = [queued[1], newest]
        assert eng.stats().accepted == (4 if policy == "drop_oldest" else 3)
        gate.open()
        assert all(f.result(timeout=30) for f in [running, *queued])
        balanced(eng)
    assert gate.ran() == ([0, 2, 3] if policy == "drop_oldest" else [0, 1, 2])


def test_map_keeps_a_bounded_number_in_flight(models, backend):
    produced = 0

    def items():
        nonlocal produced
        for _ in range(10_000_000):
            produced += 1
            yield X

    with build(backend, models.mlp, workers=2, queue_capacity=4) as eng:
        it = eng.map(items(), window=8)
        for _ in range(50):
            next(it)
        assert produced <= 50 + 8
        it.close()  # abandoning the generator cancels what is still queued
        st = eng.stats()
        assert st.accepted <= 50 + 8
        wait_until(lambda: (s := eng.stats()).accepted == s.completed + s.cancelled)


# -- cancellation ------------------------------------------------------------------------------


def test_cancel_a_queued_task_it_never_runs_and_its_lease_is_freed(models, tmp_path):
    gate = Gate(tmp_path)
    with gated_engine(models) as eng:
        running = eng.submit(gate.item(0))
        wait_until(running.running)
        queued = eng.submit(gate.item(1, pad=np.zeros(1 << 20)))
        used = eng.stats().shm_inputs_used
        assert queued.cancel() is True  # concurrent.futures semantics: at once
        assert eng.stats().shm_inputs_used <= used - (1 << 20) * 8
        gate.open()
        running.result(timeout=30)
        balanced(eng)
        assert eng.stats().cancelled == 1
    assert gate.ran() == [0]


def test_cancel_a_running_task_two_receipts(models, tmp_path):
    gate = Gate(tmp_path)
    with gated_engine(models) as eng:
        running = eng.submit(gate.item(0))
        wait_until(running.running)
        assert running.cancel() is False  # receipt one: it is running
        assert eng.cancel(running) is True  # receipt two: its result will never be delivered
        with pytest.raises(TaskCancelled):
            running.result(timeout=1)
        assert eng.stats().shm_inputs_used > 0  # the run has not ended: its buffers are held
        gate.open()
        after = eng.submit(gate.item(1)).result(timeout=30)
        wait_until(lambda: eng.stats().shm_inputs_used == 0)
        balanced(eng)
    assert after.attempts == 1 and gate.ran() == [0, 1]


def test_cancel_with_kill_rebuilds_the_slot_and_replays_its_other_tasks(models, tmp_path, backend):
    if backend == RAY:
        pytest.skip("on Ray: tests/test_ray.py's test_cancel_running_task_with_kill (the same owner path)")
    gate = Gate(tmp_path)
    with gated_engine(models, backend, inflight_per_slot=2) as eng:
        pid = eng.stats().slots[0].pid
        hung = eng.submit(gate.item(0, seconds=3600))
        held = eng.submit(gate.item(1))  # sent ahead to the same slot
        wait_until(lambda: eng.stats().queued == 0)  # ... once the owner has sent it: then it is replayed
        gate.open()
        wait_until(lambda: gate.ran() == [0])
        assert eng.cancel(hung, kill=True) is True
        with pytest.raises(TaskCancelled):
            hung.result(timeout=5)
        res = held.result(timeout=30)
        st = eng.stats()
        balanced(eng)
    assert res.pid != pid and res.attempts == 2 and st.restarts == 1 and st.failed == 0


# -- deadlines and waiting ---------------------------------------------------------------------


def test_deadline_expiry_while_queued(models, tmp_path, backend):
    gate = Gate(tmp_path)
    with gated_engine(models, backend) as eng:
        running = eng.submit(gate.item(0))
        wait_until(running.running)
        late = eng.submit(gate.item(1), deadline=0.05)
        with pytest.raises(TaskTimeout, match="not started"):
            late.result(timeout=10)
        with pytest.raises(concurrent.futures.TimeoutError):
            running.result(timeout=0.05)  # waiting is not reclaiming: nothing changes
        gate.open()
        assert running.result(timeout=30).attempts == 1
        st = eng.stats()
        balanced(eng)
    assert st.timeouts == 1 and gate.ran() == [0]


# -- lifecycle ---------------------------------------------------------------------------------


@pytest.mark.parametrize("cancel_pending", [False, True])
def test_close_with_work_in_every_state(models, tmp_path, backend, cancel_pending):
    gate = Gate(tmp_path)
    eng = gated_engine(models, backend)
    running = eng.submit(gate.item(0))
    wait_until(running.running)
    queued = [eng.submit(gate.item(i)) for i in (1, 2)]
    closer = threading.Thread(target=eng.close, kwargs={"cancel_pending": cancel_pending})
    closer.start()
    wait_until(lambda: eng.state.name != "ACCEPTING")
    with pytest.raises(EngineClosed):
        eng.submit(gate.item(3))
    if cancel_pending:
        for f in queued:
            with pytest.raises(TaskCancelled):
                f.result(timeout=5)
    gate.open()
    closer.join(60)
    assert not closer.is_alive() and eng.state.name == "CLOSED"
    assert running.result(timeout=0).attempts == 1  # the running one ended safely
    assert all(f.done() for f in queued)
    balanced(eng)
    assert gate.ran() == ([0] if cancel_pending else [0, 1, 2])


def test_close_twice_and_from_a_done_callback(models, backend):
    eng = build(backend, models.mlp, workers=1)
    fut = eng.submit(X)
    fut.add_done_callback(lambda f: eng.close())
    fut.result(timeout=30)
    eng.close()
    eng.close()
    assert eng.state.name == "CLOSED"
    with pytest.raises(EngineClosed):
        eng.submit(X)


def test_close_timeout_cancels_what_would_not_finish(models, tmp_path, backend):
    gate = Gate(tmp_path)
    eng = gated_engine(models, backend)
    stuck = eng.submit(gate.item(0))
    wait_until(stuck.running)
    eng.close(timeout=0.2)  # returns within its timeout: the workers' stop may go on after it
    with pytest.raises(TaskCancelled):
        stuck.result(timeout=30)  # (cancelled by close's abort; the deadline only catches a hang)
    wait_until(lambda: eng.state.name == "CLOSED")  # once the owner has stopped every worker
    balanced(eng)


# -- the input contract at the door ------------------------------------------------------------

BAD_INPUTS = [
    ("missing", {}, "missing \\['x'\\]"),
    ("extra", {"x": X, "y": X}, "unknown \\['y'\\]"),
    ("dtype", {"x": X.astype(np.float64)}, "expected dtype <f4 .*got <f8"),
    ("byte order", {"x": X.astype(">f4")}, "got >f4.*byte order"),
    ("rank", {"x": X[0]}, "expected rank 2.*got rank 1"),
    ("static dim", {"x": np.ones((1, 15), np.float32)}, "axis 1 must be 16"),
    ("list", {"x": [[0.0] * 16]}, "expected a numpy.ndarray"),
    ("not a dict", "x", "expected a dict"),
]


@pytest.mark.parametrize("case,inputs,match", BAD_INPUTS, ids=[c for c, _, _ in BAD_INPUTS])
def test_bad_input_is_refused_at_submit_and_nothing_is_accepted(models, case, inputs, match):
    with Engine(models.mlp, workers=1) as eng:
        with pytest.raises(InputContractError, match=match) as info:
            eng.submit(inputs)
        assert isinstance(info.value, ValueError)
        assert eng.stats().accepted == 0
        assert eng.infer(X)["probs"].shape == (1, 8)  # and the engine is fine


def test_static_batch_model_and_litert_contract(models, backend):
    if backend == RAY:
        pytest.skip("the contract at the door is BaseEngine._admit's, one code before either backend's step 2 "
                    "(on Ray: test_ray's test_input_contract_errors_at_submit)")
    with build(backend, models.static, workers=1) as eng:
        with pytest.raises(InputContractError, match="axis 0 must be 2"):
            eng.submit(np.ones((3, 16), np.float32))
        assert eng.infer(np.ones((2, 16), np.float32))["y"].shape == (2, 16)
    with build(backend, models.tfl_mlp, workers=1) as eng:
        with pytest.raises(InputContractError, match="<f4"):
            eng.submit(np.ones((1, 16), np.float64))


def test_input_checked_after_preprocess_in_the_worker(models, backend):
    with build(backend, models.mlp, workers=1, preprocess="tests.hooks:double") as eng:
        with pytest.raises(InputContractError, match="input names"):
            eng.submit({"x": X}).result(timeout=30)  # double() returns {"y": ...}
        balanced(eng)


@pytest.mark.parametrize("model", ["mlp", "tfl_mlp"])
def test_empty_batch_is_supported(models, backend, model):
    if backend == RAY and model != "mlp":
        pytest.skip("Ray runs the empty batch on ONNX Runtime; LiteRT's is the local run's (the confined run's time)")
    with build(backend, getattr(models, model), workers=1) as eng:
        out = eng.infer(np.zeros((0, 16), np.float32))
    assert out[next(iter(out))].shape == (0, 8)


def test_input_larger_than_the_arena(models):
    with Engine(models.payload, workers=1, shm_capacity=3 << 20) as eng:
        with pytest.raises(ShmCapacityError, match="input arena holds"):
            eng.submit(np.ones((4, 256 * 1024), np.float32))
        assert eng.stats().accepted == 0
        assert eng.infer(np.ones((1, 256 * 1024), np.float32))["y"].shape == (1, 256 * 1024)


def test_outputs_larger_than_the_arena_fail_the_task_cleanly(models):
    with Engine(None, workers=1, preprocess="tests.test_contract:_blow_up", shm_capacity=1 << 20) as eng:
        with pytest.raises(ShmCapacityError, match="more than the output arena can ever hold"):
            eng.submit({"n": 1 << 20}).result(timeout=30)
        assert eng.submit({"n": 10}).result(timeout=30).outputs["y"].shape == (10,)


def _blow_up(item):
    return {"y": np.zeros(item["n"], np.float64)}


def test_not_enough_memory_for_the_arenas(models):
    with pytest.raises(ShmCapacityError, match=r"needs .* bytes .* available") as info:
        Engine(models.mlp, workers=1, shm_capacity=1 << 50)
    assert info.value.needed > info.value.available


SMALL_DEV_SHM = textwrap.dedent(
    """
    import sys
    from slabpool import Engine
    from slabpool.workers.errors import ShmCapacityError
    if __name__ == "__main__":
        try:
            Engine(sys.argv[1], workers=1, shm_backend="posix")
        except ShmCapacityError as exc:
            print("ShmCapacityError", exc.needed, exc.available, str(exc))
    """
)


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs unshare and root")
def test_a_64mb_dev_shm_fails_at_construction_not_with_sigbus_later(models, tmp_path):
    script = tmp_path / "small.py"
    script.write_text(SMALL_DEV_SHM)
    cmd = f"mount -t tmpfs -o size=64m tmpfs /dev/shm && {sys.executable} {script} {models.mlp}"
    out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", cmd],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ShmCapacityError"), out.stdout + out.stderr
    needed, available = map(int, out.stdout.split()[1:3])
    assert available <= 64 << 20 < needed and "--shm-size" in out.stdout


# -- context -----------------------------------------------------------------------------------


def test_context_is_bound_per_task_and_cleared_on_every_exit_path(models, backend):
    with build(backend, None, workers=1, preprocess="tests.hooks:read_context") as eng:
        a = eng.submit({"x": X}, context={"tenant": "a", "request_id": "r1"})
        failing = eng.submit({"x": X, "raise": True}, context={"tenant": "evil"})
        b = eng.submit({"x": X})
        assert a.result(timeout=30).outputs == {"seen": {"tenant": "a", "request_id": "r1"}}
        assert a.result().context == {"tenant": "a", "request_id": "r1"}
        with pytest.raises(SessionRunError, match="asked to fail"):
            failing.result(timeout=30)
        assert b.result(timeout=30).outputs == {"seen": {}}  # never the previous task's
        balanced(eng)


def test_queued_input_bytes_are_bounded_too(models, tmp_path, backend):
    """queue_bytes bounds the inputs waiting in the queue; a single large task always fits."""
    gate = Gate(tmp_path)
    mib = np.zeros(1 << 17)  # 1 MiB of float64 riding along with each item
    with gated_engine(models, backend, queue_capacity=100, admission="reject", queue_bytes=3 << 20) as eng:
        running = eng.submit(gate.item(0, pad=mib))
        wait_until(running.running)
        queued = [eng.submit(gate.item(i, pad=mib)) for i in (1, 2)]
        with pytest.raises(QueueFull, match="bytes"):
            eng.submit(gate.item(3, pad=mib))  # 3 MiB would be over the bound
        gate.open()
        assert all(f.result(timeout=30) for f in [running, *queued])
        big = eng.submit(gate.item(4, pad=np.zeros(1 << 20)))  # 8 MiB alone in the queue: fits
        assert big.result(timeout=30).attempts == 1
        balanced(eng)


# -- inputs whose axis 0 the model names apart (ONNX dim_params) ------------------------------------

LENGTHS = [  # (a's axis-0 name, b's): apart, or one batch axis (the same name, or names an exporter made up)
    ("N", "M", False), ("N", "N", True), ("unk__3", "unk__7", True), ("a_dynamic_axes_1", "b_dynamic_axes_1", True),
]


@pytest.mark.parametrize(("first", "second", "batch"), LENGTHS, ids=[f"{a}-{b}" for a, b, _ in LENGTHS])
def test_inputs_that_name_axis_0_apart_take_sizes_apart(tmp_path, first, second, batch):
    """a[N] and b[M] may differ, as onnxruntime runs them (was: refused, "expected 2 items on
    axis 0 like the other inputs, got 3"); such a model is not batchable (its items do not
    stack), and with batching on its calls run one by one, each right. The same name, or
    names an exporter made up per input (tf2onnx's unk__N, torch's {input}_dynamic_axes_N),
    stay one batch axis, checked at the door."""
    from tests.models import onnx_models
    from tests.reference import ort_run

    path = onnx_models.two_lengths(tmp_path / "m.onnx", first, second)
    a, b = np.arange(8, dtype=np.float32).reshape(2, 4), np.ones((3, 4), np.float32)
    with Engine(path, workers=1, max_batch_size=4) as eng:
        assert eng.describe().batchable is batch
        if batch:
            with pytest.raises(InputContractError, match=r"input 'b': expected 2 items on axis 0 .*input 'a'.*got 3"):
                eng.submit({"a": a, "b": b})
            feeds = [{"a": a, "b": b[:2] + k} for k in range(6)]
        else:
            feeds = [{"a": a[: 1 + k % 2], "b": b[: 1 + k % 3] + k} for k in range(6)]
        futs = [eng.submit(f) for f in feeds]
        got = [f.result(timeout=60).outputs["y"] for f in futs]
        st = eng.stats()
    for f, y in zip(feeds, got, strict=True):
        assert y.tobytes() == ort_run(path, f)["y"].tobytes()
    assert (st.accepted, st.completed, st.failed) == (6, 6, 0)


def test_a_size_is_checked_against_the_inputs_that_name_the_same_dim():
    """Among named dims, each input's axis 0 is checked against the first input of the same
    name, and the message names both; an unnamed one is left to the model."""
    from slabpool.workers import contract
    from slabpool.workers.protocol import TensorSpec

    specs = [TensorSpec("a", "<f4", (None,), "N"), TensorSpec("b", "<f4", (None,), "M"),
             TensorSpec("c", "<f4", (None,), "N"), TensorSpec("d", "<f4", (None,))]
    arr = {n: np.zeros(k, np.float32) for n, k in (("a", 2), ("b", 3), ("c", 2), ("d", 5))}
    assert not contract.batchable(specs)
    contract.check(arr, specs)
    with pytest.raises(InputContractError, match=r"input 'c': expected 2 items on axis 0 .*input 'a', both 'N'.*got 4"):
        contract.check({**arr, "c": np.zeros(4, np.float32)}, specs)
    assert TensorSpec("a", "<f4", (None,), "N") == TensorSpec("a", "<f4", (None,))  # (not the signature)
