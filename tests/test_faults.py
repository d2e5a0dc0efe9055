"""Issue 13: one bad task never takes the engine down. One regression test per finding; the
stage x fault table is tests/test_fault_matrix.py."""

from __future__ import annotations

import gc
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from slabpool import Engine
from slabpool.engine.caller import faults
from slabpool.engine.core.states import EngineState
from slabpool.engine.local.mainguard import _guarded
from slabpool.workers.errors import (
    InputContractError,
    PoisonTask,
    SessionRunError,
    ShmCapacityError,
    TaskCancelled,
    TaskDataError,
    TaskTimeout,
)
from tests.fault_hooks import Unpicklable
from tests.ray_support.plugin import build

MiB = 1 << 20
PRE = "tests.fault_hooks:pre"
REPO = Path(__file__).resolve().parent.parent


def _good(eng: Engine, n: int, start: int = 0) -> list:
    return [eng.submit({"x": np.full(3, float(i))}) for i in range(start, start + n)]


def _check_good(futs: list, start: int = 0) -> None:
    for i, f in enumerate(futs, start):
        np.testing.assert_array_equal(f.result(timeout=60).outputs["y"], np.full(3, 2.0 * i))


def _still_serving(eng: Engine) -> None:
    assert eng.state is EngineState.ACCEPTING
    _check_good(_good(eng, 5, 100), 100)


# -- 1. the supervisor never dies of one task's data ---------------------------------------------


def test_an_unpicklable_context_fails_at_submit_and_the_engine_keeps_serving(backend):
    with build(backend, None, workers=2, preprocess=PRE) as eng:
        before = _good(eng, 20)
        with pytest.raises(TypeError, match=r"context cannot be pickled.*lock"):
            eng.submit({"x": np.ones(3)}, context={"cb": threading.Lock()})
        after = _good(eng, 20, 20)
        _check_good(before)
        _check_good(after, 20)
        _still_serving(eng)
        assert eng.stats().failed == 0


def test_an_unpicklable_input_with_a_preprocess_fails_at_submit(backend):
    with build(backend, None, workers=1, preprocess=PRE) as eng:
        before = _good(eng, 10)
        with pytest.raises(TaskDataError, match="inputs cannot be pickled"):
            eng.submit({"x": np.ones(3), "lock": threading.Lock()})
        with pytest.raises(TypeError):  # a key of a dict of arrays is user data too
            eng.submit({"x": np.ones(3), threading.Lock(): np.ones(2)})
        _check_good(before)
        _still_serving(eng)


def test_an_input_that_does_not_unpickle_in_the_worker_fails_its_own_future(backend):
    with build(backend, None, workers=1, preprocess=PRE) as eng:
        futs = _good(eng, 10)
        bad = eng.submit({"x": np.ones(3), "obj": Unpicklable()})
        futs += _good(eng, 10, 10)
        with pytest.raises(TaskDataError, match=r"cannot be unpickled.*refused on purpose"):
            bad.result(timeout=60)
        _check_good(futs)
        _still_serving(eng)
        assert eng.stats().restarts == 0


@pytest.mark.parametrize("fault,match", [("twoarg", "cannot be unpickled"), ("lock", "cannot be pickled")])
def test_a_result_that_does_not_cross_fails_its_own_future(models, backend, fault, match):
    """A postprocess result that pickles in the worker but not unpickles in the caller (an
    exception class whose __init__ takes two arguments), or does not pickle at all: that task
    fails with the real TypeError, not 'died with exit(1)'; no worker dies."""
    x = np.ones((2, 16), np.float32)
    with build(backend, models.mlp, workers=2, preprocess="tests.fault_hooks:to_feeds",
               postprocess="tests.fault_hooks:post") as eng:
        futs = [eng.submit({"x": x}) for _ in range(20)]
        bad = eng.submit({"x": x, "post": fault})
        futs += [eng.submit({"x": x}) for _ in range(20)]
        with pytest.raises(TaskDataError, match=match) as info:
            bad.result(timeout=60)
        assert isinstance(info.value, TypeError)
        for f in futs:
            assert f.result(timeout=60).outputs["probs"].shape == (2, 8)
        assert eng.state is EngineState.ACCEPTING
        assert eng.stats().restarts == 0 and eng.stats().failed == 1


