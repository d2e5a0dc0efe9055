"""Engine.infer(feeds, batch_size=...): rows on axis 0 as blocks, one task each.

Checked against the same blocks run one after another in one in-process session (byte for
byte), for ONNX Runtime (small outputs copied, large ones written in place) and LiteRT, from
arrays, dicts and memory-mapped .npy files; the counting of rows next to tasks; rows that fail
(a runtime error, a worker SIGKILLed by a row) failing alone with their own errors; the
errors a caller meets at the door."""

from __future__ import annotations

import numpy as np
import pytest

from slabpool import EngineError, InputContractError, PoisonTask, RowsFailed, SessionRunError
from slabpool.engine.caller.blocks import CLIMB_MAX, PROBE_CALLS, PROBE_ROWS, BlockSizer
from tests.models import onnx_models
from tests.ray_support.plugin import RAY, build
from tests.reference import litert_run, ort_run

RNG = np.random.default_rng(12)
# the blocks are the caller's (engine.caller.blocks), one code for both backends: Ray runs one size
# (and test_ray one more), rows that fail or kill, the door; the rest of the table is the local run's
BLOCKS_ONE_CODE = ("the blocks are engine.caller.blocks', one code for both backends: Ray runs size 1000, rows "
                   "that fail or kill, the door; this variant is the local run's (the confined run's time)")


def _serial(run, model, feeds: dict[str, np.ndarray], size: int) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
    """The same blocks, one after another, in one in-process session."""
    n = next(iter(feeds.values())).shape[0]
    parts = [run(model, {k: v[lo : lo + size] for k, v in feeds.items()}) for lo in range(0, n, size)]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert got[k].tobytes() == v.tobytes(), k


