"""Hot model swaps on local workers, where the worker processes are ours to start and kill:
what a swap counts as done, and a death while a slot starts on the new model. (The swap's
contract on both backends is in tests/test_ray.py, "hot model swaps".)"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from slabpool import Engine
from slabpool.engine.caller import faults
from slabpool.engine.core.reload import ReloadPlan
from slabpool.workers.protocol import FaultSpec
from tests.models import onnx_models
from tests.reference import ort_run


@pytest.fixture(scope="module")
def v2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return onnx_models.mlp(tmp_path_factory.mktemp("v2") / "mlp_v2.onnx", seed=1)


def test_a_ready_from_an_incarnation_started_on_the_old_model_does_not_count(models, v2):
    """The swap reaches a slot whose worker is still starting on the old model (it was being
    rebuilt after a crash); that worker's Ready must not count as the slot swapped: the slot
    is rebuilt on the new model, whose Ready then counts."""
    with Engine(models.mlp, workers=2) as eng:
        sup = eng._sup
        old = sup.model_spec()
        assert old is not None
        plan = ReloadPlan(dataclasses.replace(old, path=str(v2)), old, drain=True, allow_change=False, order=[0, 1])

        def ready_of_the_old_incarnation() -> int:  # on the supervisor thread, as a Ready is
            sup.slots[0].spec = plan.spec  # the swap has reached slot 0 ...
            plan.on_ready(sup, sup.slots[0])  # ... and the Ready of its old-model worker arrives
            sup.slots[0].spec = old
            return len(plan.swapped())

        assert sup.call(ready_of_the_old_incarnation).result(timeout=30) == 0
        assert not plan.done.is_set()


def test_a_slot_killed_while_it_starts_on_the_new_model_is_started_again(models, v2, tmp_path):
    """A worker killed from outside while it builds the new session (SIGKILL at init): the
    model is not to blame; the slot starts again on it and the swap completes."""
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    with faults.build(Engine, models.mlp, workers=2) as eng:
        faults.set_init_fault(eng, FaultSpec("init", "sigkill", str(tmp_path / "once")))  # the next start dies
        new = eng.reload(v2, timeout=120)
        res = eng.submit({"x": x}).result(timeout=60)
        st = eng.stats()
    assert (tmp_path / "once").exists()
    assert res.model_version == new and {s.model_version for s in st.slots} == {new}
    assert res.outputs["probs"].tobytes() == ort_run(v2, {"x": x})["probs"].tobytes()



def test_a_reload_by_a_relative_path_survives_a_change_of_folder(models, v2, tmp_path, monkeypatch):
    """reload("mlp_v2.onnx") from its folder, then the process changes folder and a worker dies:
    its slot comes back on the new model (was, a hostile run: the path was kept relative, as
    Engine() does not keep it, and with no usable cache every rebuild failed FileNotFoundError;
    the slot stayed DEAD). The cache is unusable here, so the slot opens the source itself."""
    x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    (tmp_path / "c").write_text("a file, not a folder: no usable cache")
    with Engine(models.mlp, workers=2, cache_dir=tmp_path / "c") as eng:
        monkeypatch.chdir(v2.parent)
        new = eng.reload(v2.name, timeout=120)
        monkeypatch.chdir(tmp_path)
        victim = eng.stats().slots[0].pid
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        res = [eng.submit({"x": x}).result(timeout=60) for _ in range(8)]
        deadline = time.monotonic() + 60  # (only a slot that never comes back reaches it)
        while time.monotonic() < deadline and (eng.stats().restarts < 1 or eng.stats().slots[0].state != "READY"):
            time.sleep(0.02)
        st = eng.stats()
    assert {s.model_version for s in st.slots} == {new} and all(s.state == "READY" for s in st.slots)
    assert all(r.model_version == new and r.outputs["probs"].tobytes() == ort_run(v2, {"x": x})["probs"].tobytes()
               for r in res)
