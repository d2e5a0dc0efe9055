"""Cancel is safe in every queue (issue 19, item 4): a task cancelled wherever it is never
takes the engine down, never frees inputs a worker may still read, and every other task ends
right, once.

The table: (where the task is when cancelled) x (what it is: a single task, a member of a group,
a member of a stacked batch, a map() chunk) x (both start methods, and Ray: the ledger and the
queue are the one owner's; a chunk is the local engine's, chunked_map is False on Ray). Each case kills its worker from
inside a task (tests.owner_hooks.gated) and holds the rebuilt worker in its initializer until
the test lets it go (tests.owner_hooks.hold_rebuilt), so "waits to replay" and "in hand" are
states the test reaches, not moments it hopes for:

    1 G (a chunk, gated) in hand in worker 1; the batch [K, S, V, B...] sent ahead behind it
    2 G goes on; K kills worker 1    -> worker 2 held in STARTING; the batch waits to replay
    3 cancel V here ("replay"), or a new V ("queued"); then let worker 2 go;
      or cancel V while S is in hand and V waits in the same batch ("grouped"),
      or while V itself is in hand ("in hand")
"""

from __future__ import annotations

import time
from concurrent.futures import CancelledError, Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slabpool import Engine
from slabpool.engine.caller.request import Request
from slabpool.workers import packing
from slabpool.workers.errors import TaskCancelled
from tests.owner_hooks import DEADLOCK_S
from tests.ray_support.plugin import RAY
from tests.ray_support.plugin import build as build_on
from tests.reference import ort_run

X = np.random.default_rng(1).standard_normal((2, 16)).astype(np.float32)
BATCH = 8  # tasks in the batch that dies: a group of 8 goes ahead to a busy slot (MIN_GROUP)

WHERE = ("queued", "replay", "grouped", "in hand")
KINDS = ("single", "group", "stacked", "chunk")
CASES = [(w, k) for w in WHERE for k in KINDS if not (w == "grouped" and k == "single")]  # a single has no mates


def wait_until(cond: Any, what: str) -> None:
    """A state a hook or the engine reaches (the deadline only catches a deadlock)."""
    end = time.monotonic() + DEADLOCK_S
    while not cond():
        assert time.monotonic() < end, f"never: {what}"
        time.sleep(0.005)


class Case:
    """One cell of the table: the engine, the tasks, each pinned to its stage by a file."""

    def __init__(self, eng: Engine, tmp: Path, where: str, kind: str) -> None:
        self.eng, self.tmp, self.where, self.kind = eng, tmp, where, kind
        self.others: list[Future[Any]] = []  # every task but the victim: each must complete
        self.victim: Future[Any] | None = None

    def item(self, x: np.ndarray = X, **files: str) -> dict[str, Any]:
        return {"x": x, **{k: str(self.tmp / v) for k, v in files.items()}}

    def first(self) -> Future[Any]:
        """G: alone at once, never waiting for batch mates."""
        return alone(self.eng, self.item(gate="gate-g"))

    def submit(self, item: dict[str, Any], *, chunk: bool = False) -> Future[Any]:
        if chunk:  # a map() chunk: one task, an outcome per item
            return self.eng._submit_chunk([self.item(), item, self.item()], None)
        return self.eng.submit(item)

    def victim_item(self) -> dict[str, Any]:
        return self.item(gate="gate-v") if self.where == "in hand" else self.item()

    def run_up_to_the_death(self) -> None:
        """Steps 1-2: returns with the batch waiting to replay and worker 2 held."""
        tmp = self.tmp
        for name in ("gate-g", "gate-s", "gate-v", "hold-2"):
            (tmp / name).touch()
        # groups follow the measured run time per task: pin it tiny, so that the batch is one
        # group sent ahead on any machine (a step measured slow under load sends one by one)
        self.eng._owner.call(setattr, self.eng._owner.dispatcher, "task_s", 1e-5).result()
        self.others.append(self.first())  # G
        wait_until((tmp / "gate-g.in").exists, "G in hand")
        single = self.kind == "single" and self.where in ("replay", "in hand")
        k = self.submit(self.item(kill_once="k", **({"gate": "gate-v"} if single and self.where == "in hand" else {})))
        if single:
            self.victim = k  # the task that killed its worker: it replays alone
        else:
            self.others.append(k)
        batch = [k]
        if self.where == "grouped":
            batch.append(self.submit(self.item(gate="gate-s")))
            self.others.append(batch[-1])
        if self.victim is None and self.where != "queued":
            self.victim = self.submit(self.victim_item(), chunk=self.kind == "chunk")
            batch.append(self.victim)
        while len(batch) < BATCH:
            batch.append(self.submit(self.item()))
            self.others.append(batch[-1])
        wait_until(lambda: self.eng.stats().queued == 0, "the batch sent ahead")
        (tmp / "gate-g").unlink()
        wait_until((tmp / "started-2").exists, "worker 1 dead, worker 2 held")
        # Ray restarts the actor itself (started-2) before the owner has settled the death: until
        # then it may still send to the slot (locally the owner starts worker 2: no wait here)
        wait_until(lambda: self.eng.stats().slots[0].state == "STARTING", "the owner saw the death")

    def cancel_victim(self) -> None:
        assert self.victim is not None
        assert self.eng.cancel(self.victim)
        with pytest.raises(TaskCancelled if self.where != "queued" else CancelledError):
            self.victim.result(timeout=DEADLOCK_S)


