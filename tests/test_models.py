"""The test-model builders produce real models that the runtimes accept and that match numpy.

ONNX models run in onnxruntime (1 intra-op thread), TFLite models in ai_edge_litert, and the
fake delegate's modes fail the way ``tests/models/delegates.py`` documents (the aborting modes in
a subprocess). Numpy references are compared with allclose, never bytes.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort  # type: ignore[import-untyped]
import pytest
import tflite  # type: ignore[import-untyped]
from ai_edge_litert.interpreter import (  # type: ignore[import-untyped]
    Interpreter,
    OpResolverType,
    load_delegate,
)

from tests.models import delegates, onnx_models, tflite_models

REPO = Path(__file__).resolve().parent.parent
DEMO_PATH = REPO / "engine" / "data" / "demo.onnx"
RTOL, ATOL = 1e-5, 1e-6

Feeds = dict[str, np.ndarray]


def _rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def _normal(*shape: int) -> np.ndarray:
    return _rng().standard_normal(shape).astype(np.float32)


def assert_matches(got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for name, ref in want.items():
        assert got[name].dtype == ref.dtype, name
        assert got[name].shape == ref.shape, name
        np.testing.assert_allclose(got[name], ref, rtol=RTOL, atol=ATOL, err_msg=name)


# ----------------------------------------------------------------------------------------------
# ONNX


def ort_session(path: Path) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.log_severity_level = 4
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def ort_run(path: Path, feeds: Feeds) -> dict[str, np.ndarray]:
    sess = ort_session(path)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds), strict=True))


@dataclass(frozen=True)
class OnnxCase:
    build: Callable[[Path], Path]
    feeds: Callable[[], Feeds]
    reference: Callable[[Feeds], Mapping[str, np.ndarray]]


def _ids() -> np.ndarray:
    return np.array([3, -1, 0, 7], dtype=np.int64)


ONNX_CASES: dict[str, OnnxCase] = {
    "mlp": OnnxCase(
        onnx_models.mlp, lambda: {"x": _normal(5, 16)}, lambda f: onnx_models.mlp_reference(f["x"])
    ),
    "convnet": OnnxCase(
        onnx_models.convnet,
        lambda: {"image": _normal(3, 3, 16, 16)},
        lambda f: onnx_models.convnet_reference(f["image"]),
    ),
    "cnn_small_image": OnnxCase(
        partial(onnx_models.cnn, size=32),
        lambda: {"image": _normal(2, 3, 32, 32)},
        lambda f: onnx_models.cnn_reference(f["image"]),
    ),
    "demo": OnnxCase(
        onnx_models.demo_model,
        lambda: {"image": _normal(2, 3, onnx_models.DEMO_SIZE, onnx_models.DEMO_SIZE)},
        lambda f: onnx_models.demo_reference(f["image"]),
    ),
    "multi_io": OnnxCase(
        onnx_models.multi_io,
        lambda: {"feats": _normal(4, 4), "ids": _ids()},
        lambda f: onnx_models.multi_io_reference(f["feats"], f["ids"]),
    ),
    "poison_in_range": OnnxCase(
        onnx_models.poison,
        lambda: {"idx": np.array([0, 9, -10], dtype=np.int64), "x": _normal(3, 4)},
        lambda f: onnx_models.poison_reference(f["idx"], f["x"]),
    ),
    "slow": OnnxCase(
        partial(onnx_models.slow, k=3, dim=64),
        lambda: {"x": _normal(4, 64)},
        lambda f: onnx_models.slow_reference(f["x"], k=3, dim=64),
    ),
    "identity": OnnxCase(
        partial(onnx_models.identity, dim=3), lambda: {"x": _normal(5, 3)}, lambda f: {"y": f["x"]}
    ),
    "payload": OnnxCase(
        partial(onnx_models.payload, elements=1000),
        lambda: {"x": _normal(2, 1000)},
        lambda f: {"y": f["x"] * np.float32(2.0)},
    ),
    "static_shape": OnnxCase(
        onnx_models.static_shape,
        lambda: {"x": _normal(2, 16)},
        lambda f: {"y": np.maximum(f["x"], np.float32(0))},
    ),
    "int_model": OnnxCase(
        onnx_models.int_model,
        lambda: {"x": np.arange(12, dtype=np.int32).reshape(3, 4) - 5},
        lambda f: onnx_models.int_reference(f["x"]),
    ),
}


@pytest.mark.parametrize("name", ONNX_CASES)
def test_onnx_model_matches_reference(name: str, tmp_path: Path) -> None:
    case = ONNX_CASES[name]
    path = case.build(tmp_path / f"{name}.onnx")
    assert path == tmp_path / f"{name}.onnx" and path.is_file()
    feeds = case.feeds()
    assert_matches(ort_run(path, feeds), case.reference(feeds))


@pytest.mark.parametrize("name", ONNX_CASES)
def test_onnx_model_is_pinned_and_checked(name: str, tmp_path: Path) -> None:
    model = onnx.load(str(ONNX_CASES[name].build(tmp_path / "m.onnx")))
    assert model.ir_version == onnx_models.IR_VERSION == 8
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
    onnx.checker.check_model(model, full_check=True)


def test_onnx_builders_are_deterministic(tmp_path: Path) -> None:
    a = onnx_models.mlp(tmp_path / "a.onnx", seed=3).read_bytes()
    b = onnx_models.mlp(tmp_path / "b.onnx", seed=3).read_bytes()
    c = onnx_models.mlp(tmp_path / "c.onnx", seed=4).read_bytes()
    assert a == b != c


def test_onnx_io_names_and_dynamic_axes(tmp_path: Path) -> None:
    def io(path: Path) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
        sess = ort_session(path)
        return (
            [(i.name, i.shape) for i in sess.get_inputs()],
            [(o.name, o.shape) for o in sess.get_outputs()],
        )

    assert io(onnx_models.mlp(tmp_path / "mlp.onnx")) == (
        [("x", ["batch", 16])],
        [("probs", ["batch", 8]), ("logits", ["batch", 8])],
    )
    assert io(onnx_models.multi_io(tmp_path / "mio.onnx")) == (
        [("feats", ["batch", 4]), ("ids", ["batch"])],
        [("sum", ["batch"]), ("total", [1])],
    )
    assert io(onnx_models.cnn(tmp_path / "cnn.onnx"))[0] == [("image", ["N", 3, 128, 128])]
    assert io(onnx_models.static_shape(tmp_path / "s.onnx"))[0] == [("x", [2, 16])]
    assert io(onnx_models.payload(tmp_path / "p.onnx"))[0] == [("x", ["batch", 2 * 1024 * 1024])]


def test_poison_raises_per_run_and_session_survives(tmp_path: Path) -> None:
    sess = ort_session(onnx_models.poison(tmp_path / "poison.onnx"))
    x = _normal(3, 4)
    bad = {"idx": np.array([0, 10, 1], dtype=np.int64), "x": x}
    good = {"idx": np.array([0, 9, 1], dtype=np.int64), "x": x}
    for _ in range(2):
        with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match="idx=10"):
            sess.run(None, bad)
        (y,) = sess.run(None, good)
        np.testing.assert_allclose(y, onnx_models.poison_reference(good["idx"], x)["y"])


def test_int_model_is_exact(tmp_path: Path) -> None:
    x = np.array([[2**31 - 5, -(2**31), 0, 7]], dtype=np.int32)
    (y,) = ort_session(onnx_models.int_model(tmp_path / "int.onnx")).run(None, {"x": x})
    assert y.dtype == np.int32
    assert np.array_equal(y, onnx_models.int_reference(x)["y"])


def test_bundled_demo_model_is_current(tmp_path: Path) -> None:
    fresh = onnx_models.demo_model(tmp_path / "demo.onnx")
    assert DEMO_PATH.read_bytes() == fresh.read_bytes(), "rerun demo_model('engine/data/demo.onnx')"
    assert DEMO_PATH.stat().st_size < 500 * 1024


# ----------------------------------------------------------------------------------------------
# TFLite


def litert_run(path: Path, feeds: Feeds, resize: bool = True) -> dict[str, np.ndarray]:
    """Resize (strict) every input to its feed's shape, allocate, invoke, read all outputs."""
    it = Interpreter(model_path=str(path), num_threads=1)
    for detail in it.get_input_details():
        if resize:
            it.resize_tensor_input(detail["index"], list(feeds[detail["name"]].shape), strict=True)
    it.allocate_tensors()
    for detail in it.get_input_details():
        it.set_tensor(detail["index"], feeds[detail["name"]])
    it.invoke()
    return {d["name"]: it.get_tensor(d["index"]) for d in it.get_output_details()}


