"""Outputs that ONNX Runtime does not write into the buffer it was bound to (workers/ort.py).

An output bound in place is proven written, or copied: a graph input passed through as an
output comes back as the input's own tensor, and the bound buffer in the output arena keeps
an earlier task's bytes (issue 19: tenant A sent x=7, tenant B sent x=1 and got x=[7]).
Each model below mixes such outputs with a normal one, z = -x; every task carries its own
values, so any byte left by another task shows.

The last test: the in-place fallback (an output whose shape depends on the data) prints
nothing on the worker's stderr.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from slabpool import Engine
from tests.models.onnx_models import _save

W = np.array([3, 1, 4, 1, 5, 9], dtype=np.float32)  # an initializer / constant output
Expected = Callable[[np.ndarray], dict[str, np.ndarray]]


def _vi(name: str, elem: int, shape: list[int | str]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def _neg(elem: int) -> str:
    return "Not" if elem == TensorProto.BOOL else "Neg"


def _graph(case: str, elem: int) -> tuple[onnx.GraphProto, Expected]:
    """One graph of the family, and the numpy outputs it must give for an input x."""
    x, z = _vi("x", elem, ["batch", 6]), _vi("z", elem, ["batch", 6])
    nodes = [helper.make_node(_neg(elem), ["x"], ["z"])]
    inits: list[onnx.TensorProto] = []
    w = _vi("w", TensorProto.FLOAT, [6])

    def neg(a: np.ndarray) -> np.ndarray:
        return ~a if a.dtype == np.bool_ else -a

    if case == "pass":  # the model: the input itself is an output
        outs, want = [x, z], lambda a: {"x": a, "z": neg(a)}
    elif case == "pass_only":
        nodes, outs, want = [], [x], lambda a: {"x": a}
    elif case == "pass_twice":  # the input listed twice, then a normal output
        outs, want = [x, x, z], lambda a: {"x": a, "z": neg(a)}
    elif case == "identity":
        nodes.append(helper.make_node("Identity", ["x"], ["y"]))
        outs, want = [_vi("y", elem, ["batch", 6]), z], lambda a: {"y": a, "z": neg(a)}
    elif case == "identity_chain":
        nodes += [helper.make_node("Identity", ["x"], ["a"]), helper.make_node("Identity", ["a"], ["y"])]
        outs, want = [z, _vi("y", elem, ["batch", 6])], lambda a: {"z": neg(a), "y": a}
    elif case == "shared":  # two outputs of one tensor
        nodes.append(helper.make_node("Identity", ["z"], ["y"]))
        outs, want = [z, _vi("y", elem, ["batch", 6])], lambda a: {"z": neg(a), "y": neg(a)}
    elif case == "duplicated":
        outs, want = [z, z], lambda a: {"z": neg(a)}
    elif case == "initializer":
        inits.append(numpy_helper.from_array(W, "w"))
        outs, want = [w, z], lambda a: {"w": W, "z": neg(a)}
    elif case == "constant":
        nodes.append(helper.make_node("Constant", [], ["w"], value=numpy_helper.from_array(W, "wv")))
        outs, want = [z, w], lambda a: {"z": neg(a), "w": W}
    else:
        raise AssertionError(case)
    return helper.make_graph(nodes, f"alias_{case}", [x], outs, inits), want


CASES = ["pass", "pass_only", "pass_twice", "identity", "identity_chain", "shared", "duplicated",
         "initializer", "constant"]
DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "int64": TensorProto.INT64,
          "int8": TensorProto.INT8, "bool": TensorProto.BOOL}


def _model(tmp_path: Path, case: str, dtype: str) -> tuple[Path, Expected]:
    graph, want = _graph(case, DTYPES[dtype])
    return _save(graph, tmp_path / f"{case}_{dtype}.onnx"), want


def _item(k: int, rows: int, dtype: str) -> dict[str, np.ndarray]:
    """Task k's own input: values no other task has (for bool, a pattern per k)."""
    if dtype == "bool":
        return {"x": (np.arange(rows * 6).reshape(rows, 6) + k) % 3 == 0}
    return {"x": (np.arange(rows * 6).reshape(rows, 6) % 5 + 10 * k + 1).astype(dtype)}


def _check(results: list[dict[str, np.ndarray]], items: list[dict[str, np.ndarray]], want: Expected) -> None:
    for k, (got, item) in enumerate(zip(results, items, strict=True)):
        exp = want(item["x"])
        assert set(got) == set(exp), k
        for name, arr in exp.items():
            assert got[name].dtype == arr.dtype and got[name].shape == arr.shape, (k, name)
            assert got[name].tobytes() == arr.tobytes(), f"task {k}, output {name!r}: {got[name]} != {arr}"


