"""Outputs whose shape changes from item to item (issue 24, item 6: a text detector at native
resolution). A model output declared with dynamic axes past the batch axis goes to Parquet as
a list column of its values plus NAME.shape, each row's shape, read back with
`np.reshape(values, shape)`; from JSONL through a hook, from a table of ragged lists and from a
folder of arrays, at several batch sizes, resumable. A .npy/.npz OUTPUT cannot hold rows of two
shapes: the job stops at the first change with one line pointing to Parquet (not item after
item computed and thrown away); equal shapes still go to .npz.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from onnx import TensorProto, helper

from tests.test_cli import durable_indexes, jsonl, slabpool
from tests.test_cli_signals import Held
from tests.test_job_options import one_line

SHAPES = [(2, 3), (4, 1), (2, 3), (1, 5), (3, 3)]


@pytest.fixture(scope="module")
def plus_one(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """x float32 [n, h, w] -> y = x + 1, same dynamic shape."""
    path = tmp_path_factory.mktemp("dyn") / "plus_one.onnx"
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "one"], ["y"])], "plus_one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "h", "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "h", "w"])],
        [helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def items(n: int) -> list[dict[str, Any]]:
    return [{"i": i, "h": SHAPES[i % 5][0], "w": SHAPES[i % 5][1]} for i in range(n)]


def want(it: dict[str, Any]) -> np.ndarray:
    h, w = it["h"], it["w"]
    return np.arange(h * w, dtype=np.float32).reshape(h, w) + it["i"] + 1


def read_back(out: Path, name: str = "y") -> list[np.ndarray | None]:
    t = pq.read_table(out)
    assert t.schema.field(name).type == pa.list_(pa.float32())
    assert t.schema.field(f"{name}.shape").type == pa.list_(pa.int64())
    # the one-liner of docs/cli.md
    return [None if v is None else np.reshape(v, s).astype(np.float32) for v, s in
            zip(t.column(name).to_pylist(), t.column(f"{name}.shape").to_pylist(), strict=True)]


def _jsonl(tmp: Path, n: int) -> tuple[list[Any], list[dict[str, Any]]]:
    its = items(n)
    return [jsonl(tmp / "in.jsonl", its), "--preprocess", "tests.cli_hooks:sized"], its


def _folder(tmp: Path, n: int) -> tuple[list[Any], list[dict[str, Any]]]:
    its = items(n)
    (tmp / "arrays").mkdir()
    for it in its:  # one item a file, without its batch axis (added: one dimension less than x)
        np.save(tmp / "arrays" / f"{it['i']:04d}.npy", want(it) - 1)
    return [tmp / "arrays"], its


@pytest.mark.parametrize(("make", "n", "size"), [(_jsonl, 120, None), (_jsonl, 300, 16), (_folder, 40, None)],
                         ids=["jsonl", "jsonl-b16", "folder"])
def test_variable_shapes_go_to_parquet_with_their_shape(make: Any, n: int, size: int | None, tmp_path: Path,
                                                        plus_one: Path) -> None:
    head, its = make(tmp_path, n)
    out = tmp_path / "o.parquet"
    p = slabpool("run", plus_one, *head, "-o", out, "--workers", 2, *(["--batch-size", size] if size else []))
    assert p.returncode == 0, p.stderr
    got = read_back(out)
    assert len(got) == n
    for g, it in zip(got, its, strict=True):
        assert g is not None
        np.testing.assert_array_equal(g, want(it))


def test_a_table_of_ragged_lists_by_blocks(tmp_path: Path, plus_one: Path) -> None:
    """No hook: rows of the same shape go as blocks together; each block's rows keep theirs."""
    n = 200
    its = [{"i": i, "h": 1, "w": 1 + (i // 7) % 4} for i in range(n)]
    x = [(want(it) - 1).tolist() for it in its]  # [1][w] nested lists a row
    pq.write_table(pa.table({"x": pa.array(x, type=pa.list_(pa.list_(pa.float32())))}), tmp_path / "t.parquet")
    out = tmp_path / "o.parquet"
    p = slabpool("run", plus_one, tmp_path / "t.parquet", "-o", out, "--workers", 2)
    assert p.returncode == 0, p.stderr
    for g, it in zip(read_back(out), its, strict=True):
        np.testing.assert_array_equal(g, want(it))


def test_a_failed_item_has_null_values_and_shape(tmp_path: Path, plus_one: Path) -> None:
    its = items(30)
    its[7]["bad"] = 1
    out = tmp_path / "o.parquet"
    p = slabpool("run", plus_one, jsonl(tmp_path / "in.jsonl", its), "-o", out, "--workers", 2,
                 "--preprocess", "tests.cli_hooks:sized")
    assert p.returncode == 2, p.stderr
    t = pq.read_table(out)
    assert t.column("y")[7].as_py() is None and t.column("y.shape")[7].as_py() is None
    assert "marked bad" in t.column("error")[7].as_py()
    got = read_back(out)
    assert all(got[i] is not None and np.array_equal(got[i], want(its[i])) for i in range(30) if i != 7)


def test_a_variable_shape_job_killed_mid_run_resumes_identical(tmp_path: Path, plus_one: Path) -> None:
    n = 400
    src = jsonl(tmp_path / "in.jsonl", items(n))
    args = ["run", plus_one, src, "-o", tmp_path / "o.parquet", "--workers", 2, "--preprocess",
            "tests.cli_hooks:sized", "--durable-every", 0.001]
    held = Held(tmp_path, "commit:1", args)
    workers = psutil.Process(held.cli.pid).children(recursive=True)
    held.cli.send_signal(signal.SIGKILL)
    held.finish()
    psutil.wait_procs(workers, timeout=20)
    assert 0 < len(durable_indexes(tmp_path / "o.parquet.parts")) < n
    p = slabpool(*args, "--resume")
    assert p.returncode == 0, p.stderr
    ref = tmp_path / "ref.parquet"
    assert slabpool(*args[:4], ref, *args[5:]).returncode == 0
    assert pq.read_table(tmp_path / "o.parquet").equals(pq.read_table(ref))


@pytest.mark.parametrize("name", ["o.npz", "o.npy", "folder"])
def test_npy_npz_stop_at_the_first_change_of_shape(name: str, tmp_path: Path, plus_one: Path) -> None:
    n = 2000
    out = tmp_path / name
    p = slabpool("run", plus_one, jsonl(tmp_path / "in.jsonl", items(n)), "-o", out, "--workers", 2,
                 "--preprocess", "tests.cli_hooks:sized")
    line = one_line(p, "model output 'y' has shape", "use -o OUT.parquet")
    assert "dynamic axes" in line
    parts = out if name == "folder" else Path(f"{out}.parts")
    assert len(durable_indexes(parts)) < n  # stopped, not every item computed and thrown away


def test_equal_shapes_of_a_dynamic_output_still_go_to_npz(tmp_path: Path, plus_one: Path) -> None:
    its = [{"i": i, "h": 2, "w": 3} for i in range(50)]
    out = tmp_path / "o.npz"
    p = slabpool("run", plus_one, jsonl(tmp_path / "in.jsonl", its), "-o", out, "--workers", 2,
                 "--preprocess", "tests.cli_hooks:sized")
    assert p.returncode == 0, p.stderr
    with np.load(out) as z:
        np.testing.assert_array_equal(z["y"], np.stack([want(it) for it in its]))
    assert json.loads(Path(f"{out}.parts/report.json").read_text())["failed"] == 0
