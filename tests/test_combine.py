"""Callers combined under load (engine.caller.combine, issue 21): `infer()` calls that queue
while every slot is busy go as one task a group, a session call per caller, and each caller
gets its own rows' outputs, byte for byte what its call alone gives. What goes wrong with a
group's task sends each of its callers back alone, to its own outputs or its own error:
a row that fails, a worker that a row kills again and again, outputs without their rows, the
engine closing. A group whose worker dies once is replayed whole.

The load is made by the input's own data (tests/express_hooks.py): two calls whose rows hold
the HANG marker hold both workers in their session run until the test opens the gate, while
the other callers join a group; the waits only catch deadlocks.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slabpool import Engine
from slabpool.workers.errors import EngineClosed, PoisonTask, SessionRunError
from tests import express_hooks as H
from tests.models import onnx_models
from tests.reference import litert_run, ort_run
from tests.test_fastpath import _until

HOOK = "tests.express_hooks:die_on_marker"
ROWS = np.random.default_rng(5).standard_normal((64, 16)).astype(np.float32)


def _combiner(eng: Engine) -> Any:
    return eng._combiner  # type: ignore[attr-defined]


def _held(eng: Engine, gate: Path, holds: list[Any], group: list[Any], holder: Any = None) -> dict[int, Any]:
    """Both workers held by a marked call each (`holds`: their inputs), then one caller a
    thread for each of `group`'s inputs, all of them joining one group; the gate opens once
    the group holds them all. Each call's outputs (or its error), by its place in `group`
    (the holds' as -1, -2)."""
    cb = _combiner(eng)
    out: dict[int, Any] = {}

    def call(i: int, x: Any) -> None:
        try:
            out[i] = eng.infer(x)
        except BaseException as exc:
            out[i] = exc

    threads = [threading.Thread(target=call, args=(-1 - j, x)) for j, x in enumerate(holds)]
    for t in threads:
        t.start()
    _until(lambda: cb.active == len(holds) and eng.stats().queued == 0
           and sum(s.state == "BUSY" for s in eng.stats().slots) == len(holds), "both workers held")
    more = [threading.Thread(target=call, args=(i, x)) for i, x in enumerate(group)]
    for t in more:
        t.start()
    _until(lambda: len(cb.line) == 1 and len(cb.line[0].inputs) == len(group), "the group holds its callers")
    if holder is not None:
        holder()
    (gate / "open").touch()
    for t in threads + more:
        t.join(120)
        assert not t.is_alive()
    return out


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want) and all(got[k].tobytes() == want[k].tobytes() for k in want)


def _hold(tag: int, shape: tuple[int, ...] = (1, 16)) -> np.ndarray:
    """Rows that hold their worker until the gate opens (H.HANG; `tag` tells the holds apart)."""
    x = np.ones(shape, np.float32)
    x.flat[0], x.flat[1] = H.HANG, tag
    return x


def test_queued_callers_share_one_task_and_each_gets_its_own_rows(models, tmp_path):
    """Six callers that queue behind two held calls go as one task; each gets its own row's
    outputs, byte-identical to the session in-process; the books count one task and six items."""
    rows = [ROWS[i : i + 1] for i in range(2, 8)]
    want = [ort_run(models.mlp, {"x": r}) for r in rows]
    with Engine(models.mlp, workers=2, initializer=HOOK, initargs=(str(tmp_path),)) as eng:
        eng.infer(ROWS[:1])  # (the door checks the signature once)
        before = eng.stats()
        out = _held(eng, tmp_path, [_hold(0), _hold(1)], rows)
        cb, st = _combiner(eng), eng.stats()
    for i, w in enumerate(want):
        assert set(out[i]) == set(w) and all(out[i][k].tobytes() == w[k].tobytes() for k in w)
        assert all(v.flags.owndata and v.flags.writeable for v in out[i].values())
    assert (cb.groups, cb.combined) == (1, 6)
    assert (st.accepted - before.accepted, st.completed - before.completed) == (3, 3)
    assert (st.items_accepted - before.items_accepted, st.items_completed - before.items_completed) == (8, 8)
    assert st.shm_inputs_used == 0


