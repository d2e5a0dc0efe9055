"""The fast path (engine.core.fastpath, issue 21): a caller that finds the engine idle
dispatches its own task and is lent the slot, waiting on the worker's pipe itself; every
guarantee of the owner thread's path holds on it, because it runs the owner's own code under
the owner lock, and everything off the happy path goes back to the owner thread.

Each case checks that the lend happened (`lends`, `lent` while a call waits; `served`: its
caller read the answer), then what the
owner's path promises: a death replays exactly once in acceptance order, timers fire, cancel and
close give receipts, each task sees its own context, the counters balance, a fork leaves the
parent's lend alone. Real workers, real signals; faults are triggered by the task itself
(engine.caller.faults, or a file gate in its preprocess); no timing is asserted (the waits here
only catch deadlocks).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slabpool import Engine
from slabpool.engine.caller import faults
from slabpool.engine.core import fastpath
from slabpool.workers.errors import EngineClosed, TaskCancelled, TaskTimeout
from slabpool.workers.protocol import FaultSpec
from tests.models import onnx_models
from tests.reference import ort_run

X = np.random.default_rng(3).standard_normal((1, 16)).astype(np.float32)
GATED = "tests.async_hooks:gated"  # marks started-<tag> in dir, waits for dir/open (with "wait")


def _fast(eng: Engine) -> Any:
    return eng._owner.fast  # type: ignore[attr-defined]


def _until(cond: Any, what: str) -> None:
    """Wait for `cond()` (a deadlock guard, not a timing)."""
    deadline = time.monotonic() + 60
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        time.sleep(0.002)


# epoll_wait, epoll_pwait, epoll_pwait2 by machine (asm/unistd.h): Python's epoll.poll makes one
EPOLL_WAITS = {"x86_64": {232, 281, 441}, "aarch64": {22, 441}}[os.uname().machine]


def _in_epoll(tid: int) -> bool:
    """The kernel's word: thread `tid` of this process is blocked in an epoll wait now
    (/proc/PID/task/TID/syscall: the number of the syscall it sleeps in, or "running")."""
    head = Path(f"/proc/self/task/{tid}/syscall").read_text().split(maxsplit=1)[0]
    return head.lstrip("-").isdigit() and int(head) in EPOLL_WAITS


def _owner_asleep(eng: Engine) -> None:
    """The owner thread sleeps in its selector's epoll wait (it holds no lock), and nothing is
    on its way to wake it: the next call may be lent. The lock let go of and `sleep_until` set
    are not enough: both hold, too, from the moment the wait returns (a wake-up read) until the
    owner takes its lock again, and a call made then races it for the lock (a CI run: not
    lent). A wake-up written but not yet read (the last lent call's dispatch told the owner of
    a new timer) would have it take its lock again under the next call."""
    fast, selector = _fast(eng), eng._transport.selector
    tid = eng._owner.thread._thread.native_id
    _until(lambda: fast.sleep_until > 0 and fast.lock.holder == 0 and not selector._wake_pending
           and not eng._owner.thread.pending and _in_epoll(tid), "the owner thread sleeps")


def _probs(models: Any, x: np.ndarray) -> np.ndarray:
    return ort_run(models.mlp, {"x": x})["probs"]


def _gated(d: Path, tag: str, wait: bool) -> dict[str, Any]:
    return {"x": X, "dir": str(d), "tag": tag, "wait": wait}


def _in_thread(fn: Any, *args: Any) -> tuple[threading.Thread, list[Any]]:
    """Run fn(*args) on a thread; its outcome (the value, or the exception) lands in the list."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn(*args))
        except BaseException as exc:  # (the test looks at it)
            out.append(exc)

    t = threading.Thread(target=run)
    t.start()
    return t, out


def _lent_call(eng: Engine, tmp_path: Path, tag: str) -> tuple[threading.Thread, list[Any]]:
    """A call on a thread whose slot is lent to it, held in its preprocess until dir/open."""
    _owner_asleep(eng)
    before = _fast(eng).lends
    t, out = _in_thread(eng.infer, _gated(tmp_path, tag, True))
    _until(lambda: (tmp_path / f"started-{tag}").exists(), "the gated task started")
    assert _fast(eng).lends == before + 1 and _fast(eng).lent, "the call was lent its slot"
    (slot,) = _fast(eng).lent
    w = eng._transport.workers[slot]
    assert w.conn is not None and w.conn.fileno() not in eng._transport.selector._watched  # its caller's to poll
    return t, out


# -- deaths and replays ---------------------------------------------------------------------------

DEATHS = [("run", "sigkill"), ("preprocess", "exit0"), ("write_outputs", "sigkill"), ("run", "exit1")]


