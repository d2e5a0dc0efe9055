"""The model that serves is the one that was loaded (issue 19, item 2).

The model file is replaced at the same path while the engine runs (a deploy, no reload()), then
a task kills its worker. The slot rebuilt after the crash must load the version the engine pinned
at start, not the new file: every result, the replayed one too, comes from the old model, and
model_version and describe() do not change. reload() then serves the new file on every slot.

The deploys, each a family member: other weights (a new file renamed over the old, as deploy
tools do, and the same inode rewritten in place), other input shapes, only the external data
file changed, and a LiteRT model."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest

from slabpool import Engine
from slabpool.engine.caller import faults
from slabpool.workers.protocol import FaultSpec
from slabpool.workers.session import SessionSpec, model_digest
from slabpool.workers.weights import ModelChanged, pin
from tests.models import onnx_models, tflite_models
from tests.ray_support.plugin import RAY, build
from tests.reference import litert_run, ort_run


def external(model: Path, out: Path) -> Path:
    """`model` saved with every initializer in one external data file, out.stem + '.data'."""
    m = onnx.load(str(model))
    onnx.save_model(m, str(out), save_as_external_data=True, location=out.stem + ".data", size_threshold=0)
    return out


def renamed_over(new: Path, path: Path) -> None:
    tmp = path.with_suffix(".deploy")
    shutil.copyfile(new, tmp)
    os.replace(tmp, path)


def in_place(new: Path, path: Path) -> None:
    with open(path, "r+b") as f:  # the same inode: a hard link or an open fd would see it too
        f.write(new.read_bytes())
        f.truncate()


@dataclass
class Deploy:
    name: str
    build: Callable[[Path], tuple[Path, Path]]  # folder -> (served path, the new version's file)
    apply: Callable[[Path, Path], None]  # (new file, served path)
    x_old: np.ndarray
    x_new: np.ndarray
    run: Callable[[Path, dict[str, np.ndarray]], dict[str, np.ndarray]] = ort_run
    changed_file: Callable[[Path], Path] = lambda p: p  # the file the deploy rewrites


X16 = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
X32 = np.random.default_rng(1).standard_normal((3, 32)).astype(np.float32)


def _mlps(d: Path, **new: int) -> tuple[Path, Path]:
    return onnx_models.mlp(d / "mlp.onnx"), onnx_models.mlp(d / "next" / "mlp.onnx", **new)


def _external(d: Path) -> tuple[Path, Path]:
    old = external(onnx_models.mlp(d / "src0.onnx"), d / "ext.onnx")
    (d / "next").mkdir()
    external(onnx_models.mlp(d / "src1.onnx", seed=1), d / "next" / "ext.onnx")
    return old, d / "next" / "ext.data"


def _tflite(d: Path) -> tuple[Path, Path]:
    return tflite_models.mlp(d / "mlp.tflite"), tflite_models.mlp(d / "next" / "mlp.tflite", seed=1)


DEPLOYS = [
    Deploy("weights, renamed over", lambda d: _mlps(d, seed=1), renamed_over, X16, X16),
    Deploy("weights, rewritten in place", lambda d: _mlps(d, seed=1), in_place, X16, X16),
    Deploy("input shapes", lambda d: _mlps(d, in_dim=32), renamed_over, X16, X32),
    Deploy("external data file", _external, lambda new, p: renamed_over(new, p.with_suffix(".data")), X16, X16,
           changed_file=lambda p: p.with_suffix(".data")),
    Deploy("litert", _tflite, renamed_over, X16[:1], X16[:1], run=litert_run),
]


@pytest.mark.parametrize("deploy", DEPLOYS, ids=[d.name for d in DEPLOYS])
def test_a_slot_rebuilt_after_a_crash_serves_the_pinned_model(deploy: Deploy, tmp_path: Path, backend: str) -> None:
    """Ray restarts a killed actor with its constructor's arguments: the same pinned spec."""
    if backend == RAY and deploy.name not in ("weights, renamed over", "external data file"):
        pytest.skip("the pin is the session's (workers.session), the same in an actor: Ray runs a weights and an "
                    "external-data deploy (the other deploys are the local run's, the confined run's time)")
    path, new_file = deploy.build(tmp_path)
    old_ref = deploy.run(path, {"x": deploy.x_old})
    once = str(tmp_path / "killed")
    with faults.injecting(), build(backend, path, workers=1, cache_dir=tmp_path / "cache") as eng:
        version, described = eng.model_version, eng.describe()
        deploy.apply(new_file, path)
        assert model_digest(str(path)) != version  # the file on disk is another model now
        replayed = faults.submit(eng, {"x": deploy.x_old}, FaultSpec("run", "sigkill", once)).result(timeout=60)
        after = [eng.submit({"x": deploy.x_old}).result(timeout=60) for _ in range(5)]
        st = eng.stats()
        assert os.path.exists(once) and st.restarts == 1  # the worker was killed and rebuilt
        assert replayed.attempts == 2
        for res in [replayed, *after]:
            assert res.model_version == version
            assert res.outputs.keys() == old_ref.keys()
            for name, want in old_ref.items():
                assert res.outputs[name].tobytes() == want.tobytes(), name
        assert eng.describe() == described and {s.model_version for s in st.slots} == {version}

        new_version = eng.reload(path, allow_signature_change=True, timeout=120)
        new_ref = deploy.run(path, {"x": deploy.x_new})
        res = eng.submit({"x": deploy.x_new}).result(timeout=60)
        assert new_version != version and res.model_version == new_version == eng.describe().model_version
        for name, want in new_ref.items():
            assert res.outputs[name].tobytes() == want.tobytes(), name