def test_litert_callers_combined(models, tmp_path):
    """The same on a LiteRT model (its session resizes for each caller's call): one task, each
    caller its own row's bytes, as the interpreter in-process gives them."""
    rows = [ROWS[i : i + 1] for i in range(2, 7)]
    want = [litert_run(models.tfl_mlp, {"x": r}) for r in rows]
    with Engine(models.tfl_mlp, workers=2, initializer=HOOK, initargs=(str(tmp_path),)) as eng:
        eng.infer(ROWS[:1])
        out = _held(eng, tmp_path, [_hold(0), _hold(1)], rows)
        cb = _combiner(eng)
    assert (cb.groups, cb.combined) == (1, 5)
    for i, w in enumerate(want):
        assert set(out[i]) == set(w) and all(out[i][k].tobytes() == w[k].tobytes() for k in w)


def test_each_caller_of_a_group_is_its_own_session_call(models, tmp_path):
    """A model whose every output row depends on the other rows of its session call
    (batch_centered): callers of three rows each, combined, get what their call alone gives,
    not rows centred over the group."""
    rng = np.random.default_rng(9)
    rows = [rng.standard_normal((3, 16)).astype(np.float32) for _ in range(5)]
    want = [ort_run(models.centered, {"x": r})["y"] for r in rows]
    holds = [_hold(tag, (3, 16)) for tag in range(2)]
    with Engine(models.centered, workers=2, initializer=HOOK, initargs=(str(tmp_path),)) as eng:
        eng.infer(rows[0])
        out = _held(eng, tmp_path, holds, rows)
        cb = _combiner(eng)
    assert (cb.groups, cb.combined) == (1, 5)
    for i, w in enumerate(want):
        assert out[i]["y"].shape == (3, 16) and out[i]["y"].tobytes() == w.tobytes()


def test_a_failing_row_fails_its_own_caller_only(models, tmp_path):
    """One caller's row makes the session raise (an index out of range): the group's task
    fails, and each caller goes alone: that one gets its SessionRunError, the others their
    outputs; items: eight accepted, seven completed, one failed."""
    idx = [np.array([i % 10], dtype=np.int64) for i in range(6)]
    idx[3] = np.array([99], dtype=np.int64)
    xs = [np.full((1, 4), float(i), dtype=np.float32) for i in range(6)]
    group = [{"idx": i, "x": x} for i, x in zip(idx, xs, strict=True)]
    holds = [{"idx": np.array([int(H.HANG)], dtype=np.int64), "x": np.full((1, 4), float(t), np.float32)}
             for t in range(2)]
    with Engine(models.poison, workers=2, initializer=HOOK, initargs=(str(tmp_path),)) as eng:
        eng.infer(group[0])
        before = eng.stats()
        out = _held(eng, tmp_path, holds, group)
        st = eng.stats()
    for i in range(6):
        if i == 3:
            assert isinstance(out[i], SessionRunError)
        else:
            assert out[i]["y"].tobytes() == ort_run(models.poison, group[i])["y"].tobytes()
    assert all(isinstance(out[h], SessionRunError) for h in (-1, -2))  # (the holds' index is out of range too)
    assert st.items_accepted - before.items_accepted == 8
    assert (st.items_completed - before.items_completed, st.items_failed - before.items_failed) == (5, 3)
    assert st.shm_inputs_used == 0


