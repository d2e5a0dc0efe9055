"""`slabpool run` over the data users have: folders of files, Parquet/CSV/Arrow tables, stdin in;
Parquet (kept columns, strings, an error column) out; batched hooks; systematic failures stop.

The real CLI in a subprocess with real workers; every result is compared with the mlp's numpy
reference (tests/models/onnx_models.mlp_reference) or with what Engine.map gives.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
from PIL import Image

from slabpool.engine.job import parquet as job_parquet
from slabpool.engine.job.dispatch import pending_items
from slabpool.engine.job.sources import JobError, open_source
from slabpool.engine.job.sources.tables import column_array
from slabpool.engine.job.store import Failure, Store
from tests.models import onnx_models
from tests.models.onnx_models import mlp_reference
from tests.test_cli import CLI, DEADLINE, ENV, REPO, jsonl, rows, slabpool


def ref(x: np.ndarray) -> dict[str, np.ndarray]:
    return mlp_reference(x)


def close(got: Any, want: np.ndarray) -> None:
    np.testing.assert_allclose(np.asarray(got, dtype=np.float32), want, rtol=1e-5, atol=1e-6)


def run_stdin(data: str, *args: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *map(str, args)], cwd=REPO, env=ENV, input=data, capture_output=True,
                          text=True, timeout=DEADLINE)


def last_line(p: subprocess.CompletedProcess[str]) -> str:
    return p.stderr.strip().splitlines()[-1]


# -- a folder of image files -> Parquet ----------------------------------------------------------------


def test_image_folder_to_parquet(tmp_path: Path, models: SimpleNamespace) -> None:
    """Every regular file, recursively, sorted by relative path; the hook gets the path; a file
    it cannot read is a failed row (null outputs, the error), the others match the reference."""
    rng = np.random.default_rng(1)
    names = ["b/img1.png", "a.png", "b/c/img0.bmp", "z.jpg.png", "a2.png"]
    pixels = {}
    for name in names:
        px = rng.integers(0, 256, (4, 4), dtype=np.uint8)
        (tmp_path / "imgs" / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(px, mode="L").save(tmp_path / "imgs" / name)
        pixels[name] = px
    (tmp_path / "imgs" / "b" / "notes.txt").write_text("not an image")
    out = tmp_path / "out.parquet"
    p = slabpool("run", models.mlp, tmp_path / "imgs", "-o", out, "--workers", 2, "--keep", "path",
                 "--preprocess", "tests.cli_hooks:load_image", "--postprocess", "tests.cli_hooks:label")
    assert p.returncode == 2, p.stderr  # one file failed, listed
    t = pq.read_table(out)
    assert t.column_names == ["path", "label", "score", "probs", "error"]
    order = sorted([*names, "b/notes.txt"])
    assert t.column("path").to_pylist() == order
    assert pa.types.is_fixed_size_list(t.schema.field("probs").type)
    assert t.schema.field("label").type == pa.string()
    for k, name in enumerate(order):
        row = t.slice(k, 1).to_pylist()[0]
        if name == "b/notes.txt":
            assert row["label"] is None and row["probs"] is None and "cannot identify image" in row["error"]
            continue
        want = ref((pixels[name].reshape(1, 16) / 255.0).astype(np.float32))["probs"][0]
        assert row["error"] is None and row["label"] == f"class-{int(np.argmax(want))}"
        close(row["probs"], want)
        assert row["score"] == pytest.approx(float(want.max()), rel=1e-5)


def test_npy_folder_without_hook_keeps_its_meaning_and_path_column(tmp_path: Path, models: SimpleNamespace) -> None:
    x = rows(5)
    (tmp_path / "items").mkdir()
    for i in range(5):
        np.save(tmp_path / "items" / f"{i:02d}.npy", x[i])
    out = tmp_path / "o.parquet"
    p = slabpool("run", models.mlp, tmp_path / "items", "-o", out, "--workers", 1, "--keep", "path")
    assert p.returncode == 0, p.stderr
    t = pq.read_table(out)
    assert t.column("path").to_pylist() == [f"{i:02d}.npy" for i in range(5)]
    close(t.column("logits").to_pylist(), ref(x)["logits"])


# -- tables --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lists", ["fixed", "variable"])
def test_parquet_table_scored_with_its_id_kept(lists: str, tmp_path: Path, models: SimpleNamespace) -> None:
    """No hook: the column named after the model's input feeds it, read in record batches
    (several row groups); the id column comes back next to the outputs, in input order."""
    n = 23
    x = rows(n, seed=3)
    ids = [f"id-{i * 7}" for i in range(n)]
    col = (pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 16) if lists == "fixed"
           else pa.array(x.tolist(), type=pa.list_(pa.float32())))
    pq.write_table(pa.table({"id": ids, "x": col, "other": list(range(n))}), tmp_path / "t.parquet", row_group_size=5)
    out = tmp_path / "scores.parquet"
    p = slabpool("run", models.mlp, tmp_path / "t.parquet", "-o", out, "--workers", 2, "--batch-size", 4,
                 "--keep", "id,other")
    assert p.returncode == 0, p.stderr
    t = pq.read_table(out)
    assert t.column_names == ["id", "other", "probs", "logits", "error"]
    assert t.column("id").to_pylist() == ids and t.column("other").to_pylist() == list(range(n))
    assert t.schema.field("other").type == pa.int64()  # kept columns keep their type
    assert t.schema.field("probs").type == pa.list_(pa.float32(), 8)
    close(t.column("probs").to_pylist(), ref(x)["probs"])
    assert t.column("error").null_count == n


def test_csv_through_a_hook(tmp_path: Path, models: SimpleNamespace) -> None:
    """With a hook, a CSV row arrives as a dict column -> value (header names, typed)."""
    x = rows(9, seed=4)
    table = pa.table({"id": [100 + i for i in range(9)], **{f"f{k}": x[:, k].astype(np.float64) for k in range(16)}})
    pacsv.write_csv(table, tmp_path / "in.csv")
    out = tmp_path / "out.parquet"
    p = slabpool("run", models.mlp, tmp_path / "in.csv", "-o", out, "--workers", 2, "--keep", "id",
                 "--preprocess", "tests.cli_hooks:row_features")
    assert p.returncode == 0, p.stderr
    t = pq.read_table(out)
    assert t.column("id").to_pylist() == [100 + i for i in range(9)]
    close(t.column("probs").to_pylist(), ref(x)["probs"])


def test_arrow_table_to_npz_and_ragged_lists(tmp_path: Path, models: SimpleNamespace) -> None:
    """An Arrow (Feather v2) table without a hook to .npz; a null cell fails that row alone."""
    x = rows(6, seed=5)
    cells: list[Any] = x.tolist()
    cells[2] = None
    feather.write_feather(pa.table({"x": pa.array(cells, type=pa.list_(pa.float32()))}), tmp_path / "t.feather")
    out = tmp_path / "out.npz"
    p = slabpool("run", models.mlp, tmp_path / "t.feather", "-o", out, "--workers", 1)
    assert p.returncode == 2, p.stderr
    with np.load(out) as z:
        good = [0, 1, 3, 4, 5]
        close(z["probs"][good], ref(x[good])["probs"])
        assert np.isnan(z["probs"][2]).all()
    failures = Path(f"{out}.parts/failures.jsonl").read_text()
    assert '"index": 2' in failures and "null" in failures


def test_table_columns_must_match_the_model(tmp_path: Path, models: SimpleNamespace) -> None:
    pq.write_table(pa.table({"feat": [[1.0] * 16]}), tmp_path / "t.parquet")
    p = slabpool("run", models.mlp, tmp_path / "t.parquet", "-o", tmp_path / "o.parquet", "--workers", 1)
    assert p.returncode == 1
    assert len(p.stderr.strip().splitlines()) == 1 and "no column 'x'" in p.stderr and "feat" in p.stderr


def test_column_array_reads_blocks_or_defers_to_rows() -> None:
    same = pa.array([[[1, 2], [3, 4]], [[5, 6], [7, 8]]], type=pa.list_(pa.list_(pa.int32())))
    got = column_array(pa, same)
    assert got is not None and got.dtype == np.int32 and got.shape == (2, 2, 2)
    assert column_array(pa, pa.array([[1.0], [2.0, 3.0]])) is None  # ragged: row by row
    assert column_array(pa, pa.array([1.5, None])) is None  # a null: that row fails alone
    sliced = pa.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], type=pa.list_(pa.float64(), 2)).slice(1, 2)
    np.testing.assert_array_equal(column_array(pa, sliced), [[3.0, 4.0], [5.0, 6.0]])


# -- stdin ---------------------------------------------------------------------------------------------


def test_stdin_jsonl_text_and_no_resume(tmp_path: Path, models: SimpleNamespace) -> None:
    x = rows(5, seed=6)
    data = "".join(json.dumps({"i": i, "x": r.tolist()}) + "\n" for i, r in enumerate(x))
    out = tmp_path / "o.parquet"
    p = run_stdin(data, "run", models.mlp, "-", "-o", out, "--workers", 1, "--preprocess",
                  "tests.cli_hooks:feeds", "--keep", "line")
    assert p.returncode == 0, p.stderr
    t = pq.read_table(out)
    assert t.column("line").to_pylist() == [1, 2, 3, 4, 5]
    close(t.column("probs").to_pylist(), ref(x)["probs"])

    p = run_stdin("4\n\n-2\n", "run", "-", "-o", tmp_path / "sq.npy", "--text", "--workers", 1,
                  "--preprocess", "tests.cli_hooks:square")
    assert p.returncode == 0, p.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "sq.npy"), [[4, 16], [-2, 4]])

    p = run_stdin(data, "run", models.mlp, "-", "-o", out, "--resume", "--preprocess", "tests.cli_hooks:feeds")
    assert p.returncode == 1 and "--resume cannot replay stdin" in p.stderr, p.stderr


@pytest.mark.parametrize("how", ["truncate", "rewrite"])
def test_an_input_changed_while_the_job_runs_is_not_published(how: str, tmp_path: Path, models: SimpleNamespace) -> None:
    """INPUT cut short or rewritten in place (same length) by its producer while the job runs:
    exit 1 with one line naming the change, OUTPUT not written (was, found by a hostile run: a
    truncation ended "interrupted ... Resume with" with exit 130 and no signal sent, a rewrite
    published an OUTPUT mixing old and new rows with exit 0). Fixed, --overwrite starts over."""
    x = rows(6, seed=4)
    src = tmp_path / "in.jsonl"
    items: list[dict[str, Any]] = [{"i": i, "x": r.tolist()} for i, r in enumerate(x)]
    jsonl(src, [{**items[0], how: str(src)}, *items[1:]])
    out = tmp_path / "o.parquet"
    args = ("run", models.mlp, src, "-o", out, "--workers", 1, "--preprocess", "tests.cli_hooks:feeds")
    p = slabpool(*args)
    assert p.returncode == 1, p.stderr
    said = last_line(p)
    assert said.startswith(f"slabpool run: error: INPUT changed while the job ran: {src}"), said
    assert ("bytes, now" if how == "truncate" else "was rewritten") in said and "OUTPUT was not written" in said
    assert not out.exists()
    report = json.loads((tmp_path / "o.parquet.parts" / "report.json").read_text())
    assert (report["exit_status"], report["interrupted"]) == (1, None)
    jsonl(src, items)
    p = slabpool(*args, "--overwrite")
    assert p.returncode == 0, p.stderr
    close(pq.read_table(out).column("probs").to_pylist(), ref(x)["probs"])


def test_a_pipe_as_input_is_read_once(tmp_path: Path, models: SimpleNamespace) -> None:
    """/dev/stdin, `<(zcat in.jsonl.gz)`, a FIFO: read once and held, as `-` is, its lines JSON
    (was: counted in a first read that drained it, then nothing computed, exit 130 "interrupted"
    with no signal sent). An array or table INPUT that is a pipe is refused up front."""
    x = rows(5, seed=8)
    data = "".join(json.dumps({"i": i, "x": r.tolist()}) + "\n" for i, r in enumerate(x))
    out = tmp_path / "o.parquet"
    p = run_stdin(data, "run", models.mlp, "/dev/stdin", "-o", out, "--workers", 1,
                  "--preprocess", "tests.cli_hooks:feeds", "--keep", "line")
    assert p.returncode == 0, p.stderr
    t = pq.read_table(out)
    assert t.column("line").to_pylist() == [1, 2, 3, 4, 5]
    close(t.column("probs").to_pylist(), ref(x)["probs"])
    fifo = tmp_path / "in.npy"
    os.mkfifo(fifo)  # (never opened: nobody writes it, and the refusal comes first)
    with pytest.raises(JobError, match=r"in.npy is not a regular file \(a pipe\?\): a .npy INPUT is read more"):
        open_source(fifo, hook=False)


def test_unreadable_files_in_a_folder_fail_alone(tmp_path: Path, models: SimpleNamespace) -> None:
    """An empty .npy and a damaged .npz among good files: those two items fail, named, the
    others are the model's (was: numpy's EOFError and zipfile.BadZipFile ended the job with a
    traceback, and every rerun met them again)."""
    x = rows(6, seed=5)
    folder = tmp_path / "items"
    folder.mkdir()
    for i in range(6):
        np.save(folder / f"{i:02d}.npy", x[i])
    (folder / "02.npy").write_bytes(b"")
    (folder / "04.npy").unlink()
    (folder / "04.npz").write_bytes(b"PK\x03\x04 not a zip")
    out = tmp_path / "o.npz"
    p = slabpool("run", models.mlp, folder, "-o", out, "--workers", 1)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    failures = [json.loads(ln) for ln in (tmp_path / "o.npz.parts" / "failures.jsonl").read_text().splitlines()]
    assert [(f["index"], f["error"]) for f in failures] == [(2, "ValueError"), (4, "ValueError")]
    assert "02.npy cannot be read as .npy" in failures[0]["message"]
    assert "04.npz cannot be read as .npz" in failures[1]["message"]
    got = np.load(out)["probs"]
    good = [0, 1, 3, 5]
    np.testing.assert_allclose(got[good], ref(x[good])["probs"], rtol=1e-5, atol=1e-6)
    with pytest.raises(JobError, match=r"cannot read input .*04\.npz"):
        open_source(folder / "04.npz", hook=False)


def test_a_npy_truncated_while_it_is_read_stops_with_one_line(tmp_path: Path) -> None:
    """A memory-mapped .npy cut short by its producer mid-job: its next rows raise JobError
    (was: the copy of rows past the new end killed the job with SIGBUS, no report, no line)."""
    path = tmp_path / "in.npy"
    np.save(path, rows(64, seed=9))
    src = open_source(path, hook=False)
    blocks = src.blocks(16)
    np.testing.assert_array_equal(next(blocks).rows[""], rows(64, seed=9)[:16])  # type: ignore[index]
    assert src.rows is not None and src.changed() is None
    os.truncate(path, path.stat().st_size // 2)
    for read in (lambda: next(blocks), lambda: src.rows(40, 48)):  # type: ignore[misc]
        with pytest.raises(JobError, match=r"INPUT changed while the job ran: .*in.npy was [\d,]+ bytes, now"):
            read()
    assert "bytes, now" in (src.changed() or "")


def test_a_byte_order_mark_before_the_first_line_is_not_part_of_it(tmp_path: Path, models: SimpleNamespace) -> None:
    """A JSONL file (and stdin) that starts with a UTF-8 byte order mark, as Windows editors
    write them: the first line is its JSON, every row the model's (was: the first item failed
    with "Unexpected UTF-8 BOM", exit 2); a text line keeps no mark either."""
    x = rows(4, seed=8)
    data = "".join(json.dumps({"i": i, "x": r.tolist()}) + "\r\n" for i, r in enumerate(x))
    (tmp_path / "in.jsonl").write_bytes(b"\xef\xbb\xbf" + data.encode())
    out = tmp_path / "o.parquet"
    p = slabpool("run", models.mlp, tmp_path / "in.jsonl", "-o", out, "--workers", 1, "--keep", "line",
                 "--preprocess", "tests.cli_hooks:feeds")
    assert p.returncode == 0, p.stderr
    t = pq.read_table(out)
    assert t.column("line").to_pylist() == [1, 2, 3, 4]
    close(t.column("probs").to_pylist(), ref(x)["probs"])
    p = run_stdin("\ufeff4\n-2\n", "run", "-", "-o", tmp_path / "sq.npy", "--text", "--workers", 1,
                  "--preprocess", "tests.cli_hooks:square")
    assert p.returncode == 0, p.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "sq.npy"), [[4, 16], [-2, 4]])


# -- batched hooks -------------------------------------------------------------------------------------


def test_batched_hooks_and_a_bad_item_fails_alone(tmp_path: Path, models: SimpleNamespace) -> None:
    x = rows(20, seed=7)
    items = [{"i": i, "x": r.tolist(), **({"bad": 1} if i == 13 else {})} for i, r in enumerate(x)]
    out = tmp_path / "o.parquet"
    p = slabpool("run", models.mlp, jsonl(tmp_path / "in.jsonl", items), "-o", out, "--workers", 2,
                 "--batch-size", 6, "--preprocess", "tests.cli_hooks:feeds_batch",
                 "--postprocess", "tests.cli_hooks:labels_batch")
    assert p.returncode == 2, p.stderr
    t = pq.read_table(out)
    want = [f"class-{int(k)}" for k in np.argmax(ref(x)["probs"], axis=1)]
    labels = t.column("output").to_pylist()
    assert labels[:13] == want[:13] and labels[14:] == want[14:] and labels[13] is None
    errors = t.column("error").to_pylist()
    assert [i for i, e in enumerate(errors) if e] == [13] and "marked bad" in errors[13]


def test_batched_preprocess_with_a_per_item_postprocess_flag(tmp_path: Path, models: SimpleNamespace) -> None:
    """--batched on a per-item-looking pair: preprocess gets lists, the model's rows split back."""
    x = rows(7, seed=8)
    items = [{"i": i, "x": r.tolist()} for i, r in enumerate(x)]
    out = tmp_path / "o.npz"
    p = slabpool("run", models.mlp, jsonl(tmp_path / "in.jsonl", items), "-o", out, "--workers", 1,
                 "--batch-size", 3, "--preprocess", "tests.cli_hooks:feeds_batch")
    assert p.returncode == 0, p.stderr
    with np.load(out) as z:
        close(z["probs"], ref(x)["probs"])