@pytest.mark.parametrize("stage,action", DEATHS, ids=[f"{s}-{a}" for s, a in DEATHS])
def test_a_worker_killed_while_its_slot_is_lent_replays_the_call_once(models, tmp_path, start_method, stage, action):
    """One caller, one worker: the call that kills its worker at `stage` was lent its slot; it
    comes back from the replay (the owner thread's: the lend went back), once, with the right
    outputs; the calls after it are lent again; one restart, nothing failed."""
    fault = FaultSpec(stage, action, str(tmp_path / "fired"))
    with faults.build(Engine, models.mlp, workers=1, start_method=start_method) as eng:
        want = eng.infer(X)["probs"]
        _owner_asleep(eng)
        before = _fast(eng).lends
        got = faults.infer(eng, X, fault)["probs"]
        lent_the_fault = _fast(eng).lends - before
        after = [eng.infer(X)["probs"] for _ in range(3)]
        st = eng.stats()
    assert lent_the_fault == 1
    assert all(g.tobytes() == want.tobytes() for g in [got, *after])
    assert (st.accepted, st.completed, st.failed, st.restarts, st.replayed) == (5, 5, 0, 1, 1)


@pytest.mark.parametrize("workers", [1, 2])
def test_calls_one_after_another_are_each_lent_and_answered_on_the_callers_thread(models, workers):
    """One caller, one call after another: each is lent a slot and its caller reads the answer
    (`served`), on 1 worker (the slot just given back takes the next call) and on 2; outputs
    byte-identical to the owner thread's path; the books balance.

    Each call is made with the owner thread asleep: a lent call that sets the first timer of
    an idle engine (its stall time) wakes the owner, which may still hold its lock when the
    next call comes, and that call then goes the owner's way (a CI run on a loaded host: 18 of
    20 lent). Every call is still lent and answered here; only when is the test's."""
    with Engine(models.mlp, workers=workers) as eng:
        want = eng.submit(X).result(60).outputs["probs"]  # (submit: no caller waits on it)
        before = _fast(eng).served
        got = []
        for _ in range(20):
            _owner_asleep(eng)
            got.append(eng.infer(X)["probs"])
        served = _fast(eng).served - before
        st = eng.stats()
    assert served == 20
    assert all(g.tobytes() == want.tobytes() for g in got)
    assert (st.accepted, st.completed, st.failed) == (21, 21, 0)


def _flood(eng: Engine, threads: int, calls: int, fault_at: tuple[int, int], fault: FaultSpec) -> tuple[list[list[np.ndarray]], np.ndarray]:
    """`threads` threads each make `calls` single-row calls; the call at `fault_at` (thread,
    call) carries `fault`. Each thread's outputs in order, and the rows."""
    rows = np.random.default_rng(4).standard_normal((threads * calls, 16)).astype(np.float32)
    out: list[list[np.ndarray]] = [[] for _ in range(threads)]
    errors: list[BaseException] = []
    start = threading.Barrier(threads)

    def run(t: int) -> None:
        start.wait()
        try:
            for j in range(calls):
                x = rows[t * calls + j : t * calls + j + 1]
                out[t].append(faults.infer(eng, x, fault if (t, j) == fault_at else None)["probs"])
        except BaseException as exc:  # (the test looks at it)
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert not any(w.is_alive() for w in workers), "a call never ended"
    assert not errors, errors
    return out, rows


FLOOD = [("run", "sigkill"), ("preprocess", "exit0")]


@pytest.mark.slow
@pytest.mark.parametrize("stage,action", FLOOD, ids=[f"{s}-{a}" for s, a in FLOOD])
def test_a_flood_of_single_calls_from_8_threads_with_a_kill_replays_exactly_once(models, tmp_path, start_method,
                                                                               stage, action):
    """8 threads call one row at a time (lent when the engine is idle, batched by the owner
    thread when they queue); one call kills its worker. Every call returns its own row's
    outputs, once; one restart; the books balance, in tasks and in items."""
    threads, calls = 8, 15
    fault = FaultSpec(stage, action, str(tmp_path / "fired"))
    with faults.build(Engine, models.mlp, workers=2, start_method=start_method) as eng:
        for _ in range(3):
            _owner_asleep(eng)
            eng.infer(X)
        served = _fast(eng).lends
        out, rows = _flood(eng, threads, calls, (5, 7), fault)
        st = eng.stats()
    assert served >= 1
    want = _probs(models, rows)
    for t in range(threads):
        assert len(out[t]) == calls
        for j, probs in enumerate(out[t]):
            np.testing.assert_allclose(probs[0], want[t * calls + j], rtol=1e-5, atol=1e-6)
    n = threads * calls + 3
    assert (st.accepted, st.completed, st.failed, st.cancelled) == (n, n, 0, 0)
    assert st.items_accepted == st.items_completed == n
    assert st.restarts == 1 and st.replayed >= 1