def _probs(f: Feeds) -> dict[str, np.ndarray]:
    return {"probs": tflite_models.mlp_reference(f["x"])["probs"]}


def _logits(f: Feeds) -> dict[str, np.ndarray]:
    return {"logits": tflite_models.mlp_reference(f["x"])["logits"]}


@dataclass(frozen=True)
class TfliteCase:
    build: Callable[[Path], Path]
    feeds: Callable[[], Feeds]
    reference: Callable[[Feeds], Mapping[str, np.ndarray]]
    signature: dict[str, list[int]]  # input name -> shape_signature
    resize: bool = True


def _ab() -> Feeds:
    return {"a": _normal(4, 4), "b": _normal(4, 4) * np.float32(3)}


TFLITE_CASES: dict[str, TfliteCase] = {
    "mlp": TfliteCase(tflite_models.mlp, lambda: {"x": _normal(4, 16)}, _probs, {"x": [-1, 16]}),
    "mlp_logits": TfliteCase(
        tflite_models.mlp_logits, lambda: {"x": _normal(4, 16)}, _logits, {"x": [-1, 16]}
    ),
    "static_mlp": TfliteCase(
        tflite_models.static_mlp, lambda: {"x": _normal(2, 16)}, _probs, {"x": [2, 16]}, False
    ),
    "two_inputs": TfliteCase(
        tflite_models.two_inputs,
        _ab,
        lambda f: tflite_models.two_inputs_reference(f["a"], f["b"]),
        {"a": [-1, 4], "b": [-1, 4]},
    ),
}