def test_batched_postprocess_with_the_wrong_count_stops_the_job(tmp_path: Path, models: SimpleNamespace) -> None:
    items = [{"i": i, "x": r.tolist()} for i, r in enumerate(rows(8))]
    p = slabpool("run", models.mlp, jsonl(tmp_path / "in.jsonl", items), "-o", tmp_path / "o.parquet",
                 "--workers", 1, "--batch-size", 4, "--preprocess", "tests.cli_hooks:feeds_batch",
                 "--postprocess", "tests.cli_hooks:wrong_count")
    assert p.returncode == 1, p.stderr
    assert "one result per item: 4 items, got 3 results" in last_line(p), p.stderr


# -- systematic failures stop the job ------------------------------------------------------------------


def test_systematic_failure_stops_early_with_the_first_error(tmp_path: Path, models: SimpleNamespace) -> None:
    n = 600
    pq.write_table(pa.table({"id": list(range(n)), "v": [0.5] * n}), tmp_path / "t.parquet")
    p = slabpool("run", models.mlp, tmp_path / "t.parquet", "-o", tmp_path / "o.parquet", "--workers", 2,
                 "--preprocess", "tests.cli_hooks:needs_label")
    assert p.returncode == 1, p.stderr
    line = last_line(p)
    assert line.startswith("slabpool run: error: stopped: the first") and "KeyError" in line and "label" in line
    report = json.loads((tmp_path / "o.parquet.parts" / "report.json").read_text())
    assert 100 <= report["computed_this_run"] < n and report["exit_status"] == 1