@pytest.mark.parametrize("size", [1, 7, 100, 1000, 5000])
def test_blocks_equal_the_same_blocks_run_serially(backend, models, size) -> None:  # type: ignore[no-untyped-def]
    if backend == RAY and size != 1000:
        pytest.skip(BLOCKS_ONE_CODE)
    x = RNG.standard_normal((3001, 16)).astype(np.float32)
    with build(backend, models.mlp, workers=2) as eng:
        got = eng.infer({"x": x}, batch_size=size)
        bare = eng.infer(x, batch_size=size)  # a bare array: the model's one input
        st = eng.stats()
    want = _serial(ort_run, models.mlp, {"x": x}, size)
    _same(got, want)
    _same(bare, want)
    blocks = -(-3001 // size)
    assert st.accepted == st.completed <= 2 * blocks  # a task holds one block or several
    if blocks > 100:
        assert st.accepted < blocks  # once the run time is known, many blocks to a task
    assert st.items_accepted == st.items_completed == 2 * 3001  # the rows handed in
    assert st.items_failed == st.failed == 0


@pytest.mark.parametrize("model,make,size", [
    ("int_model", lambda n: RNG.integers(-1000, 1000, (n, 4)).astype(np.int32), 33),
    ("payload", lambda n: RNG.standard_normal((n, 256 * 1024)).astype(np.float32), 3),  # 3 MiB a block: in place
    ("identity", lambda n: RNG.standard_normal((n, 4)).astype(np.float32), 64),
], ids=["int", "payload-in-place", "identity"])
def test_other_models_and_outputs_written_in_place(backend, models, model, make, size) -> None:  # type: ignore[no-untyped-def]
    if backend == RAY:
        pytest.skip("outputs written in place into shared memory: an actor's go back through Ray's object store"
                    if model == "payload" else BLOCKS_ONE_CODE)
    path = getattr(models, model)
    x = make(20 if model == "payload" else 500)
    with build(backend, path, workers=2) as eng:
        got = eng.infer(x, batch_size=size)
        st = eng.stats()
    name = "x"
    _same(got, _serial(ort_run, path, {name: x}, size))
    if model == "payload":
        assert st.outputs_in_place > 0  # the runtime wrote the blocks' outputs into shared memory


def test_two_inputs_from_memory_mapped_files(backend, models, tmp_path) -> None:  # type: ignore[no-untyped-def]
    if backend == RAY:
        pytest.skip(BLOCKS_ONE_CODE)
    idx = RNG.integers(-10, 10, 700).astype(np.int64)
    x = RNG.standard_normal((700, 4)).astype(np.float32)
    np.save(tmp_path / "idx.npy", idx)
    np.save(tmp_path / "x.npy", x)
    feeds = {"idx": np.load(tmp_path / "idx.npy", mmap_mode="r"), "x": np.load(tmp_path / "x.npy", mmap_mode="r")}
    with build(backend, models.poison, workers=2) as eng:
        got = eng.infer(feeds, batch_size=128)
    _same(got, _serial(ort_run, models.poison, {"idx": idx, "x": x}, 128))


def test_litert_blocks(backend, models) -> None:  # type: ignore[no-untyped-def]
    if backend == RAY:
        pytest.skip(BLOCKS_ONE_CODE)
    x = RNG.standard_normal((300, 16)).astype(np.float32)
    with build(backend, models.tfl_mlp, workers=2) as eng:
        got = eng.infer(x, batch_size=64)
        name = eng.describe().inputs[0].name
    _same(got, _serial(litert_run, models.tfl_mlp, {name: x}, 64))


def test_auto_block_size(backend, models) -> None:  # type: ignore[no-untyped-def]
    if backend == RAY:
        pytest.skip(BLOCKS_ONE_CODE)
    x = RNG.standard_normal((20_000, 16)).astype(np.float32)
    with build(backend, models.mlp, workers=2) as eng:
        got = eng.infer({"x": x}, batch_size="auto")
        st = eng.stats()
    want = ort_run(models.mlp, {"x": x})
    np.testing.assert_allclose(got["y"] if "y" in got else next(iter(got.values())), next(iter(want.values())),
                               rtol=1e-5, atol=1e-6)
    assert 2 <= st.accepted < 20_000 // PROBE_ROWS  # a probe, then blocks grown from the run time per row
    assert st.items_completed == 20_000


def test_block_sizer_follows_the_run_time_and_the_arena() -> None:
    class R:  # a Result's two fields the sizer reads
        def __init__(self, run: float, rows: int) -> None:
            self.timings = type("T", (), {"run": run})()
            self.outputs = {"y": np.zeros((rows, 1), np.float32)}

    s = BlockSizer("auto", in_row_bytes=4, arena_bytes=1 << 30, in_flight=4)
    assert s.probing and s.next() == PROBE_ROWS * PROBE_CALLS and s.step == 0  # a few small calls, timed
    s.observe(R(0.0001, 100), 100)  # 1 us a row: calls of 2 ms, tasks of 30 ms
    assert not s.probing and s.step == 2000 and s.next() == 15 * 2000
    s.observe(R(0.001, 100), 100)  # slower now (3.7 us a row, an EWMA): fewer calls a task, the step stays
    assert s.step == 2000 and s.next() == 4 * 2000
    tight = BlockSizer("auto", in_row_bytes=64, arena_bytes=1 << 20, in_flight=4)  # 128 KiB a task
    tight.observe(R(0.0001, 100), 100)
    assert tight.step == 2000 and tight.next() == 2000  # one call: 2048 rows fit, not two calls
    slow = BlockSizer("auto", 4, 1 << 30, 4)
    slow.observe(R(0.1, 100), 100)  # 1 ms a row
    assert slow.step == 2 and slow.next() == 30
    fixed = BlockSizer(17, 4, 1 << 20, 4)
    assert not fixed.probing and fixed.step == 17 and fixed.next() == 17  # the step is the batch size
    fixed.observe(R(0.0017, 1700), 1700)  # 1 us a row: 30 ms is 1764 calls; 32 KiB rows fit 1927
    assert fixed.next() == 1764 * 17
    slow_fixed = BlockSizer(17, 4, 1 << 20, 4)
    slow_fixed.observe(R(1.7, 1700), 1700)  # 1 ms a row: one call a task, never less
    assert slow_fixed.next() == 17
    hooked = BlockSizer(17, 4, 1 << 20, 4, group=False)  # hooks see a task's rows: one block a task
    hooked.observe(R(0.0017, 1700), 1700)
    assert hooked.next() == 17
    timed = BlockSizer(17, 4, 1 << 20, 4, task_timeout=0.02)  # a task stays well inside its limit
    timed.observe(R(0.0017, 1700), 1700)  # 1 us a row: 5 ms is 294 calls
    assert timed.next() == 294 * 17
    for bad in (0, -1, 2.5, "big", True):
        with pytest.raises(ValueError, match="batch_size"):
            BlockSizer(bad, 4, 1 << 20, 4)  # type: ignore[arg-type]


def test_auto_tries_longer_calls_while_a_row_gets_cheaper() -> None:
    """A model whose weights stream from memory once a call (a 48-layer 512-wide MLP: 8 rows a
    call at 2 ms ran 3x slower than calls of 300): "auto" doubles the step, one task at a time,
    while a row gets at least 10% cheaper, and goes back to the last step that paid once a longer
    one has not paid twice in a row; a task cut before the step changed is no evidence. Only from
    a small step (CLIMB_FROM rows: a costly row): a model warming up looks like longer calls paying."""
    class R:
        def __init__(self, per_row: float, rows: int) -> None:
            self.timings = type("T", (), {"run": per_row * rows})()
            self.outputs = {"y": np.zeros((rows, 1), np.float32)}

    s = BlockSizer("auto", in_row_bytes=4, arena_bytes=1 << 30, in_flight=4)
    s.observe(R(25e-6, 32), 32, PROBE_ROWS)  # the probe: 25 us a row, calls of 80 rows (2 ms)
    s.observe(R(25e-6, 80), 80, 80)  # the step's first task (it may only grow once from it)
    assert s.step == 80
    s.observe(R(25e-6, 80), 80, 80)  # the climb's base: try 160
    assert s.step == 160
    s.observe(R(25e-6, 80), 80, 80)  # a task cut before the change: no evidence
    assert s.step == 160
    s.observe(R(12e-6, 160), 160, 160)  # a row 52% cheaper: kept, try 320
    assert s.step == 320
    s.observe(R(11.5e-6, 320), 320, 320)  # 4% cheaper only: one more task at 320 decides
    assert s.step == 320
    s.observe(R(11.8e-6, 320), 320, 320)  # not again: back to 160, for good
    assert s.step == 160
    s.observe(R(1e-6, 160), 160, 160)
    assert s.step == 160
    cache_bound = BlockSizer("auto", 4, 1 << 30, 4)  # calls past the caches cost more a row: no climb
    cache_bound.observe(R(100e-6, 32), 32, PROBE_ROWS)  # (100 us a row: calls of 20)
    for _ in range(2):
        cache_bound.observe(R(100e-6, 20), 20, 20)
    cache_bound.observe(R(95e-6, 40), 40, 40)
    cache_bound.observe(R(98e-6, 40), 40, 40)
    assert cache_bound.step == 20
    fast_rows = BlockSizer("auto", 4, 1 << 30, 4)  # a cheap row (1 us: calls of 2000): no climb at all
    fast_rows.observe(R(1e-6, 32), 32, PROBE_ROWS)
    for per in (1e-6, 0.5e-6, 0.2e-6):  # (warming up: faster and faster, whatever the size)
        fast_rows.observe(R(per, 2000), 2000, 2000)
    assert fast_rows.step == 2000 and not fast_rows._climbing
    steep = BlockSizer("auto", 4, 1 << 30, 4)  # always cheaper: at most CLIMB_MAX times the chosen step
    steep.observe(R(1e-3, 32), 32, PROBE_ROWS)  # 1 ms a row: calls of 2 rows
    steep.observe(R(1e-3, 2), 2, 2)
    per = 1e-3
    while steep._climbing:
        steep.observe(R(per, steep.step), steep.step, steep.step)
        per /= 2
    assert steep.step == 2 * CLIMB_MAX
    fixed = BlockSizer(17, 4, 1 << 20, 4)
    for _ in range(3):
        fixed.observe(R(1e-3 / (fixed.step or 1), 17), 17, 17)
    assert fixed.step == 17  # a size the caller gave is never changed


def test_rows_that_fail_in_the_runtime_fail_alone(backend, models) -> None:  # type: ignore[no-untyped-def]
    n = 500
    idx = RNG.integers(-10, 10, n).astype(np.int64)
    bad = [3, 250, 251, 499]
    idx[bad] = [99, -50, 10, 1000]  # outside the table: InvalidArgument for these rows only
    x = RNG.standard_normal((n, 4)).astype(np.float32)
    with build(backend, models.poison, workers=2) as eng:
        with pytest.raises(RowsFailed) as info:
            eng.infer({"idx": idx, "x": x}, batch_size=64)
        st = eng.stats()
    err = info.value
    assert err.rows == bad
    assert all(isinstance(err.errors[i], SessionRunError) for i in bad)
    assert err.outputs is not None
    y = err.outputs["y"]
    assert np.isnan(y[bad]).all()
    good = np.setdiff1d(np.arange(n), bad)
    want = onnx_models.poison_reference(idx[good], x[good])["y"]
    np.testing.assert_allclose(y[good], want, rtol=1e-6)
    assert st.restarts == 0
    assert st.items_accepted == n and st.items_failed == len(bad) and st.items_completed == n - len(bad)


@pytest.mark.parametrize("size,in_place", [(1, None), (7, None), (100, 0), (100, None), (1000, 0)])
def test_tasks_of_many_blocks_run_each_block_as_one_call(backend, models, size, in_place) -> None:  # type: ignore[no-untyped-def]
    if backend == RAY and (in_place is not None or size != 7):
        pytest.skip("in_place_min_bytes is refused on Ray (no output arena)" if in_place is not None else BLOCKS_ONE_CODE)
    """A model whose every output row depends on the rows it ran with (x - mean over axis 0):
    equal bytes mean each block of `size` rows was one call, whatever the task holding it
    (in place: a slice of the output region per call)."""
    x = RNG.standard_normal((6001, 16)).astype(np.float32)
    settings = {} if backend == RAY else {"in_place_min_bytes": in_place}  # (a setting Ray refuses)
    with build(backend, models.centered, workers=2, **settings) as eng:
        eng.infer(x[:3000], batch_size=size)  # the run time is known now: many blocks a task
        before = eng.stats()
        got = eng.infer(x, batch_size=size)
        st = eng.stats()
    _same(got, _serial(ort_run, models.centered, {"x": x}, size))
    assert st.completed - before.completed < -(-6001 // size) or size == 1000
    if in_place == 0:
        assert st.outputs_in_place > before.outputs_in_place


def test_a_task_of_many_blocks_is_cut_on_block_edges(backend, models) -> None:  # type: ignore[no-untyped-def]
    if backend == RAY:
        pytest.skip(BLOCKS_ONE_CODE)
    """One bad row fails its task, which is cut on block edges: every other block keeps its
    rows (byte-identical outputs for a model whose rows depend on their block's other rows)."""
    n, size, bad_row = 6000, 100, 4321
    x = RNG.standard_normal((n, 16)).astype(np.float32)
    idx = RNG.integers(-10, 10, n).astype(np.int64)
    feeds = {"idx": idx.copy(), "x": x}
    feeds["idx"][bad_row] = 99  # outside the table: the call that holds it fails
    with build(backend, models.centered_poison, workers=2) as eng:
        eng.infer({"idx": idx[:4000], "x": x[:4000]}, batch_size=size)  # the run time is known now
        before = eng.stats().completed
        with pytest.raises(RowsFailed) as info:
            eng.infer(feeds, batch_size=size)
        tasks = eng.stats().completed - before
    err = info.value
    assert err.rows == [bad_row] and isinstance(err.errors[bad_row], SessionRunError)
    assert tasks < n // size  # several blocks a task
    want = _serial(ort_run, models.centered_poison, {"idx": idx, "x": x}, size)["y"]
    assert err.outputs is not None
    got = err.outputs["y"]
    own = np.zeros(n, bool)
    own[bad_row // size * size : bad_row // size * size + size] = True  # its block, cut further
    assert got[~own].tobytes() == want[~own].tobytes()
    assert np.isnan(got[bad_row]).all() and not np.isnan(np.delete(got[own], bad_row % size, axis=0)).any()


def test_with_a_hook_a_task_is_one_block(backend, models) -> None:  # type: ignore[no-untyped-def]
    if backend == RAY:
        pytest.skip(BLOCKS_ONE_CODE)
    """A preprocess sees a task's rows at once: tasks stay single blocks, so a hook that looks
    across rows (here: centring them) gives what it gives on those blocks run serially."""
    x = RNG.standard_normal((3000, 4)).astype(np.float32)
    with build(backend, models.identity, workers=2, preprocess="tests.hooks:center_rows") as eng:
        eng.infer(x[:1000], batch_size=50)
        before = eng.stats().completed
        got = eng.infer(x, batch_size=50)
        tasks = eng.stats().completed - before
    want = np.concatenate([x[lo : lo + 50] - x[lo : lo + 50].mean(axis=0) for lo in range(0, 3000, 50)])
    assert tasks == 60 and got["y"].tobytes() == want.astype(np.float32).tobytes()


def test_a_row_that_kills_workers_fails_alone(backend, models) -> None:  # type: ignore[no-untyped-def]
    if backend == RAY:
        pytest.skip("bisecting a block to the killing row is engine.caller.blocks', one code; each death an actor "
                    "restart (20 s of the confined run): poison on Ray is test_crash's, test_ray's, test_batching's")
    n = 48
    x = RNG.standard_normal((n, 16)).astype(np.float32)
    kill = np.zeros(n, bool)
    kill[37] = True
    with build(backend, models.mlp, workers=2, preprocess="tests.hooks:kill_rows", max_attempts=2) as eng:
        with pytest.raises(RowsFailed) as info:
            eng.infer({"x": x, "kill": kill}, batch_size=16)
        st = eng.stats()
    err = info.value
    assert err.rows == [37]
    assert isinstance(err.errors[37], PoisonTask)
    assert err.outputs is not None
    good = np.setdiff1d(np.arange(n), [37])
    want = _serial(ort_run, models.mlp, {"x": x}, 1)  # rows alone: compare loosely (blocks were cut)
    for k, v in want.items():
        np.testing.assert_allclose(err.outputs[k][good], v[good], rtol=1e-5, atol=1e-6)
        assert np.isnan(err.outputs[k][37]).all()
    assert st.restarts >= 2 and st.quarantined >= 1
    assert st.items_failed == 1 and st.items_completed == n - 1


def test_rows_that_fail_in_a_preprocess_fail_alone_integer_outputs_zero(backend, models) -> None:  # type: ignore[no-untyped-def]
    if backend == RAY:
        pytest.skip(BLOCKS_ONE_CODE)
    n = 100
    x = RNG.integers(-9, 9, (n, 4)).astype(np.int32)
    bad = np.zeros(n, bool)
    bad[[0, 57]] = True
    with build(backend, models.int_model, workers=2, preprocess="tests.hooks:fail_rows") as eng:
        with pytest.raises(RowsFailed) as info:
            eng.infer({"x": x, "bad": bad}, batch_size=32)
    err = info.value
    assert err.rows == [0, 57]
    assert all(isinstance(e, SessionRunError) and "bad row" in str(e) for e in err.errors.values())
    assert err.outputs is not None
    y = err.outputs["y"]
    assert y.dtype == np.int32 and (y[[0, 57]] == 0).all()  # failed rows of an integer output: 0
    good = np.setdiff1d(np.arange(n), [0, 57])
    _same({"y": y[good]}, onnx_models.int_reference(x[good]))


def test_every_row_failing_leaves_no_outputs(backend, models) -> None:  # type: ignore[no-untyped-def]
    if backend == RAY:
        pytest.skip(BLOCKS_ONE_CODE)
    idx = np.full(8, 77, np.int64)
    with build(backend, models.poison, workers=1) as eng:
        with pytest.raises(RowsFailed) as info:
            eng.infer({"idx": idx, "x": np.zeros((8, 4), np.float32)}, batch_size=4)
    assert info.value.rows == list(range(8)) and info.value.outputs is None


def test_errors_at_the_door(backend, models) -> None:  # type: ignore[no-untyped-def]
    x = RNG.standard_normal((10, 16)).astype(np.float32)
    with build(backend, models.mlp, workers=1) as eng:
        with pytest.raises(InputContractError, match="dtype"):
            eng.infer(x.astype(np.float64), batch_size=4)  # once, not per block
        for size in (4, "auto"):  # the caller's own shape (was: "got (0, 8)", the checked slice's)
            with pytest.raises(InputContractError, match=r"got \(10, 8\)"):
                eng.infer(x[:, :8].copy(), batch_size=size)
        with pytest.raises(ValueError, match="batch_size"):
            eng.infer(x, batch_size=0)
        got = eng.infer(x, batch_size=np.int64(4))  # a numpy integer is an integer (was refused)
        assert got["probs"].tobytes() == eng.infer(x, batch_size=4)["probs"].tobytes()
        with pytest.raises(ValueError, match="same number of rows"):
            eng.infer({"x": x, "y": x[:3]}, batch_size=4)
        with pytest.raises(TypeError, match="rows go as"):
            eng.infer([x], batch_size=4)
        with pytest.raises(TypeError, match="not \\['deadline'\\]"):
            eng.infer(x, batch_size=4, deadline=1.0)
        empty = eng.infer(x[:0], batch_size=4)  # no rows: one task, as without batch_size
        assert next(iter(empty.values())).shape[0] == 0
        assert eng.stats().failed == 0
    with build(backend, models.static, workers=1) as eng:
        spec = eng.describe().inputs[0]
        with pytest.raises(ValueError, match="not a dynamic axis 0"):
            eng.infer(np.zeros(spec.shape, np.float32), batch_size=1)  # type: ignore[arg-type]
    with build(backend, models.multi_io, workers=1) as eng:  # "total" has no batch axis
        feeds = {"feats": np.ones((6, 4), np.float32), "ids": np.arange(6, dtype=np.int64)}
        with pytest.raises(EngineError, match="rows must lie on axis 0"):
            eng.infer(feeds, batch_size=3)


def test_map_counts_items_next_to_tasks(backend, models) -> None:  # type: ignore[no-untyped-def]
    if backend == RAY:
        pytest.skip("counts chunk tasks: several items as one task are the local engine's (on Ray, one task per item)")
    items = [{"x": RNG.standard_normal((1, 16)).astype(np.float32)} for _ in range(2000)]
    with build(backend, models.mlp, workers=2) as eng:
        assert len(list(eng.map(items))) == 2000
        it = eng.map(items, chunk=50)
        for _ in range(10):
            next(it)
        it.close()  # abandoned: what was not delivered counts as cancelled
    st = eng.stats()  # closed: every task has ended
    assert st.accepted < 2000  # chunks
    assert st.items_accepted == st.items_completed + st.items_cancelled + st.items_failed
    assert st.items_accepted >= 2010 and st.items_completed >= 2010
    assert st.accepted == st.completed + st.cancelled + st.failed


def test_every_row_of_a_call_is_one_models() -> None:
    """A reload() while infer(batch_size=) runs computes some blocks on the old model and some
    on the new (a hostile run: 4 of 2,427 calls returned arrays mixing both, and an array
    names no version). The blocks of another version than the engine's now run again, until
    every row is one model's; the rows are counted once."""
    from slabpool.engine.caller.blocks import Piece, gather

    def piece(lo: int, hi: int, version: str) -> Piece:
        return Piece(lo, hi, outputs={"y": np.full((hi - lo, 2), ord(version), np.float32)}, version=version)

    first = [piece(0, 4, "a"), piece(4, 8, "b"), piece(8, 12, "a"), piece(12, 16, "b")]
    asked: list[list[tuple[int, int]]] = []
    now = iter(["a", "b"])  # the engine's version (a tie's decider): "a" while the swap goes on, then "b"
    served = iter(["b", "b"])  # what the slots run when the blocks go again: the swapped one

    def again(runs: list[tuple[int, int]]):  # type: ignore[no-untyped-def]
        asked.append(runs)
        v = next(served)
        return [piece(lo, hi, v) for lo, hi in runs]

    counts: dict[str, int] = {}
    out = gather(first, 16, lambda **kw: counts.update(kw), again=again, version=lambda: next(now))
    assert asked == [[(4, 8), (12, 16)], [(0, 4), (8, 12)]]
    assert (out["y"] == ord("b")).all()
    assert counts == {"completed": 16, "failed": 0, "cancelled": 0}
    # a swap held up (a slot hangs in its start): the engine still names "a", the serving slot
    # runs "b"; the rows go to "b", the most rows' version, in one round (not again and again)
    asked.clear()
    served = iter(["b"])
    out = gather([piece(0, 4, "a"), piece(4, 16, "b")], 16, lambda **kw: counts.update(kw), again=again,
                 version=lambda: "a")
    assert asked == [[(0, 4)]] and (out["y"] == ord("b")).all()


def test_blocks_during_reloads_are_each_one_models(models, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import threading

    v2 = onnx_models.mlp(tmp_path / "v2.onnx", seed=3)
    x = np.random.default_rng(5).standard_normal((64, 16)).astype(np.float32)
    want = {p: np.concatenate([ort_run(p, {"x": x[i : i + 4]})["probs"] for i in range(0, 64, 4)])
            for p in (models.mlp, v2)}
    got: list[np.ndarray] = []
    with build("local", models.mlp, workers=2) as eng:
        stop = threading.Event()

        def calls() -> None:
            while not stop.is_set():
                got.append(eng.infer({"x": x}, batch_size=4)["probs"])

        t = threading.Thread(target=calls)
        t.start()
        for path in (v2, models.mlp, v2):
            eng.reload(path, timeout=120)
        stop.set()
        t.join()
    assert got and all(any(g.tobytes() == w.tobytes() for w in want.values()) for g in got)