@pytest.mark.parametrize("name", TFLITE_CASES)
def test_tflite_model_matches_reference(name: str, tmp_path: Path) -> None:
    case = TFLITE_CASES[name]
    path = case.build(tmp_path / f"{name}.tflite")
    assert path == tmp_path / f"{name}.tflite" and path.is_file()
    feeds = case.feeds()
    assert_matches(litert_run(path, feeds, case.resize), case.reference(feeds))


@pytest.mark.parametrize("name", TFLITE_CASES)
def test_tflite_shape_signature_and_signature_def(name: str, tmp_path: Path) -> None:
    case = TFLITE_CASES[name]
    it = Interpreter(model_path=str(case.build(tmp_path / "m.tflite")), num_threads=1)
    details = it.get_input_details()
    assert {d["name"]: d["shape_signature"].tolist() for d in details} == case.signature
    outputs = [d["name"] for d in it.get_output_details()]
    assert it.get_signature_list() == {
        "serving_default": {"inputs": list(case.signature), "outputs": outputs}
    }


def test_tflite_dynamic_output_signature_and_runner(tmp_path: Path) -> None:
    it = Interpreter(model_path=str(tflite_models.mlp(tmp_path / "mlp.tflite")), num_threads=1)
    assert it.get_output_details()[0]["shape_signature"].tolist() == [-1, 8]
    x = _normal(3, 16)
    got = it.get_signature_runner("serving_default")(x=x)
    np.testing.assert_allclose(got["probs"], _probs({"x": x})["probs"], rtol=RTOL, atol=ATOL)


def test_tflite_resize_strict_refuses_fixed_dims(tmp_path: Path) -> None:
    it = Interpreter(model_path=str(tflite_models.mlp(tmp_path / "mlp.tflite")), num_threads=1)
    with pytest.raises(RuntimeError, match="ResizeInputTensorStrict"):
        it.resize_tensor_input(it.get_input_details()[0]["index"], [4, 15], strict=True)