@pytest.mark.parametrize(("limit", "status"), [("1", 1), ("20%", 2), ("3", 2)])
def test_max_failures(limit: str, status: int, tmp_path: Path, models: SimpleNamespace) -> None:
    items = [{"i": i, "x": r.tolist(), **({"bad": 1} if i in (2, 9, 15) else {})} for i, r in enumerate(rows(20))]
    p = slabpool("run", models.mlp, jsonl(tmp_path / "in.jsonl", items), "-o", tmp_path / "o.npz", "--workers", 1,
                 "--preprocess", "tests.cli_hooks:feeds", "--max-failures", limit)
    assert p.returncode == status, p.stderr
    if status == 1:
        assert "more than --max-failures 1" in last_line(p) and "item 2 is marked bad" in last_line(p)


def test_a_few_bad_items_are_listed_not_stopped(tmp_path: Path, models: SimpleNamespace) -> None:
    """The default rule stops on all-failed starts only: a bad first item among good ones is fine."""
    items = [{"i": i, "x": r.tolist(), **({"bad": 1} if i == 0 else {})} for i, r in enumerate(rows(5))]
    p = slabpool("run", models.mlp, jsonl(tmp_path / "in.jsonl", items), "-o", tmp_path / "o.npz", "--workers", 1,
                 "--preprocess", "tests.cli_hooks:feeds")
    assert p.returncode == 2, p.stderr