@pytest.mark.parametrize("marker", [H.KILL, H.ALWAYS], ids=["killed-once", "kills-every-time"])
def test_a_group_whose_worker_dies(models, tmp_path, marker):
    """A row that SIGKILLs its worker once: the group is replayed whole, every caller gets its
    outputs. A row that kills every worker that runs it: the group is quarantined, each caller
    goes alone, and only that row's caller ends in PoisonTask."""
    rows = [ROWS[i : i + 1].copy() for i in range(2, 8)]
    rows[2][0, 0], rows[2][0, 1] = marker, 7
    with Engine(models.mlp, workers=2, initializer=HOOK, initargs=(str(tmp_path),)) as eng:
        eng.infer(ROWS[:1])
        out = _held(eng, tmp_path, [_hold(0), _hold(1)], rows)
        st = eng.stats()
    for i, r in enumerate(rows):
        if i == 2 and marker == H.ALWAYS:
            assert isinstance(out[i], PoisonTask)
        else:
            assert out[i]["probs"].tobytes() == ort_run(models.mlp, {"x": r})["probs"].tobytes()
    assert st.restarts >= 1 and st.shm_inputs_used == 0
    assert st.items_accepted == st.items_completed + st.items_failed


def test_outputs_without_the_callers_rows_send_each_caller_alone(models, tmp_path):
    """NonZero's output is [2, nnz], whatever the rows: each session call's outputs fail the
    worker's check, and each caller gets its own call's outputs alone."""
    rng = np.random.default_rng(2)
    rows = [(rng.random((1, 8)) > 0.5).astype(np.float32) for _ in range(4)]
    holds = [_hold(tag, (1, 8)) for tag in range(2)]
    with Engine(models.nonzero, workers=2, initializer=HOOK, initargs=(str(tmp_path),)) as eng:
        eng.infer(rows[0])
        out = _held(eng, tmp_path, holds, rows)
        cb = _combiner(eng)
    assert cb.combined == 0
    for i, r in enumerate(rows):
        assert out[i]["idx"].tobytes() == ort_run(models.nonzero, {"x": r})["idx"].tobytes()


def test_callers_waiting_in_a_group_when_the_engine_closes(models, tmp_path):
    """close() while a group waits for a slot: the held calls finish (a drain), the group's
    callers each end once with EngineClosed; nothing hangs, nothing stays leased, and close()
    returns once the last call has ended (a lent call's end wakes the draining owner thread,
    whose next timer is 600 s out here)."""
    rows = [ROWS[i : i + 1] for i in range(2, 6)]
    eng = Engine(models.mlp, workers=2, initializer=HOOK, initargs=(str(tmp_path),), stall_after=600.0)
    closer = threading.Thread(target=eng.close)
    try:
        eng.infer(ROWS[:1])

        def close_first() -> None:
            closer.start()
            _until(lambda: eng.state.name != "ACCEPTING", "close() has begun")

        out = _held(eng, tmp_path, [_hold(0), _hold(1)], rows, holder=close_first)
    finally:
        closer.join(60)
        stuck = closer.is_alive()
        eng.close()
    assert not stuck, "close() waited for the owner thread's next timer (600 s out)"
    assert all("probs" in out[h] for h in (-1, -2))
    assert all(isinstance(out[i], EngineClosed) for i in range(4))
    st = eng.stats()
    assert st.items_accepted == st.items_completed + st.items_failed


def test_what_goes_alone(models):
    """Calls that do not combine: a model without a dynamic axis 0, dynamic batching (it stacks
    under load itself), a signature the door has not checked, a call with a keyword."""
    with Engine(models.static, workers=1) as eng:
        x = np.ones((2, 16), np.float32)
        eng.infer(x)
        assert _combiner(eng)._combinable(eng, x) is None
    with Engine(models.mlp, workers=1, max_batch_size=8) as eng:
        assert not _combiner(eng).on
    with Engine(models.mlp, workers=1) as eng:
        assert _combiner(eng)._combinable(eng, ROWS[:1]) is None  # (a signature the door has not checked)
        eng.infer(ROWS[:1], context={"k": 1})  # (a keyword: the call goes its own way)
        assert _combiner(eng).inside == 0
        assert _combiner(eng)._combinable(eng, ROWS[:1]) is not None


