"""`slabpool run` on Parquet/CSV/Arrow tables without a hook: rows travel as row blocks.

The real CLI in a subprocess with real workers: a table's record batches become contiguous
blocks of the model's input columns (report.json says "blocks", one task per block),
byte-identical to the same blocks run one after another in one session; --keep columns and
Parquet output still work; a null or ragged cell, or a row the model fails on, fails alone
with its own error; a job SIGKILLed mid-run resumes and ends byte-identical. The readers
(engine.job.sources.base.SpanRows) are also checked directly on CSV and on nulls.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from slabpool.engine.caller.blocks import RowsUnreadable
from slabpool.engine.job.sources import open_source
from slabpool.workers.protocol import TensorSpec
from tests.models.onnx_models import poison_reference
from tests.test_cli import CLI, slabpool
from tests.test_job_blocks import kill_mid_run_then_resume, serial_blocks

RNG = np.random.default_rng(151)


def fixed(x: np.ndarray) -> pa.Array:
    """Rows of a 2-D array as a fixed-size list column."""
    return pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1])


def report(parts: Path) -> dict[str, Any]:
    return json.loads((parts / "report.json").read_text())  # type: ignore[no-any-return]


def failures(parts: Path) -> list[tuple[int, str, str]]:
    lines = (parts / "failures.jsonl").read_text().splitlines()
    return [(f["index"], f["error"], f["message"]) for f in map(json.loads, lines)]


def column(t: pa.Table, name: str, dtype: Any = np.float32) -> np.ndarray:
    return np.asarray(t.column(name).to_pylist(), dtype=dtype)


@pytest.mark.parametrize("lists", ["fixed", "variable"])
def test_parquet_goes_by_blocks_byte_identical_with_kept_ids(lists: str, tmp_path: Path,
                                                             models: SimpleNamespace) -> None:
    n, size = 3000, 250
    x = RNG.standard_normal((n, 16)).astype(np.float32)
    ids = [f"row-{i}" for i in range(n)]
    col = fixed(x) if lists == "fixed" else pa.array(list(x), type=pa.list_(pa.float32()))
    pq.write_table(pa.table({"id": ids, "x": col}), tmp_path / "t.parquet", row_group_size=700)
    out = tmp_path / "o.parquet"
    p = slabpool("run", models.mlp, tmp_path / "t.parquet", "-o", out, "--workers", 2, "--batch-size", size,
                 "--keep", "id")
    assert p.returncode == 0, p.stderr
    rep = report(Path(f"{out}.parts"))
    assert rep["dispatch"] == "blocks" and 1 <= sum(s["tasks_done"] for s in rep["slots"]) <= n // size
    t = pq.read_table(out)
    assert t.column_names == ["id", "probs", "logits", "error"]
    assert t.column("id").to_pylist() == ids and t.column("error").null_count == n
    want = serial_blocks(models.mlp, {"x": x}, size)
    for name in ("probs", "logits"):
        assert column(t, name).tobytes() == want[name].tobytes(), name


def test_npz_output_from_an_arrow_table_byte_identical(tmp_path: Path, models: SimpleNamespace) -> None:
    """Several record batches (an Arrow file of 4 batches) gather into one contiguous span."""
    x = RNG.standard_normal((1200, 16)).astype(np.float32)
    batches = [pa.record_batch({"x": fixed(x[lo : lo + 300])}) for lo in range(0, 1200, 300)]
    with pa.ipc.new_file(tmp_path / "t.arrow", batches[0].schema) as w:
        for b in batches:
            w.write_batch(b)
    out = tmp_path / "o.npz"
    p = slabpool("run", models.mlp, tmp_path / "t.arrow", "-o", out, "--workers", 2, "--batch-size", 400)
    assert p.returncode == 0, p.stderr
    assert report(Path(f"{out}.parts"))["dispatch"] == "blocks"
    want = serial_blocks(models.mlp, {"x": x}, 400)  # blocks cross the file's record batches
    with np.load(out) as z:
        for k, v in want.items():
            assert z[k].tobytes() == v.tobytes(), k


def test_failing_rows_of_a_table_fail_alone(tmp_path: Path, models: SimpleNamespace) -> None:
    """Nulls in either input column, and rows the model fails on (an index outside its
    table), each fail alone with their own error; every other row is computed by blocks."""
    n = 2000
    idx = RNG.integers(-10, 10, n).astype(np.int64)
    x = RNG.standard_normal((n, 4)).astype(np.float32)
    runtime_bad, idx_null, x_null = [5, 1000, 1999], [7, 1500], [0, 8, 1501]
    idx[runtime_bad] = 55
    idx_col = pa.array(idx, mask=np.isin(np.arange(n), idx_null))
    x_col = pa.array([None if i in x_null else r for i, r in enumerate(x.tolist())], type=pa.list_(pa.float32(), 4))
    pq.write_table(pa.table({"idx": idx_col, "x": x_col, "key": np.arange(n) * 3}), tmp_path / "t.parquet",
                   row_group_size=512)
    out = tmp_path / "o.parquet"
    p = slabpool("run", models.poison, tmp_path / "t.parquet", "-o", out, "--workers", 2, "--batch-size", 128,
                 "--keep", "key")
    assert p.returncode == 2, p.stderr
    parts = Path(f"{out}.parts")
    got = failures(parts)
    bad = sorted([*runtime_bad, *idx_null, *x_null])
    assert [i for i, _, _ in got] == bad
    for i, error, message in got:
        if i in runtime_bad:  # the message names what failed, not the engine's task number
            assert error == "SessionRunError" and message.startswith("InvalidArgument: "), message
        else:
            column_name = "idx" if i in idx_null else "x"
            assert error == "ValueError" and f"column {column_name!r}" in message and "null" in message
    assert report(parts)["dispatch"] == "blocks"
    t = pq.read_table(out)
    assert t.column("key").to_pylist() == (np.arange(n) * 3).tolist()
    errors = t.column("error").to_pylist()
    assert [i for i, e in enumerate(errors) if e] == bad
    good = np.setdiff1d(np.arange(n), bad)
    y = t.column("y").to_pylist()
    assert all(y[i] is None for i in bad)
    np.testing.assert_allclose(np.asarray([y[i] for i in good], np.float32),
                               poison_reference(idx[good], x[good])["y"], rtol=1e-6)


def test_ragged_lists_fail_their_rows_alone(tmp_path: Path, models: SimpleNamespace) -> None:
    """A variable-list column whose rows differ in length: the rows of the model's width go
    by blocks, a row of another length fails alone (the model's contract), in input order."""
    x = RNG.standard_normal((40, 16)).astype(np.float32)
    cells: list[Any] = x.tolist()
    cells[3] = cells[3][:15]
    cells[30] = [*cells[30], 1.0]
    cells[31] = [1.0, None, *cells[31][2:]]  # a null inside the list
    feather.write_feather(pa.table({"x": pa.array(cells, type=pa.list_(pa.float32()))}), tmp_path / "t.feather")
    out = tmp_path / "o.npy"
    p = slabpool("run", models.mlp, tmp_path / "t.feather", "-o", out, "--workers", 2, "--batch-size", 8)
    assert p.returncode == 2, p.stderr
    got = failures(Path(f"{out}.parts"))
    assert [(i, e) for i, e, _ in got] == [(3, "InputContractError"), (30, "InputContractError"), (31, "ValueError")]
    assert "column 'x'" in got[2][2] and "null" in got[2][2]  # the column's name, not its type
    y = np.load(out)
    good = [i for i in range(40) if i not in (3, 30, 31)]
    want = serial_blocks(models.mlp, {"x": x[good]}, 1)["probs"]
    np.testing.assert_allclose(y[good], want, rtol=1e-5, atol=1e-6)
    assert np.isnan(y[[3, 30, 31]]).all()


@pytest.mark.slow
def test_sigkill_mid_table_resumes_byte_identical(tmp_path: Path, models: SimpleNamespace) -> None:
    n, size = 4000, 40  # 8 MB of rows: one span, so blocks of 40 from row 0
    x = RNG.standard_normal((n, 512)).astype(np.float32)
    pq.write_table(pa.table({"x": fixed(x)}), tmp_path / "t.parquet", row_group_size=300)
    out = tmp_path / "o.npy"
    parts = Path(f"{out}.parts")
    args = [*CLI, "run", models.slow, tmp_path / "t.parquet", "-o", out, "--workers", 2, "--batch-size", size,
            "--durable-every", 0.001]
    durable = kill_mid_run_then_resume(args, parts, n, size)
    rep = report(parts)
    assert rep["skipped_durable"] == len(durable) and rep["computed_this_run"] == n - len(durable)
    assert rep["dispatch"] == "blocks"
    want = serial_blocks(models.slow, {"x": x}, size)["y"]  # one span: blocks stay aligned across the resume
    assert np.load(out).tobytes() == want.tobytes()


# -- the readers, directly ------------------------------------------------------------------------------


def test_an_empty_line_of_a_one_column_csv_is_its_row_not_skipped(tmp_path: Path) -> None:
    """A one-column CSV's empty cell is an empty line: its row (a null cell, which fails
    alone), so the rows after it keep their places. Was: pyarrow skipped the line, the source
    counted 9 rows of 10, and each later row took the output of the one before it (exit 0)."""
    (tmp_path / "t.csv").write_text("a\n" + "".join("\n" if i == 6 else f"{i}\n" for i in range(10)))
    src = open_source(tmp_path / "t.csv", hook=False)
    src.bind([TensorSpec("a", "int64", (None,))])
    assert src.count == 10
    reader = src.row_reader([(0, 10)])
    assert list(reader.runs()) == [(0, 6), (6, 7), (7, 10)]
    np.testing.assert_array_equal(reader.read(7, 10)["a"], [7, 8, 9])
    with pytest.raises(RowsUnreadable, match=r"column 'a'.*null"):
        reader.read(6, 7)


def test_a_csv_column_named_after_an_input_is_parsed_as_its_dtype(tmp_path: Path) -> None:
    """CSV text has no binary type: the column that feeds a float32 input is read as float32
    (was: inferred as double, then refused as the wrong dtype: no float32 input could be fed
    from a CSV without a hook); a kept column is still typed from the text."""
    (tmp_path / "t.csv").write_text("a,id\n" + "".join(f"{i / 3},{i}\n" for i in range(6)))
    src = open_source(tmp_path / "t.csv", hook=False)
    src.choose_keep(["id"])
    src.bind([TensorSpec("a", "<f4", (None,))])
    reader = src.row_reader([(0, 6)])
    assert list(reader.runs()) == [(0, 6)]
    got = reader.read(0, 6)["a"]
    assert got.dtype == np.float32 and got.tolist() == [np.float32(i / 3) for i in range(6)]


def test_csv_rows_read_as_spans_around_a_bad_row(tmp_path: Path) -> None:
    """A CSV's scalar columns become arrays; an empty cell is a span of one row that raises
    RowsUnreadable; runs follow `todo` (a resume skips settled rows); kept values follow."""
    a = np.arange(10, dtype=np.float64) / 4
    (tmp_path / "t.csv").write_text("a,b,id\n" + "".join(
        f"{'' if i == 6 else a[i]},{i},{100 + i}\n" for i in range(10)))
    src = open_source(tmp_path / "t.csv", hook=False)
    src.choose_keep(["id"])
    src.bind([TensorSpec("a", "float64", (None,)), TensorSpec("b", "int64", (None,))])
    reader = src.row_reader([(1, 4), (5, 10)])
    assert reader.row_bytes() == 16
    first = reader.first()
    assert first["a"].tolist() == [0.0] and first["b"].tolist() == [0]
    runs = list(reader.runs())
    assert runs == [(1, 4), (5, 6), (6, 7), (7, 10)]
    got = reader.read(1, 4)
    np.testing.assert_array_equal(got["a"], a[1:4])
    np.testing.assert_array_equal(got["b"], [1, 2, 3])
    assert reader.kept(7, 10) == {"id": [107, 108, 109]}
    with pytest.raises(RowsUnreadable, match=r"column 'a'.*null"):
        reader.read(6, 7)
    reader.release(7)
    with pytest.raises(LookupError):
        reader.read(1, 4)
    np.testing.assert_array_equal(reader.read(8, 10)["b"], [8, 9])


@pytest.mark.parametrize("kind", ["parquet", "csv", "arrow"])
def test_table_paths_that_are_no_utf8_text(kind: str, tmp_path: Path, models: SimpleNamespace) -> None:
    """Linux names are bytes: a Latin-1 INPUT or OUTPUT name (no UTF-8 text) reads and writes
    as any other. pyarrow opens names as UTF-8 only: was UnicodeEncodeError after the job ran,
    exit 1, OUTPUT not written."""
    import os

    x = RNG.standard_normal((300, 16)).astype(np.float32)
    src = tmp_path / os.fsdecode(b"caf\xe9." + kind.encode())
    made = tmp_path / f"t.{kind}"  # (pyarrow writes no such name either)
    if kind == "parquet":
        pq.write_table(pa.table({"x": fixed(x)}), made)
    elif kind == "arrow":
        feather.write_feather(pa.table({"x": fixed(x)}), str(made))
    else:
        from pyarrow import csv

        csv.write_csv(pa.table({f"c{i}": x[:, i] for i in range(16)}), str(made))
    made.rename(src)
    out = tmp_path / os.fsdecode(b"r\xe9sultat.parquet")
    cols = ["--columns", "x=" + ",".join(f"c{i}" for i in range(16))] if kind == "csv" else []
    p = slabpool("run", models.mlp, src, "-o", out, "--workers", 2, "--batch-size", 100, *cols)
    assert p.returncode == 0, p.stderr
    t = pq.read_table(pa.BufferReader(out.read_bytes()))
    want = serial_blocks(models.mlp, {"x": x}, 100)
    for name in ("probs", "logits"):
        assert column(t, name).tobytes() == want[name].tobytes(), name
