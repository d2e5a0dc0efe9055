"""`slabpool run --columns INPUT=COL,COL,...` (issue 24, item 7): a table's columns, in the
order given, side by side as one model input (rows [N, columns]), for CSV, Parquet and Arrow,
without a hook; several inputs at once. Clear errors, up front, for a column the table lacks,
a column of another dtype than the input's (nothing is cast), a non-numeric column, a count
that does not fit the input; a null cell fails its row alone, naming its column.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
from onnx import TensorProto, helper

from tests.models import onnx_models
from tests.reference import ort_run
from tests.test_cli import slabpool
from tests.test_job_options import one_line

RNG = np.random.default_rng(241)
N = 700


@pytest.fixture(scope="module")
def m13(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return onnx_models.mlp(tmp_path_factory.mktemp("m13") / "m13.onnx", in_dim=13)


@pytest.fixture(scope="module")
def two_inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Inputs a float32 [N, 3] and b float32 [N, 2]; output y = concat(a, 2 b) [N, 5]."""
    path = tmp_path_factory.mktemp("two") / "two.onnx"
    graph = helper.make_graph(
        [helper.make_node("Mul", ["b", "two"], ["b2"]), helper.make_node("Concat", ["a", "b2"], ["y"], axis=1)],
        "two", [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["n", 3]),
                helper.make_tensor_value_info("b", TensorProto.FLOAT, ["n", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 5])],
        [helper.make_tensor("two", TensorProto.FLOAT, [1], [2.0])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def write(table: pa.Table, tmp: Path, fmt: str) -> Path:
    path = tmp / f"t.{fmt}"
    if fmt == "csv":
        pacsv.write_csv(table, path)
    elif fmt == "parquet":
        pq.write_table(table, path, row_group_size=250)
    else:
        feather.write_feather(table, path)
    return path


def features(n: int = N) -> tuple[np.ndarray, pa.Table]:
    """13 float32 columns c0..c12, stored in a shuffled order among an id and a label."""
    x = RNG.standard_normal((n, 13)).astype(np.float32)
    cols: dict[str, Any] = {f"c{k}": x[:, k] for k in range(13)}
    order = [f"c{k}" for k in RNG.permutation(13)]
    return x, pa.table({"id": np.arange(n), "label": [f"r{i}" for i in range(n)], **{c: cols[c] for c in order}})


FORMATS = ["csv", "parquet", "arrow"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("order", "size"), [("given", None), ("reversed", 64)])
def test_columns_in_the_given_order_feed_the_input(fmt: str, order: str, size: int | None, tmp_path: Path,
                                                   m13: Path) -> None:
    x, table = features()
    names = [f"c{k}" for k in range(13)]
    if order == "reversed":
        names, x = names[::-1], x[:, ::-1]
    src = write(table, tmp_path, fmt)
    out = tmp_path / "o.npz"
    p = slabpool("run", m13, src, "-o", out, "--workers", 2, "--columns", "x=" + ",".join(names),
                 *(["--batch-size", size] if size else []))
    assert p.returncode == 0, p.stderr
    want = ort_run(m13, {"x": np.ascontiguousarray(x)})
    with np.load(out) as z:
        for k, v in want.items():
            np.testing.assert_allclose(z[k], v, rtol=1e-5, atol=1e-6)
    assert json.loads(Path(f"{out}.parts/report.json").read_text())["dispatch"] == "blocks"


@pytest.mark.parametrize("fmt", FORMATS)
def test_several_inputs_and_kept_columns_to_parquet(fmt: str, tmp_path: Path, two_inputs: Path) -> None:
    n = 300
    v = RNG.standard_normal((n, 5)).astype(np.float32)
    t = pa.table({"id": np.arange(n), **{f"v{k}": v[:, k] for k in range(5)}})
    out = tmp_path / "o.parquet"
    p = slabpool("run", two_inputs, write(t, tmp_path, fmt), "-o", out, "--workers", 2,
                 "--columns", "b=v3,v4", "--columns", "a=v0,v1,v2", "--keep", "id")
    assert p.returncode == 0, p.stderr
    got = pq.read_table(out)
    assert got.column("id").to_pylist() == list(range(n))
    y = np.asarray(got.column("y").to_pylist(), np.float32)
    np.testing.assert_array_equal(y, np.concatenate([v[:, :3], 2 * v[:, 3:]], axis=1))


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_a_null_cell_fails_its_row_alone_naming_its_column(fmt: str, tmp_path: Path, m13: Path) -> None:
    x, table = features(400)
    c3 = table.column("c3").to_pylist()
    for i in (5, 399):
        c3[i] = None
    table = table.set_column(table.schema.get_field_index("c3"), "c3", pa.array(c3, pa.float32()))
    out = tmp_path / "o.npy"
    p = slabpool("run", m13, write(table, tmp_path, fmt), "-o", out, "--workers", 2,
                 "--columns", "x=" + ",".join(f"c{k}" for k in range(13)))
    assert p.returncode == 2, p.stderr
    failures = [json.loads(ln) for ln in Path(f"{out}.parts/failures.jsonl").read_text().splitlines()]
    assert [f["index"] for f in failures] == [5, 399]
    assert all("'c3'" in f["message"] and "null" in f["message"] for f in failures), failures
    good = np.setdiff1d(np.arange(400), [5, 399])
    np.testing.assert_allclose(np.load(out)[good], ort_run(m13, {"x": x[good]})["probs"], rtol=1e-5, atol=1e-6)


def test_a_csv_cell_that_is_not_a_number_stops_the_job_naming_it(tmp_path: Path, m13: Path) -> None:
    rows = "\n".join(",".join(["1.5"] * 13) for _ in range(20))
    (tmp_path / "t.csv").write_text(",".join(f"c{k}" for k in range(13)) + "\n" + rows + "\n" + "x," * 12 + "x\n")
    p = slabpool("run", m13, tmp_path / "t.csv", "-o", tmp_path / "o.npy", "--workers", 1,
                 "--columns", "x=" + ",".join(f"c{k}" for k in range(13)))
    one_line(p, "c0")


def _bad(tmp: Path) -> Path:
    _, table = features(20)
    table = table.append_column("d64", pa.array(np.zeros(20)))  # float64
    return write(table, tmp, "parquet")


C13 = ",".join(f"c{k}" for k in range(13))
BAD: list[tuple[str, list[Any], str]] = [
    ("missing column", ["--columns", "x=" + C13.replace("c7", "c77")], "has no column 'c77'"),
    ("other dtype", ["--columns", "x=" + C13.replace("c7", "d64")], "column 'd64' holds double (float64)"),
    ("not numeric", ["--columns", "x=" + C13.replace("c7", "label")], "column 'label' holds string"),
    ("too few", ["--columns", "x=" + C13.replace(",c12", "")], "12 columns, but the model's input 'x' takes 13"),
    ("unknown input", ["--columns", "y=c0", "--columns", "x=" + C13], "the model has no input 'y'"),
    ("twice", ["--columns", "x=" + C13, "--columns", "x=" + C13], "names the input 'x' twice"),
    ("syntax", ["--columns", "c0,c1"], "argument --columns: expected INPUT=COL[,COL...]"),
    ("with a hook", ["--columns", "x=" + C13, "--preprocess", "tests.cli_hooks:row_features"], "leave out one"),
]


@pytest.mark.parametrize(("case", "extra", "says"), BAD, ids=[c[0] for c in BAD])
def test_columns_that_cannot_form_the_input_are_one_error_up_front(case: str, extra: list[Any], says: str,
                                                                   tmp_path: Path, m13: Path) -> None:
    p = slabpool("run", m13, _bad(tmp_path), "-o", tmp_path / "o.npy", "--workers", 1, *extra)
    one_line(p, says)
    assert not (tmp_path / "o.npy").exists()


def test_columns_need_a_table(tmp_path: Path, m13: Path) -> None:
    np.save(tmp_path / "in.npy", np.zeros((3, 13), np.float32))
    one_line(slabpool("run", m13, tmp_path / "in.npy", "-o", tmp_path / "o.npy", "--columns", "x=a"),
             "--columns takes a Parquet, CSV or Arrow INPUT")


def test_a_resume_with_other_columns_is_refused(tmp_path: Path, m13: Path) -> None:
    _, table = features(50)
    src = write(table, tmp_path, "parquet")
    run = ("run", m13, src, "-o", tmp_path / "o.npz", "--workers", 1)
    assert slabpool(*run, "--columns", "x=" + C13).returncode == 0
    flipped = ",".join(C13.split(",")[::-1])
    one_line(slabpool(*run, "--columns", "x=" + flipped), f"--columns was x={C13}, now x={flipped}")