def test_a_caller_interrupted_while_its_group_waits(models, tmp_path):
    """Ctrl-C (a real SIGINT) in the main thread while it waits first in a group: it raises
    KeyboardInterrupt at once, leaves the group (its row still runs, its outputs unread), and
    the next caller leads the group when a slot frees: the others get their outputs."""
    rows = [ROWS[i : i + 1] for i in range(2, 7)]
    out: dict[int, Any] = {}
    with Engine(models.mlp, workers=2, initializer=HOOK, initargs=(str(tmp_path),)) as eng:
        eng.infer(ROWS[:1])
        cb = _combiner(eng)
        holds = [threading.Thread(target=eng.infer, args=(_hold(t),)) for t in range(2)]
        for t in holds:
            t.start()
        _until(lambda: cb.active == 2 and eng.stats().queued == 0
               and sum(s.state == "BUSY" for s in eng.stats().slots) == 2, "both workers held")
        main = threading.get_ident()

        def call(i: int) -> None:
            out[i] = eng.infer(rows[i])

        others = [threading.Thread(target=call, args=(i,)) for i in range(1, 5)]

        def conduct() -> None:
            _until(lambda: len(cb.line) == 1 and len(cb.line[0].inputs) == 1, "the main thread waits in a group")
            for t in others:
                t.start()
            _until(lambda: len(cb.line[0].inputs) == 5, "the group holds its callers")
            group = cb.line[0]
            signal.pthread_kill(main, signal.SIGINT)
            _until(lambda: group.waiters[0] is None, "the main thread left its group")
            (tmp_path / "open").touch()

        conductor = threading.Thread(target=conduct)
        conductor.start()
        with pytest.raises(KeyboardInterrupt):
            eng.infer(rows[0])
        for t in [conductor, *holds, *others]:
            t.join(120)
            assert not t.is_alive()
        assert (cb.groups, cb.combined) == (1, 4)
    for i in range(1, 5):
        assert out[i]["probs"].tobytes() == ort_run(models.mlp, {"x": rows[i]})["probs"].tobytes()


def test_a_slow_models_callers_go_alone_once_a_group_has_been_timed(models, tmp_path):
    """A model whose call takes milliseconds gains nothing from combining (the run, not the
    engine's cost a task, sets the pace), and loses the pipelining of a task sent ahead to its
    slot: once a group's time a caller is past SLOW_S, callers that queue go alone, each its
    own task, with the same outputs."""
    from slabpool.engine.caller import combine

    # (the suite's slow model runs ~0.45 ms a row here, with a group's leader and worker
    # polling: too near SLOW_S to tell; three times its layers are well past it)
    slow = onnx_models.slow(tmp_path / "slower.onnx", k=48, dim=512)
    rng = np.random.default_rng(4)
    rows = [rng.standard_normal((1, 512)).astype(np.float32) for _ in range(8)]
    holds = [_hold(tag, (1, 512)) for tag in range(4)]
    with Engine(slow, workers=2, initializer=HOOK, initargs=(str(tmp_path / "a"),)) as eng:
        (tmp_path / "a").mkdir()
        eng.infer(rows[0])
        cb = _combiner(eng)
        first = _held(eng, tmp_path / "a", holds[:2], rows[:4])
        assert (cb.groups, cb.combined) == (1, 4) and cb.per_call > combine.SLOW_S
        (tmp_path / "a" / "open").unlink()
        out: dict[int, Any] = {}
        threads = [threading.Thread(target=lambda j=j: out.__setitem__(-1 - j, eng.infer(holds[2 + j]))) for j in range(2)]
        threads += [threading.Thread(target=lambda i=i: out.__setitem__(i, eng.infer(rows[4 + i]))) for i in range(4)]
        accepted = eng.stats().accepted
        for t in threads[:2]:
            t.start()
        _until(lambda: sum(s.state == "BUSY" for s in eng.stats().slots) == 2 and eng.stats().queued == 0, "held")
        for t in threads[2:]:
            t.start()
        _until(lambda: eng.stats().accepted == accepted + 6, "four calls accepted, each its own task")
        assert not cb.line
        (tmp_path / "a" / "open").touch()
        for t in threads:
            t.join(120)
        assert (cb.groups, cb.combined) == (1, 4)
    for i in range(4):
        assert first[i]["y"].tobytes() == ort_run(slow, {"x": rows[i]})["y"].tobytes()
        assert out[i]["y"].tobytes() == ort_run(slow, {"x": rows[4 + i]})["y"].tobytes()


