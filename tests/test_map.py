"""Engine.map with chunks: several items as one task, each item with its own outcome.

Checked against per-item references: order, identity of each item's rows, per-item errors
(at the door, in the runtime, in a preprocess), a poison item that kills workers inside a
chunk (it fails alone), chunk sizes that follow the measured run time, abandoning the map."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from slabpool import Engine
from slabpool.engine.caller.mapping import MAX_CHUNK, _Pace
from slabpool.workers.errors import InputContractError, PoisonTask, SessionRunError
from tests.models import onnx_models
from tests.ray_support.plugin import RAY, build
from tests.reference import ort_run

RNG = np.random.default_rng(7)
# map(chunk=N) on Ray: one task per item, each with its own outcome (chunked_map is False there)
COUNTS_CHUNKS = "counts chunk tasks: several items as one task are the local engine's (on Ray, one task per item)"


def _close(got, want, exact: bool = False) -> None:  # type: ignore[no-untyped-def]
    assert set(got) == set(want)
    for k, v in want.items():  # stacked runs: ORT's bits may depend on batch size (see test_batching)
        assert got[k].shape == v.shape
        if exact:
            assert got[k].tobytes() == v.tobytes()
        else:
            np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [1, 7, 64, None])
@pytest.mark.parametrize("stacked", [False, True], ids=["one by one", "stacked"])
def test_chunked_map_equals_one_task_per_item(models, backend, chunk, stacked) -> None:  # type: ignore[no-untyped-def]
    if backend == RAY and chunk in (64, None):
        pytest.skip(COUNTS_CHUNKS)
    if backend == RAY and chunk == 7:
        pytest.skip("chunk=7 is one task per item on Ray: the chunk=1 cases are Ray's map")
    items = [{"x": RNG.standard_normal((int(n), 16)).astype(np.float32)} for n in RNG.integers(1, 4, 500)]
    settings = {"max_batch_size": 64} if stacked else {}  # dynamic batching on: chunks stack too
    with build(backend, models.mlp, workers=2, **settings) as eng:
        results = list(eng.map(items, chunk=chunk))
        st = eng.stats()
    assert len(results) == len(items)
    for it, res in zip(items, results, strict=True):
        _close(res.outputs, ort_run(models.mlp, it), exact=not stacked)  # each item its own rows
        for arr in res.outputs.values():
            assert arr.flags.writeable
    if chunk == 64:
        assert st.accepted == -(-len(items) // 64)  # one task per chunk
        ids = [r.task_id for r in results]
        assert ids == sorted(ids) and len(set(ids)) == st.accepted
    if chunk is None:
        assert st.accepted < len(items) // 4  # tiny items: chunks grew from the measured run time
    assert st.completed == st.accepted and st.failed == 0


def test_items_that_fail_in_the_runtime_fail_alone_inside_a_chunk(models) -> None:  # type: ignore[no-untyped-def]
    idx = [0, 3, 99, 5, -50, 9, 1, 2]  # 99 and -50 are outside the table: InvalidArgument
    items = [{"idx": np.array([i], np.int64), "x": np.ones((1, 4), np.float32)} for i in idx]
    with Engine(models.poison, workers=1) as eng:
        outs = list(eng.map(items, chunk=8, return_exceptions=True))
        with pytest.raises(SessionRunError):
            list(eng.map(items, chunk=8))  # without return_exceptions: raises at its position
        assert eng.stats().restarts == 0  # a runtime error leaves the worker serving
    for i, it, out in zip(idx, items, outs, strict=True):
        if -10 <= i <= 9:
            _close(out.outputs, onnx_models.poison_reference(it["idx"], it["x"]))
        else:
            assert isinstance(out, SessionRunError), out
            assert "indices" in str(out) and out.task_id == outs[0].task_id  # the item's own error


def test_a_poison_item_inside_a_chunk_fails_alone(models) -> None:  # type: ignore[no-untyped-def]
    items = [{"x": RNG.standard_normal((1, 16)).astype(np.float32), "kill": i == 3} for i in range(8)]
    with Engine(models.mlp, workers=1, preprocess="tests.hooks:kill_flagged", max_attempts=2) as eng:
        outs = list(eng.map(items, chunk=8, return_exceptions=True))
        st = eng.stats()
    assert isinstance(outs[3], PoisonTask)
    for i, (it, out) in enumerate(zip(items, outs, strict=True)):
        if i != 3:
            _close(out.outputs, ort_run(models.mlp, {"x": it["x"]}))
    assert st.quarantined == 2  # the chunk, then the item alone; its 7 mates were run again and done
    assert st.restarts == 4


def test_a_bad_item_is_refused_at_the_door(models, backend) -> None:  # type: ignore[no-untyped-def]
    items = [{"x": np.ones((1, 16), np.float32)}] * 5 + [{"x": np.ones((1, 15), np.float32)}]
    with build(backend, models.mlp, workers=1) as eng:
        with pytest.raises(InputContractError, match="axis 1 must be 16"):
            list(eng.map(items, chunk=4))
        assert list(eng.map(items[:5], chunk=4))  # the engine goes on


@pytest.mark.parametrize("chunk", [1, 4, None])
@pytest.mark.parametrize("bad", [0, 5, 9])
def test_an_item_refused_at_the_door_raises_at_its_position_with_its_index(models, backend, chunk, bad) -> None:  # type: ignore[no-untyped-def]
    """Was: the contract error was raised at once, before the results of the items ahead of it,
    and without an .index."""
    if backend == RAY and (chunk != 1 or bad != 5):
        pytest.skip("chunk=N is one task per item on Ray: Ray runs chunk=1 with the refusal mid-way (bad=5)")
    items = [{"x": np.full((1, 16), i, np.float32)} for i in range(10)]
    items[bad] = {"x": np.ones((1, 15), np.float32)}
    with build(backend, models.mlp, workers=1) as eng:
        got = []
        with pytest.raises(InputContractError, match="axis 1 must be 16") as err:
            for res in eng.map(items, chunk=chunk):
                got.append(res.index)
        assert got == list(range(bad)) and err.value.index == bad  # type: ignore[attr-defined]


@pytest.mark.parametrize("chunk", [1, 4, None])
@pytest.mark.parametrize("ordered", [True, False])
def test_an_iterable_that_raises_gets_every_outcome_before_its_error(models, backend, chunk, ordered) -> None:  # type: ignore[no-untyped-def]
    """As the builtin map(): the outcomes of every item the iterable gave, then its error. Was:
    the error at once, the items read ahead of it cancelled (a generator over 3,000 items gave
    134-212 results, then its error: a hostile run)."""
    if backend == RAY and chunk != 1:
        pytest.skip("chunk=N is one task per item on Ray: chunk=1 covers it there")
    n = 300
    xs = np.random.default_rng(7).standard_normal((n, 16)).astype(np.float32)

    def items():  # type: ignore[no-untyped-def]
        for i in range(n):
            yield {"x": xs[i : i + 1]}
        raise OSError("the source went away")

    with build(backend, models.mlp, workers=2) as eng:
        got = {}
        with pytest.raises(OSError, match="the source went away"):
            for res in eng.map(items(), chunk=chunk, ordered=ordered):
                got[res.index] = res.outputs
        assert sorted(got) == list(range(n))
        want = ort_run(models.mlp, {"x": xs})
        for i in range(n):
            _close(got[i], {k: v[i : i + 1] for k, v in want.items()})
        st = eng.stats()
        assert (st.items_accepted, st.items_completed, st.items_cancelled) == (n, n, 0)
        assert len(list(eng.map([{"x": xs[:1]}] * 3))) == 3  # the engine goes on


def test_abandoning_a_chunked_map_cancels_what_is_queued(models) -> None:  # type: ignore[no-untyped-def]
    items = ({"x": np.ones((1, 16), np.float32)} for _ in range(10_000))
    with Engine(models.mlp, workers=1) as eng:
        it = eng.map(items, chunk=16, window=64)
        first = next(it)
        it.close()
        st = eng.stats()
        assert first.outputs["probs"].shape == (1, 8)
        assert st.accepted <= 64 // 16 + 1  # the window bounds what was ever submitted


def test_chunk_size_follows_the_measured_run_time() -> None:
    pace = _Pace()
    assert pace.chunk(None, 2) == 1  # nothing measured yet
    pace.observe(0.030, 1)  # 30 ms an item: one by one
    assert pace.chunk(None, 2) == 1
    pace = _Pace()
    pace.observe(0.0002, 40)  # 5 us an item
    assert pace.chunk(None, 2) == MAX_CHUNK
    assert pace.chunk(64, 2) == 16  # two tasks per worker within the caller's window
    pace.weigh({"x": np.zeros(1 << 20, np.float32)})  # 4 MiB items: 16 MiB of inputs a chunk at most
    assert pace.chunk(None, 2) == 4


def test_chunks_are_off_where_they_cannot_apply(models) -> None:  # type: ignore[no-untyped-def]
    items = [{"x": np.ones((1, 16), np.float32)}] * 40
    with Engine(models.mlp, workers=1, task_timeout=30) as eng:  # a limit per task, not per item
        assert len(list(eng.map(items, chunk=8))) == 40
        assert eng.stats().accepted == 40
    with pytest.raises(ValueError, match="chunk"):
        with Engine(models.mlp, workers=1) as eng:
            list(eng.map(items, chunk=0))


def test_same_shape_items_of_a_chunk_travel_stacked() -> None:
    """One array per input name for the whole chunk (one copy), split back item by item."""
    from slabpool.workers import packing
    from slabpool.workers.protocol import Chunk, Rows

    items = Chunk({"a": RNG.standard_normal((n, 3)).astype(np.float32), "b": np.arange(n, dtype=np.int64)}
                  for n in (1, 2, 1, 4))
    skeleton, arrays = packing.split(items)
    assert type(skeleton) is Rows and skeleton.counts == (1, 2, 1, 4) and len(arrays) == 2
    buf = np.zeros(1 << 12, np.uint8)

    def at(off: int, dt: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        return buf[off : off + dt.itemsize * int(np.prod(shape))].view(dt).reshape(shape)

    packed = packing.write(skeleton, arrays, 0, at)
    assert len(packed.arrays) == 2  # not one per item
    for copy in (False, True):
        back = packing.unpack(packed, at, copy=copy)
        assert type(back) is Chunk and len(back) == 4
        for got, want in zip(back, items, strict=True):
            assert set(got) == {"a", "b"}
            for k in want:
                assert got[k].tobytes() == want[k].tobytes() and got[k].shape == want[k].shape
    for odd in ([{"a": np.ones((1, 3), np.float32)}, {"a": np.ones((1, 4), np.float32)}],  # trailing shape
                [{"a": np.ones((1, 3), np.float32)}, {"a": np.ones((1, 3), np.float64)}],  # dtype
                [{"a": np.ones((1, 3), np.float32)}, {"b": np.ones((1, 3), np.float32)}],  # names
                [{"a": np.ones((2, 3), np.float32), "b": np.ones(1, np.int64)}],  # rows differ in an item
                [{"a": np.float32(1)}]):  # not an array with rows
        assert type(packing.split(Chunk(odd))[0]) is Chunk  # each item keeps its own arrays


def test_two_input_items_of_varied_rows_in_chunks(models) -> None:  # type: ignore[no-untyped-def]
    items = [{"feats": RNG.standard_normal((int(n), 4)).astype(np.float32), "ids": np.arange(int(n), dtype=np.int64)}
             for n in RNG.integers(1, 5, 300)]
    with Engine(models.multi_io, workers=2) as eng:
        results = list(eng.map(items, chunk=32))
    for it, res in zip(items, results, strict=True):
        _close(res.outputs, ort_run(models.multi_io, it), exact=True)


def test_unordered_map_yields_what_finishes_first(models, tmp_path, backend) -> None:  # type: ignore[no-untyped-def]
    """Item 0 waits at a gate that opens only once the five others came back: an ordered map
    would wait for item 0 first (and never open the gate); an unordered one does not."""
    gate = tmp_path / "gate"
    items = [{"x": np.full((1, 16), i, np.float32), **({"gate": str(gate)} if i == 0 else {})} for i in range(6)]
    seen = []
    with build(backend, models.mlp, workers=2, inflight_per_slot=1, preprocess="tests.hooks:gated") as eng:
        for res in eng.map(items, chunk=1, ordered=False):
            seen.append(res.task_id)
            if len(seen) == 5:
                gate.touch()
        want = {r.task_id: r.outputs["probs"] for r in eng.map([{"x": it["x"]} for it in items], chunk=1)}
    assert sorted(seen[:5]) == [1, 2, 3, 4, 5] and seen[5] == 0
    assert len(want) == 6


def test_a_ctrl_c_while_map_waits_for_a_chunk_leaves_its_items_counted(models, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """SIGINT while map() waits for a chunk's task (held in its worker): KeyboardInterrupt, and
    the chunk's items count as cancelled (was, a hostile run: the chunk was taken off map()'s
    pending tasks before the wait, so nothing cancelled or counted it; accepted items ran ahead
    of completed + failed + cancelled for good, by a chunk each interrupt)."""
    gate, log = tmp_path / "gate", tmp_path / "log"
    items = [{"x": np.ones((1, 16), np.float32), "gate": str(gate), "log": str(log)} for _ in range(16)]
    with Engine(models.mlp, workers=1, preprocess="tests.hooks:gated") as eng:

        def interrupt_once_held() -> None:
            deadline = time.monotonic() + 60  # (only a task that never starts reaches it)
            while not log.exists() and time.monotonic() < deadline:
                time.sleep(0.005)
            os.kill(os.getpid(), signal.SIGINT)

        t = threading.Thread(target=interrupt_once_held)
        t.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                list(eng.map(items, chunk=16))
        finally:
            t.join(60)
            gate.touch()
        deadline = time.monotonic() + 60
        while eng.stats().completed + eng.stats().cancelled < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        st = eng.stats()
        assert st.items_accepted == 16 and st.items_completed + st.items_failed + st.items_cancelled == 16, st
        assert len(list(eng.map([{"x": np.ones((1, 16), np.float32)}] * 3))) == 3  # it serves on


@pytest.mark.parametrize("chunk", [1, None], ids=["one-a-task", "auto-chunks"])
def test_a_close_from_another_thread_yields_what_was_accepted_then_raises(models, backend, chunk) -> None:  # type: ignore[no-untyped-def]
    """Another thread's close() (a drain) while map() runs: every item accepted before it is
    run by the drain, and map() yields its outcome in order, then raises EngineClosed (as an
    iterable that raises: the outcomes before it, then its error). Was: EngineClosed at once,
    from the next submit, and the accepted items' outcomes dropped (~35 of them in a hostile
    run), a chunk's counted cancelled though it ran."""
    from slabpool.engine.core.states import EngineState
    from slabpool.workers.errors import EngineClosed

    xs = [RNG.standard_normal((1, 16)).astype(np.float32) for _ in range(120)]
    eng = build(backend, models.mlp)
    closer = threading.Thread(target=eng.close)

    def items():  # type: ignore[no-untyped-def]
        for i, x in enumerate(xs):
            if i == 60:
                closer.start()
                deadline = time.monotonic() + 60  # (only a hang reaches it)
                while eng.state is EngineState.ACCEPTING and time.monotonic() < deadline:
                    time.sleep(0.002)
            yield {"x": x}

    got = []
    try:
        with pytest.raises(EngineClosed):
            for r in eng.map(items(), chunk=chunk):
                got.append(r)
    finally:
        closer.join(60)
        eng.close()
    st = eng.stats()
    accepted = st.items_accepted  # (60; fewer in chunks: the chunk being filled when the close began is refused whole)
    assert 0 < accepted <= 60 and (accepted == 60 or chunk is None)
    assert [r.index for r in got] == list(range(accepted))
    for r in got:
        np.testing.assert_allclose(r.outputs["probs"], ort_run(models.mlp, {"x": xs[r.index]})["probs"],
                                   rtol=1e-5, atol=1e-6)
    assert (st.items_completed, st.items_cancelled, st.items_failed) == (accepted, 0, 0)
