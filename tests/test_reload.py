"""Hot model swap under load: no task fails, every Result names the version that computed it,
a model that does not load (or changes the signature) leaves the old one serving."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from slabpool import Engine
from slabpool.engine.local.reload import SignatureChanged
from slabpool.workers.errors import SessionInitError
from tests.models import onnx_models
from tests.reference import ort_run


@pytest.fixture(scope="module")
def v2(tmp_path_factory):
    return onnx_models.mlp(tmp_path_factory.mktemp("v2") / "mlp_v2.onnx", seed=1)


def _load(eng: Engine, xs, out: list, stop: threading.Event) -> None:
    i = 0
    while not stop.is_set():
        out.append((xs[i % len(xs)], eng.submit({"x": xs[i % len(xs)]})))
        i += 1


@pytest.mark.parametrize("drain", [True, False])
def test_reload_under_load_loses_nothing_and_tags_every_result(models, v2, drain):
    xs = [np.random.default_rng(i).standard_normal((2, 16)).astype(np.float32) for i in range(8)]
    with Engine(models.mlp, workers=2) as eng:
        v1 = eng.model_version
        submitted: list = []
        stop = threading.Event()
        t = threading.Thread(target=_load, args=(eng, xs, submitted, stop))
        t.start()
        try:
            new = eng.reload(v2, drain_slot=drain, timeout=120)
        finally:
            stop.set()
            t.join()
        after = eng.submit({"x": xs[0]}).result(timeout=60)
        st = eng.stats()
    assert new != v1 and eng.model_version == new and after.model_version == new
    assert {s.model_version for s in st.slots} == {new} and st.failed == 0
    refs = {v1: models.mlp, new: v2}
    versions = set()
    for x, fut in submitted:
        res = fut.result(timeout=60)
        versions.add(res.model_version)
        assert res.outputs["probs"].tobytes() == ort_run(refs[res.model_version], {"x": x})["probs"].tobytes()
    assert versions <= {v1, new}


def test_a_model_that_does_not_load_leaves_the_old_one_serving(models, tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"garbage")
    x = np.ones((1, 16), np.float32)
    with Engine(models.mlp, workers=2) as eng:
        v1 = eng.model_version
        with pytest.raises(SessionInitError, match="old model keeps serving"):
            eng.reload(bad, timeout=120)
        results = [eng.submit({"x": x}).result(timeout=60) for _ in range(20)]
        st = eng.stats()
    assert {r.model_version for r in results} == {v1} and eng.model_version == v1
    assert {s.model_version for s in st.slots} == {v1} and st.failed == 0


def test_signature_change_is_refused_unless_allowed(models):
    image = np.ones((1, 3, 16, 16), np.float32)
    with Engine(models.mlp, workers=2) as eng:
        v1 = eng.model_version
        with pytest.raises(SignatureChanged, match="signature differs"):
            eng.reload(models.convnet, timeout=120)
        assert eng.infer(np.ones((1, 16), np.float32))["probs"].shape == (1, 8)
        new = eng.reload(models.convnet, allow_signature_change=True, timeout=120)
        out = eng.submit({"image": image}).result(timeout=60)
    assert new != v1 and out.model_version == new and out.outputs["probs"].shape == (1, 10)