def test_a_groups_task_tells_its_worker_to_poll_for_the_next(models, tmp_path):
    """A lent call's worker polls for the next call after answering (spin_us: a caller that
    calls again soon is served without a wake-up), and so does a group's: its RunBatch says
    spin_us too (at 3 and 4 callers, groups of one or two, 1.3-1.7x the calls/s; the host's
    runnable count still stops the polls where they would take a core: workers.wire.Spin),
    with its other callers counted as the engine's own (RunBatch.peers). (A leader that finds
    the owner thread stepping goes the owner's way, not lent, and no caller waits on its
    pipe: then again, a fresh engine.)"""
    for attempt in range(5):
        d = tmp_path / f"try{attempt}"
        d.mkdir()
        lent, pid = _a_group_after_two_holds(models, d)
        if lent:
            break
    else:
        raise AssertionError("the group's task was never lent its slot in 5 tries")
    # (closed: the worker's last wait, the one after the group's answer, took the stop message)
    assert float((d / f"spins-{pid}").read_text().split()[-1]) == 250e-6
    # (and that the engine's own tasks poll beside it, not the host's crowd: its three other
    # callers, inside a call and not lent, and any hold still lent: workers.wire.polling_peers)
    assert int((d / f"spins-{pid}-peers").read_text().split()[-1]) >= 3


def _a_group_after_two_holds(models: Any, d: Path) -> tuple[bool, int]:
    """Two held calls, then a group of four behind them, on an engine whose workers record
    their spins in `d`: whether the group's task was lent its slot, and that slot's pid."""
    rows = [ROWS[i : i + 1] for i in range(2, 6)]
    with Engine(models.mlp, workers=2, initializer="tests.express_hooks:marked_and_spins",
                initargs=(str(d),), spin_us=250) as eng:
        eng.infer(ROWS[:1])
        fast = eng._sup.fast  # type: ignore[attr-defined]
        seen: dict[str, Any] = {}

        def count() -> None:
            seen.update(done={s.pid: s.tasks_done for s in eng.stats().slots}, lends=fast.lends)

        _held(eng, d, [_hold(0), _hold(1)], rows, holder=count)
        after = {s.pid: s.tasks_done for s in eng.stats().slots}
        (pid,) = [p for p in after if after[p] - seen["done"][p] == 2]  # (its hold, then the group)
        assert _combiner(eng).groups == 1
        return fast.lends - seen["lends"] == 1, pid


def test_a_groups_slot_is_parked_and_back_in_the_owners_selector_by_its_next_wait(models, tmp_path):
    """A group's task's slot, answered, goes back parked: out of the owner's selector (under
    load the next group's leader is lent it within microseconds, and a give-back and a lend
    of a pipe in the selector cost two epoll_ctl). The owner is woken and puts it back at its
    next wait (engine.core.fastpath, PARK_S); a call alone's slot goes straight back. (A
    leader that finds the owner stepping goes the owner's way, unlent, and nothing parks:
    then again, a fresh engine.)"""
    for attempt in range(5):
        d = tmp_path / f"try{attempt}"
        d.mkdir()
        if _a_parked_group(models, d):
            return
    raise AssertionError("the group's task was never lent its slot in 5 tries")


def _a_parked_group(models: Any, d: Path) -> bool:
    rows = [ROWS[i : i + 1] for i in range(2, 6)]
    with Engine(models.mlp, workers=2, initializer=HOOK, initargs=(str(d),)) as eng:
        fast, transport = eng._sup.fast, eng._transport  # type: ignore[attr-defined]
        selector = transport.selector
        eng.infer(ROWS[:1])
        assert fast.parks == 0
        seen: dict[str, int] = {}
        out = _held(eng, d, [_hold(0), _hold(1)], rows, holder=lambda: seen.update(lends=fast.lends))
        for i in range(4):
            _same(out[i], ort_run(models.mlp, {"x": rows[i]}))
        if fast.lends - seen["lends"] != 1:
            return False
        assert _combiner(eng).groups == 1 and fast.parks == 1
        _until(lambda: not selector._parked, "the owner's next wait puts the parked pipe back")
        with fast.lock.owning():
            assert {w.fd for w in transport.workers} <= set(selector._watched)
        for i in range(3):
            _same(eng.submit(ROWS[i : i + 1]).result(timeout=60).outputs, ort_run(models.mlp, {"x": ROWS[i : i + 1]}))
    return True