def test_a_lent_call_behind_which_others_queue_replays_in_acceptance_order(models, tmp_path):
    """A call holds its lent slot (one worker) while three more queue behind it; its worker is
    SIGKILLed (by its own task). The lend goes back, the lent task replays first, then the
    queued ones, in acceptance order (the order the worker saw them)."""
    with Engine(models.mlp, workers=1, preprocess="tests.test_fastpath:gated_or_kill") as eng:
        eng.infer({"x": X})
        _owner_asleep(eng)
        order = tmp_path / "order"
        first = {"x": X, "dir": str(tmp_path), "order": str(order), "n": 0, "kill_once": str(tmp_path / "k")}
        t, out = _in_thread(eng.infer, first)
        _until(lambda: (tmp_path / "started-0").exists(), "the lent task started")
        assert _fast(eng).lent
        futs = [eng.submit({"x": X, "order": str(order), "n": n}) for n in (1, 2, 3)]
        (tmp_path / "open").touch()
        t.join(60)
        results = [f.result(60) for f in futs]
        st = eng.stats()
    assert not isinstance(out[0], BaseException) and len(results) == 3
    seen = [int(v) for v in order.read_text().split()]
    assert seen == [0, 0, 1, 2, 3]  # run once and killed, then the replay, then the queue
    # (the queued ones may have been sent to the dying slot, between its EOF and its death: replayed too)
    assert (st.completed, st.failed, st.restarts) == (5, 0, 1) and st.replayed >= 1


def gated_or_kill(item: dict[str, Any]) -> dict[str, np.ndarray]:
    """A preprocess for the mlp: note item n in `order`; with `dir`, mark started-n and wait for
    dir/open; with `kill_once`, SIGKILL this worker the first time (a file says it fired)."""
    import signal

    if "order" in item:
        with open(item["order"], "a") as f:
            f.write(f"{item['n']}\n")
    if "dir" in item:
        Path(item["dir"], f"started-{item['n']}").touch()
        deadline = time.monotonic() + 60
        while not Path(item["dir"], "open").exists() and time.monotonic() < deadline:
            time.sleep(0.002)
    mark = item.get("kill_once")
    if mark is not None:
        try:
            os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            os.kill(os.getpid(), signal.SIGKILL)
        except FileExistsError:
            pass
    return {"x": np.ascontiguousarray(item["x"], dtype=np.float32)}


# -- timers, cancel, close, reload ---------------------------------------------------------------


def test_task_timeout_fires_on_a_lent_call(models, monkeypatch):
    """A lent call that hangs in its run: the owner thread's timer (woken by the caller's
    dispatch) kills the slot; the lender is told (the guard poll off), TaskTimeout; the engine
    serves on."""
    monkeypatch.setattr(fastpath, "POLL_S", 600.0)
    with faults.build(Engine, models.mlp, workers=1, task_timeout=0.5) as eng:
        eng.infer(X)
        _owner_asleep(eng)
        before = _fast(eng).lends
        with pytest.raises(TaskTimeout):
            faults.infer(eng, X, FaultSpec("run", "hang"))
        lent = _fast(eng).lends - before
        after = eng.infer(X)["probs"]
        st = eng.stats()
    assert lent == 1 and after.shape == (1, 8)
    assert (st.timeouts, st.failed, st.completed, st.restarts) == (1, 1, 2, 1)


def test_a_deadline_expires_in_the_queue_behind_a_lent_call(models, tmp_path):
    """One worker, lent to a gated call: a call with a deadline queues behind it and expires
    there (the owner thread's timer, though the slot is the caller's); the lent call ends well."""
    with Engine(models.mlp, workers=1, preprocess=GATED) as eng:
        eng.infer(_gated(tmp_path, "warm", False))
        t, out = _lent_call(eng, tmp_path, "a")
        late = eng.submit(_gated(tmp_path, "late", False), deadline=0.05)
        with pytest.raises(TaskTimeout, match="deadline"):
            late.result(60)
        (tmp_path / "open").touch()
        t.join(60)
        st = eng.stats()
    assert out[0]["probs"].shape == (1, 8)
    assert not (tmp_path / "started-late").exists()
    assert (st.completed, st.failed + st.cancelled) == (2, 1)


