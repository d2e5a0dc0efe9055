"""The worker's lean path (workers.lean, issue 21): one plain task, no option, in the fewest
opcodes. What it sends must be what the general path sends.

- in one process, two real workers (a real ONNX Runtime session each, real shared memory, a
  real pipe) given the same messages in the same order: one runs every batch the general way
  (Worker.run_batch), the other as its loop does (the lean path first). The BatchDone bytes
  are the same (run_s aside), and so are the bytes in the output region: outputs of several
  dtypes, outputs written in place, a bound run that falls back (shapes that follow the
  data), a region too small (the grant), no region leased ahead, a run that raises (the same
  RemoteError but for the traceback's frames, logged with the same task fields);
- in real worker processes: the lean path is the one taken (counted by an initializer), the
  outputs equal a general-only engine's byte for byte, an error of the run reaches the caller
  as the general path's does, and a worker that dies inside a lean run is charged for that
  task: replayed once, or quarantined when it kills every time.
"""

from __future__ import annotations

import logging
import os
import pickle
import struct
import time
from multiprocessing import Pipe
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from slabpool import Engine
from slabpool.shm.mapping import Mapping
from slabpool.workers import lean as lean_module
from slabpool.workers import main as worker_main
from slabpool.workers.errors import PoisonTask, SessionRunError
from slabpool.workers.main import Worker, WorkerBoot
from slabpool.workers.pipeline import IDLE
from slabpool.workers.protocol import (
    OutputGrant,
    RunBatch,
    TaskSpec,
    decode,
    encode,
    flat_skeleton,
)
from slabpool.workers.session import SessionSpec, load_session
from slabpool.workers.worklog import Outbox, task_fields
from tests import express_hooks as H
from tests.reference import ort_run

IN, OUT = 1 << 22, 1 << 22
STATUS = OUT - 64


def mixed(path: Path) -> Path:
    """x float32[N,4] -> y float32 (2x), i int64 (cast), b bool (x > 0), h float16 (cast),
    s float32[1] (a sum: no batch axis)."""
    nodes = [
        helper.make_node("Add", ["x", "x"], ["y"]),
        helper.make_node("Cast", ["x"], ["i"], to=TensorProto.INT64),
        helper.make_node("Greater", ["x", "zero"], ["b"]),
        helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16),
        helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
        helper.make_node("Unsqueeze", ["s", "axes"], ["s1"]),
    ]
    graph = helper.make_graph(
        nodes, "mixed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4]),
         helper.make_tensor_value_info("i", TensorProto.INT64, ["N", 4]),
         helper.make_tensor_value_info("b", TensorProto.BOOL, ["N", 4]),
         helper.make_tensor_value_info("h", TensorProto.FLOAT16, ["N", 4]),
         helper.make_tensor_value_info("s1", TensorProto.FLOAT, [1])],
        [helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0]),
         helper.make_tensor("axes", TensorProto.INT64, [1], [0])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)
    return path


@pytest.fixture(scope="module")
def mixed_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return mixed(tmp_path_factory.mktemp("lean") / "mixed.onnx")


# -- in one process: two workers, the same messages ---------------------------------------------


class Side:
    """One real Worker (not its loop): its session, its arenas, the supervisor's end of its pipe."""

    def __init__(self, model: Path, in_place_min_bytes: int | None, task_timeout: float | None = None) -> None:
        in_fd, out_fd = os.memfd_create("lean-in"), os.memfd_create("lean-out")
        os.ftruncate(in_fd, IN)
        os.ftruncate(out_fd, OUT)
        self.feed = Mapping(os.dup(in_fd), IN, writable=True)  # the caller's side of the inputs
        self.ours, theirs = Pipe()
        spec = SessionSpec(str(model), "onnxruntime")
        boot = WorkerBoot(0, 1, spec, None, None, None, (), IN, OUT, task_timeout, False, logging.INFO,
                          status_offset=STATUS, in_place_min_bytes=in_place_min_bytes)
        self.worker = Worker(boot, theirs, Outbox(theirs), Mapping(in_fd, IN, writable=False),
                             Mapping(out_fd, OUT, writable=True), load_session(spec))
        self.theirs = theirs
        self.lean_taken = 0

    def run(self, msg: RunBatch, general: bool) -> bytes:
        """The BatchDone's bytes, as the loop sends them (lean first unless `general`)."""
        w = self.worker
        assert w.lean is not None
        done = None if general else w.lean.run(msg)
        if done is not None:
            self.lean_taken += 1
        else:
            done = encode(w.run_batch(msg))
        assert w.status[0] != IDLE  # (the loop writes IDLE after the batch, as here)
        w.status[0] = IDLE
        w._in_hand = IDLE
        return done

    def close(self) -> None:
        self.ours.close()
        self.theirs.close()