def test_jsonl_lines_are_parsed_in_the_workers_and_a_bad_line_fails_alone(tmp_path: Path,
                                                                           models: SimpleNamespace) -> None:
    """3000 lines, many to a task: a line that is not JSON and an item the hook refuses each fail
    alone, with their line numbers kept; every other row is the model's output for its line."""
    x = rows(3000)
    text = []
    for i, r in enumerate(x):
        if i % 997 == 5:
            text.append("{not json")
        elif i % 1009 == 7:
            text.append(json.dumps({"i": i, "x": r.tolist(), "bad": 1}))
        else:
            text.append(json.dumps({"i": i, "x": r.tolist()}))
        if i % 500 == 0:
            text.append("   ")  # blank lines are not items, but count as lines
    (tmp_path / "in.jsonl").write_text("\n".join(text) + "\n")
    out = tmp_path / "o.parquet"
    p = slabpool("run", models.mlp, tmp_path / "in.jsonl", "-o", out, "--workers", 2, "--keep", "line",
                 "--preprocess", "tests.cli_hooks:feeds")
    assert p.returncode == 2, p.stderr
    t = pq.read_table(out).to_pylist()
    assert len(t) == 3000
    bad_json = {i for i in range(3000) if i % 997 == 5}
    bad_hook = {i for i in range(3000) if i % 1009 == 7} - bad_json
    want = mlp_reference(x)["probs"]
    line = 0
    for i, row in enumerate(t):
        line += 1 + (i > 0 and (i - 1) % 500 == 0)  # the blank line written after item i - 1
        assert row["line"] == line
        if i in bad_json:
            assert row["probs"] is None and "not JSON" in row["error"]
        elif i in bad_hook:
            assert row["probs"] is None and "marked bad" in row["error"]
        else:
            assert row["error"] is None
            np.testing.assert_allclose(row["probs"], want[i], rtol=1e-5, atol=1e-6)
    failures = [json.loads(ln) for ln in Path(f"{out}.parts/failures.jsonl").read_text().splitlines()]
    assert {f["index"] for f in failures} == bad_json | bad_hook


