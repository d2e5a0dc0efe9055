"""The asyncio front end on a real event loop and real worker processes.

Gates are files (tests/async_hooks.py): a gated task marks that it started and then holds its
slot until the test opens the gate, so "queued" and "running" are states the test arranges,
not timings it hopes for. Every wait has a deadline that only a deadlock reaches.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slabpool import Engine
from slabpool.engine.caller import aio, lanes
from slabpool.workers.errors import QueueFull, SessionRunError, TaskCancelled
from tests.models import onnx_models
from tests.ray_support.plugin import build

DEADLOCK_S = 60.0


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, DEADLOCK_S))


async def until(what: Callable[[], bool], why: str) -> None:
    """Yield to the loop until `what()` holds; only a deadlock reaches the deadline."""
    deadline = time.monotonic() + DEADLOCK_S
    while not what():
        assert time.monotonic() < deadline, f"never happened: {why}"
        await asyncio.sleep(0.002)


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 16)).astype(np.float32)


def probs(x: np.ndarray) -> np.ndarray:
    return onnx_models.mlp_reference(x)["probs"]


def gated_engine(models: Any, backend: str, **kw: Any) -> Engine:
    """One slot holding one task at a time: a second task stays queued while the first runs."""
    settings = {"workers": 1, "inflight_per_slot": 1, "preprocess": "tests.async_hooks:gated"}
    return build(backend, models.mlp, **(settings | kw))  # type: ignore[no-any-return]


def item(gate: Path, tag: str, *, wait: bool = False) -> dict[str, Any]:
    return {"x": rows(1), "dir": str(gate), "tag": tag, "wait": wait}


def started(gate: Path, tag: str) -> bool:
    return (gate / f"started-{tag}").exists()


# -- results --------------------------------------------------------------------------------------


def test_infer_submit_and_async_with(models: Any, backend: str) -> None:
    async def main() -> Engine:
        async with build(backend, models.mlp, workers=2) as eng:
            x = rows(3)
            out = await eng.infer_async({"x": x})
            np.testing.assert_allclose(out["probs"], probs(x), rtol=1e-5, atol=1e-6)
            res = await eng.submit_async({"x": x}, context={"tenant": "a"})
            assert (res.task_id, res.attempts, res.context) == (1, 1, {"tenant": "a"})
            assert res.model_version == eng.model_version
            assert eng.state.name == "ACCEPTING"
        return eng

    eng = run(main())
    assert eng.state.name == "CLOSED"


def test_map_async_order_and_bounded_window(models: Any, backend: str) -> None:
    window, n = 3, 24
    pulled = 0

    async def source() -> Any:
        nonlocal pulled
        for i in range(n):
            pulled += 1
            yield {"x": rows(1, seed=i)}

    async def main() -> None:
        async with build(backend, models.mlp, workers=2) as eng:
            got = 0
            async for res in eng.map_async(source(), window=window):
                # accepted and not yet handed to the consumer: never more than the window
                assert pulled - got <= window
                assert eng.stats().accepted - got <= window
                np.testing.assert_allclose(res.outputs["probs"], probs(rows(1, seed=got)), rtol=1e-5, atol=1e-6)
                assert res.task_id == got
                got += 1
            assert got == n

    run(main())


def test_map_async_plain_iterable_return_exceptions(models: Any, backend: str) -> None:
    items = [{"x": rows(1, seed=i), "fail": i % 4 == 1} for i in range(8)]

    async def main() -> list[Any]:
        async with build(backend, models.mlp, workers=2, preprocess="tests.async_hooks:log_and_feed") as eng:
            return [r async for r in eng.map_async(items, return_exceptions=True)]

    out = run(main())
    assert [isinstance(r, SessionRunError) for r in out] == [it["fail"] for it in items]
    assert [r.task_id for r in out] == list(range(8))


def test_map_async_after_another_threads_close_yields_what_was_accepted_then_raises(models: Any, backend: str) -> None:
    """As map(): another thread's close() (a drain) while map_async runs: the outcome of every
    item accepted before it, in order, then EngineClosed (was: EngineClosed at once, and the
    accepted items' outcomes dropped, their tasks cancelled)."""
    from slabpool.engine.core.states import EngineState
    from slabpool.workers.errors import EngineClosed

    xs = [rows(1, seed=i) for i in range(40)]

    async def main() -> tuple[list[Any], Any]:
        eng = build(backend, models.mlp, workers=2)
        closer = threading.Thread(target=eng.close)

        async def stream():  # type: ignore[no-untyped-def]
            for i, x in enumerate(xs):
                if i == 20:
                    closer.start()
                    await until(lambda: eng.state is not EngineState.ACCEPTING, "the close to begin")
                yield {"x": x}

        got = []
        try:
            with pytest.raises(EngineClosed):
                async for r in eng.map_async(stream(), window=64):
                    got.append(r)
        finally:
            await asyncio.to_thread(closer.join, 60)
            eng.close()
        return got, eng.stats()

    got, st = run(main())
    assert [r.index for r in got] == list(range(20)) and (st.accepted, st.completed, st.cancelled) == (20, 20, 0)
    for r in got:
        np.testing.assert_allclose(r.outputs["probs"], probs(xs[r.index]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_map_async_over_an_iterable_that_raises_gets_every_outcome_first(models: Any, backend: str, kind: str) -> None:
    """As map(): every outcome of the items the iterable gave, in order, then its error (was: its
    error at once, and what was in flight cancelled)."""
    n = 40
    xs = [rows(1, seed=i) for i in range(n)]

    def plain():  # type: ignore[no-untyped-def]
        for x in xs:
            yield {"x": x}
        raise OSError("the source went away")

    async def stream():  # type: ignore[no-untyped-def]
        for x in xs:
            await asyncio.sleep(0)
            yield {"x": x}
        raise OSError("the source went away")

    async def main() -> tuple[list[Any], Any]:
        got = []
        async with build(backend, models.mlp, workers=2) as eng:
            with pytest.raises(OSError, match="the source went away"):
                async for r in eng.map_async(plain() if kind == "sync" else stream(), window=8):
                    got.append(r)
            return got, eng.stats()

    got, st = run(main())
    assert [r.index for r in got] == list(range(n))
    for r, x in zip(got, xs, strict=True):
        np.testing.assert_allclose(r.outputs["probs"], onnx_models.mlp_reference(x)["probs"], rtol=1e-5, atol=1e-6)
    assert (st.items_accepted, st.items_completed, st.items_cancelled) == (n, n, 0)


def test_map_async_stops_early_and_cancels_the_rest(models: Any, backend: str, tmp_path: Path) -> None:
    async def main() -> None:
        async with gated_engine(models, backend) as eng:
            feed = [item(tmp_path, "0")] + [item(tmp_path, str(i), wait=True) for i in range(1, 4)]
            async for res in eng.map_async(feed, window=4):
                assert res.task_id == 0
                break  # task 1 holds the slot at the gate; 2 and 3 are queued
            await until(lambda: eng.stats().cancelled == 3, "the rest cancelled")
            (tmp_path / "open").touch()
        st = eng.stats()
        assert (st.accepted, st.completed, st.cancelled) == (4, 1, 3)
        assert not started(tmp_path, "2") and not started(tmp_path, "3")

    run(main())


# -- cancellation receipts --------------------------------------------------------------------------


def test_cancel_queued_never_runs(models: Any, backend: str, tmp_path: Path) -> None:
    async def main() -> None:
        async with gated_engine(models, backend) as eng:
            a = asyncio.create_task(eng.infer_async(item(tmp_path, "a", wait=True)))
            await until(lambda: started(tmp_path, "a"), "a holds the slot")

            b = asyncio.create_task(eng.infer_async(item(tmp_path, "b")))
            await until(lambda: eng.stats().queued == 1, "b queued")
            b.cancel()
            with pytest.raises(asyncio.CancelledError):
                await b
            st = eng.stats()  # the receipt is immediate: out of the queue, counted
            assert (st.queued, st.cancelled) == (0, 1)

            with pytest.raises(TimeoutError):  # a timeout scope: the same receipt
                async with asyncio.timeout(0.05):
                    await eng.infer_async(item(tmp_path, "c"))
            st = eng.stats()
            assert (st.queued, st.cancelled) == (0, 2)

            (tmp_path / "open").touch()
            await a
        st = eng.stats()
        assert (st.accepted, st.completed, st.cancelled, st.failed) == (3, 1, 2, 0)
        assert not started(tmp_path, "b") and not started(tmp_path, "c")

    run(main())


def test_cancel_running_is_never_delivered(models: Any, backend: str, tmp_path: Path) -> None:
    async def main() -> None:
        async with gated_engine(models, backend) as eng:
            a = asyncio.create_task(eng.infer_async(item(tmp_path, "a", wait=True)))
            await until(lambda: started(tmp_path, "a"), "a running")
            a.cancel()
            with pytest.raises(asyncio.CancelledError):
                await a
            # it ends at once, while its run is still held at the gate
            await until(lambda: eng.stats().cancelled == 1, "a cancelled")
            assert eng.stats().slots[0].tasks_done == 0 and not (tmp_path / "open").exists()

            (tmp_path / "open").touch()
            await until(lambda: eng.stats().slots[0].tasks_done == 1, "a's run ended")
            st = eng.stats()
            assert (st.completed, st.cancelled) == (0, 1)  # its result was dropped

            x = rows(2, seed=7)
            res = await eng.submit_async({"x": x})
            assert res.task_id == 1
            np.testing.assert_allclose(res.outputs["probs"], probs(x), rtol=1e-5, atol=1e-6)

    run(main())


def test_close_on_error_cancels_queued_waiters_without_blocking_the_loop(models: Any, backend: str, tmp_path: Path) -> None:
    """`async with` closes on a thread: while close() waits for the running task, the loop
    still runs (here: the coroutine that opens the gate once the queued task is cancelled)."""

    async def open_gate_after(task: asyncio.Task[Any]) -> None:
        await asyncio.wait([task])
        (tmp_path / "open").touch()

    async def main() -> None:
        eng = gated_engine(models, backend)
        with pytest.raises(RuntimeError, match="boom"):
            async with eng:
                a = asyncio.create_task(eng.infer_async(item(tmp_path, "a", wait=True)))
                await until(lambda: started(tmp_path, "a"), "a running")
                b = asyncio.create_task(eng.infer_async(item(tmp_path, "b")))
                await until(lambda: eng.stats().queued == 1, "b queued")
                opener = asyncio.create_task(open_gate_after(b))
                raise RuntimeError("boom")
        with pytest.raises(TaskCancelled) as info:  # the engine's error, not asyncio's
            await b
        assert info.value.reason == "closed"
        await opener
        assert (await a)["probs"].shape == (1, 8)
        assert eng.state.name == "CLOSED"

    run(main())


# -- admission ----------------------------------------------------------------------------------


def test_the_loop_never_waits_on_a_full_queue_while_200_run(models: Any) -> None:
    """A full queue sends callers to the admission lane, never to a wait on the loop: every
    caller that waits for a place in the admission queue (each joins its line first: recorded
    as it happens) is on another thread, and there were such waits (the lane was exercised)."""
    waits: list[int] = []

    class RecordedLine(collections.deque):  # type: ignore[type-arg]
        def append(self, turn: Any) -> None:
            waits.append(threading.get_ident())
            super().append(turn)

    async def main() -> None:
        async with Engine(models.mlp, workers=2, queue_capacity=4) as eng:
            eng._queue._line = RecordedLine()
            loop_thread = threading.get_ident()
            xs = [rows(2, seed=i) for i in range(200)]
            outs = await asyncio.gather(*(eng.infer_async({"x": x}) for x in xs))
            for x, out in zip(xs, outs, strict=True):
                np.testing.assert_allclose(out["probs"], probs(x), rtol=1e-5, atol=1e-6)
            assert lanes.lanes(eng).admit.jobs > 0, "the queue never filled: the lane was not exercised"
            assert waits, "no caller ever waited for room: the queue never filled"
            assert loop_thread not in waits, "the event loop's thread waited on the full queue"

    run(main())


def test_full_queue_with_reject_raises_queue_full(models: Any, backend: str, tmp_path: Path) -> None:
    async def main() -> None:
        async with gated_engine(models, backend, admission="reject", queue_capacity=1) as eng:
            a = asyncio.create_task(eng.infer_async(item(tmp_path, "a", wait=True)))
            await until(lambda: started(tmp_path, "a"), "a running")
            b = asyncio.create_task(eng.infer_async(item(tmp_path, "b")))
            await until(lambda: eng.stats().queued == 1, "b queued")
            with pytest.raises(QueueFull):
                await eng.infer_async(item(tmp_path, "c"))
            (tmp_path / "open").touch()
            await asyncio.gather(a, b)
        assert eng.stats().accepted == 2

    run(main())


# -- mistakes at the call, and Ctrl-C on a loop run by hand (a hostile run found each) -------------


def test_times_and_context_are_checked_at_the_call_as_the_sync_calls_do(models: Any, backend: str) -> None:
    """submit_async/infer_async raise what submit raises for a bad block_timeout, deadline or
    context, at the call (was: accepted with the queue not full; a context of the wrong type
    failed in the worker with a SessionRunError); map()/map_async() check their context at the
    call; the engine serves on with nothing accepted."""
    x = {"x": rows(1)}

    async def main() -> None:
        async with build(backend, models.mlp, workers=1) as eng:
            for kw, err in [({"block_timeout": "1"}, TypeError), ({"block_timeout": True}, TypeError),
                            ({"block_timeout": float("nan")}, ValueError), ({"deadline": "1"}, TypeError),
                            ({"context": "tenant-a"}, TypeError), ({"context": ["a"]}, TypeError)]:
                with pytest.raises(err, match=next(iter(kw))):
                    await eng.submit_async(x, **kw)
                with pytest.raises(err, match=next(iter(kw))):
                    await eng.infer_async(x, **kw)
                with pytest.raises(err, match=next(iter(kw))):
                    eng.submit(x, **kw)
            with pytest.raises(TypeError, match="context must be a dict"):
                eng.map([x], context=5)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="context must be a dict"):
                eng.map_async([x], context=5)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="not a function"):
                eng.map_async(rows)  # type: ignore[arg-type]
            assert eng.stats().accepted == 0
            res = await eng.submit_async(x, context={"tenant": "a"}, block_timeout=1.0)
            assert res.context == {"tenant": "a"}

    run(main())


@pytest.mark.parametrize("return_exceptions", [True, False])
def test_map_async_gives_an_item_refused_at_the_door_at_its_position(models: Any, backend: str,
                                                                      return_exceptions: bool) -> None:
    """As map(): an item the door refuses (float64 where the model takes float32) is that
    item's error, with its .index, after the outcomes before it; with return_exceptions the
    rest still runs. Was: map_async raised it at once, the result before it never yielded and
    its task cancelled, the error without an index."""
    from slabpool.workers.errors import InputContractError

    items = [{"x": rows(1, seed=0)}, {"x": rows(1, seed=1).astype(np.float64)}, {"x": rows(1, seed=2)}]

    async def main() -> tuple[list[Any], BaseException | None]:
        got: list[Any] = []
        async with build(backend, models.mlp, workers=1) as eng:
            try:
                async for r in eng.map_async(items, return_exceptions=return_exceptions):
                    got.append(r)
            except InputContractError as exc:
                return got, exc
        return got, None

    got, raised = run(main())
    if return_exceptions:
        assert raised is None and [type(r).__name__ for r in got] == ["Result", "InputContractError", "Result"]
        assert got[1].index == 1 and [got[0].index, got[2].index] == [0, 2]
    else:
        assert [r.index for r in got] == [0] and raised is not None and raised.index == 1  # type: ignore[attr-defined]
    np.testing.assert_allclose(got[0].outputs["probs"], probs(rows(1, seed=0)), rtol=1e-5, atol=1e-6)


def _lane_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("slabpool-aio-")]


