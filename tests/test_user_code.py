"""User code in the workers that misbehaves: an exception whose str() raises, BaseExceptions, a
thread left running, a fork whose child returns. Each costs its own task at most, and nothing
else: no other task's outcome, no worker, no exit stalled (tests/user_code_hooks.py). The first
two on both backends; a worker process's exit and fork are the local transport's."""

from __future__ import annotations

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