@pytest.mark.parametrize("kill", [False, True], ids=["cancel", "cancel-kill"])
def test_cancel_of_a_lent_call_gives_its_receipt_and_wakes_the_caller(models, tmp_path, kill, monkeypatch):
    """cancel() of a running task whose slot is lent to its caller: the receipt is True, the
    caller's infer() raises TaskCancelled at once (its gate still closed: the lend was ended,
    the caller woken: the lender's guard poll is turned off, it would hide a missing wake-up),
    the task is never delivered; the slot serves on."""
    monkeypatch.setattr(fastpath, "POLL_S", 600.0)
    with Engine(models.mlp, workers=1, preprocess=GATED) as eng:
        eng.infer(_gated(tmp_path, "warm", False))
        t, out = _lent_call(eng, tmp_path, "a")
        (task,) = eng._owner.ledger.unfinished()
        assert eng.cancel(task.future, kill=kill) is True
        t.join(60)
        assert not t.is_alive() and isinstance(out[0], TaskCancelled)
        assert not _fast(eng).lent
        (tmp_path / "open").touch()
        after = eng.infer(_gated(tmp_path, "b", False))["probs"]
        _until(lambda: eng.stats().completed == 2, "the books balance")
        st = eng.stats()
    assert after.shape == (1, 8)
    assert (st.cancelled, st.completed, st.failed, st.restarts) == (1, 2, 0, int(kill))


def test_close_during_a_lent_call_drains_it(models, tmp_path):
    """close() while a caller waits on its lent slot: the call ends with its outputs, then the
    engine closes, nothing left running."""
    eng = Engine(models.mlp, workers=1, preprocess=GATED)
    eng.infer(_gated(tmp_path, "warm", False))
    t, out = _lent_call(eng, tmp_path, "a")
    closing, closed = _in_thread(eng.close)
    _until(lambda: eng.state.name != "ACCEPTING", "close() began")
    (tmp_path / "open").touch()
    t.join(60)
    closing.join(60)
    assert not closing.is_alive() and closed == [None]
    assert out[0]["probs"].shape == (1, 8)
    assert eng.stats().completed == 2


def test_close_with_a_timeout_cancels_a_lent_call(models, tmp_path, monkeypatch):
    """close(timeout=) expires while a caller waits on its lent slot: its call ends with
    TaskCancelled (the receipt; its caller told, the guard poll off), the worker is stopped,
    nothing is left."""
    monkeypatch.setattr(fastpath, "POLL_S", 600.0)
    eng = Engine(models.mlp, workers=1, preprocess=GATED)
    eng.infer(_gated(tmp_path, "warm", False))
    t, out = _lent_call(eng, tmp_path, "a")
    eng.close(timeout=0.3)
    t.join(60)
    assert not t.is_alive() and isinstance(out[0], TaskCancelled)
    assert eng.stats().cancelled == 1


@pytest.fixture(scope="module")
def v2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return onnx_models.mlp(tmp_path_factory.mktemp("v2") / "mlp_v2.onnx", seed=1)


def test_a_reload_during_a_lent_call_waits_for_it(models, tmp_path, v2):
    """reload() while a caller waits on its lent slot: the call ends on the old model, the slot
    swaps after it (the drain), and the next calls run the new one."""
    with Engine(models.mlp, workers=1, preprocess=GATED) as eng:
        old = eng.infer(_gated(tmp_path, "warm", False))["probs"]
        t, out = _lent_call(eng, tmp_path, "a")
        reloading, version = _in_thread(eng.reload, v2)
        _until(lambda: eng._owner.reload is not None or version, "the reload began")
        (tmp_path / "open").touch()
        t.join(60)
        reloading.join(120)
        new = eng.infer(_gated(tmp_path, "b", False))["probs"]
        st = eng.stats()
    assert out[0]["probs"].tobytes() == old.tobytes()
    assert isinstance(version[0], str)
    assert new.tobytes() != old.tobytes()
    assert (st.completed, st.failed) == (3, 0)


# -- context, async, fork, the outbox --------------------------------------------------------------


def test_each_lent_call_sees_its_own_context(models, start_method):
    """Threads calling one at a time, each call with its own context (lent or batched): each
    result sees exactly its own; a call without one sees none."""
    with Engine(None, workers=2, start_method=start_method, preprocess="tests.hooks:read_context") as eng:
        seen: dict[int, object] = {}

        def run(t: int) -> None:
            for j in range(10):
                rid = t * 100 + j
                seen[rid] = eng.infer({"n": rid}, context={"request_id": rid})["seen"]

        _owner_asleep(eng)
        alone = eng.infer({"n": -1}, context={"request_id": -1})["seen"]
        threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
        for w in threads:
            w.start()
        for w in threads:
            w.join(60)
        bare = eng.infer({"n": -2})["seen"]
        served = _fast(eng).lends
    assert served >= 1
    assert len(seen) == 40 and all(seen[rid] == {"request_id": rid} for rid in seen)
    assert alone == {"request_id": -1} and bare == {}


