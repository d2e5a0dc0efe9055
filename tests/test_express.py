"""The express lane (engine.local.express, issue 21): an idle engine's `infer()` of plain
inputs skips the queue's and the dispatcher's choosing and goes straight to an idle slot lent
to its caller, with the same records as any call (a Task on a slot, in the ledger, its input
lease, the lend). So every guarantee holds on it as on any call: a worker that dies in the
run replays the call once (SIGKILL, SIGSEGV, os._exit(0)); an input that kills worker after
worker is quarantined; task_timeout and close(timeout=) end it with their errors; calls from
many threads each get their own row's outputs; the books balance and nothing is left leased.

Faults ride on the input's data (tests/express_hooks.py: the session's run of a marked input
dies), since the express lane takes no preprocess and no FaultSpec. Real workers, real
signals; the waits only catch deadlocks.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from typing import Any

import numpy as np
import pytest

from slabpool import Engine
from slabpool.engine.core import fastpath
from slabpool.workers.errors import PoisonTask, TaskCancelled, TaskTimeout
from tests import express_hooks as H
from tests.reference import ort_run
from tests.test_fastpath import _fast, _in_thread, _owner_asleep, _until

HOOK = "tests.express_hooks:die_on_marker"
ROWS = np.random.default_rng(11).standard_normal((64, 16)).astype(np.float32)


def _lane(eng: Engine) -> Any:
    return eng._express  # type: ignore[attr-defined]


def _row(i: int, marker: float | None = None, tag: int = 0) -> np.ndarray:
    x = ROWS[i : i + 1].copy()
    if marker is not None:
        x[0, 0], x[0, 1] = marker, tag  # (tag: a marked call that dies once, again)
    return x


def _express_run(eng: Engine, calls: Any) -> Any:
    """`calls()` with every call of it through the express lane: the owner thread asleep
    first. Its first express call may set the owner's next timer (a stall check ~10 s out)
    and wake it once, and a call that comes while the owner steps goes the general way: then
    again (a deadlock guard of 20 tries, not a timing)."""
    for _ in range(20):
        _owner_asleep(eng)
        before = _lane(eng).taken
        got = calls()
        if _lane(eng).taken - before == len(got):
            return got
    raise AssertionError("the calls never all went the express lane in 20 tries")


def _marked_express_call(eng: Engine, marker: float, call: Any, prepare: Any = None) -> tuple[Any, int]:
    """`call(x)` of a marked row that goes the express lane (after `prepare()`): the owner
    thread asleep first (on a loaded machine it may wake meanwhile, and then the call goes the
    general way, where its worker dies too: another tag, another try). Its outputs and the
    tries made."""
    for tag in range(20):
        if prepare is not None:
            prepare()
        _owner_asleep(eng)
        before = _lane(eng).taken
        got = call(_row(1, marker, tag))
        if _lane(eng).taken == before + 1:
            return got, tag + 1
    raise AssertionError("no marked call went the express lane in 20 tries")


def test_idle_calls_take_the_express_lane_with_the_sessions_own_bytes(models):
    """Dict and bare-array inputs, one model of two inputs of two dtypes and two outputs:
    after the first call of a signature (the door checks it once), every idle call goes the
    express lane; outputs byte-identical to an in-process session; the books balance."""
    feeds = {"feats": np.arange(8, dtype=np.float32).reshape(2, 4), "ids": np.array([3, -1], dtype=np.int64)}
    with Engine(models.multi_io, workers=2) as eng:
        got = [eng.infer(feeds)]
        assert _lane(eng).taken == 0  # (the first checks the signature, through the general path)
        got += _express_run(eng, lambda: [eng.infer(feeds) for _ in range(9)])
        st = eng.stats()
    want = ort_run(models.multi_io, feeds)
    for g in got:
        assert set(g) == set(want) and all(g[k].tobytes() == want[k].tobytes() for k in want)
    assert st.accepted == st.completed == len(got) and st.failed == 0
    assert st.shm_inputs_used == 0
    with Engine(models.mlp, workers=1) as eng:
        out = [eng.infer(_row(0))["probs"]]
        out += _express_run(eng, lambda: [eng.infer(_row(i))["probs"] for i in range(1, 5)])[-4:]
    for i, o in enumerate(out):
        assert o.tobytes() == ort_run(models.mlp, {"x": _row(i)})["probs"].tobytes()


@pytest.mark.parametrize("marker", [H.KILL, H.SEGV, H.EXIT0], ids=["sigkill", "sigsegv", "exit0"])
def test_a_worker_that_dies_in_an_express_call_replays_it_once(models, tmp_path, start_method, marker):
    """The worker dies inside the run of an express call: the call still returns its own
    row's outputs (replayed once on the rebuilt slot), counted once; later calls go the
    express lane again."""
    with Engine(models.mlp, workers=2, initializer=HOOK, initargs=(str(tmp_path),),
                start_method=start_method) as eng:
        eng.infer(_row(0))
        got, tries = _marked_express_call(eng, marker, lambda x: eng.infer(x)["probs"])
        _until(lambda: all(s.state.name == "READY" for s in eng._owner.slots), "the slot rebuilt")  # type: ignore[attr-defined]
        before = _lane(eng).taken
        after = [eng.infer(_row(i))["probs"] for i in range(2, 6)]
        taken = _lane(eng).taken - before
        st = eng.stats()
    assert got.tobytes() == ort_run(models.mlp, {"x": _row(1, marker, tries - 1)})["probs"].tobytes()
    assert all(a.tobytes() == ort_run(models.mlp, {"x": _row(i)})["probs"].tobytes() for i, a in zip(range(2, 6), after))
    assert taken >= 1
    calls = 1 + tries + 4
    assert (st.accepted, st.completed, st.failed, st.replayed, st.restarts) == (calls, calls, 0, tries, tries)
    assert st.shm_inputs_used == 0


def test_an_input_that_kills_every_worker_on_the_express_lane_is_quarantined(models, tmp_path):
    """A poison input: each worker that runs it dies; after max_attempts deaths it fails alone
    with PoisonTask naming them, and the engine serves on through the express lane."""
    with Engine(models.mlp, workers=2, max_attempts=2, initializer=HOOK, initargs=(str(tmp_path),)) as eng:
        eng.infer(_row(0))
        with pytest.raises(PoisonTask) as err:
            eng.infer(_row(1, H.ALWAYS))
        after = eng.infer(_row(2))["probs"]  # (both slots may still be starting: the general way)
        _until(lambda: all(s.state.name == "READY" for s in eng._owner.slots), "both slots rebuilt")  # type: ignore[attr-defined]
        (again,) = _express_run(eng, lambda: [eng.infer(_row(3))["probs"]])
        st = eng.stats()
    assert len(err.value.crashes) == 2
    assert after.tobytes() == ort_run(models.mlp, {"x": _row(2)})["probs"].tobytes()
    assert again.tobytes() == ort_run(models.mlp, {"x": _row(3)})["probs"].tobytes()
    assert (st.quarantined, st.failed, st.restarts) == (1, 1, 2) and st.completed == st.accepted - 1


def test_task_timeout_ends_a_hung_express_call(models, tmp_path, monkeypatch):
    """An express call hangs in its run: the owner thread's timer kills the slot, the caller
    (told: the guard poll is off) gets TaskTimeout; the engine serves on."""
    monkeypatch.setattr(fastpath, "POLL_S", 600.0)
    with Engine(models.mlp, workers=1, task_timeout=0.5, initializer=HOOK, initargs=(str(tmp_path),)) as eng:
        eng.infer(_row(0))
        for tries in range(1, 6):  # (the owner thread may wake as the call comes: the general way)
            _owner_asleep(eng)
            before = _lane(eng).taken
            with pytest.raises(TaskTimeout):
                eng.infer(_row(1, H.HANG))
            if _lane(eng).taken == before + 1:
                break
        else:
            raise AssertionError("no hung call went the express lane in 5 tries")
        after = eng.infer(_row(2))["probs"]
        st = eng.stats()
    assert after.shape == (1, 8)
    assert (st.timeouts, st.failed, st.completed, st.restarts) == (tries, tries, 2, tries)


def test_close_with_a_timeout_cancels_an_express_call(models, tmp_path, monkeypatch):
    """close(timeout=) runs out while an express call hangs: the call ends with TaskCancelled,
    the worker is stopped, nothing is left leased. (A fresh engine a try: on a loaded machine
    the owner thread may wake as the call comes, and then it goes the general way, where the
    same holds; the lane must have taken one of the tries.)"""
    monkeypatch.setattr(fastpath, "POLL_S", 600.0)
    taken = False
    for attempt in range(5):
        gate = tmp_path / f"try{attempt}"
        gate.mkdir()
        eng = Engine(models.mlp, workers=1, initializer=HOOK, initargs=(str(gate),))
        out: list[Any] = []
        try:
            eng.infer(_row(0))

            def call() -> None:
                try:
                    out.append(eng.infer(_row(1, H.HANG)))
                except BaseException as exc:
                    out.append(exc)

            _owner_asleep(eng)
            t = threading.Thread(target=call)
            t.start()
            _until(lambda: (gate / "started").exists(), "the call runs")
            taken = _lane(eng).taken == 1
        finally:
            eng.close(timeout=0.3)
        t.join(60)
        assert not t.is_alive() and isinstance(out[0], TaskCancelled)
        st = eng.stats()
        assert (st.cancelled, st.completed) == (1, 1)
        if taken:
            break
    assert taken, "no hung call went the express lane in 5 tries"


@pytest.mark.parametrize("lane", ["express", "fast path"])
def test_close_drains_a_lent_call_as_soon_as_it_ends(models, tmp_path, lane):
    """close() while a lent call runs (its caller reads the answer, not the owner thread): the
    call ends with its outputs, and close() returns at once after, not at the owner thread's
    next timer (a stall check set 600 s out here: the join's 60 s only catches that)."""
    for attempt in range(5):
        gate = tmp_path / f"try{attempt}"
        gate.mkdir()
        eng = Engine(models.mlp, workers=1, initializer=HOOK, initargs=(str(gate),), stall_after=600.0)
        _lane(eng).on = lane == "express"
        out: list[Any] = []
        eng.infer(_row(0))

        def call() -> None:
            out.append(eng.infer(_row(1, H.HANG)))

        _owner_asleep(eng)
        lends = eng._owner.fast.lends
        t = threading.Thread(target=call)
        t.start()
        _until(lambda: (gate / "started").exists(), "the call runs")
        lent = eng._owner.fast.lends == lends + 1
        closer = threading.Thread(target=eng.close)
        closer.start()
        _until(lambda: eng._owner.ledger.closing is not None, "close() drains")
        (gate / "open").touch()
        t.join(60)
        closer.join(60)
        assert not t.is_alive() and not closer.is_alive(), "close() waited for the owner's timer"
        assert out[0]["probs"].shape == (1, 8)
        if lent:
            return
    raise AssertionError("no hung call was lent in 5 tries")


def test_calls_from_many_threads_each_get_their_own_rows_outputs(models, tmp_path):
    """8 threads calling at once, with a worker killed in the middle: the express lane takes
    the calls that find a slot idle, the others queue (in groups); every call gets its own
    row's outputs exactly once, the books balance in tasks and items."""
    want = ort_run(models.mlp, {"x": ROWS})["probs"]
    got: dict[tuple[int, int], np.ndarray] = {}
    with Engine(models.mlp, workers=2, initializer=HOOK, initargs=(str(tmp_path),)) as eng:
        eng.infer(_row(0))

        def caller(k: int) -> None:
            for j in range(40):
                i = (k * 40 + j) % len(ROWS)
                marker = H.KILL if (k, j) == (3, 20) else None
                got[(k, j)] = eng.infer(_row(i, marker))["probs"]

        threads = [threading.Thread(target=caller, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        taken = _lane(eng).taken
        st = eng.stats()
    assert len(got) == 320
    for (k, j), g in got.items():
        i = (k * 40 + j) % len(ROWS)
        ref = ort_run(models.mlp, {"x": _row(i, H.KILL)})["probs"] if (k, j) == (3, 20) else want[i : i + 1]
        assert g.tobytes() == ref.tobytes()
    assert taken >= 1
    # (calls that queued went in groups, a task a group: engine.caller.combine)
    assert st.accepted == st.completed <= 321 and (st.failed, st.restarts) == (0, 1)
    assert st.items_accepted == st.items_completed == 321
    assert st.shm_inputs_used == 0


@pytest.mark.parametrize("max_batch_size", [1, 4])
def test_a_thread_call_takes_an_idle_slot_while_another_holds_the_owners_work(models, tmp_path, max_batch_size):
    """One slot runs a submitted task (the owner's: nobody waits on its pipe) that hangs in
    its run; a plain call of another thread takes the other, idle slot through the express
    lane (declined, it went the owner's way, and that slot's work then declined the next
    call in turn). With dynamic batching the idle slot is the owner's to fill: the call goes
    the general way, where calls that queue under load are stacked. Outputs byte for byte."""
    with Engine(models.mlp, workers=2, max_batch_size=max_batch_size, initializer=HOOK,
                initargs=(str(tmp_path),)) as eng:
        eng.infer(_row(0))
        hung = eng.submit(_row(1, H.HANG))
        _until(lambda: (tmp_path / "started").exists(), "the submitted task runs")
        _owner_asleep(eng)
        before = _lane(eng).taken
        got = eng.infer(_row(2))["probs"]
        taken = _lane(eng).taken - before
        (tmp_path / "open").touch()
        late = hung.result(60).outputs["probs"]
        st = eng.stats()
    assert taken == (1 if max_batch_size == 1 else 0)
    assert got.tobytes() == ort_run(models.mlp, {"x": _row(2)})["probs"].tobytes()
    assert late.tobytes() == ort_run(models.mlp, {"x": _row(1, H.HANG)})["probs"].tobytes()
    assert st.accepted == st.completed == 3 and st.shm_inputs_used == 0


def test_a_thread_call_waits_for_the_owner_lock_and_takes_the_express_lane(models):
    """The owner lock is held (here by the test, as by another caller's step or the owner's):
    a plain call waits for it, and then goes the express lane, not the owner's way."""
    with Engine(models.mlp, workers=2) as eng:
        eng.infer(_row(0))
        _owner_asleep(eng)
        lock, before = _lane(eng).lock, _lane(eng).taken
        lock.own()
        try:
            t, out = _in_thread(eng.infer, _row(3))
            _until(lambda: _frame_name(t) == "own", "the call waits for the owner lock")
        finally:
            lock.let_go()
        t.join(60)
        taken = _lane(eng).taken - before
    assert taken == 1
    assert out[0]["probs"].tobytes() == ort_run(models.mlp, {"x": _row(3)})["probs"].tobytes()


def _frame_name(t: threading.Thread) -> str | None:
    """The function thread `t` runs now (a C call's caller: a lock's acquire shows `own`)."""
    frame = sys._current_frames().get(t.ident or 0)
    return None if frame is None else frame.f_code.co_name


def test_what_the_express_lane_leaves_to_the_general_path(models):
    """A context, a preprocess, a deadline, inputs past EXPRESS_MAX_BYTES, a signature the door
    has not checked yet: each goes the general way, with the same outputs."""
    from slabpool.engine.local.express import EXPRESS_MAX_BYTES

    with Engine(models.mlp, workers=1) as eng:
        eng.infer(_row(0))
        a = eng.infer(_row(0), context={"k": 1})["probs"]
        b = eng.infer(_row(0), deadline=30.0)["probs"]
        big = np.repeat(ROWS, EXPRESS_MAX_BYTES // ROWS.nbytes + 1, axis=0)
        c = eng.infer(big)["probs"]
        assert _lane(eng).taken == 0
        (d,) = _express_run(eng, lambda: [eng.infer(_row(0))["probs"]])
    with Engine(models.mlp, workers=1, preprocess="tests.hooks:to_feeds") as eng:
        eng.infer({"x": _row(0)})
        eng.infer({"x": _row(0)})
        assert _lane(eng).taken == 0
    want = ort_run(models.mlp, {"x": _row(0)})["probs"]
    assert a.tobytes() == b.tobytes() == d.tobytes() == want.tobytes()
    assert c.tobytes() == ort_run(models.mlp, {"x": big})["probs"].tobytes()


def test_a_leftover_run_of_many_workers_leaves_no_lease_and_no_lend(models):
    """The express lane across slots: each call goes to an idle slot; after many, nothing is
    lent or leased, each slot has served some."""
    with Engine(models.mlp, workers=2) as eng:
        for i in range(50):
            eng.infer(_row(i % len(ROWS)))
        st = eng.stats()
        assert not eng._owner.fast.lent  # type: ignore[attr-defined]
    assert st.shm_inputs_used == 0 and st.completed == 50


def _spins(path: Any) -> list[float]:
    return [float(v) for v in path.read_text().split()] if path.exists() else []


@pytest.mark.parametrize("spin_us", [0, 250, 10_000])
def test_a_lent_call_tells_its_worker_to_poll_for_the_next_and_a_queued_one_does_not(models, tmp_path, spin_us):
    """spin_us: the RunBatch of an express call carries it (the worker polls that long for the
    next call before it sleeps: RunBatch.spin); a submitted task's batch, which no caller waits
    on, carries 0; spin_us=0 never polls. The outputs are the session's either way."""
    log = tmp_path / "spins"
    with Engine(models.mlp, workers=1, spin_us=spin_us, initializer="tests.express_hooks:record_spins",
                initargs=(str(log),)) as eng:
        eng.infer(_row(0))  # (the door checks the signature; this call may be lent: it waits)
        # its waits: the first, the output grant of the first answer (no shape seen yet), after it
        _until(lambda: len(_spins(log)) >= 3, "the worker waits after its first answer")
        for i in range(3):  # (submit: nobody waits on the answer; the owner thread reads it)
            eng.submit(_row(i)).result()
            _until(lambda: len(_spins(log)) >= 4 + i, "the worker waits after the submitted call")
        owner_waits = len(_spins(log))
        got = _express_run(eng, lambda: [eng.infer(_row(i))["probs"] for i in range(1, 4)])
        waits = 2 + eng.stats().completed  # (a wait after each answer; _express_run may have tried again)
        _until(lambda: len(_spins(log)) >= waits, "the worker waits after the last answer")
    spins = _spins(log)
    assert len(spins) == waits and spins[0] == 0.0  # (its first wait: nothing answered yet)
    assert spins[owner_waits - 3 : owner_waits] == [0.0] * 3  # (after the submitted tasks' answers)
    lent = spins[-3:]  # (after each of the last 3 answers: the express calls' batches)
    assert lent == [spin_us / 1e6] * 3
    assert _peers(log) == [0] * waits  # (one call lent at a time: no other task of the engine polls)
    for i, g in enumerate(got, 1):
        assert g.tobytes() == ort_run(models.mlp, {"x": _row(i)})["probs"].tobytes()


def _peers(log: Any) -> list[int]:
    path = log.parent / f"{log.name}-peers"
    return [int(v) for v in path.read_text().split()] if path.exists() else []


def test_a_lent_call_beside_another_tells_its_worker_of_the_engines_other_pollers(models, tmp_path):
    """Two calls lent their slots at once (one hangs in its run): the second's RunBatch tells
    its worker that two more tasks of the engine poll (the other call's caller and worker,
    RunBatch.peers), so that a host of as many runnable tasks as that does not stop its poll
    for the next call (workers.wire.Spin); the first, sent alone, carries none. Outputs are
    the session's."""
    with Engine(models.mlp, workers=2, initializer="tests.express_hooks:marked_and_spins",
                initargs=(str(tmp_path),)) as eng:
        eng.infer(_row(0))
        for _ in range(20):  # (each call may find the owner stepping and go the general way: again)
            for name in ("started", "open"):
                (tmp_path / name).unlink(missing_ok=True)
            _owner_asleep(eng)
            before = _lane(eng).taken
            t, hung = _in_thread(eng.infer, _row(1, H.HANG))
            _until(lambda: (tmp_path / "started").exists(), "the first call runs")
            first = _lane(eng).taken == before + 1 and len(_fast(eng).lent) == 1
            got = eng.infer(_row(2))["probs"]
            both = first and _lane(eng).taken == before + 2
            (tmp_path / "open").touch()
            t.join(60)
            if both:
                break
        else:
            raise AssertionError("the two calls were never lent at once in 20 tries")
        logs = sorted(tmp_path.glob("spins-*[0-9]"))
        _until(lambda: sorted(_peers(p)[-1] for p in logs) == [0, 2], "each worker waits after its answer")
    assert got.tobytes() == ort_run(models.mlp, {"x": _row(2)})["probs"].tobytes()
    assert hung[0]["probs"].tobytes() == ort_run(models.mlp, {"x": _row(1, H.HANG)})["probs"].tobytes()


def test_a_worker_killed_while_it_polls_for_the_next_call_costs_no_call(models):
    """A worker SIGKILLed after answering an express call (in its poll for the next, 10 ms
    long here): the answered call stands, nothing replays; the next call is answered on the
    rebuilt slot, the restart counted."""
    import os
    import signal

    with Engine(models.mlp, workers=1, spin_us=10_000) as eng:
        eng.infer(_row(0))
        (first,) = _express_run(eng, lambda: [eng.infer(_row(1))["probs"]])
        os.kill(eng.stats().slots[0].pid, signal.SIGKILL)
        _until(lambda: eng.stats().restarts == 1, "the death seen")
        after = eng.infer(_row(2))["probs"]
        st = eng.stats()
    assert first.tobytes() == ort_run(models.mlp, {"x": _row(1)})["probs"].tobytes()
    assert after.tobytes() == ort_run(models.mlp, {"x": _row(2)})["probs"].tobytes()
    assert (st.accepted, st.completed, st.failed, st.replayed, st.restarts) == (3, 3, 0, 0, 1)


def test_an_engine_in_a_process_holding_a_thousand_files_open(models, tmp_path, past_fd_setsize):
    """A process with a thousand files or sockets open (a server's): the engine's pipes are
    numbered past select()'s FD_SETSIZE. Lent calls (their callers spin on those pipes), one
    whose worker dies in its run, 8 threads' calls (in groups) and infer_async all get their
    own rows' outputs, the death read to its end; the books balance. (select() raised
    ValueError into every lent call there.)"""
    want = ort_run(models.mlp, {"x": ROWS})["probs"]
    with Engine(models.mlp, workers=2, initializer=HOOK, initargs=(str(tmp_path),)) as eng:
        assert min(w.conn.fileno() for w in eng._transport.workers) >= past_fd_setsize
        first = eng.infer(_row(0))["probs"]
        died, tries = _marked_express_call(eng, H.KILL, lambda x: eng.infer(x)["probs"])
        _until(lambda: all(s.state.name == "READY" for s in eng._owner.slots), "the slot rebuilt")  # type: ignore[attr-defined]
        got: dict[int, np.ndarray] = {}

        def caller(k: int) -> None:
            for j in range(10):
                got[k * 10 + j] = eng.infer(_row((k * 10 + j) % len(ROWS)))["probs"]

        threads = [threading.Thread(target=caller, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        loop = asyncio.new_event_loop()
        try:
            aio = [loop.run_until_complete(eng.infer_async(_row(i)))["probs"] for i in range(6)]
        finally:
            loop.close()
        lends = _fast(eng).lends
        st = eng.stats()
    assert first.tobytes() == want[:1].tobytes()
    assert died.tobytes() == ort_run(models.mlp, {"x": _row(1, H.KILL, tries - 1)})["probs"].tobytes()
    assert len(got) == 80 and all(g.tobytes() == want[i % len(ROWS)][None].tobytes() for i, g in got.items())
    assert all(a.tobytes() == want[i : i + 1].tobytes() for i, a in enumerate(aio))
    assert lends >= 1 + tries
    calls = 1 + tries + 80 + 6
    assert st.items_accepted == st.items_completed == calls
    assert (st.failed, st.replayed, st.restarts) == (0, tries, tries) and st.shm_inputs_used == 0


def test_calls_in_a_process_out_of_file_descriptors_are_answered_unlent(models, out_of_fds):
    """A server at its limit on open files: a lend needs one more (a new thread's eventfd, an
    event loop's dup of the pipe). Without it the call is not lent and is answered the
    owner's way: new threads' calls, an event loop's and an old thread's all get their rows'
    outputs, and the engine serves on. (The loop's dup raised under the owner lock and stopped
    the engine; a new thread's call raised OSError.)"""
    want = ort_run(models.mlp, {"x": ROWS})["probs"]
    with Engine(models.mlp, workers=2) as eng:
        loop = asyncio.new_event_loop()
        got: list[Any] = [eng.infer(_row(0))["probs"], loop.run_until_complete(eng.infer_async(_row(1)))["probs"]]
        try:
            with out_of_fds(16):
                for k in range(3):
                    t, out = _in_thread(lambda k=k: [eng.infer(_row(2 + 3 * k + j))["probs"] for j in range(3)])
                    t.join(60)
                    assert not isinstance(out[0], BaseException), out[0]
                    got += out[0]
                got += [loop.run_until_complete(eng.infer_async(_row(i)))["probs"] for i in range(11, 14)]
                got += [eng.infer(_row(i))["probs"] for i in range(14, 17)]
        finally:
            loop.close()
        got.append(eng.infer(_row(17))["probs"])
        st = eng.stats()
    assert [g.tobytes() for g in got] == [want[i : i + 1].tobytes() for i in range(18)]
    assert (st.state, st.completed, st.failed) == ("ACCEPTING", 18, 0)


# -- infer_async: the same lane, lent to the event loop ---------------------------------------------


@pytest.mark.parametrize("spin_us", [250, 0, 10_000])
def test_async_calls_one_at_a_time_take_the_express_lane(models, spin_us):
    """A loop calling infer_async one call at a time: after two calm calls every call goes the
    express lane, lent to the loop (its answer caught by the loop's poll, or a reader on its
    pipe: spin_us 0); outputs byte-identical; the books balance and no descriptor or lease is
    left."""

    loop = asyncio.new_event_loop()

    def calls() -> list[np.ndarray]:
        return [loop.run_until_complete(eng.infer_async(_row(i)))["probs"] for i in range(12)]

    try:
        with Engine(models.mlp, workers=2, spin_us=spin_us) as eng:
            eng._owner.fast.spin.cpus = 1 << 20  # type: ignore[attr-defined]  # (a loaded host: it polls all the same)
            calls()  # (the first call checks the signature; a loop is lent after two calm calls)
            got = _express_run(eng, calls)
            st = eng.stats()
            fast = eng._owner.fast  # type: ignore[attr-defined]
            assert not fast.lent
            if spin_us == 10_000:  # (an answer in 10 ms, once in 12 calls: its look in place ran)
                assert fast.spin.caught >= 1
            if spin_us == 0:  # (never polls: every answer through the loop's reader)
                assert fast.spin.caught == 0
    finally:
        loop.close()
    assert all(g.tobytes() == ort_run(models.mlp, {"x": _row(i)})["probs"].tobytes() for i, g in enumerate(got))
    assert st.accepted == st.completed and st.shm_inputs_used == 0


def test_submit_async_takes_the_lane_with_the_owner_paths_result(models, tmp_path):
    """`submit_async` of plain inputs, one at a time on a loop, goes the express lane too, and
    its Result is what the owner thread's path makes: the task's id, its outputs
    (byte-identical), the version, slot and worker that computed them, one attempt, its
    timings (what `slabpool serve` answers with). A call whose worker dies in its run comes
    back from the replay with two attempts, on the rebuilt or the other slot."""
    loop = asyncio.new_event_loop()

    def calls() -> list[Any]:
        return [loop.run_until_complete(eng.submit_async(_row(i))) for i in range(8)]

    def call(x: np.ndarray) -> Any:
        return loop.run_until_complete(eng.submit_async(x))

    try:
        with Engine(models.mlp, workers=2, initializer=HOOK, initargs=(str(tmp_path),)) as eng:
            general = [eng.submit(_row(i)).result(60) for i in range(2)]  # (the owner thread's Results)
            calls()  # (the first checks the signature; a loop is lent after two calm calls)
            got = _express_run(eng, calls)
            pids = {s.index: s.pid for s in eng._owner.slots}  # type: ignore[attr-defined]
            died, tries = _marked_express_call(eng, H.KILL, call, lambda: [call(_row(i)) for i in range(2)])
            version = eng.model_version
    finally:
        loop.close()
    for r in (*general, *got):
        assert r.model_version == version != "" and r.attempts == 1 and r.context is None and r.index is None
        assert r.pid == pids[r.slot] and r.timings.total >= r.timings.run > 0 and r.timings.queued >= 0
    ids = [r.task_id for r in got]
    assert ids == sorted(ids) and len(set(ids)) == len(ids) and ids[0] > general[-1].task_id
    assert all(r.outputs["probs"].tobytes() == ort_run(models.mlp, {"x": _row(i)})["probs"].tobytes()
               for i, r in enumerate(got))
    assert died.attempts == 2 and died.model_version == version
    assert died.outputs["probs"].tobytes() == ort_run(models.mlp, {"x": _row(1, H.KILL, tries - 1)})["probs"].tobytes()


@pytest.mark.parametrize("marker", [H.KILL, H.EXIT0], ids=["sigkill", "exit0"])
def test_a_worker_that_dies_in_an_async_express_call_replays_it_once(models, tmp_path, marker):
    """The same on an event loop: the lend is the loop's (two calm calls first), the death
    the owner thread's to see; the awaiting call gets its row's outputs, once."""
    loop = asyncio.new_event_loop()

    def calm() -> None:  # (two calm calls: the loop calls one at a time)
        for i in range(2):
            loop.run_until_complete(eng.infer_async(_row(i)))

    def call(x: np.ndarray) -> np.ndarray:
        return loop.run_until_complete(eng.infer_async(x))["probs"]

    try:
        with Engine(models.mlp, workers=2, initializer=HOOK, initargs=(str(tmp_path),)) as eng:
            eng.infer(_row(0))
            died, tries = _marked_express_call(eng, marker, call, calm)
            after = [loop.run_until_complete(eng.infer_async(_row(i)))["probs"] for i in range(4, 8)]
            st = eng.stats()
    finally:
        loop.close()
    assert died.tobytes() == ort_run(models.mlp, {"x": _row(1, marker, tries - 1)})["probs"].tobytes()
    assert all(a.tobytes() == ort_run(models.mlp, {"x": _row(i)})["probs"].tobytes() for i, a in zip(range(4, 8), after))
    calls = 1 + 3 * tries + 4
    assert (st.accepted, st.completed, st.failed, st.replayed, st.restarts) == (calls, calls, 0, tries, tries)


def test_an_async_express_call_cancelled_while_it_runs_ends_once(models, tmp_path, monkeypatch):
    """The coroutine awaiting an express call is cancelled while the run hangs: the task ends
    cancelled (once: its late answer is dropped), the lend goes back, the slot serves on."""
    monkeypatch.setattr(fastpath, "POLL_S", 600.0)

    async def scenario(eng: Engine) -> tuple[int, np.ndarray]:
        for _ in range(20):  # (calm calls until the loop is calm with the owner asleep: on a
            for i in range(3):  # loaded machine the owner may wake meanwhile and take its lock)
                await eng.infer_async(_row(i))
            _owner_asleep(eng)
            if eng._owner.fast.loop_calm:  # type: ignore[attr-defined]
                break
        before = _lane(eng).taken
        call = asyncio.ensure_future(eng.infer_async(_row(3, H.HANG)))
        while not (tmp_path / "started").exists():
            await asyncio.sleep(0.002)
        lane = _lane(eng).taken - before
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        while eng.stats().cancelled != 1:
            await asyncio.sleep(0.002)
        (tmp_path / "open").touch()
        return lane, (await eng.infer_async(_row(4)))["probs"]

    with Engine(models.mlp, workers=1, initializer=HOOK, initargs=(str(tmp_path),)) as eng:
        lane, after = asyncio.run(scenario(eng))
        _until(lambda: eng.stats().completed == eng.stats().accepted - 1, "the books balance")
        st = eng.stats()
        assert not eng._owner.fast.lent  # type: ignore[attr-defined]
    assert lane == 1
    assert after.tobytes() == ort_run(models.mlp, {"x": _row(4)})["probs"].tobytes()
    assert st.accepted == st.completed + 1 and (st.cancelled, st.failed) == (1, 0)


def test_a_gather_of_async_calls_with_a_kill_gets_every_rows_outputs_once(models, tmp_path):
    """40 calls gathered on one loop, one of them killing its worker: the first goes the
    express lane, the rest queue; each gets its own row's outputs, the books balance."""

    async def scenario(eng: Engine) -> list[Any]:
        for i in range(3):
            await eng.infer_async(_row(i))
        return list(await asyncio.gather(*[eng.infer_async(_row(i % len(ROWS), H.KILL if i == 0 else None))
                                           for i in range(40)]))

    with Engine(models.mlp, workers=2, initializer=HOOK, initargs=(str(tmp_path),)) as eng:
        got = asyncio.run(scenario(eng))
        st = eng.stats()
    for i, g in enumerate(got):
        ref = ort_run(models.mlp, {"x": _row(i % len(ROWS), H.KILL if i == 0 else None)})["probs"]
        assert g["probs"].tobytes() == ref.tobytes()
    assert (st.accepted, st.completed, st.failed, st.restarts) == (43, 43, 0, 1)