def test_tflite_file_layout(tmp_path: Path) -> None:
    raw = tflite_models.mlp(tmp_path / "mlp.tflite").read_bytes()
    assert raw[4:8] == b"TFL3"
    model = tflite.Model.GetRootAs(raw, 0)
    assert model.Version() == 3
    assert model.Buffers(0).DataLength() == 0
    base = np.frombuffer(raw, np.uint8).ctypes.data
    for i in range(1, model.BuffersLength()):
        data = model.Buffers(i).DataAsNumpy()
        assert data.size > 0
        assert (data.ctypes.data - base) % 16 == 0, f"buffer {i} is not 16-byte aligned"


def test_same_seed_mlp_is_the_same_function_in_both_runtimes(tmp_path: Path) -> None:
    x = _normal(4, 16)
    onnx_out = ort_run(onnx_models.mlp(tmp_path / "m.onnx", seed=7), {"x": x})
    tfl_out = litert_run(tflite_models.mlp(tmp_path / "m.tflite", seed=7), {"x": x})
    np.testing.assert_allclose(tfl_out["probs"], onnx_out["probs"], rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------------------------------------
# fake delegate

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not available")

_DELEGATE_CHILD = textwrap.dedent(
    """
    import sys
    from ai_edge_litert.interpreter import Interpreter, load_delegate
    lib, model, mode = sys.argv[1:]
    delegate = load_delegate(lib, {"mode": mode})
    Interpreter(model_path=model, num_threads=1, experimental_delegates=[delegate])
    print("survived")
    """
)


@pytest.fixture(scope="module")
def fake_delegate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return delegates.build_fake_delegate(tmp_path_factory.mktemp("delegate"))


@pytest.fixture
def mlp_tflite(tmp_path: Path) -> Path:
    return tflite_models.mlp(tmp_path / "mlp.tflite")


def _interpreter_with(lib: Path, model: Path, mode: str) -> Interpreter:
    return Interpreter(
        model_path=str(model),
        num_threads=1,
        experimental_delegates=[load_delegate(str(lib), {"mode": mode})],
        experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
    )


@needs_gcc
def test_fake_delegate_build_is_cached(fake_delegate: Path) -> None:
    mtime = fake_delegate.stat().st_mtime_ns
    assert delegates.build_fake_delegate(fake_delegate.parent) == fake_delegate
    assert fake_delegate.stat().st_mtime_ns == mtime
    assert [p.name for p in fake_delegate.parent.iterdir()] == [fake_delegate.name]


@needs_gcc
def test_fake_delegate_noop_claims_nothing(fake_delegate: Path, mlp_tflite: Path) -> None:
    it = _interpreter_with(fake_delegate, mlp_tflite, "noop")
    it.allocate_tensors()
    assert "DELEGATE" not in [op["op_name"] for op in it._get_ops_details()]
    x = _normal(1, 16)
    it.set_tensor(it.get_input_details()[0]["index"], x)
    it.invoke()
    got = it.get_tensor(it.get_output_details()[0]["index"])
    np.testing.assert_allclose(got, _probs({"x": x})["probs"], rtol=RTOL, atol=ATOL)


@needs_gcc
def test_fake_delegate_fail_prepare(fake_delegate: Path, mlp_tflite: Path) -> None:
    with pytest.raises(RuntimeError, match="delegate application failure"):
        _interpreter_with(fake_delegate, mlp_tflite, "fail_prepare")


@needs_gcc
@pytest.mark.parametrize(("mode", "message"), [("refuse", "refused"), ("bogus", "unknown mode")])
def test_fake_delegate_refuses(fake_delegate: Path, mode: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_delegate(str(fake_delegate), {"mode": mode})


@needs_gcc
@pytest.mark.parametrize(
    ("mode", "returncode"),
    [("noop", 0), ("abort_on_create", -signal.SIGABRT), ("abort_on_prepare", -signal.SIGABRT)],
)
def test_fake_delegate_in_child(
    fake_delegate: Path, mlp_tflite: Path, mode: str, returncode: int
) -> None:
    cmd = [sys.executable, "-c", _DELEGATE_CHILD, str(fake_delegate), str(mlp_tflite), mode]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == returncode, proc.stderr
    assert ("survived" in proc.stdout) == (returncode == 0)