def test_a_runbatch_that_does_not_fit_the_pipe_is_not_lent(models):
    """A task whose RunBatch is larger than the pipe takes (a 1 MiB context): its write waits in
    the slot's outbox, whose write events are the owner's, so the lend ends at once; the call
    ends on the owner thread's path (its caller reads no answer), with its own context."""
    with Engine(None, workers=1, preprocess="tests.hooks:read_context") as eng:
        _owner_asleep(eng)
        before = _fast(eng).served
        small = eng.infer({"n": 1}, context={"blob": "s"})["seen"]
        lent_small = _fast(eng).served - before
        _owner_asleep(eng)
        before = _fast(eng).served
        big = eng.infer({"n": 2}, context={"blob": "b" * (1 << 20)})["seen"]
        lent_big = _fast(eng).served - before
        assert not _fast(eng).lent
    assert (lent_small, lent_big) == (1, 0)
    assert small == {"blob": "s"} and big == {"blob": "b" * (1 << 20)}


def test_async_calls_are_lent_to_the_loop_and_a_death_replays_once(models, tmp_path, start_method):
    """infer_async one at a time: the loop is lent the slot and reads the answer; then 40 at
    once on the same loop (most batched by the owner thread), one killing its worker: every
    call its own outputs, once; one restart."""
    with Engine(models.mlp, workers=2, start_method=start_method, preprocess="tests.hooks:kill_marked") as eng:
        want = eng.infer({"x": X})["probs"]

        async def main() -> tuple[list[np.ndarray], int]:
            one, before = [], _fast(eng).lends
            while _fast(eng).lends < before + 4 and len(one) < 40:  # (the first is not lent: loop_calm;
                _owner_asleep(eng)  # on a loaded machine the owner thread may wake meanwhile)
                one.append((await eng.infer_async({"x": X}))["probs"])
            lent = _fast(eng).lends - before
            items: list[dict[str, Any]] = [{"x": X} for _ in range(40)]
            items[17] = {"x": X, "kill_once": str(tmp_path / "killed")}
            many = await asyncio.gather(*(eng.infer_async(it) for it in items))
            return one + [m["probs"] for m in many], lent

        got, lent = asyncio.run(main())
        st = eng.stats()
    assert lent == 4
    assert len(got) >= 45 and all(g.tobytes() == want.tobytes() for g in got)
    assert (st.completed, st.failed, st.restarts) == (len(got) + 1, 0, 1) and st.replayed >= 1


def test_an_async_call_cancelled_on_a_lent_slot_ends_once_and_the_slot_serves_on(models, tmp_path):
    """The awaiting coroutine is cancelled while the loop holds the lent slot: the task ends
    cancelled (never delivered); the worker's late answer is read, and the slot serves on."""
    with Engine(models.mlp, workers=1, preprocess=GATED) as eng:

        async def main() -> np.ndarray:
            await eng.infer_async(_gated(tmp_path, "warm", False))
            _owner_asleep(eng)
            call = asyncio.ensure_future(eng.infer_async(_gated(tmp_path, "a", True)))
            while not (tmp_path / "started-a").exists():
                await asyncio.sleep(0.005)
            assert _fast(eng).lent
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            # the cancel lane's receipt, while the run is still held at the gate (opened
            # before it, the answer could come first and the task end done: a race, not a case)
            deadline = time.monotonic() + 60
            while eng.stats().cancelled != 1:
                assert time.monotonic() < deadline, "never: the cancel lane's receipt"
                await asyncio.sleep(0.002)
            assert not (tmp_path / "open").exists()
            (tmp_path / "open").touch()
            return (await eng.infer_async(_gated(tmp_path, "b", False)))["probs"]

        after = asyncio.run(main())
        st = eng.stats()
    assert after.shape == (1, 8)
    assert (st.cancelled, st.completed, st.failed) == (1, 2, 0)