def test_news_on_a_parked_pipe_is_read_while_the_engine_idles(models, tmp_path, caplog):
    """A worker's log record sent between tasks, after its slot's pipe was parked by a
    group's task and the engine idles, reaches the caller's logging. (What the owner does to
    a parked pipe while it would sleep long, this test does not pin: other wake-ups of the
    owner put the pipe back here too. test_a_park_wakes_an_owner_that_sleeps_longer_than_park_s
    does.)"""
    rows = [ROWS[i : i + 1] for i in range(2, 6)]
    caplog.set_level(logging.WARNING, logger="tests.between")
    with Engine(models.mlp, workers=2, initializer="tests.express_hooks:marked_and_logs_when_told",
                initargs=(str(tmp_path),), stall_after=3600) as eng:  # (no stall check wakes the owner)
        eng.infer(ROWS[:1])
        _held(eng, tmp_path, [_hold(0), _hold(1)], rows)
        assert eng._sup.fast.parks == 1  # type: ignore[attr-defined]
        (tmp_path / "log").touch()
        _until(lambda: sum(r.name == "tests.between" for r in caplog.records) == 2, "both workers' records")
    pids = {s.pid for s in eng.stats().slots}
    assert {r.getMessage() for r in caplog.records if r.name == "tests.between"} == {
        f"between tasks, pid {p}" for p in pids}


def test_a_park_wakes_an_owner_that_sleeps_longer_than_park_s(models):
    """The owner sleeps until its next timer (a stall check, here an hour away): a group's
    task that parks its slot wakes it, and its next wait puts the pipe back."""
    from slabpool.engine.caller.request import Request

    with Engine(models.mlp, workers=1, stall_after=3600) as eng:
        eng.infer(ROWS[:1])
        fast, selector = eng._sup.fast, eng._transport.selector  # type: ignore[attr-defined]
        got = eng._run_group(Request({"x": ROWS[:4]}, units=0, step=1))  # type: ignore[attr-defined]
        _same(got, ort_run(models.mlp, {"x": ROWS[:4]}))
        assert fast.parks == 1
        _until(lambda: not selector._parked, "the owner's next wait puts the parked pipe back")


def test_a_send_that_is_not_a_lend_puts_a_parked_pipe_back_at_once(models):
    """A parked pipe whose slot is sent work that no caller waits on (a caller acting as the
    owner dispatches what queued, while the owner thread sleeps) is back in the owner's
    selector before the RunBatch leaves: the owner thread reads its answer."""
    with Engine(models.mlp, workers=1) as eng:
        eng.infer(ROWS[:1])
        fast, transport = eng._sup.fast, eng._transport  # type: ignore[attr-defined]
        selector, w = transport.selector, transport.workers[0]
        with fast.lock.owning():  # (as a lender acts: the owner thread waits for the lock meanwhile)
            assert transport.lend(0) == w.fd and w.fd not in selector._watched
            transport.give_back(0, park=True)
            assert w.fd not in selector._watched and w.fd in selector._parked
            fut = eng.submit(ROWS[:1])
            eng._sup.dispatcher.dispatch(time.monotonic())  # type: ignore[attr-defined]
            assert eng._sup.slots[0].batches, "the task went to the slot"  # type: ignore[attr-defined]
            assert w.fd in selector._watched and not selector._parked
        _same(fut.result(timeout=60).outputs, ort_run(models.mlp, {"x": ROWS[:1]}))
