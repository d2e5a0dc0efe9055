"""User code in the workers that misbehaves: an exception whose str() raises, BaseExceptions, a
thread left running, a fork whose child returns. Each costs its own task at most, and nothing
else: no other task's outcome, no worker, no exit stalled (tests/user_code_hooks.py). The first
two on both backends; a worker process's exit and fork are the local transport's."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest

from slabpool import Engine
from slabpool.engine.local import slot as slot_module
from slabpool.workers.errors import SessionRunError
from tests.ray_support.plugin import build
from tests.reference import ort_run

HOOK = "tests.user_code_hooks:misbehave"
RNG = np.random.default_rng(7)


def _x(i: int) -> np.ndarray:
    return np.random.default_rng(i).standard_normal((1, 16)).astype(np.float32)


def _exit_codes(monkeypatch: pytest.MonkeyPatch) -> list[int | None]:
    """The exit code of every worker the engine reaps from here on."""
    codes: list[int | None] = []
    reap = slot_module.Slot.reap

    def reaping(self: Any) -> int | None:
        code = reap(self)
        codes.append(code)
        return code

    monkeypatch.setattr(slot_module.Slot, "reap", reaping)
    return codes


def test_an_exception_whose_str_raises_fails_its_own_item_alone(models: Any, backend: str) -> None:
    """Was: remote_error's str() raised inside the worker's handler, and the whole batch failed
    with that error: 16 of 400 submits, ~970 of 3000 map() items (a chunk is one task)."""
    items = [{"x": _x(i), **({"bad_str": 1} if i == 250 else {})} for i in range(400)]
    with build(backend, models.mlp, preprocess=HOOK) as eng:
        got = list(eng.map(items, return_exceptions=True))
        alone = eng.submit(items[250])
        with pytest.raises(SessionRunError, match=r"BadStr: <str\(\) of the BadStr raised RuntimeError>"):
            alone.result(timeout=60)
        st = eng.stats()
    failed = [i for i, r in enumerate(got) if isinstance(r, BaseException)]
    assert failed == [250] and "BadStr" in str(got[250])
    for i in (0, 249, 251, 399):
        assert got[i].outputs["probs"].tobytes() == ort_run(models.mlp, {"x": _x(i)})["probs"].tobytes()
    assert st.restarts == 0 and st.items_failed == 2


@pytest.mark.parametrize("base", ["SystemExit(0)", "SystemExit(3)", "KeyboardInterrupt", "GeneratorExit"])
def test_a_base_exception_from_a_hook_fails_its_task_alone(models: Any, backend: str, base: str) -> None:
    """SystemExit, KeyboardInterrupt, GeneratorExit raised by user code (the worker ignores
    SIGINT: they are the user's): that task's SessionRunError, naming it (was: the worker died,
    three in a row, and the task was quarantined as PoisonTask with only an exit code)."""
    with build(backend, models.mlp, preprocess=HOOK) as eng:
        bad = eng.submit({"x": _x(1), "base": base})
        good = [eng.submit({"x": _x(i)}) for i in range(2, 8)]
        with pytest.raises(SessionRunError, match=base.split("(")[0]):
            bad.result(timeout=60)
        outs = [f.result(timeout=60) for f in good]
        in_map = list(eng.map([{"x": _x(9)}, {"x": _x(9), "base": base}], return_exceptions=True))
        st = eng.stats()
    assert all(o.outputs["probs"].shape == (1, 8) for o in outs)
    assert isinstance(in_map[1], SessionRunError) and base.split("(")[0] in str(in_map[1])
    assert st.restarts == 0 and st.quarantined == 0


@pytest.mark.parametrize("where", ["recycle", "close"])
def test_a_thread_left_by_a_hook_does_not_hold_the_worker_at_its_exit(models: Any, monkeypatch: pytest.MonkeyPatch,
                                                                       where: str) -> None:
    """A non-daemon thread a hook left running: a retiring worker (max_tasks_per_worker) and a
    closing one exit by themselves (was: multiprocessing joined the thread, and the worker
    waited for its SIGKILL: 10 s a recycle, 5 s a close, each call meanwhile waiting)."""
    codes = _exit_codes(monkeypatch)
    recycle = {"max_tasks_per_worker": 1} if where == "recycle" else {}
    with Engine(models.mlp, workers=1, preprocess=HOOK, **recycle) as eng:
        first = eng.submit({"x": _x(1), "thread": 1}).result(timeout=60)
        second = eng.submit({"x": _x(2)}).result(timeout=60)  # (recycle: on the rebuilt worker)
    assert first.outputs["probs"].shape == second.outputs["probs"].shape == (1, 8)
    assert codes and all(c == 0 for c in codes), codes  # exited, never SIGKILLed (-9)


def test_a_fork_whose_child_returns_into_the_worker_stalls_nothing(models: Any) -> None:
    """A hook forks and both processes return: the child exits at the worker's next step, before
    it touches the worker's pipe (was: both read it; every later task stalled, and close()
    without a timeout never returned)."""
    with Engine(models.mlp, workers=1, preprocess=HOOK) as eng:
        forked = eng.submit({"x": _x(1), "fork": 1}).result(timeout=60)
        later = [eng.submit({"x": _x(i)}).result(timeout=60) for i in range(2, 6)]
        st = eng.stats()
    assert forked.outputs["probs"].tobytes() == ort_run(models.mlp, {"x": _x(1)})["probs"].tobytes()
    assert [r.outputs["probs"].shape for r in later] == [(1, 8)] * 4 and st.restarts == 0


# -- the caller's code where the engine runs it: done-callbacks and signal handlers ----------------


@pytest.mark.parametrize("call", ["infer", "map", "infer_blocks", "result"])
def test_a_waiting_call_in_a_done_callback_is_refused_not_a_hang(models: Any, backend: str, call: str) -> None:
    """A done-callback runs on the engine's own thread: a call there that waits for the engine
    would wait for itself. RuntimeError saying so (was: the engine hung for good, close() too,
    and the process never exited); the engine serves on."""
    got: list[BaseException | None] = []
    with build(backend, models.mlp) as eng:
        waits = {"infer": lambda: eng.infer({"x": _x(2)}), "map": lambda: list(eng.map([{"x": _x(2)}])),
                 "infer_blocks": lambda: eng.infer(np.vstack([_x(2)] * 4), batch_size=2),
                 "result": lambda: eng.submit({"x": _x(2)}).result()}

        def callback(_: Any) -> None:
            try:
                waits[call]()
                got.append(None)
            except BaseException as exc:
                got.append(exc)

        fut = eng.submit({"x": _x(1)})
        fut.add_done_callback(callback)
        fut.result(timeout=60)
        deadline = time.monotonic() + 60  # (only a hang reaches it)
        while not got and time.monotonic() < deadline:
            time.sleep(0.005)
        after = eng.infer({"x": _x(3)})
    assert got and isinstance(got[0], RuntimeError) and "would wait for that thread" in str(got[0]), got
    assert after["probs"].tobytes() == ort_run(models.mlp, {"x": _x(3)})["probs"].tobytes()


def test_close_from_a_signal_handler_during_infer_closes_without_the_stall_watchdog(
        models: Any, caplog: pytest.LogCaptureFixture) -> None:
    """SIGTERM's handler calls close() while the main thread loops infer() (a graceful stop):
    the close ends at once, or, when the handler interrupted the call's own owner step, once
    that call returns; never through the stall watchdog (was: half the time the main thread's
    lent slot waited for its lender, blocked in that close(): 10 s, then "has not taken the
    batch"). Every call before it was answered; the loop ends with EngineClosed."""
    import signal
    import threading

    from slabpool.workers.errors import EngineClosed

    assert threading.current_thread() is threading.main_thread()
    for round_ in range(4):
        eng = Engine(models.mlp, workers=2)
        seen: list[str] = []

        def on_term(*_: Any) -> None:
            eng.close()
            seen.append(eng.state.name)

        previous = signal.signal(signal.SIGTERM, on_term)
        try:
            threading.Timer(0.05 + 0.03 * round_, os.kill, (os.getpid(), signal.SIGTERM)).start()
            calls = 0
            with pytest.raises(EngineClosed):
                while True:
                    eng.infer({"x": _x(1)})
                    calls += 1
        finally:
            signal.signal(signal.SIGTERM, previous)
        eng.close()
        st = eng.stats()
        assert seen and seen[0] in ("CLOSED", "DRAINING") and eng.state.name == "CLOSED"
        assert calls and st.completed >= calls and st.failed == 0
    assert not [r for r in caplog.records if "has not taken" in r.getMessage() or "no progress" in r.getMessage()]