def test_a_loop_lend_goes_back_to_the_owner_when_work_queues_behind_it(models, tmp_path, monkeypatch):
    """One loop calling one at a time is lent the slot; held at its gate, a second call from
    the loop queues behind it: the owner thread takes the lend back (the loop may look late:
    the owner reads the answer and feeds the slot), and both end with their outputs, once.
    (RECLAIM_S, the guard for a loop that stopped looking, is put out of reach.)"""
    monkeypatch.setattr(fastpath, "RECLAIM_S", 3600.0)
    want = _probs(models, X)
    with Engine(models.mlp, workers=1, preprocess=GATED) as eng:

        async def main() -> tuple[list[dict[str, Any]], int]:
            await eng.infer_async(_gated(tmp_path, "warm", False))  # one idle accept before a's
            for attempt in range(20):  # (on a loaded machine the owner thread may wake meanwhile)
                gate = tmp_path / f"try{attempt}"
                gate.mkdir()
                _owner_asleep(eng)
                before, served = _fast(eng).lends, _fast(eng).served
                a = asyncio.ensure_future(eng.infer_async(_gated(gate, "a", True)))
                while not (gate / "started-a").exists():
                    await asyncio.sleep(0.005)
                if _fast(eng).lends == before + 1 and _fast(eng).lent:
                    break
                (gate / "open").touch()  # not lent: let it end, and try again
                await a
            else:
                raise AssertionError("no call was lent to the loop in 20 tries")
            b = asyncio.ensure_future(eng.infer_async(_gated(gate, "b", False)))
            deadline = time.monotonic() + 30
            while _fast(eng).lent:  # b queued: the owner takes a's slot back
                assert time.monotonic() < deadline, "never: the lend taken back"
                await asyncio.sleep(0.002)
            (gate / "open").touch()
            got = list(await asyncio.gather(a, b))
            return got, _fast(eng).served - served

        got, served = asyncio.run(main())
        st = eng.stats()
    assert [g["probs"].tobytes() for g in got] == [want.tobytes()] * 2
    assert served == 0  # a's answer was the owner thread's to read
    assert st.completed == st.accepted and (st.failed, st.cancelled) == (0, 0)


def test_a_loop_closed_with_a_lent_call_pending_leaves_no_descriptor(models, tmp_path, monkeypatch):
    """An event loop is lent the slot, then closed with the call pending (never run again):
    the owner takes the slot back (RECLAIM_S), reads the answer, and the lend's dup of the pipe
    is closed (was: left open for the life of the process); the engine serves on."""
    monkeypatch.setattr(fastpath, "RECLAIM_S", 0.2)
    with Engine(models.mlp, workers=1, preprocess=GATED) as eng:
        for attempt in range(20):  # (on a loaded machine the owner thread may wake meanwhile)
            gate = tmp_path / f"try{attempt}"
            gate.mkdir()
            loop = asyncio.new_event_loop()
            for tag in ("w1", "w2"):  # two idle accepts in a row: the loop calls one at a time
                loop.run_until_complete(eng.infer_async(_gated(gate, tag, False)))
            _owner_asleep(eng)
            before = _fast(eng).lends
            call = loop.create_task(eng.infer_async(_gated(gate, "a", True)))

            async def started() -> None:
                while not (gate / "started-a").exists():
                    await asyncio.sleep(0.002)

            loop.run_until_complete(started())
            lent = list(_fast(eng).lent.values())
            if _fast(eng).lends == before + 1 and lent:
                break
            (gate / "open").touch()
            loop.run_until_complete(call)
            loop.close()
        else:
            raise AssertionError("no call was lent to the loop in 20 tries")
        (lend,) = lent
        fd, inode = lend.fd, os.fstat(lend.fd).st_ino
        call.cancel()  # (the coroutine is never run again: quiet its "destroyed but pending")
        loop.close()
        (gate / "open").touch()
        _until(lambda: lend.task.state.is_terminal and not _fast(eng).lent, "the owner to take the lend back")
        _until(lambda: not _open_as(fd, inode), "the lend's descriptor to be closed")
        after = eng.infer(_gated(gate, "b", False))["probs"]
    assert after.tobytes() == _probs(models, X).tobytes()


def _open_as(fd: int, inode: int) -> bool:
    try:
        return os.fstat(fd).st_ino == inode
    except OSError:
        return False