@pytest.mark.parametrize("fault,error", [("twoarg", TaskDataError), ("deep", SessionRunError)])
def test_a_chunk_item_whose_result_does_not_cross_fails_alone(fault, error):
    items = [{"x": np.full(3, float(i))} for i in range(300)]
    items[150] = {"x": np.ones(3), "fault": fault}
    with Engine(None, workers=2, preprocess=PRE) as eng:
        out = list(eng.map(items, chunk=50, return_exceptions=True))
        _still_serving(eng)
    assert isinstance(out[150], error)
    for i, r in enumerate(out):
        if i != 150:
            np.testing.assert_array_equal(r.outputs["y"], np.full(3, 2.0 * i))


def test_a_result_too_deep_to_walk_fails_alone_among_grouped_tasks(backend):
    """Tiny tasks go to a worker in groups: one result nested past the recursion limit fails
    its own task (RecursionError named), not its group."""
    with build(backend, None, workers=1, preprocess=PRE) as eng:
        _check_good(_good(eng, 200))  # measured: tiny tasks go in groups from here
        futs = _good(eng, 20)
        deep = eng.submit({"x": np.ones(3), "fault": "deep"})
        futs += _good(eng, 20, 20)
        with pytest.raises(SessionRunError, match="RecursionError"):
            deep.result(timeout=60)
        _check_good(futs)
        _still_serving(eng)


# -- 2. groups and stacked batches fit the arenas ----------------------------------------------------