def test_map_after_a_deploy_and_a_crash_is_one_model(tmp_path: Path, backend: str) -> None:
    """Two workers, one of them killed mid-map() after the deploy: every item of the map()
    comes from the old model (issue 19 saw 2,122 items from the new model and 1,878 from the old)."""
    path, new_file = _mlps(tmp_path, seed=1)
    rows = np.random.default_rng(2).standard_normal((60, 16)).astype(np.float32)
    ref = ort_run(path, {"x": rows})["probs"]
    once = str(tmp_path / "killed")
    items = [{"x": rows[i:i + 1], **({"kill_once": once} if i == 20 else {})} for i in range(len(rows))]
    with build(backend, path, workers=2, preprocess="tests.hooks:kill_marked", cache_dir=tmp_path / "cache") as eng:
        version, first = eng.model_version, {s.pid for s in eng.stats().slots}
        renamed_over(new_file, path)
        outs = list(eng.map(items, chunk=1))
        deadline = time.monotonic() + 60  # only a deadlock reaches it
        while {s.state for s in eng.stats().slots} != {"READY"} and time.monotonic() < deadline:
            time.sleep(0.01)
        outs += list(eng.map(items[:20] + items[21:], chunk=1))  # both slots idle: both serve
        assert eng.stats().restarts == 1 and eng.model_version == version
    assert {r.model_version for r in outs} == {version} and {r.pid for r in outs} - first  # the rebuilt slot served
    got = np.concatenate([r.outputs["probs"] for r in outs[:60]])
    assert np.concatenate([r.outputs["probs"] for r in outs[60:]]).tobytes() == np.delete(ref, 20, 0).tobytes()
    assert got.tobytes() == ref.tobytes()


@pytest.mark.parametrize("cache", ["none", "entry"])
def test_a_changed_source_is_refused_not_loaded(tmp_path: Path, cache: str) -> None:
    """No usable cache entry and a source that is no longer the pinned version: the slot's start
    is refused with an error naming both versions and reload(), never served."""
    path, new_file = _mlps(tmp_path, seed=1)
    spec = SessionSpec(str(path), "onnxruntime", digest=model_digest(str(path)),
                       cache_dir=None if cache == "none" else str(tmp_path / "cache"))
    renamed_over(new_file, path)
    with pytest.raises(ModelChanged, match=r"changed on disk .*version [0-9a-f]{16}, now [0-9a-f]{16}.*reload\(\)"):
        pin(spec, "copy")
    assert not list((tmp_path / "cache").glob("*-copy-*/manifest.json")) if cache == "entry" else True


def test_the_pinned_model_under_both_start_methods(tmp_path: Path, start_method: str) -> None:
    path, new_file = _mlps(tmp_path, seed=1)
    ref = ort_run(path, {"x": X16})["probs"]
    with faults.build(Engine, path, workers=1, start_method=start_method, cache_dir=tmp_path / "c") as eng:
        version = eng.model_version
        renamed_over(new_file, path)
        res = faults.submit(eng, {"x": X16}, FaultSpec("run", "sigkill", str(tmp_path / "once"))).result(timeout=60)
    assert res.attempts == 2 and res.model_version == version and res.outputs["probs"].tobytes() == ref.tobytes()