def alone(eng: Engine, item: dict[str, Any]) -> Future[Any]:
    """A task that never waits for batch mates: a chunk of one item; on Ray, which has no
    chunks, a task that counts no rows (as infer(batch_size=) sends a block)."""
    if eng.chunked_map:
        return eng._submit_chunk([item], None)
    return eng._submit(Request(item, units=0))


def reference(eng: Engine, x: np.ndarray = X) -> np.ndarray:
    """The outputs of one item alone (a stacked engine would wait for its mates)."""
    outputs = alone(eng, {"x": x}).result(timeout=DEADLOCK_S).outputs
    return (packing.chunk_items(outputs)[0] if eng.chunked_map else outputs)["probs"]


def build(models: Any, tmp: Path, kind: str, where: str) -> Engine:
    """One slot; `where`: a start method, or "ray"."""
    if where == RAY and kind == "chunk":
        pytest.skip("a map() chunk is one task of many items on the local engine only (chunked_map is False on Ray)")
    stacked = {"max_batch_size": BATCH, "max_batch_wait_ms": 600_000} if kind == "stacked" else {}
    return build_on(where, models.mlp, workers=1, preprocess="tests.owner_hooks:gated",
                    initializer="tests.owner_hooks:hold_rebuilt", initargs=(str(tmp),), queue_capacity=64, **stacked)