def test_close_stops_the_asyncio_lanes_and_a_call_after_it_starts_none(models: Any) -> None:
    """A sync close() stops the admission and cancel lanes (was: two idle threads for as long
    as the engine object lived); a call on the closed engine raises EngineClosed and starts no
    thread (was: both again)."""
    from slabpool.workers.errors import EngineClosed

    big = {"x": np.zeros((aio.INLINE_COPY_BYTES // 64 + 1, 16), np.float32)}  # (admitted on the lane)
    eng = Engine(models.mlp, workers=1)
    try:
        before = set(_lane_threads())
        run(eng.infer_async(big))
        assert set(_lane_threads()) - before
    finally:
        eng.close()
    deadline = time.monotonic() + DEADLOCK_S
    while set(_lane_threads()) - before:
        assert time.monotonic() < deadline, _lane_threads()
        time.sleep(0.005)
    for x in (big, {"x": rows(1)}):
        with pytest.raises(EngineClosed):
            run(eng.infer_async(x))
    assert not set(_lane_threads()) - before


def _hand_run(eng: Engine, loop: asyncio.AbstractEventLoop, x: Any, tries: int = 1000) -> int:
    """Calls on a loop run by hand until one is interrupted (KeyboardInterrupt out of
    run_until_complete): how many calls that took. Many tries: a loop is lent its slot only
    when the engine is calm (two idle accepts in a row), which a busy host may deny for a
    while (20 tries ran out once in CI, beside other tests); each call is ~1 ms."""
    for n in range(1, tries + 1):
        try:
            loop.run_until_complete(eng.infer_async(x))
        except KeyboardInterrupt:
            return n
    raise AssertionError(f"no call was interrupted in {tries}")


def test_a_ctrl_c_in_a_hand_run_loops_step_abandons_the_call_not_the_engine(models: Any,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop run by hand on the main thread (run_until_complete: a script's, Jupyter's), SIGINT
    while it runs the owner's step for the slot lent to it: KeyboardInterrupt comes out of
    run_until_complete once the step is done, and the engine serves on, async and sync, every
    task ended once. Was: EngineInternalError for every later call ("a caller acting as the
    owner was interrupted"), the engine stopped for good."""
    import signal

    assert threading.current_thread() is threading.main_thread()  # (only it runs handlers)
    x = {"x": rows(1)}
    loop = asyncio.new_event_loop()
    try:
        with Engine(models.mlp, workers=1) as eng:
            for _ in range(3):
                loop.run_until_complete(eng.infer_async(x))
            transport = eng._transport  # type: ignore[attr-defined]
            fired: list[int] = []

            def ctrl_c(read: Any) -> Any:
                def reading(slot: int) -> Any:
                    if not fired:
                        fired.append(slot)
                        signal.raise_signal(signal.SIGINT)
                    return read(slot)
                return reading

            # the step reads the answer with lent_frames (the express lane's) or read_lent (a
            # call the general path lent the slot to the loop): which one a call takes depends
            # on what else is in flight at its accept
            monkeypatch.setattr(transport, "lent_frames", ctrl_c(transport.lent_frames))
            monkeypatch.setattr(transport, "read_lent", ctrl_c(transport.read_lent))
            previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # (Python's own, as a script has)
            try:
                calls = 3 + _hand_run(eng, loop, x)
            except AssertionError as exc:  # (say which: no lent read at all, or a signal that never came out)
                raise AssertionError(f"{exc}; SIGINT raised in a lent read of slot: {fired}") from None
            finally:
                signal.signal(signal.SIGINT, previous)
            monkeypatch.undo()
            assert fired
            again = loop.run_until_complete(asyncio.wait_for(eng.infer_async(x), DEADLOCK_S))
            sync = eng.infer(x)
            calls += 2
            st = eng.stats()
            assert eng.state.name == "ACCEPTING"
        assert again["probs"].tobytes() == sync["probs"].tobytes()
        np.testing.assert_allclose(sync["probs"], probs(x["x"]), rtol=1e-5, atol=1e-6)
        assert (st.accepted, st.completed, st.failed, st.cancelled) == (calls, calls, 0, 0)
    finally:
        loop.close()


def test_a_ctrl_c_as_a_call_is_handed_to_the_admission_lane_leaves_it_usable(models: Any,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGINT between the admission lane's count of a job and its put (a hand-run loop on the
    main thread): the call is abandoned (its task cancelled, or ended if already admitted) and
    the lane's backlog goes back to 0, so later calls take the express lane again. Was: the
    backlog stuck at 1, and every later call took a thread hop through the lane for good."""
    import signal

    big = {"x": np.zeros((aio.INLINE_COPY_BYTES // 64 + 1, 16), np.float32)}
    x = {"x": rows(1)}
    loop = asyncio.new_event_loop()
    try:
        with Engine(models.mlp, workers=1) as eng:
            loop.run_until_complete(eng.infer_async(big))  # (the lanes exist)
            lane = lanes.lanes(eng).admit
            jobs = lane._jobs

            class Interrupting:  # the lane's queue, whose put is where the Ctrl-C lands
                def put(self, item: Any) -> None:
                    signal.raise_signal(signal.SIGINT)
                    jobs.put(item)

                def get(self) -> Any:
                    return jobs.get()

            monkeypatch.setattr(lane, "_jobs", Interrupting())
            with pytest.raises(KeyboardInterrupt):
                loop.run_until_complete(eng.infer_async(big))
            monkeypatch.undo()
            deadline = time.monotonic() + DEADLOCK_S
            while lane.backlog:
                assert time.monotonic() < deadline, "the lane's backlog never went back to 0"
                time.sleep(0.002)
            while (st := eng.stats()).accepted != st.completed + st.cancelled + st.failed:
                assert time.monotonic() < deadline, "the interrupted call's task never ended"
                time.sleep(0.002)
            taken = eng._express.taken  # type: ignore[attr-defined]
            for _ in range(20):  # (the first calls after one that was in flight go the general way)
                loop.run_until_complete(eng.infer_async(x))
                if eng._express.taken > taken:  # type: ignore[attr-defined]
                    break
            assert eng._express.taken > taken, lane.backlog  # type: ignore[attr-defined]
        st = eng.stats()
        assert st.accepted == st.completed + st.cancelled and st.failed == 0
    finally:
        loop.close()


# -- the documented example -----------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient`")
def test_starlette_example_serves_inference(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    monkeypatch.setenv("SLABPOOL_WORKERS", "1")
    from examples import starlette_app

    image = np.zeros((3, 112, 112), dtype=np.float32)
    with TestClient(starlette_app.app) as client:
        got = client.post("/predict", content=image.tobytes(),
                          headers={"content-type": "application/octet-stream", "x-request-id": "r-1"})
        assert got.status_code == 200, got.text
        body = got.json()
        assert len(body["probs"]) == 10 and body["label"] == int(np.argmax(body["probs"]))
        assert client.post("/predict", content=b"\0" * 12).status_code == 422
        metrics = client.get("/metrics")
        assert "slabpool_tasks_completed_total 1" in metrics.text
        assert client.get("/healthz").status_code == 200