@pytest.mark.parametrize("pre,post", [("feeds", "tagged"), ("feeds_batch", "tagged_batch")])
def test_a_postprocess_gets_the_parsed_json_item(pre: str, post: str, tmp_path: Path,
                                                 models: SimpleNamespace) -> None:
    """JSON lines travel as text and are parsed in the worker: the postprocess (per item or
    batched) still gets the parsed item, as the preprocess does."""
    x = rows(40, seed=9)
    items = [{"i": 1000 + i, "x": r.tolist()} for i, r in enumerate(x)]
    out = tmp_path / "o.parquet"
    p = slabpool("run", models.mlp, jsonl(tmp_path / "in.jsonl", items), "-o", out, "--workers", 2,
                 "--preprocess", f"tests.cli_hooks:{pre}", "--postprocess", f"tests.cli_hooks:{post}")
    assert p.returncode == 0, p.stderr
    t = pq.read_table(out)
    assert t.column("i").to_pylist() == [1000 + i for i in range(40)]
    assert t.column("label").to_pylist() == np.argmax(ref(x)["probs"], axis=1).tolist()


def test_an_item_of_two_rows_next_to_one_of_none_fails_alone(tmp_path: Path, models: SimpleNamespace) -> None:
    """Outputs of a chunk that add up to one row per item, but not item by item (2 rows, then
    0): both items fail, every other keeps its own row."""
    x = rows(200)
    items = [{"i": i, "x": r.tolist(), **({"rows": 2} if i == 50 else {"rows": 0} if i == 51 else {})}
             for i, r in enumerate(x)]
    out = tmp_path / "o.npy"
    p = slabpool("run", models.mlp, jsonl(tmp_path / "in.jsonl", items), "-o", out, "--workers", 1,
                 "--preprocess", "tests.cli_hooks:feeds_rows")
    assert p.returncode == 2, p.stderr
    failures = [json.loads(ln) for ln in Path(f"{out}.parts/failures.jsonl").read_text().splitlines()]
    assert sorted(f["index"] for f in failures) == [50, 51]
    got, want = np.load(out), mlp_reference(x)["probs"]
    keep = np.ones(200, bool)
    keep[[50, 51]] = False
    np.testing.assert_allclose(got[keep], want[keep], rtol=1e-5, atol=1e-6)
    assert np.isnan(got[[50, 51]]).all()


