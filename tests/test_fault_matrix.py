"""The fault-containment matrix (issue 13): where a task goes wrong (stage) crossed with how
(fault). In every cell only the offending task fails, with a clear error of its own; the engine
is still ACCEPTING and answers correctly; nothing is left behind (processes and shared memory:
the autouse fixture; file descriptors: counted here).

    stage            unpicklable        raises             kills              hangs              too big
    submit           context: TypeError contract: Input-   -                  full queue:        inputs: Shm-
                     at submit          ContractError                         QueueFull          CapacityError
    queue            -                  cancelled while    -                  deadline passes:   > queue_bytes:
                                        queued                                TaskTimeout        still runs
    dispatch         not unpicklable in -                  worker killed with stalled worker:    batch outputs
                     the worker: Task-                     work sent ahead:   work sent ahead    too big together:
                     DataError                             all replay         runs elsewhere     split, all run
    worker           result not         preprocess raises: kills every time:  task_timeout:      outputs never
                     picklable: Task-   SessionRunError    PoisonTask         TaskTimeout        fit: ShmCapacity-
                     DataError                                                                   Error
    result transfer  result does not    postprocess        dies writing       hangs writing      group outputs too
                     unpickle: Task-    raises: Session-   outputs: Poison-   outputs: Task-     big together:
                     DataError          RunError           Task               Timeout            split, all run
    caller           context changed    done-callback      cancel(kill=True): map abandoned      -
                     after submit: the  raises: logged,    that task alone    mid-way: the rest
                     worker sees the    the task's result                     is cancelled
                     submitted one      stands

A '-' is a pair that has no meaning at that stage (nothing of the caller's runs at dispatch
that could raise; a queue holds no process to kill; the caller's own objects are never too
big for the engine). Hangs and kills that need a timer or a restart are marked slow; they
still run in the normal suite.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slabpool import Engine
from slabpool.engine.caller import faults
from slabpool.engine.core.states import EngineState
from slabpool.workers.errors import (
    InputContractError,
    PoisonTask,
    QueueFull,
    SessionRunError,
    ShmCapacityError,
    TaskDataError,
    TaskTimeout,
)
from slabpool.workers.protocol import FaultSpec
from tests.fault_hooks import Unpicklable
from tests.ray_support.inner import INNER
from tests.ray_support.plugin import RAY, build

MiB = 1 << 20
PRE = "tests.fault_hooks:pre"


def item(i: int, **extra: Any) -> dict[str, Any]:
    return {"x": np.full(3, float(i)), **extra}


def check(fut: Future, i: int) -> None:
    np.testing.assert_array_equal(fut.result(timeout=60).outputs["y"], np.full(3, 2.0 * i))


class Run:
    """One cell: good tasks before and after the bad one, each checked."""

    def __init__(self, eng: Engine, tmp: Path) -> None:
        self.eng, self.tmp = eng, tmp
        self.good: list[tuple[Future, int]] = []
        self.n = 0

    def goods(self, k: int = 8) -> None:
        for _ in range(k):
            self.good.append((self.eng.submit(item(self.n)), self.n))
            self.n += 1

    def pid(self, slot: int = 0) -> int:
        return self.eng.stats().slots[slot].pid

    def warm(self) -> None:
        """Tasks measured: from now on tiny tasks go in groups."""
        self.goods(100)
        for f, i in self.good:
            check(f, i)


def fails(fut: Future, cls: type[BaseException], match: str) -> None:
    with pytest.raises(cls, match=match):
        fut.result(timeout=60)


# -- the cells ------------------------------------------------------------------------------------


def submit_unpicklable(r: Run) -> None:
    with pytest.raises(TypeError, match="context cannot be pickled"):
        r.eng.submit(item(0), context={"lock": __import__("threading").Lock()})


def submit_raises(r: Run) -> None:
    with pytest.raises(InputContractError, match="x"):
        r.eng.submit({"x": np.ones((1, 15), np.float32)})


def submit_hangs(r: Run) -> None:
    pid = r.pid()
    os.kill(pid, signal.SIGSTOP)  # nothing drains the queue now
    try:
        with pytest.raises(QueueFull):
            for i in range(200):
                r.eng.submit(item(i), block_timeout=0.05).add_done_callback(lambda f: None)
    finally:
        os.kill(pid, signal.SIGCONT)


def submit_too_big(r: Run) -> None:
    with pytest.raises(ShmCapacityError, match="input arena"):
        r.eng.submit({"x": np.ones(2 * MiB)})


def queue_raises(r: Run) -> None:
    pid = r.pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        fut = r.eng.submit(item(0))
        r.goods(2)
        cancelled = [f for f, _ in r.good[-2:]] + [fut]
        assert any(f.cancel() for f in cancelled)  # one of them still queued
        r.good = [(f, i) for f, i in r.good if not f.cancelled()]
    finally:
        os.kill(pid, signal.SIGCONT)


def queue_hangs(r: Run) -> None:
    pid = r.pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        bad = r.eng.submit(item(0), deadline=0.2)
        fails(bad, TaskTimeout, "still queued at its deadline")
    finally:
        os.kill(pid, signal.SIGCONT)


def queue_too_big(r: Run) -> None:
    big = r.eng.submit({"x": np.ones(MiB // 2)})  # > queue_bytes: waits for an empty queue, then runs
    np.testing.assert_array_equal(big.result(timeout=60).outputs["y"], np.full(MiB // 2, 2.0))


def dispatch_unpicklable(r: Run) -> None:
    fails(r.eng.submit(item(0, obj=Unpicklable())), TaskDataError, "cannot be unpickled")


def dispatch_kills(r: Run) -> None:
    r.warm()
    pid = r.pid()
    os.kill(pid, signal.SIGSTOP)
    r.goods(40)  # groups sent ahead to a worker that then dies: they all replay
    os.kill(pid, signal.SIGKILL)


def dispatch_hangs(r: Run) -> None:
    r.warm()
    pid = r.pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        r.goods(40)
        held = {t.id for t in r.eng._sup.slots[0].batches[0].tasks}  # what it has in hand
        waiting = [(f, i) for f, i in r.good if f.slabpool_task.id not in held]
        for f, i in waiting:  # everything else finishes on the other slot
            check(f, i)
    finally:
        os.kill(pid, signal.SIGCONT)


def dispatch_too_big(r: Run) -> None:
    futs = [r.eng.submit(item(i, fault="big", nbytes=MiB)) for i in range(12)]
    for f in futs:  # 1 MiB each, batches of 8 would need 8 MiB of a 4 MiB limit per batch
        assert f.result(timeout=60).outputs["y"].nbytes == MiB


def worker_unpicklable(r: Run) -> None:
    fails(r.eng.submit(item(0, fault="lock")), TaskDataError, "cannot be pickled")


def worker_raises(r: Run) -> None:
    fails(r.eng.submit(item(0, fault="raise")), SessionRunError, "asked to fail")


def worker_kills(r: Run) -> None:
    fails(r.eng.submit(item(0, fault="kill")), PoisonTask, "SIGKILL")


def worker_hangs(r: Run) -> None:
    fails(r.eng.submit(item(0, fault="hang")), TaskTimeout, r"ran past task_timeout=1\.0 s")


def worker_too_big(r: Run) -> None:
    fails(r.eng.submit(item(0, fault="big", nbytes=16 * MiB)), ShmCapacityError, "can ever hold")


def transfer_unpicklable(r: Run) -> None:
    fails(r.eng.submit(item(0, fault="twoarg")), TaskDataError, "cannot be unpickled")


def transfer_raises(r: Run) -> None:
    bad = r.eng.submit({"x": np.ones((1, 16), np.float32), "post": "raise"})
    fails(bad, SessionRunError, "postprocess refused")


def transfer_kills(r: Run) -> None:
    bad = faults.submit(r.eng, item(0), FaultSpec("write_outputs", "sigkill"))
    fails(bad, PoisonTask, "SIGKILL")


def transfer_hangs(r: Run) -> None:
    bad = faults.submit(r.eng, item(0), FaultSpec("write_outputs", "hang"))
    fails(bad, TaskTimeout, "task_timeout")


def transfer_too_big(r: Run) -> None:
    r.warm()
    pid = r.pid()
    os.kill(pid, signal.SIGSTOP)  # queue up: a group of 1 MiB outputs, more than 4 MiB together
    try:
        futs = [r.eng.submit(item(i, fault="big", nbytes=MiB)) for i in range(20)]
    finally:
        os.kill(pid, signal.SIGCONT)
    for f in futs:
        assert f.result(timeout=60).outputs["y"].nbytes == MiB


def caller_unpicklable(r: Run) -> None:
    ctx: dict[str, Any] = {"tenant": "a"}
    fut = r.eng.submit(item(0), context=ctx)
    ctx["lock"] = __import__("threading").Lock()  # after submit: the task was sealed before
    check(fut, 0)


def caller_raises(r: Run) -> None:
    fut = r.eng.submit(item(0))
    fut.add_done_callback(lambda f: 1 / 0)
    check(fut, 0)


def caller_kills(r: Run) -> None:
    for f, i in r.good:  # idle slots: the hanging task is the one in hand, not sent ahead
        check(f, i)
    fut = r.eng.submit(item(0, fault="hang"))
    deadline = time.monotonic() + 60  # only a deadlock reaches it
    while not fut.running() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert r.eng.cancel(fut, kill=True)  # its slot is rebuilt; the slot's other tasks replay
    with pytest.raises(CancelledError):
        fut.result(timeout=60)


def caller_hangs(r: Run) -> None:
    it = r.eng.map((item(i) for i in range(500)), window=16)
    for i, res in zip(range(10), it, strict=False):
        np.testing.assert_array_equal(res.outputs["y"], np.full(3, 2.0 * i))
    it.close()  # abandoned: what it still had queued is cancelled


@dataclass
class Cell:
    run: Callable[[Run], None]
    settings: dict[str, Any] = field(default_factory=dict)
    model: str | None = None  # a model of the `models` fixture; None: the preprocess is the task
    failed: int | None = None  # tasks failed in stats() (None: not checked)
    faults: bool = False  # its tasks may carry a FaultSpec (engine.caller.faults)


SMALL = {"shm_capacity": 8 * MiB}
CELLS: dict[tuple[str, str], Cell] = {
    ("submit", "unpicklable"): Cell(submit_unpicklable, failed=0),
    ("submit", "raises"): Cell(submit_raises, model="mlp", failed=0),
    ("submit", "hangs"): Cell(submit_hangs, {"workers": 1, "queue_capacity": 4}, failed=0),
    ("submit", "too big"): Cell(submit_too_big, {"shm_capacity": 4 * MiB}, failed=0),
    ("queue", "raises"): Cell(queue_raises, {"workers": 1}, failed=0),
    ("queue", "hangs"): Cell(queue_hangs, {"workers": 1, "stall_after": 0.3}, failed=1),
    ("queue", "too big"): Cell(queue_too_big, {"queue_bytes": MiB // 4}, failed=0),
    ("dispatch", "unpicklable"): Cell(dispatch_unpicklable, failed=1),
    ("dispatch", "kills"): Cell(dispatch_kills, {"workers": 1, "queue_capacity": 100}, failed=0),
    ("dispatch", "hangs"): Cell(dispatch_hangs, {"workers": 2, "stall_after": 0.3}),
    ("dispatch", "too big"): Cell(dispatch_too_big, {**SMALL, "max_batch_size": 8, "max_batch_wait_ms": 50},
                                  failed=0),
    ("worker", "unpicklable"): Cell(worker_unpicklable, failed=1),
    ("worker", "raises"): Cell(worker_raises, failed=1),
    ("worker", "kills"): Cell(worker_kills, failed=1),
    ("worker", "hangs"): Cell(worker_hangs, {"task_timeout": 1.0}, failed=1),
    ("worker", "too big"): Cell(worker_too_big, SMALL, failed=1),
    ("result transfer", "unpicklable"): Cell(transfer_unpicklable, failed=1),
    ("result transfer", "raises"): Cell(transfer_raises, {"preprocess": "tests.fault_hooks:to_feeds",
                                                          "postprocess": "tests.fault_hooks:post"}, "mlp", 1),
    ("result transfer", "kills"): Cell(transfer_kills, failed=1, faults=True),
    ("result transfer", "hangs"): Cell(transfer_hangs, {"task_timeout": 1.0}, failed=1, faults=True),
    ("result transfer", "too big"): Cell(transfer_too_big, {**SMALL, "workers": 1, "queue_capacity": 100}, failed=0),
    ("caller", "unpicklable"): Cell(caller_unpicklable, failed=0),
    ("caller", "raises"): Cell(caller_raises, failed=0),
    ("caller", "kills"): Cell(caller_kills, failed=0),
    ("caller", "hangs"): Cell(caller_hangs, failed=0),
}
# On Ray: the cells where an actor or the Ray transport takes part. Why the others do not run there:
ONE_CODE = "the caller's side (the door, the queue, a done-callback: BaseEngine, TaskQueue), one code on both backends"
PIPELINE = ("a hook that raises fails its task in workers.pipeline, the same code in an actor (on Ray: "
            "test_contract's context case, test_first_contact's refusal after preprocess)")
HELD_BY_SIGSTOP = ("holds a local worker with SIGSTOP to fill its pipe or the queue behind it (on Ray a slot is held "
                   "from inside its task: test_contract, test_ray)")
NOT_ON_RAY = {
    ("submit", "raises"): ONE_CODE, ("caller", "raises"): ONE_CODE, ("queue", "too big"): ONE_CODE,
    ("submit", "hangs"): HELD_BY_SIGSTOP, ("queue", "raises"): HELD_BY_SIGSTOP, ("queue", "hangs"): HELD_BY_SIGSTOP,
    ("dispatch", "kills"): HELD_BY_SIGSTOP, ("dispatch", "hangs"): HELD_BY_SIGSTOP,
    ("submit", "too big"): "the input arena's size (shm_capacity): an actor's inputs go through Ray's object store",
    ("dispatch", "too big"): "outputs split to fit the output arena (shm_capacity): the local transport's",
    ("worker", "too big"): "outputs larger than the output arena (shm_capacity): the local transport's",
    ("result transfer", "too big"): "group outputs split to fit the output arena: the local transport's",
    ("result transfer", "kills"): "write_outputs is a local worker's stage (into the output arena)",
    ("result transfer", "hangs"): "write_outputs is a local worker's stage (into the output arena)",
    ("worker", "raises"): PIPELINE, ("result transfer", "raises"): PIPELINE,
    ("caller", "hangs"): ONE_CODE + " (map() abandoned: engine.caller.mapping; on Ray in test_contract)",
    ("submit", "unpicklable"): ONE_CODE + " (the context sealed at submit; on Ray in test_faults)",
    ("worker", "kills"): "PoisonTask names the signal that killed the worker; Ray does not say how an actor died "
                         "(the poison itself runs on Ray in test_crash and test_ray)",
}
SLOW = {("dispatch", "kills"), ("dispatch", "hangs"), ("worker", "kills"), ("worker", "hangs"),
        ("result transfer", "kills"), ("result transfer", "hangs"), ("caller", "kills")}


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(scope="module", autouse=True)
def _warm_multiprocessing():
    """The forkserver and the resource tracker start once per process, with their own fds
    (not in the confined Ray run, whose namespace must be empty at its end)."""
    if INNER:
        return
    with Engine(None, workers=1, preprocess=PRE) as eng:
        eng.infer(item(0))


@pytest.mark.parametrize("stage,fault", [
    pytest.param(*key, marks=[pytest.mark.slow] if key in SLOW else [], id=f"{key[0]}-{key[1]}") for key in CELLS])
def test_only_the_offending_task_fails(models, tmp_path, caplog, backend, stage, fault):
    if backend == RAY and (stage, fault) in NOT_ON_RAY:
        pytest.skip(NOT_ON_RAY[(stage, fault)])
    cell = CELLS[(stage, fault)]
    settings = {"workers": 2, "preprocess": None if cell.model else PRE, **cell.settings}
    if settings["preprocess"] is None:
        del settings["preprocess"]
    fds = _fds()
    model = getattr(models, cell.model) if cell.model else None
    with faults.injecting() if cell.faults else contextlib.nullcontext():
        engine = build(backend, model, **settings)
    with caplog.at_level(logging.ERROR, logger="slabpool.engine"), engine as eng:
        r = Run(eng, tmp_path)
        if model is None:
            r.goods()
        cell.run(r)
        if model is None:
            r.goods()
            for f, i in r.good:
                check(f, i)
            check(eng.submit(item(7)), 7)  # and it still answers correctly
        else:
            assert eng.infer({"x": np.ones((1, 16), np.float32)})["probs"].shape == (1, 8)
        assert eng.state is EngineState.ACCEPTING
        if cell.failed is not None:
            assert eng.stats().failed == cell.failed
    assert not [r for r in caplog.records if "supervisor failed" in r.getMessage()]
    assert eng.state is EngineState.CLOSED
    assert backend == RAY or _fds() <= fds, "file descriptors left behind"  # (Ray's client opens its own)