def _message(side: Side, batch_id: int, feeds: dict[str, np.ndarray], out: tuple[int, int] = (4096, OUT // 2),
             in_at: int = 128, step: int = 0) -> RunBatch:
    from slabpool.workers import packing

    arrays = list(feeds.values())
    packed = packing.write(flat_skeleton(tuple(feeds)), arrays, in_at, side.feed.array)
    msg = RunBatch(batch_id, (TaskSpec(batch_id * 10, 1, 7, packed, step=step),), False, *out)
    return decode(encode(msg))  # (as the worker gets it)


def _without_run_s(data: bytes) -> bytes:
    run_s = pickle.loads(data)[2]
    return data.replace(b"G" + struct.pack(">d", run_s), b"G" + bytes(8), 1)


def _compare(model: Path, steps: list[tuple[dict[str, np.ndarray], dict[str, Any]]],
             in_place_min_bytes: int | None = None, grants: bool = False) -> tuple[list[bytes], int]:
    """Each step's message to both sides; the BatchDone bytes and the region they name equal."""
    general, lean = Side(model, in_place_min_bytes), Side(model, in_place_min_bytes)
    sent = []
    try:
        for n, (feeds, kw) in enumerate(steps, start=1):
            done = []
            for side, is_general in ((general, True), (lean, False)):
                msg = _message(side, n, feeds, **kw)
                if grants:  # (what the supervisor sends when the batch becomes its slot's head)
                    side.ours.send_bytes(encode(OutputGrant(n, 8192, OUT // 4)))
                done.append(side.run(msg, is_general))
            assert _without_run_s(done[0]) == _without_run_s(done[1]), n
            got = decode(done[0])
            for o in got.outcomes:
                for ref in (o.outputs.arrays if o.outputs else ()):
                    a, b = (s.worker.outputs.array(ref.offset, np.dtype(ref.dtype), ref.shape) for s in (general, lean))
                    assert a.tobytes() == b.tobytes(), (n, ref)
            sent.append(done[0])
        return sent, lean.lean_taken
    finally:
        general.close()
        lean.close()


def test_outputs_of_several_dtypes_are_the_general_paths_bytes(mixed_model: Path) -> None:
    x = np.array([[1.5, -2.0, 0.0, 3.25]], np.float32)
    steps = [({"x": x + k}, {}) for k in range(4)] + [({"x": np.tile(x, (3, 1))}, {})]  # (new shapes)
    steps.append(({"x": x}, {"out": (8192, 4096)}))  # another region
    sent, taken = _compare(mixed_model, steps)
    assert taken == len(steps) - 2  # the first of each signature: the general path checks it
    out = decode(sent[0]).outcomes[0]
    assert [np.dtype(r.dtype).name for r in out.outputs.arrays] == ["float32", "int64", "bool", "float16", "float32"]
    assert decode(sent[-1]).outcomes[0].outputs.arrays[0].offset == 8192


@pytest.mark.parametrize("step", [1, 3], ids=["a call a row", "calls of 3 rows, the last of 1"])
def test_a_task_in_steps_is_the_general_paths_bytes(models: Any, step: int) -> None:
    """A group of callers' rows (engine.caller.combine) or a block of infer(batch_size=): one
    session call of `step` rows after another, their outputs concatenated; the same bytes as
    the general path's, in place too."""
    x = np.random.default_rng(3).standard_normal((4, 16)).astype(np.float32)
    steps = [({"x": x + k}, {"step": step}) for k in range(3)]
    sent, taken = _compare(models.mlp, steps)
    assert taken == 2
    y = decode(sent[1]).outcomes[0].outputs.arrays[0]
    assert y.shape[0] == 4
    sent, taken = _compare(models.mlp, steps, in_place_min_bytes=0)
    assert [pickle.loads(d)[5] for d in sent] == [0, 1, 1] and taken == 2  # (BatchDone.in_place: learnt, then bound)


def test_a_task_in_steps_whose_outputs_lack_the_rows_fails_as_in_the_general_path(mixed_model: Path) -> None:
    """An output without the calls' rows on axis 0 (here a sum, of shape [1]) cannot be cut
    back into each call's rows: the task's error, the general path's ValueError."""
    x = {"x": np.ones((4, 4), np.float32)}
    errors = []
    for is_general in (True, False):
        side = Side(mixed_model, None)
        try:
            side.run(_message(side, 1, x, step=2), is_general)  # (the signature checked)
            errors.append(decode(side.run(_message(side, 2, x, step=2), is_general)).outcomes[0].error)
            assert side.lean_taken == (0 if is_general else 1)
        finally:
            side.close()
    (g, lo) = errors
    assert (g.kind, g.type_name, g.message) == (lo.kind, lo.type_name, lo.message)
    assert g.type_name == "ValueError" and "not those 2 rows on axis 0" in g.message


def test_two_inputs_and_an_output_without_batch_axis(models: Any) -> None:
    feeds = {"feats": np.arange(8, dtype=np.float32).reshape(2, 4), "ids": np.array([3, -1], np.int64)}
    _, taken = _compare(models.multi_io, [(feeds, {})] * 3)
    assert taken == 2


def test_outputs_written_in_place_report_the_same(models: Any) -> None:
    x = {"x": np.ones((1, 256 * 1024), np.float32)}
    sent, taken = _compare(models.payload, [(x, {})] * 3, in_place_min_bytes=0)
    assert [pickle.loads(s)[5] for s in sent] == [0, 1, 1]  # (BatchDone.in_place: learnt, then bound)
    assert taken == 2


def test_a_bound_run_that_fails_runs_plainly_as_before(models: Any) -> None:
    """Output shapes that follow the data (NonZero): the bound run fails, a plain run follows,
    the signature is never bound again."""
    a = np.zeros((1, 8), np.float32)
    a[0, 1] = 1
    b = np.ones((1, 8), np.float32)
    sent, taken = _compare(models.nonzero, [({"x": a}, {}), ({"x": a}, {}), ({"x": b}, {}), ({"x": b}, {})],
                           in_place_min_bytes=0)
    assert [pickle.loads(s)[5] for s in sent] == [0, 1, 0, 0]
    assert taken == 3


@pytest.mark.parametrize("out", [(4096, 8), (-1, 0)], ids=["region too small", "no region"])
def test_a_region_to_ask_for_is_granted_as_before(mixed_model: Path, out: tuple[int, int]) -> None:
    x = {"x": np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)}
    sent, taken = _compare(mixed_model, [(x, {"out": out})] * 3, grants=True)
    assert taken == 2
    assert all(decode(s).outcomes[0].outputs.arrays[0].offset == 8192 for s in sent)


class _Fields(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append({**task_fields.get(), "message": record.getMessage()})


def test_an_error_of_the_run_is_the_general_paths_remote_error(models: Any) -> None:
    ok = {"idx": np.array([1], np.int64), "x": np.ones((1, 4), np.float32)}
    bad = {"idx": np.array([99], np.int64), "x": np.ones((1, 4), np.float32)}
    handler = _Fields()
    logger = logging.getLogger("slabpool.workers")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    general, lean = Side(models.poison, None), Side(models.poison, None)
    try:
        errors = []
        for side, is_general in ((general, True), (lean, False)):
            side.run(_message(side, 1, ok), is_general)  # (the signature checked)
            handler.seen.clear()
            done = decode(side.run(_message(side, 2, bad), is_general))
            errors.append((done.outcomes[0], list(handler.seen)))
        assert lean.lean_taken == 1
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
        general.close()
        lean.close()
    (g, g_logs), (lo, lo_logs) = errors
    assert g.outputs is None and lo.outputs is None and g.task_id == lo.task_id
    ge, le = g.error, lo.error
    assert (ge.kind, ge.type_name, ge.message, ge.needed, ge.available) == (le.kind, le.type_name, le.message, 0, 0)
    assert ge.traceback.splitlines()[-1] == le.traceback.splitlines()[-1]  # (the frames above: each path's own)
    assert g_logs == lo_logs == [{"task_id": 20, "attempt": 1, "stage": "run", "message": "task failed in run: " + ge.type_name}]


@pytest.mark.parametrize("task_timeout", [None, 30.0], ids=["untimed", "timed"])
def test_the_status_word_names_the_task_during_the_run(mixed_model: Path, task_timeout: float | None) -> None:
    """Read from inside the session's run (the real run, called by a wrapper): word 0 the task;
    with task_timeout, word 1 when its time started (monotonic ns), as Worker._hand writes."""
    side = Side(mixed_model, None, task_timeout)
    seen = []
    real = side.worker.session
    assert real is not None
    run = real.run

    def watched(feeds: Any, timeout: Any = None) -> Any:
        seen.append((int(side.worker.status[0]), int(side.worker.status[1]), time.monotonic_ns(), timeout))
        return run(feeds, timeout)

    real.run = watched  # type: ignore[method-assign]
    try:
        x = {"x": np.ones((1, 4), np.float32)}
        start = time.monotonic_ns()
        side.run(_message(side, 1, x), False)
        side.run(_message(side, 2, x), False)
    finally:
        side.close()
    assert side.lean_taken == 1 and [s[0] for s in seen] == [10, 20]
    assert all(t == task_timeout for *_, t in seen)
    if task_timeout is not None:
        assert all(start <= since <= now for _, since, now, _ in seen)


def test_a_task_with_an_option_is_declined_before_any_step(mixed_model: Path) -> None:
    side = Side(mixed_model, None)
    try:
        x = {"x": np.ones((1, 4), np.float32)}
        side.run(_message(side, 1, x), False)
        msg = _message(side, 2, x)
        lean = side.worker.lean
        assert lean is not None
        t = msg.tasks[0]
        for other in (msg._replace(tasks=(t, t._replace(task_id=21))), msg._replace(tasks=(t._replace(deadline=1e12),)), msg._replace(tasks=(t._replace(context={"a": 1}),))):
            assert lean.run(other) is None
            assert side.worker.status[0] == IDLE
        assert lean.run(msg) is not None
    finally:
        side.close()


# -- real worker processes ---------------------------------------------------------------------


_IN_LEAN = [False]


def counted(directory: str, die: bool = False) -> None:
    """Initializer: each batch the lean path answers, and each the general path runs, as a line
    in <directory>/lean-<pid> or general-<pid> (its first task's id). `die`: express_hooks'
    markers too (a run that dies on its data), and each run made inside a lean one noted in
    lean-runs-<pid> (its first input value) before it runs."""
    from slabpool.workers import ort

    if die:
        H.die_on_marker(directory)
    lean_run, general_run, session_run = lean_module.LeanPath.run, worker_main.Worker.run_batch, ort.OrtSession.run

    def note(kind: str, value: Any) -> None:
        with open(os.path.join(directory, f"{kind}-{os.getpid()}"), "a") as f:
            f.write(f"{value}\n")

    def lean(self: Any, msg: RunBatch) -> Any:
        _IN_LEAN[0] = True
        try:
            done = lean_run(self, msg)
        finally:
            _IN_LEAN[0] = False
        if done is not None:
            note("lean", msg.tasks[0].task_id)
        return done

    def general(self: Any, msg: RunBatch) -> Any:
        note("general", msg.tasks[0].task_id)
        return general_run(self, msg)

    def run(self: Any, feeds: dict[str, np.ndarray], *args: Any, **kw: Any) -> Any:
        if _IN_LEAN[0]:
            note("lean-runs", float(next(iter(feeds.values())).flat[0]))
        return session_run(self, feeds, *args, **kw)

    lean_module.LeanPath.run = lean  # type: ignore[method-assign]
    worker_main.Worker.run_batch = general  # type: ignore[method-assign]
    ort.OrtSession.run = run  # type: ignore[method-assign]


def general_only() -> None:
    """Initializer: the worker never takes the lean path."""
    lean_module.LeanPath.run = lambda self, msg: None  # type: ignore[method-assign]


def _lines(directory: Path, kind: str) -> list[float]:
    return [float(v) for p in directory.glob(f"{kind}-[0-9]*") for v in p.read_text().split()]


def test_engine_calls_take_the_lean_path_with_the_general_paths_bytes(mixed_model: Path, tmp_path: Path) -> None:
    rows = np.random.default_rng(3).standard_normal((6, 4)).astype(np.float32)
    with Engine(mixed_model, workers=2, initializer=counted, initargs=(str(tmp_path),)) as eng:
        got = [eng.infer({"x": rows[i : i + 1]}) for i in range(6)]
    with Engine(mixed_model, workers=2, initializer=general_only) as eng:
        want = [eng.infer({"x": rows[i : i + 1]}) for i in range(6)]
    for g, w, i in zip(got, want, range(6), strict=True):
        ref = ort_run(mixed_model, {"x": rows[i : i + 1]})
        assert list(g) == list(w) == list(ref)
        assert all(g[k].dtype == w[k].dtype and g[k].tobytes() == w[k].tobytes() == ref[k].tobytes() for k in g)
    lean, general = _lines(tmp_path, "lean"), _lines(tmp_path, "general")
    assert len(lean) >= 4 and len(lean) + len(general) == 6  # (a worker's first signature: general)


def test_an_error_of_a_lean_run_reaches_the_caller_as_before(models: Any, tmp_path: Path) -> None:
    ok = {"idx": np.array([1], np.int64), "x": np.ones((1, 4), np.float32)}
    bad = {"idx": np.array([99], np.int64), "x": np.ones((1, 4), np.float32)}
    errors = []
    for init, args in ((counted, (str(tmp_path),)), (general_only, ())):
        with Engine(models.poison, workers=1, initializer=init, initargs=args) as eng:
            eng.infer(ok)
            with pytest.raises(SessionRunError) as err:
                eng.infer(bad)
            assert eng.infer(ok)["y"].shape == (1, 4)
            errors.append(err.value)
    assert len(_lines(tmp_path, "lean")) == 2  # (the error and the call after it)
    assert type(errors[0]) is type(errors[1]) and str(errors[0]) == str(errors[1])


def test_a_worker_that_dies_in_a_lean_run_is_charged_for_its_task(models: Any, tmp_path: Path) -> None:
    """A death inside a lean run: replayed once (charged once), and an input that kills every
    worker is quarantined. (A batch of one task is charged whether or not the status word
    names it: that the word names it is test_the_status_word_names_the_task_during_the_run's.)"""
    rows = np.random.default_rng(5).standard_normal((4, 16)).astype(np.float32)

    def row(i: int, marker: float | None = None) -> np.ndarray:
        x = rows[i : i + 1].copy()
        if marker is not None:
            x[0, 0] = marker
        return x

    with Engine(models.mlp, workers=2, max_attempts=2, initializer=counted, initargs=(str(tmp_path), True)) as eng:
        for _ in range(4):  # (each worker checks the signature once, the general way)
            eng.infer({"x": row(0)})
        once = eng.infer({"x": row(1, H.KILL)})["probs"]
        assert eng.stats().replayed == 1
        with pytest.raises(PoisonTask) as err:
            eng.infer({"x": row(2, H.ALWAYS)})
        st = eng.stats()
    assert once.tobytes() == ort_run(models.mlp, {"x": row(1, H.KILL)})["probs"].tobytes()
    assert len(err.value.crashes) == 2 and st.quarantined == 1
    assert st.restarts == 3 and st.replayed >= 1
    died_in_lean = set(_lines(tmp_path, "lean-runs")) & {H.KILL, H.ALWAYS}
    assert died_in_lean == {H.KILL, H.ALWAYS}  # (the first death of each: in a lean run)