# -- Parquet output: strings, refusals, store order -----------------------------------------------------


@pytest.mark.parametrize("hook", [False, True])
def test_one_number_a_row_keeps_its_dtype_in_every_output(hook: bool, tmp_path: Path) -> None:
    """A scorer's output, y[batch]: one float32 a row in .npy, .npz and Parquet (by blocks
    without a hook, item by item with one)."""
    model = onnx_models.row_sum(tmp_path / "row_sum.onnx")
    x = np.random.default_rng(5).standard_normal((37, 4)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    want = x.sum(axis=1, dtype=np.float32)
    extra = ["--preprocess", "tests.cli_hooks:row_feeds"] if hook else []
    for name in ("y.npy", "y.npz", "y.parquet"):
        out = tmp_path / name
        p = slabpool("run", model, tmp_path / "x.npy", "-o", out, "--workers", 2, *extra)
        assert p.returncode == 0, p.stderr
        if name == "y.parquet":
            t = pq.read_table(out)
            assert t.schema.field("y").type == pa.float32()
            got = np.asarray(t.column("y").to_pylist(), np.float32)
        else:
            got = np.load(out)["y"] if name.endswith(".npz") else np.load(out)
        assert got.dtype == np.float32 and got.shape == (37,)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_an_input_without_rows_says_so_and_writes_nothing(tmp_path: Path, models: SimpleNamespace) -> None:
    np.save(tmp_path / "e.npy", np.zeros((0, 16), np.float32))
    (tmp_path / "h.csv").write_text("x\n")
    (tmp_path / "e.jsonl").write_text("")
    pq.write_table(pa.table({"x": pa.array([], type=pa.list_(pa.float32(), 16))}), tmp_path / "e.parquet")
    for src, out in [("e.npy", "o.npy"), ("e.parquet", "o.parquet"), ("h.csv", "o2.parquet"), ("e.jsonl", "o.npz")]:
        hook = ["--preprocess", "tests.cli_hooks:feeds"] if src.endswith(".jsonl") else []
        p = slabpool("run", models.mlp, tmp_path / src, "-o", tmp_path / out, "--workers", 1, *hook)
        assert p.returncode == 0, p.stderr
        assert f"{src} holds no items; nothing was computed, {tmp_path / out} was not written" in p.stdout, p.stdout
        assert not (tmp_path / out).exists()


def test_string_output_to_npz_is_refused_pointing_to_parquet(tmp_path: Path, models: SimpleNamespace) -> None:
    np.save(tmp_path / "in.npy", rows(30))
    p = slabpool("run", models.mlp, tmp_path / "in.npy", "-o", tmp_path / "o.npz", "--workers", 1,
                 "--postprocess", "tests.cli_hooks:label")
    assert p.returncode == 1, p.stderr
    assert "output 'label' holds" in last_line(p) and ".parquet" in last_line(p)
    assert not (tmp_path / "o.npz").exists()


def test_keep_needs_parquet_and_a_known_column(tmp_path: Path, models: SimpleNamespace) -> None:
    np.save(tmp_path / "in.npy", rows(3))
    p = slabpool("run", models.mlp, tmp_path / "in.npy", "-o", tmp_path / "o.npz", "--keep", "id")
    assert p.returncode == 1 and "--keep needs a .parquet OUTPUT" in p.stderr
    pq.write_table(pa.table({"x": rows(2).tolist()}), tmp_path / "t.parquet")
    p = slabpool("run", models.mlp, tmp_path / "t.parquet", "-o", tmp_path / "o.parquet", "--keep", "id")
    assert p.returncode == 1 and "no such column; it offers x" in p.stderr, p.stderr


def test_missing_pyarrow_is_a_clear_error(tmp_path: Path, models: SimpleNamespace) -> None:
    pq.write_table(pa.table({"x": rows(2).tolist()}), tmp_path / "t.parquet")
    code = ("import sys; sys.modules['pyarrow'] = None; from slabpool.engine.job.cli import main; "
            f"sys.exit(main(['run', {str(models.mlp)!r}, {str(tmp_path / 't.parquet')!r}, '-o', "
            f"{str(tmp_path / 'o.npz')!r}]))")
    p = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=DEADLINE)
    assert p.returncode == 1
    assert "needs pyarrow: pip install 'slabpool[parquet]'" in p.stderr and "Traceback" not in p.stderr