def test_a_loop_with_calls_in_flight_is_lent_a_slot_again_after_two_calls_alone(models, tmp_path):
    """A loop's first call (no call of its before), and its first after a wave of calls at
    once, are not lent: only a second idle accept in a row says the loop calls one at a time
    (a server's waves would otherwise lend each wave's first call while the rest queue). The
    wave is held at a gate until all of it is accepted (no call of it ends before the last
    accept), then let go."""
    want = _probs(models, X)
    with Engine(models.mlp, workers=2, preprocess=GATED) as eng:

        async def alone(tag: str) -> int:
            """Calls one at a time until one is lent (on a loaded machine the owner thread may
            wake meanwhile); how many were not lent before it."""
            for missed in range(20):
                _owner_asleep(eng)
                before = _fast(eng).lends
                out.append((await eng.infer_async(_gated(tmp_path, f"{tag}{missed}", False)))["probs"])
                if _fast(eng).lends > before:
                    return missed
            raise AssertionError("no call was lent to the loop in 20 tries")

        out: list[np.ndarray] = []

        async def main() -> tuple[list[int], list[np.ndarray]]:
            lends = []
            _owner_asleep(eng)
            out.append((await eng.infer_async(_gated(tmp_path, "first", False)))["probs"])
            lends.append(_fast(eng).lends)
            await alone("one")
            lends.append(_fast(eng).lends)
            wave = [asyncio.ensure_future(eng.infer_async(_gated(tmp_path, f"w{i}", True))) for i in range(16)]
            deadline = time.monotonic() + 60
            while eng.stats().accepted < len(out) + 16:
                assert time.monotonic() < deadline, "never: the wave accepted"
                await asyncio.sleep(0.002)
            (tmp_path / "open").touch()
            out.extend(m["probs"] for m in await asyncio.gather(*wave))
            lends.append(_fast(eng).lends)
            missed = await alone("two")
            return [*lends, missed], out

        (first, calm, wave, missed), out = asyncio.run(main())
        st = eng.stats()
    assert first == 0  # the loop's first call: no idle accept before it
    assert wave - calm <= 1  # the wave: at most its first call (taken back as the rest queue)
    assert missed >= 1  # after the wave: its first call alone is not lent, a later one is
    assert all(o.tobytes() == want.tobytes() for o in out)
    assert (st.completed, st.failed) == (len(out), 0)


def test_a_fork_while_a_slot_is_lent_leaves_the_parents_call_alone(models, tmp_path, start_method):
    """os.fork() while a thread waits on its lent slot: in the child the engine refuses calls
    (EngineClosed naming the fork) and the child exits without touching the slot; in the
    parent the lent call ends with its outputs, and the slot is lent again after."""
    with Engine(models.mlp, workers=1, start_method=start_method, preprocess=GATED) as eng:
        eng.infer(_gated(tmp_path, "warm", False))
        t, out = _lent_call(eng, tmp_path, "a")
        pid = os.fork()
        if pid == 0:  # the child: no lock is waited on, no lend is touched
            code = 3
            try:
                eng.infer(_gated(tmp_path, "child", False))
            except EngineClosed as exc:
                code = 0 if "fork" in str(exc) else 4
            except BaseException:  # (any other outcome is the failure)
                code = 5
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        (tmp_path / "open").touch()
        t.join(60)
        _owner_asleep(eng)
        before = _fast(eng).lends
        again = eng.infer(_gated(tmp_path, "b", False))["probs"]
        lent_again = _fast(eng).lends - before
    assert os.waitstatus_to_exitcode(status) == 0
    assert out[0]["probs"].shape == (1, 8) and again.shape == (1, 8)
    assert lent_again == 1
    assert not (tmp_path / "started-child").exists()


# -- Ctrl-C on the main thread (engine.core.interrupts) ---------------------------------------------

STRETCHES = ["the caller's dispatch", "the lender's step", "between accept and wait", "the lender's spin"]