def _tenants(eng: Engine, items: list[dict[str, np.ndarray]], threads: int) -> list[dict[str, np.ndarray]]:
    """Each thread submits its share at once (deep queues: tasks grouped, laid out in place
    one after another); results in item order."""
    results: list[dict[str, np.ndarray] | None] = [None] * len(items)

    def tenant(first: int) -> None:
        futs = [(k, eng.submit(items[k])) for k in range(first, len(items), threads)]
        for k, f in futs:
            results[k] = f.result(timeout=60).outputs

    pool = [threading.Thread(target=tenant, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=120)
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


@pytest.mark.parametrize("case", CASES)
def test_every_output_is_this_tasks_own_whatever_the_runtime_wrote(tmp_path, case) -> None:  # type: ignore[no-untyped-def]
    model, want = _model(tmp_path, case, "float32")
    items = [_item(k, rows, "float32") for k, rows in enumerate([1, 1, 1, 3, 3, 1, 3, 1])]
    with Engine(model, workers=1, in_place_min_bytes=0) as eng:
        results = [eng.submit(it).result(timeout=60).outputs for it in items]  # one a run
        st = eng.stats()
    _check(results, items, want)
    assert st.outputs_in_place == len(items) - 2  # the first of each shape learns, the rest bound


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("case", ["pass", "shared"])
def test_aliasing_outputs_of_every_dtype(tmp_path, case, dtype) -> None:  # type: ignore[no-untyped-def]
    model, want = _model(tmp_path, case, dtype)
    items = [_item(k, 2, dtype) for k in range(6)]
    with Engine(model, workers=1, in_place_min_bytes=0) as eng:
        results = [eng.submit(it).result(timeout=60).outputs for it in items]
    _check(results, items, want)


@pytest.mark.parametrize("in_place", [0, None], ids=["in_place", "copied"])
def test_concurrent_tenants_each_get_their_own_bytes(tmp_path, start_method, in_place) -> None:  # type: ignore[no-untyped-def]
    model, want = _model(tmp_path, "pass_twice", "int64")
    items = [_item(k, 1 + k % 2, "int64") for k in range(48)]
    with Engine(model, workers=2, start_method=start_method, in_place_min_bytes=in_place) as eng:
        _check([eng.submit(it).result(timeout=60).outputs for it in items[:4]], items[:4], want)  # learn
        results = _tenants(eng, items, threads=4)
        st = eng.stats()
    _check(results, items, want)
    assert (st.outputs_in_place > 0) is (in_place is not None)


_FALLBACK = """
    import sys
    import numpy as np
    from slabpool import Engine

    if __name__ == "__main__":
        a = {"x": np.array([[0, 1, 0, 2, 0, 0, 3, 0]], dtype=np.float32)}  # 3 nonzero
        b = {"x": np.array([[4, 1, 0, 2, 5, 0, 3, 0]], dtype=np.float32)}  # 5: the bound run fails
        with Engine(sys.argv[1], workers=1, in_place_min_bytes=0, start_method=sys.argv[2]) as eng:
            outs = [eng.infer(it)["idx"].shape[1] for it in (a, a, b, a, b)]
            print(outs, eng.stats().outputs_in_place)
"""


def test_the_in_place_fallback_prints_nothing_on_stderr(models, tmp_path, start_method) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "fallback.py"
    script.write_text(textwrap.dedent(_FALLBACK))
    out = subprocess.run([sys.executable, str(script), str(models.nonzero), start_method],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("]")[0] == "[3, 3, 5, 3, 5"  # the second a was bound, b fell back
    assert out.stderr == "", out.stderr


@pytest.mark.parametrize("case", ["pass_twice", "shared", "identity"])
def test_blocks_of_rows_run_in_place_get_their_own_bytes(tmp_path, case) -> None:  # type: ignore[no-untyped-def]
    """infer(batch_size=): a task of several blocks, each a session call into a slice of the
    bound region."""
    model, want = _model(tmp_path, case, "float32")
    with Engine(model, workers=1, in_place_min_bytes=0) as eng:
        for k in range(4):
            item = _item(k, 10, "float32")
            got = eng.infer(item, batch_size=3)
            for name, arr in want(item["x"]).items():
                assert got[name].tobytes() == arr.tobytes(), (k, name)
        assert eng.stats().outputs_in_place > 0