def test_parquet_store_assembles_input_order_across_runs(tmp_path: Path) -> None:
    """Shards committed out of order (a resumed run fills holes) come back in input order;
    failed rows are null with their error; a shard of failures only has no output columns."""
    parts = tmp_path / "o.parquet.parts"
    store = Store.open(parts, {"job": 1}, resume=False, overwrite=False, parquet=True,
                       keep_types={"id": pa.string()})
    schema = {"y": ("<f4", (2,)), "label": ("py", ())}

    def cols(idx: list[int]) -> dict[str, Any]:
        return {"y": np.asarray([[i, -i] for i in idx], dtype=np.float32), "label": [f"L{i}" for i in idx]}

    def kept(idx: list[int]) -> dict[str, list[Any]]:  # the done items' values, then the failures'
        return {"id": [f"#{i}" for i in idx]}

    store.commit(np.array([5, 6, 7]), cols([5, 6, 7]), [Failure(4, "ValueError", "bad", 1)], kept=kept([5, 6, 7, 4]),
                 schema=schema)
    store.commit(np.zeros(0, np.int64), {}, [Failure(3, "PoisonTask", "died", 2)], kept=kept([3]), schema=schema)
    store.commit(np.array([0, 2, 1]), cols([0, 2, 1]), [], kept=kept([0, 2, 1]), schema=schema)
    out = tmp_path / "o.parquet"
    with open(out, "wb") as f:
        job_parquet.assemble(store.shard_paths(), 8, ("id",), f)
    store.close()
    t = pq.read_table(out)
    assert t.column("id").to_pylist() == [f"#{i}" for i in range(8)]
    assert t.column("label").to_pylist() == ["L0", "L1", "L2", None, None, "L5", "L6", "L7"]
    assert t.column("y").to_pylist()[1] == [1.0, -1.0] and t.column("y").to_pylist()[3] is None
    assert t.column("error").to_pylist()[3:5] == ["PoisonTask: died", "ValueError: bad"]
    reopened = Store.open(parts, {"job": 1}, resume=True, overwrite=False, parquet=True,
                          keep_types={"id": pa.string()})
    try:
        assert reopened.settled() == set(range(8)) and reopened.schema() == schema
    finally:
        reopened.close()