@pytest.mark.parametrize("where,kind", CASES, ids=[f"{w.replace(' ', '-')}-{k}" for w, k in CASES])
def test_cancel_anywhere_leaves_the_others_and_the_engine_whole(models, tmp_path, start_or_ray, where, kind):
    with build(models, tmp_path, kind, start_or_ray) as eng:
        want = reference(eng)
        case = Case(eng, tmp_path, where, kind)
        case.run_up_to_the_death()
        if where == "queued":
            case.victim = case.submit(case.victim_item(), chunk=kind == "chunk")
            for _ in range({"single": 0, "stacked": BATCH}.get(kind, 1)):  # mates: they would go together
                case.others.append(case.submit(case.item()))
            case.cancel_victim()
        elif where == "replay":
            case.cancel_victim()
        (tmp_path / "hold-2").unlink()  # 3: worker 2 replays
        if where == "grouped":
            wait_until((tmp_path / "gate-s.in").exists, "S in hand, V behind it in its batch")
            case.cancel_victim()
        elif where == "in hand":
            wait_until((tmp_path / "gate-v.in").exists, "V in hand")
            case.cancel_victim()
        for gate in ("gate-s", "gate-v"):
            (tmp_path / gate).unlink()
        results = [f.result(timeout=DEADLOCK_S) for f in case.others]
        after = reference(eng)  # the engine keeps serving
        st = eng.stats()
    for r in results:
        for outs in [r.outputs] if isinstance(r.outputs, dict) else packing.chunk_items(r.outputs):  # (a chunk)
            np.testing.assert_allclose(outs["probs"], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(after, want)
    assert st.restarts == 1
    assert (st.completed, st.failed, st.cancelled) == (len(results) + 2, 0, 1)  # each ended once
    assert st.accepted == st.completed + st.failed + st.cancelled
    assert st.shm_inputs_used == 0, "an input lease leaked"


@pytest.mark.parametrize("kind", ["group", "stacked"])
def test_cancelled_replays_are_never_sent_again(models, tmp_path, backend, kind):
    """The issue's case, many times over: half a dead worker's batch is cancelled while it
    waits to replay, and new tasks lease inputs meanwhile (the freed memory is reused at
    once). A cancelled task's inputs are freed then, so it must never reach a worker: it did,
    and the answer of a task the supervisor no longer held failed every task with
    EngineInternalError."""
    if backend == RAY:
        pytest.skip("its shared-memory half (a freed lease reused at once) is the local transport's; the cancel "
                    "in the replay queue runs on Ray in the table's replay cells")
    with build(models, tmp_path, kind, "forkserver") as eng:
        case = Case(eng, tmp_path, "replay", kind)
        case.run_up_to_the_death()
        batch = case.others[1:]  # K and seven mates; the victim of the case too
        victims = [*batch[1::2], case.victim]
        assert all(eng.cancel(f) for f in victims)
        fresh = [eng.submit({"x": X + i}) for i in range(1, BATCH + 1)]
        (tmp_path / "hold-2").unlink()
        for gate in ("gate-s", "gate-v"):
            (tmp_path / gate).unlink()
        kept = [f.result(timeout=DEADLOCK_S) for f in [*batch[0::2], *fresh]]
        for f in victims:
            with pytest.raises(TaskCancelled):
                f.result(timeout=DEADLOCK_S)
        want = [reference(eng)] * len(batch[0::2]) + [reference(eng, X + i) for i in range(1, BATCH + 1)]
        st = eng.stats()
    for r, w in zip(kept, want, strict=True):
        np.testing.assert_allclose(r.outputs["probs"], w, rtol=1e-5, atol=1e-6)
    assert st.cancelled == len(victims) and st.failed == 0 and st.shm_inputs_used == 0


def test_a_cancelled_queued_task_is_done_for_wait_and_as_completed(models, tmp_path, backend):
    """Future.cancel() of a queued task: concurrent.futures.wait() and as_completed() see it
    done at once, as with an executor's Future (was: never; it stayed CANCELLED, not
    CANCELLED_AND_NOTIFIED, and wait() ran to its timeout); the task never runs."""
    import concurrent.futures as cf

    gate, ran = tmp_path / "gate", tmp_path / "ran"
    item = {"x": X[:1], "gate": str(gate), "log": str(ran)}
    with build_on(backend, models.mlp, workers=1, inflight_per_slot=1, preprocess="tests.hooks:gated") as eng:
        held = eng.submit(item)
        wait_until(ran.exists, "the first task held in its worker")
        queued = eng.submit(item)
        assert queued.cancel() and queued.cancelled()
        done, not_done = cf.wait([queued, held], timeout=DEADLOCK_S, return_when=cf.FIRST_COMPLETED)
        assert done == {queued} and not_done == {held}
        assert list(cf.as_completed([queued], timeout=DEADLOCK_S)) == [queued]
        gate.touch()
        assert held.result(timeout=DEADLOCK_S).outputs["probs"].shape == (1, 8)
        st = eng.stats()
    assert (st.accepted, st.completed, st.cancelled) == (2, 1, 1)
    assert ran.read_text().split() == ["?"]  # (the cancelled one never ran)


@pytest.mark.parametrize("kill", [False, True], ids=["cancel", "kill"])
def test_a_task_sent_ahead_and_cancelled_never_runs(models, tmp_path, kill):
    """A task sent ahead to a busy slot (inflight_per_slot=2) and cancelled before it starts is
    taken back: its worker skips it, so the calls behind it do not wait for it (was: it ran,
    its result dropped; a server's request whose client had gone ran all the same), and
    kill=True rebuilds no worker for it. Its inputs are freed once the worker has answered."""
    gate, ran = tmp_path / "gate", tmp_path / "ran"
    with Engine(models.mlp, workers=1, preprocess="tests.hooks:gated") as eng:
        held = eng.submit({"x": X[:1], "gate": str(gate), "log": str(ran), "id": "held"})
        wait_until(ran.exists, "the first task held in its worker")
        ahead = eng.submit({"x": X[:1], "log": str(ran), "id": "ahead"})
        wait_until(lambda: eng.stats().queued == 0, "the second task sent ahead to the busy slot")
        assert eng.cancel(ahead, kill=kill)
        with pytest.raises(TaskCancelled, match="sent ahead to a worker: taken back"):
            ahead.result(timeout=DEADLOCK_S)
        gate.touch()
        assert held.result(timeout=DEADLOCK_S).outputs["probs"].shape == (1, 8)
        after = eng.submit({"x": X[:1], "log": str(ran), "id": "after"}).result(timeout=DEADLOCK_S)
        assert after.outputs["probs"].tobytes() == ort_run(models.mlp, {"x": X[:1]})["probs"].tobytes()
        wait_until(lambda: eng.stats().shm_inputs_used == 0, "every input freed")
        st = eng.stats()
    assert ran.read_text().split() == ["held", "after"]  # (the cancelled one never ran)
    assert (st.accepted, st.completed, st.cancelled, st.restarts) == (3, 2, 1, 0)


def test_a_batch_taken_back_after_its_worker_began_it_is_answered_and_teaches_nothing() -> None:
    """The race the sent-ahead cancel meets: the worker had already finished the batch before
    and begun this one when the Revoke left, and its NeedOutput for it arrives with the batch
    emptied (revoked). The supervisor refuses it a region (nothing reads those outputs) and
    learns no size from it; its answer teaches nothing either. Was: a ZeroDivisionError in the
    owner thread (`nbytes // len(batch.tasks)`), and every call failed with EngineInternalError
    (a hostile run: 6 runs of 6, within 264 cancels)."""
    from slabpool.engine.core.task import Batch
    from slabpool.engine.local.regions import OutputRegions, Sent
    from slabpool.shm.arena import Arena

    arena = Arena("out", 1 << 20, instance="test-revoked")
    try:
        regions = OutputRegions(arena, 0)
        batch = Batch([], stack=False, revoked=True)
        grant = regions.on_need(Sent(batch), 4096)
        assert grant is not None and grant.offset == -1 and "taken back" in grant.error
        regions.observed(batch, 4096)
        regions.learn(batch, 4096)
        assert regions.per_task == 0 and not regions._predicted and arena.used == 0
    finally:
        arena.close()