def _tile_model(path: Path, elements: int, times: int) -> Path:
    """x[batch, elements] -> Tile(1, times) -> y[batch, elements * times]."""
    graph = helper.make_graph(
        [helper.make_node("Tile", ["x", "reps"], ["y"])], "tile",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", elements])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", elements * times])],
        [helper.make_tensor("reps", TensorProto.INT64, [2], [1, times])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def _run_all(eng: Engine, xs: list[np.ndarray], want) -> None:
    futs = [eng.submit({"x": x}) for x in xs]
    for i, (f, x) in enumerate(zip(futs, xs, strict=True)):
        np.testing.assert_array_equal(f.result(timeout=120).outputs["y"], want(x))
        futs[i] = None  # type: ignore[call-overload]  # outputs of 21 MiB: keep few alive


def test_stacked_batches_whose_outputs_do_not_fit_together_are_split(tmp_path):
    """3 MiB in, 21 MiB out per item, max_batch_size=8: 8 items' outputs exceed half the
    output arena. Every item fits alone, so every item succeeds."""
    elements = 3 * MiB // 4
    model = _tile_model(tmp_path / "tile.onnx", elements, 7)
    xs = [np.full((1, elements), float(i), np.float32) for i in range(24)]
    with Engine(model, workers=2, max_batch_size=8, max_batch_wait_ms=50) as eng:
        _run_all(eng, xs, lambda x: np.tile(x, (1, 7)))
        assert eng.stats().failed == 0 and eng.stats().stacked_batches >= 1
        _run_all(eng, xs[:8], lambda x: np.tile(x, (1, 7)))  # sized to fit from the start now


def test_a_small_arena_with_batching_delivers_every_item(tmp_path):
    """A 16 MiB arena, 4 MiB outputs per item (from 0.5 MiB in), max_batch_size=4: a batch of
    four would need twice the 8 MiB one batch may hold; batches are split to fit."""
    elements = MiB // 8
    model = _tile_model(tmp_path / "tile.onnx", elements, 8)
    xs = [np.full((1, elements), float(i), np.float32) for i in range(40)]
    with Engine(model, workers=2, shm_capacity=16 * MiB, max_batch_size=4, max_batch_wait_ms=50,
                queue_capacity=64) as eng:
        _run_all(eng, xs, lambda x: np.tile(x, (1, 8)))
        assert eng.stats().failed == 0


@pytest.mark.parametrize("fresh", ["recycled", "replayed"])
def test_groups_sent_to_a_fresh_worker_fit(tmp_path, fresh):
    """Without batching, tiny tasks go in groups, one output region per group: 1 MiB outputs,
    groups of several, an 8 MiB arena (4 MiB per group). After recycling
    (max_tasks_per_worker) or a replay the groups are sized anew: none fails for sharing."""
    elements = MiB // 64
    model = _tile_model(tmp_path / "tile.onnx", elements, 16)
    xs = [np.full((1, elements), float(i), np.float32) for i in range(120)]
    kw: dict = {"max_tasks_per_worker": 40} if fresh == "recycled" else {}
    with faults.build(Engine, model, workers=1, shm_capacity=8 * MiB, queue_capacity=200, **kw) as eng:
        _run_all(eng, xs[:40], lambda x: np.tile(x, (1, 16)))  # measured: tiny tasks, groups next
        if fresh == "replayed":
            from slabpool.workers.protocol import FaultSpec
            faults.submit(eng, {"x": xs[0]}, FaultSpec("run", "sigkill", str(tmp_path / "once"))).result(60)
        _run_all(eng, xs, lambda x: np.tile(x, (1, 16)))
        assert eng.stats().failed == 0


@pytest.mark.parametrize("chunk", [None, 16])
def test_map_chunks_whose_outputs_do_not_fit_together_deliver_every_item(tmp_path, chunk):
    """map() of items with 4 MiB outputs (0.5 MiB in) on a 16 MiB arena: automatic chunks are
    sized to the measured outputs; a chunk given by the caller (16 items: 64 MiB of outputs)
    runs again item by item. Every item fits alone, so every item succeeds; an item that can
    never fit fails alone, as ShmCapacityError, at its position."""
    elements = MiB // 8
    model = _tile_model(tmp_path / "tile.onnx", elements, 8)
    items = [{"x": np.full((1, elements), float(i), np.float32)} for i in range(40)]
    with Engine(model, workers=2, shm_capacity=16 * MiB) as eng:
        for i, res in enumerate(eng.map(items, chunk=chunk)):
            np.testing.assert_array_equal(res.outputs["y"], np.tile(items[i]["x"], (1, 8)))
        items[7] = {"x": np.ones((5, elements), np.float32)}  # 20 MiB of outputs: never fits
        got = list(eng.map(items, chunk=chunk, return_exceptions=True))
        assert [i for i, r in enumerate(got) if not hasattr(r, "outputs")] == [7]
        assert isinstance(got[7], ShmCapacityError)
        assert eng.stats().state == "ACCEPTING"


def test_outputs_that_can_never_fit_fail_as_shm_capacity_error_alone():
    with Engine(None, workers=1, preprocess=PRE, shm_capacity=4 * MiB) as eng:
        futs = _good(eng, 5)
        big = eng.submit({"x": np.ones(3), "fault": "big", "nbytes": 8 * MiB})
        futs += _good(eng, 5, 5)
        with pytest.raises(ShmCapacityError, match=r"can ever hold.*raise shm_capacity") as info:
            big.result(timeout=60)
        assert info.value.needed >= 8 * MiB and 0 < info.value.available < 4 * MiB
        _check_good(futs)
        _still_serving(eng)


def test_inputs_that_can_never_fit_fail_at_submit():
    with Engine(None, workers=1, preprocess=PRE, shm_capacity=2 * MiB) as eng:
        with pytest.raises(ShmCapacityError, match="input arena"):
            eng.submit({"x": np.ones(MiB)})
        _still_serving(eng)


# -- 3. map(return_exceptions=True) ----------------------------------------------------------------


def test_map_yields_an_input_refused_at_the_door_at_its_position(models, backend):
    rows = [{"x": np.full((1, 16), i, np.float32)} for i in range(1000)]
    rows[1] = {"x": np.ones((1, 15), np.float32)}  # the wrong width: refused at submit()
    rows[700] = {"x": np.ones((1, 17), np.float32)}
    with build(backend, models.mlp, workers=2) as eng:
        out = list(eng.map(rows, return_exceptions=True))
        assert len(out) == 1000
        assert isinstance(out[1], InputContractError) and isinstance(out[700], InputContractError)
        assert all(r.outputs["probs"].shape == (1, 8) for i, r in enumerate(out) if i not in (1, 700))
        with pytest.raises(InputContractError):  # without return_exceptions it still raises
            list(eng.map(rows[:5]))
        assert eng.state is EngineState.ACCEPTING


# -- 4. 5. an engine dropped, a construction interrupted -------------------------------------------


@pytest.mark.parametrize("collect", [True, False])
def test_an_engine_dropped_without_close_is_collected_and_stops(models, collect):
    """Dropped, it stops at once (its last reference gone: no cycle to wait for the collector),
    though the caller keeps a Future of it."""
    eng = Engine(models.mlp, workers=2)
    kept = eng.submit({"x": np.ones((1, 16), np.float32)})
    kept.result(timeout=60)
    pids = [s.pid for s in eng.stats().slots]
    ref = weakref.ref(eng)
    with pytest.warns(ResourceWarning, match="without close"):
        del eng
        if collect:
            gc.collect()
    assert ref() is None and kept.done() and not kept.cancel()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # reaped, not only dead


def test_ctrl_c_while_the_workers_start_leaves_nothing_behind(models, tmp_path, start_method):
    with pytest.raises(KeyboardInterrupt):
        Engine(models.mlp, workers=2, start_method=start_method, initializer="tests.fault_hooks:sigint_parent",
               initargs=(str(tmp_path / "once"),))
    # the autouse fixture checks that no worker and no shared memory is left


# -- 6. task_timeout per task --------------------------------------------------------------------


@pytest.mark.slow
def test_task_timeout_holds_per_task_inside_a_group():
    """A task that sleeps 5 s among tiny tasks sent in groups, task_timeout=1: it ends with
    TaskTimeout (a limit of group size x 1 s let it finish); the others succeed."""
    with Engine(None, workers=1, preprocess=PRE, task_timeout=1.0, queue_capacity=200) as eng:
        _check_good(_good(eng, 200))  # the run time per task is measured: groups from now on
        pid = eng.stats().slots[0].pid
        os.kill(pid, signal.SIGSTOP)  # idle, no task in hand: the tasks below queue up as groups
        try:
            futs = _good(eng, 20)
            slow = eng.submit({"x": np.ones(3), "fault": "sleep", "seconds": 5})
            futs += _good(eng, 20, 20)
        finally:
            os.kill(pid, signal.SIGCONT)
        with pytest.raises(TaskTimeout, match=r"ran past task_timeout=1.0 s"):
            slow.result(timeout=60)
        _check_good(futs)
        _still_serving(eng)


# -- 7. a stalled worker ---------------------------------------------------------------------------


def test_a_worker_stopped_while_idle_keeps_no_work(caplog):
    """SIGSTOP while it holds no task: what is sent to it, its next batch included, is taken
    back after stall_after and runs on the other slot; nothing waits for it."""
    with Engine(None, workers=2, preprocess=PRE, stall_after=0.5) as eng:
        _check_good(_good(eng, 200))  # tiny tasks go in groups from here
        stopped = eng.stats().slots[0].pid
        os.kill(stopped, signal.SIGSTOP)
        try:
            with caplog.at_level(logging.WARNING, logger="slabpool.engine"):
                _check_good(_good(eng, 60))
                for i, res in enumerate(eng.map({"x": np.full(3, float(i))} for i in range(500))):
                    np.testing.assert_array_equal(res.outputs["y"], np.full(3, 2.0 * i))
            assert any("slot 0" in r.getMessage() and "has not taken" in r.getMessage() for r in caplog.records)
            _still_serving(eng)
            closer = threading.Thread(target=eng.close)  # no timeout: it holds no task to wait for
            closer.start()
            closer.join(60)  # only a deadlock reaches it
            assert not closer.is_alive() and eng.state is EngineState.CLOSED
        finally:
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass


def test_work_sent_ahead_to_a_worker_stalled_in_a_task_runs_elsewhere(caplog):
    """SIGSTOP while it runs a task: that task stays in hand (it may still finish); what was
    sent ahead runs elsewhere; close(timeout=) returns and cancels the task in hand."""
    with Engine(None, workers=2, preprocess=PRE, stall_after=0.5) as eng:
        _check_good(_good(eng, 200))
        hung = eng.submit({"x": np.ones(3), "fault": "hang"})
        slot = _slot_holding(eng, hung.slabpool_task.id)
        stopped = eng.stats().slots[slot].pid
        os.kill(stopped, signal.SIGSTOP)
        try:
            with caplog.at_level(logging.WARNING, logger="slabpool.engine"):
                _check_good(_good(eng, 60))
                # the stall is the watchdog's timer (stall_after after the hung task started):
                # it fires whether or not any of the 60 was sent ahead to that slot (if none
                # was, they may all end before it: waited for here, not asserted at once)
                deadline = time.monotonic() + 60  # only a deadlock reaches it
                while not any(f"slot {slot}" in r.getMessage() and "no progress" in r.getMessage()
                              for r in caplog.records):
                    assert time.monotonic() < deadline, "never: the stall warning"
                    time.sleep(0.01)
            _still_serving(eng)
            assert not hung.done()
            eng.close(timeout=1.0)  # returns: the stalled worker is killed
        except BaseException:
            eng.close(timeout=1.0)  # (a failure above: `with` would wait for the hung task forever)
            raise
        finally:
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
        with pytest.raises(TaskCancelled):
            hung.result(timeout=10)


def _slot_holding(eng: Engine, task_id: int) -> int:
    """The slot whose worker has the task in hand (its status word), once it has."""
    deadline = time.monotonic() + 60  # only a deadlock reaches it
    while time.monotonic() < deadline:
        for i in range(len(eng._sup.slots)):
            if int(eng._transport.status[i, 0]) == task_id:
                return i
        time.sleep(0.01)
    raise AssertionError(f"no worker took task {task_id}")


# -- 8. errors that show their cause ---------------------------------------------------------------


def test_a_script_without_the_main_guard_is_told_what_to_do(tmp_path):
    script = tmp_path / "noguard.py"
    script.write_text("import numpy as np\nfrom slabpool import Engine\n"
                      "eng = Engine(None, workers=1, preprocess='tests.hooks:double')\n"
                      "print(eng.infer({'x': np.ones(2)}))\neng.close()\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0
    assert 'if __name__ == "__main__":' in out.stderr and "line 3" in out.stderr
    guarded = tmp_path / "guarded.py"
    guarded.write_text("import numpy as np\nfrom slabpool import Engine\n\n\ndef main():\n"
                       "    with Engine(None, workers=1, preprocess='tests.hooks:double') as eng:\n"
                       "        print(eng.infer({'x': np.ones(2)})['y'].tolist())\n\n\n"
                       "if __name__ == '__main__':\n    main()\n")
    out = subprocess.run([sys.executable, str(guarded)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "[2.0, 2.0]" in out.stdout


GUARDS = {  # script -> whether the line that makes the Engine (marked E) may be guarded
    "E\n": False,
    "if '__main__' == __name__:\n    E\n": True,
    "if x == '__main__':\n    E\n": False,
    "if __name__ == '__main__' and len(sys.argv) > 0:\n    E\n": True,
    "try:\n    if __name__ == '__main__':\n        E\nexcept KeyboardInterrupt:\n    pass\n": True,
    "with ctx():\n    if __name__ == '__main__':\n        E\n": True,
    "if __name__ != '__main__':\n    pass\nelse:\n    E\n": True,
    "for i in range(2):\n    E\n": False,
    "try:\n    E\nfinally:\n    pass\n": False,
    "with ctx():\n    E\n": False,
}


@pytest.mark.parametrize("body,guarded", GUARDS.items())
def test_the_guard_is_found_at_any_depth_and_only_a_sure_miss_refused(tmp_path, body, guarded):
    """A guarded script is never refused (a guard inside try/with/else, or combined with
    `and`); a statement that no test of __name__ encloses is."""
    src = tmp_path / "s.py"
    src.write_text("a = 1\n" + body.replace("E", "eng = Engine()"))
    line = 1 + next(i for i, text in enumerate(body.splitlines(), 1) if "E" in text and "Exc" not in text)
    assert _guarded(str(src), line) is guarded
    assert _guarded(str(src), 1) is False  # `a = 1`
    assert _guarded(str(tmp_path / "missing.py"), 1) is True  # no source: never refuse


# -- 9. settings ------------------------------------------------------------------------------------


@pytest.mark.parametrize("setting,value", [
    ("task_timeout", 0), ("task_timeout", -1), ("task_timeout", float("nan")), ("task_timeout", float("inf")),
    ("shm_capacity", -5), ("shm_capacity", 1000), ("queue_bytes", -1), ("max_batch_wait_ms", -3),
    ("max_batch_wait_ms", float("nan")), ("startup_timeout", 0), ("stall_after", -1.0),
    ("max_tasks_per_worker", 0), ("worker_memory_limit", -1), ("workers", True), ("max_attempts", 0),
    ("shm_backend", "x"), ("admission", "drop_newest"), ("start_method", "thread"),
    ("spin_us", -1), ("spin_us", float("nan")), ("spin_us", 10_001), ("spin_us", True), ("spin_us", "250"),
])
def test_a_bad_setting_is_refused_by_name(setting, value):
    with pytest.raises(ValueError, match=rf"^{setting} must be .*got {value!r}"):
        Engine(None, preprocess=PRE, **{setting: value})


def test_errors_keep_their_classes():
    """What the caller catches: a result that does not cross is a TypeError, an item that can
    never fit is a ShmCapacityError (not a SessionRunError)."""
    assert issubclass(TaskDataError, TypeError)
    assert not issubclass(ShmCapacityError, SessionRunError)
    assert not issubclass(TaskDataError, PoisonTask)


def test_a_full_disk_while_writing_output_names_the_file_and_the_cause(tmp_path):
    """A real short write: the kernel's file size limit (RLIMIT_FSIZE) stops numpy's write
    part-way, as a full disk does; the error names the file and says no space was left."""
    import resource

    from slabpool.engine.job.store import write_atomic

    path = tmp_path / "shard.npy"
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, old[1]))
    try:
        with pytest.raises(OSError, match=rf"could not write {path}: no space left on device") as info:
            write_atomic(path, lambda f: np.save(f, np.zeros(48_000, np.float32)))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert "written" in str(info.value) and "bytes free" in str(info.value)
    assert not path.exists() and not list(tmp_path.iterdir())  # no torn file either


def test_a_package_run_with_dash_m_needs_no_guard(tmp_path):
    """`python -m package` runs package/__main__.py, which multiprocessing never imports again
    in a worker: its top level may make an Engine."""
    pkg = tmp_path / "tool"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text("import numpy as np\nfrom slabpool import Engine\n"
                                     "with Engine(None, workers=1, preprocess='tests.hooks:double') as eng:\n"
                                     "    print(eng.infer({'x': np.ones(2)})['y'].tolist())\n")
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{tmp_path}"}
    out = subprocess.run([sys.executable, "-m", "tool"], capture_output=True, text=True, env=env, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "[2.0, 2.0]" in out.stdout