def test_lines_source_keeps_line_numbers_and_parses_json_where_it_is_decoded(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"v": 1}\n\n{"v": 2}\r\n  \n{"s": "a\u2028b"}')
    src = open_source(tmp_path / "a.jsonl", hook=True)
    src.choose_keep(["line"])
    assert src.count == 3
    got = [(i, get(), kept) for i, get, kept in pending_items(src, [(0, src.count)])]  # lines travel as text
    assert got == [(0, '{"v": 1}', {"line": 1}), (1, '{"v": 2}', {"line": 3}),
                   (2, '{"s": "a\u2028b"}', {"line": 5})]
    assert src.decode is not None
    assert [src.decode(text) for _, text, _ in got] == [{"v": 1}, {"v": 2}, {"s": "a\u2028b"}]
    with pytest.raises(ValueError, match="not JSON"):
        src.decode("{oops")
    text = open_source(tmp_path / "a.jsonl", hook=True, text=True)
    assert text.decode is None and [get() for _, get, _ in pending_items(text, [(0, text.count)])][1] == '{"v": 2}'


def test_lines_source_that_is_not_utf8_is_refused_up_front(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_bytes(b'{"v": 1}\n\xff\xfe\n')
    with pytest.raises(JobError, match="cannot read input"):
        open_source(tmp_path / "a.jsonl", hook=True)


@pytest.mark.parametrize("read_chars", [1, 3, 64, 1 << 22])
def test_lines_are_read_in_pieces_like_a_text_file_read_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              read_chars: int) -> None:
    """Lines cut by the end of a read, \\r\\n cut in two, blank lines, no final newline: each
    non-blank line once, with its number, as reading the whole file with universal newlines."""
    from slabpool.engine.job.sources import lines

    monkeypatch.setattr(lines, "READ_CHARS", read_chars)
    rng = np.random.default_rng(read_chars)
    for trial in range(40):
        pieces = [str(rng.choice(["", " ", "\t", "a", "héllo", '{"x": 1}', "x" * int(rng.integers(0, 30))]))
                  + str(rng.choice(["\n", "\r\n", "\r", "\n\n"])) for _ in range(int(rng.integers(0, 30)))]
        text = "".join(pieces)[: None if trial % 2 else -1]
        path = tmp_path / f"{trial}.txt"
        path.write_bytes(text.encode())
        src = open_source(path, hook=True)
        src.choose_keep(["line"])
        got = [(i, get(), kept["line"]) for i, get, kept in pending_items(src, [(0, src.count)])]
        whole = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        want = [(n, ln) for n, ln in enumerate(whole, 1) if ln.strip()]
        assert got == [(i, ln, n) for i, (n, ln) in enumerate(want)] and src.count == len(want), repr(text)