@pytest.mark.parametrize("where", STRETCHES)
def test_a_ctrl_c_while_the_caller_acts_as_the_owner_abandons_the_call_not_the_engine(models, where, monkeypatch):
    """SIGINT on the main thread while, lent a slot, it does the owner's work: in its own
    dispatch (the RunBatch about to be written), in the step that reads the worker's answer,
    or between the accept and its wait (signal.raise_signal there: the handler runs at once);
    or while it polls for the answer before it sleeps (spin_us: not the owner's work, the same end).
    infer() raises KeyboardInterrupt once that stretch is over; the task ends once (completed,
    its result dropped), no input lease is left, the engine serves on and lends again. Was:
    EngineInternalError ("a caller acting as the engine's owner was interrupted") for every
    later call, and the input lease freed twice (the supervisor thread failed on it). A handler
    a test put in before (the job's) is gone: the engine's goes over the default again."""
    main = threading.main_thread()
    assert threading.current_thread() is main  # (only it runs signal handlers)
    fired: list[str] = []

    def ctrl_c() -> None:
        if not fired and threading.current_thread() is main:  # (the owner thread's dispatch: no)
            fired.append(where)
            signal.raise_signal(signal.SIGINT)

    with Engine(models.mlp, workers=1) as eng:
        signal.signal(signal.SIGINT, lambda signum, frame: None)  # a job's handler, say, for a while
        try:
            want = eng.infer(X)["probs"]
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        fast = _fast(eng)
        if where == "the caller's dispatch":
            send = fast.co.dispatcher.before_send
            monkeypatch.setattr(fast.co.dispatcher, "before_send", lambda slot, b: (ctrl_c(), send(slot, b)))
        elif where == "the lender's spin":  # (its poll before it sleeps: spin_us, workers.wire.Spin)
            spin = fast.spin.wait
            monkeypatch.setattr(fast.spin, "wait", lambda fd, s, peers=0: (ctrl_c(), spin(fd, s, peers))[1])
        elif where == "the lender's step":  # (the express lane reads with lent_frames)
            read, frames = fast.transport.read_lent, fast.transport.lent_frames
            monkeypatch.setattr(fast.transport, "read_lent", lambda slot: (ctrl_c(), read(slot))[1])
            monkeypatch.setattr(fast.transport, "lent_frames", lambda slot: (ctrl_c(), frames(slot))[1])
        else:
            accept, express = fast.accept, eng._express._dispatch  # type: ignore[attr-defined]
            monkeypatch.setattr(fast, "accept", lambda *a: (accept(*a), ctrl_c())[0])
            monkeypatch.setattr(eng._express, "_dispatch", lambda *a: (express(*a), ctrl_c())[0])
        calls = 1
        for _ in range(20):  # (on a loaded machine the owner thread may wake meanwhile: not lent)
            _owner_asleep(eng)
            before = fast.lends
            calls += 1
            try:
                eng.infer(X)
            except KeyboardInterrupt:
                assert fired and fast.lends == before + 1
                break
            assert not fired
        else:
            raise AssertionError("no call was lent in 20 tries")
        monkeypatch.undo()
        _until(lambda: eng.stats().completed == calls, "the interrupted task to end")
        _owner_asleep(eng)
        after = [eng.infer(X)["probs"] for _ in range(3)]
        lent_after = fast.lends - before - 1
        st = eng.stats()
        assert eng.state.name == "ACCEPTING" and not fast.lent
    assert all(a.tobytes() == want.tobytes() for a in after) and lent_after >= 1
    assert (st.accepted, st.completed, st.failed, st.cancelled, st.restarts) == (calls + 3, calls + 3, 0, 0, 0)
    assert st.shm_inputs_used == 0


def test_a_ctrl_c_while_the_lender_polls_comes_at_once_and_the_owner_reads_the_answer(models, tmp_path):
    """SIGINT while the main thread polls its lent slot (the task held in its preprocess): the
    KeyboardInterrupt comes at once, the gate still closed; the slot goes back to the owner
    thread, which reads the answer when it comes; the engine serves on."""
    assert threading.current_thread() is threading.main_thread()
    with Engine(models.mlp, workers=1, preprocess=GATED) as eng:
        eng.infer(_gated(tmp_path, "warm", False))
        _owner_asleep(eng)

        def interrupt_once_started() -> None:
            _until(lambda: (tmp_path / "started-a").exists(), "the gated task started")
            os.kill(os.getpid(), signal.SIGINT)

        t = threading.Thread(target=interrupt_once_started)
        t.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                eng.infer(_gated(tmp_path, "a", True))
        finally:
            t.join(60)
        assert not (tmp_path / "open").exists() and not _fast(eng).lent  # given back, before its answer
        (tmp_path / "open").touch()
        _until(lambda: eng.stats().completed == 2, "the owner thread to read the answer")
        after = eng.infer(_gated(tmp_path, "b", False))["probs"]
        st = eng.stats()
    assert after.tobytes() == _probs(models, X).tobytes()
    assert (st.accepted, st.completed, st.failed, st.shm_inputs_used) == (3, 3, 0, 0)


def test_a_sigint_handler_of_the_users_own_is_left_alone():
    """The engine's handler goes in only over Python's default, asked at each stretch: a
    handler of the user's stays; once the default is back, the engine's goes in again."""
    from slabpool.engine.core import interrupts

    def mine(signum: int, frame: Any) -> None:
        pass

    old = signal.signal(signal.SIGINT, mine)
    try:
        interrupts.enter()
        interrupts.leave()
        assert signal.getsignal(signal.SIGINT) is mine
        signal.signal(signal.SIGINT, signal.default_int_handler)
        interrupts.enter()
        try:
            assert signal.getsignal(signal.SIGINT) is interrupts._on_sigint
            signal.raise_signal(signal.SIGINT)  # deferred: raised at the stretch's end
        finally:
            with pytest.raises(KeyboardInterrupt):
                interrupts.leave()
        with pytest.raises(KeyboardInterrupt):  # outside a stretch: at once, as the default
            signal.raise_signal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, old)


def test_the_ray_transport_lends_no_slot():
    """Ray's actors answer through Ray, to the owner thread: its transport says no, and its
    calls take the owner thread's path (the same API)."""
    ray_transport = pytest.importorskip("slabpool.engine.ray.transport")
    assert ray_transport.RayTransport.can_lend is False
