"""`slabpool run`'s options: what each accepts and how it says no, and batched hooks whose
bookkeeping stays linear in --batch-size (one split of a list's result, not one per item).

In process (`cli.main(argv)`) where the test counts calls made in the job's own process
(the split of a batched result); real workers, real sessions.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pytest

from slabpool.engine.job import cli
from slabpool.engine.job import hooks as job_hooks
from tests.test_cli import jsonl, rows, slabpool


def one_line(p: Any, *texts: str) -> str:
    assert p.returncode == 1, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    for text in texts:
        assert text in lines[0], lines[0]
    return str(lines[0])


# -- argument errors name the option and what it accepts ------------------------------------------


BAD_VALUES = [
    ("--batch-size", "many", "a positive integer or 'auto'"),
    ("--batch-size", "0", "a positive integer or 'auto'"),
    ("--batch-size", "-3", "a positive integer or 'auto'"),
    ("--workers", "two", "a positive integer"),
    ("--workers", "0", "a positive integer"),
    ("--max-attempts", "1.5", "a positive integer"),
    ("--task-timeout", "soon", "a positive, finite number"),
    ("--durable-every", "0", "a positive, finite number"),
    ("--log-every", "nan", "a positive, finite number"),
    ("--task-timeout", "inf", "a positive, finite number"),  # (was: past argparse, then "cannot start")
]


@pytest.mark.parametrize(("option", "value", "accepts"), BAD_VALUES, ids=[f"{o}={v}" for o, v, _ in BAD_VALUES])
def test_a_bad_value_names_the_option_and_what_it_accepts(option: str, value: str, accepts: str,
                                                          tmp_path: Path, models: SimpleNamespace) -> None:
    np.save(tmp_path / "in.npy", rows(3))
    p = slabpool("run", models.mlp, tmp_path / "in.npy", "-o", tmp_path / "o.npy", option, value)
    line = one_line(p, f"argument {option}", accepts, repr(value))
    assert "_positive" not in line and "invalid" not in line, line  # never a private function's name


@pytest.mark.parametrize(("argv", "accepts"), [
    (["bench", "{m}", "--workers", "0"], "comma-separated positive integers"),
    (["bench", "{m}", "--workers", "1,-2"], "comma-separated positive integers"),
    (["doctor", "{m}", "--workers", "-3"], "a positive integer"),
], ids=["bench-0", "bench-negative", "doctor-negative"])
def test_bench_and_doctor_refuse_a_bad_worker_count_before_any_work(argv: list[str], accepts: str,
                                                                     models: SimpleNamespace) -> None:
    """Was: bench printed its table's header, doctor its whole host report, then the error."""
    p = slabpool(*[a.format(m=models.mlp) for a in argv])
    one_line(p, "argument --workers", accepts)
    assert p.stdout == "", p.stdout


def test_output_stdout_is_refused_and_nothing_is_made(tmp_path: Path, models: SimpleNamespace) -> None:
    """`-o -`: a job's OUTPUT keeps its progress beside it, so it cannot be stdout; refused in
    one line, and no folder named "-" is made (was: made, and written to)."""
    np.save(tmp_path / "in.npy", rows(3))
    p = slabpool("run", models.mlp, tmp_path / "in.npy", "-o", "-", cwd=tmp_path)
    one_line(p, "-o -", "not stdout")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["in.npy"]


@pytest.mark.parametrize("suffix", [".NPY", ".Npz", ".PARQUET"])
def test_an_output_suffix_in_capitals_names_the_same_file_format(suffix: str, tmp_path: Path,
                                                                 models: SimpleNamespace) -> None:
    """OUTPUT's suffix is read in any case, as an INPUT's is: o.NPY is a .npy file (was: a
    folder named o.NPY); every row is the model's."""
    from tests.models.onnx_models import mlp_reference

    x = rows(5, seed=4)
    np.save(tmp_path / "in.npy", x)
    out = tmp_path / f"o{suffix}"
    p = slabpool("run", models.mlp, tmp_path / "in.npy", "-o", out, "--workers", 1)
    assert p.returncode == 0, p.stderr
    assert out.is_file()
    want = mlp_reference(x)["probs"]
    if suffix == ".PARQUET":
        import pyarrow.parquet as pq

        got = np.asarray(pq.read_table(out).column("probs").to_pylist(), dtype=np.float32)
    elif suffix == ".Npz":
        got = np.load(out)["probs"]
    else:
        got = np.load(out)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# The spelling is read with the arguments, before any input is: one input kind shows that AUTO
# is auto; "auto" goes through all three (a job each).
@pytest.mark.parametrize(("spelled", "kinds"), [("auto", 3), ("AUTO", 1)])
def test_batch_size_auto_is_the_default(spelled: str, kinds: int, tmp_path: Path, models: SimpleNamespace) -> None:
    x = rows(700)
    np.save(tmp_path / "in.npy", x)
    items = [{"i": i, "x": r.tolist()} for i, r in enumerate(x[:50])]
    for src, out, extra in [
        (tmp_path / "in.npy", tmp_path / "o.npy", []),  # blocks: sized from the measured time per row
        (jsonl(tmp_path / "in.jsonl", items), tmp_path / "o.npz", ["--preprocess", "tests.cli_hooks:feeds"]),
        (tmp_path / "in.jsonl", tmp_path / "b.npz", ["--preprocess", "tests.cli_hooks:feeds_batch"]),  # batched
    ][:kinds]:
        p = slabpool("run", models.mlp, src, "-o", out, "--workers", 2, "--batch-size", spelled, *extra)
        assert p.returncode == 0, p.stderr
        assert "(batch size auto)" in p.stdout
        parts = Path(f"{out}.parts")
        assert json.loads((parts / "report.json").read_text())["batch_size"] == "auto"


# -- batched hooks: one split per list -------------------------------------------------------------


def _inputs(tmp: Path, n: int) -> dict[str, Path]:
    jsonl(tmp / "in.jsonl", [{"i": i} for i in range(n)])
    pacsv.write_csv(pa.table({"i": list(range(n)), "name": [f"n{i}" for i in range(n)]}), tmp / "in.csv")
    (tmp / "files").mkdir()
    for i in range(n):
        (tmp / "files" / f"{i}.txt").write_text("x")
    return {"jsonl": tmp / "in.jsonl", "csv": tmp / "in.csv", "folder": tmp / "files"}


@pytest.mark.parametrize("size", [1, 7, 64, 1024])
def test_a_batched_result_is_split_once_per_list(size: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The job splits each list's result into its items once: calls grow with the number of
    lists, not with lists x items (which made --batch-size 1024 ten times slower than 64)."""
    n = 1100 if size > 1 else 150
    calls: list[int] = []
    real = job_hooks.split

    def counted(outputs: Any, k: int, **kw: Any) -> list[Any]:
        calls.append(k)
        return real(outputs, k, **kw)

    monkeypatch.setattr(job_hooks, "split", counted)
    for kind, src in _inputs(tmp_path, n).items():
        calls.clear()
        out = tmp_path / f"{kind}.npy"
        status = cli.main(["run", str(src), "-o", str(out), "--workers", "2", "--batch-size", str(size),
                           "--preprocess", "tests.cli_hooks:zeros_batch"])
        assert status == 0, kind
        order = sorted(range(n), key=str) if kind == "folder" else range(n)  # a folder: by file name
        want = np.repeat(np.asarray(list(order), np.float32)[:, None], 13, axis=1)
        np.testing.assert_array_equal(np.load(out), want)
        assert len(calls) == math.ceil(n / size) and sum(calls) == n, (kind, len(calls))


# -- the fingerprint: every option that shapes the output ------------------------------------------


def _table(tmp: Path, n: int) -> Path:
    x = rows(n)
    t = pa.table({"id": list(range(n)), "name": [f"n{i}" for i in range(n)],
                  "x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 16)})
    import pyarrow.parquet as pq

    pq.write_table(t, tmp / "t.parquet", row_group_size=50)
    return tmp / "t.parquet"


def _numbers(tmp: Path, n: int) -> Path:
    (tmp / "n.jsonl").write_text("".join(f"{i}\n" for i in range(n)))
    return tmp / "n.jsonl"


def _items(tmp: Path, n: int) -> Path:
    return jsonl(tmp / "in.jsonl", [{"i": i, "x": r.tolist()} for i, r in enumerate(rows(n))])


# (case, input, OUTPUT name, first run's options, the rerun's, what the refusal says); MODEL
# is the mlp unless the options say "-" (no model)
CHANGED: list[tuple[str, Any, str, list[str], list[str], str]] = [
    ("keep-other", _table, "o.parquet", ["--keep", "id"], ["--keep", "name"], "--keep was id, now name"),
    ("keep-order", _table, "o.parquet", ["--keep", "id,name"], ["--keep", "name,id"],
     "--keep was id,name, now name,id"),
    ("keep-dropped", _table, "o.parquet", ["--keep", "id"], [], "--keep was id, now (none)"),
    ("text", _numbers, "o.npz", ["-", "--preprocess", "tests.cli_hooks:square"],
     ["-", "--preprocess", "tests.cli_hooks:square", "--text"], "--text was off, now on"),
    ("hook-batch", _items, "o.npz", ["--preprocess", "tests.cli_hooks:feeds_batch", "--batch-size", "8"],
     ["--preprocess", "tests.cli_hooks:feeds_batch", "--batch-size", "16"],
     "--batch-size (the items a batched hook gets at once) was 8, now 16"),
    ("postprocess", _items, "o.parquet", ["--preprocess", "tests.cli_hooks:feeds"],
     ["--preprocess", "tests.cli_hooks:feeds", "--postprocess", "tests.cli_hooks:tagged"],
     "--postprocess was (none), now tests.cli_hooks:tagged"),
    ("two-at-once", _items, "res", ["--preprocess", "tests.cli_hooks:feeds"],
     ["--preprocess", "tests.cli_hooks:feeds_batch", "--batch-size", "4"],
     "--preprocess was tests.cli_hooks:feeds, now tests.cli_hooks:feeds_batch; --batched (hooks that take a "
     "list) was off, now on; --batch-size (the items a batched hook gets at once) was (none), now 4"),
]


def _argv(tmp: Path, model: Path, src: Path, out: Path, opts: list[str]) -> list[Any]:
    head = ["run", src] if opts[:1] == ["-"] else ["run", model, src]
    return [*head, "-o", out, "--workers", 2, "--durable-every", 0.05, *(o for o in opts if o != "-")]


REFUSALS = [(*c, False) for c in CHANGED] + [(*c, True) for c in CHANGED if c[0] in ("keep-other", "hook-batch")]


@pytest.mark.parametrize(("case", "make", "name", "first", "then", "says", "partial"), REFUSALS,
                         ids=[f"{c[0]}-{'part-done' if c[-1] else 'complete'}" for c in REFUSALS])
def test_a_resume_with_other_options_is_refused_naming_them(
    case: str, make: Any, name: str, first: list[str], then: list[str], says: str, partial: bool,
    tmp_path: Path, models: SimpleNamespace,
) -> None:
    """A rerun on the OUTPUT of a job run with other options would mix two jobs' rows (or
    die on a column it lacks): refused, each differing option named with its old and new
    value; nothing of the first job is touched. Complete, and with part of the items durable
    (the journal of a job killed after its first commits)."""
    src, out = make(tmp_path, 300), tmp_path / name
    p = slabpool(*_argv(tmp_path, models.mlp, src, out, first))
    assert p.returncode == 0, p.stderr
    parts = out if out.suffix == "" else Path(f"{out}.parts")
    if partial:
        journal = (parts / "journal.jsonl").read_text().splitlines()
        (parts / "journal.jsonl").write_text(journal[0] + "\n")  # as durable when it was killed
        if out.is_file():
            out.unlink()
    before = {p: p.read_bytes() for p in sorted(parts.rglob("*")) if p.is_file()}
    p = slabpool(*_argv(tmp_path, models.mlp, src, out, then))
    line = one_line(p, "holds results of a different job", says)
    assert "KeyError" not in line
    assert {p: p.read_bytes() for p in sorted(parts.rglob("*")) if p.is_file()} == before


def test_the_model_is_known_by_its_bytes(tmp_path: Path, models: SimpleNamespace) -> None:
    """The model rewritten at the same path (a deploy) is another job; the same bytes touched
    or moved are the same job."""
    import shutil

    from tests.models import onnx_models

    np.save(tmp_path / "in.npy", rows(40))
    model = tmp_path / "m.onnx"
    shutil.copyfile(models.mlp, model)
    run = ("run", model, tmp_path / "in.npy", "-o", tmp_path / "o.npz", "--workers", 1)
    assert slabpool(*run).returncode == 0
    os_touch = model.stat().st_mtime_ns + 10**9
    import os

    os.utime(model, ns=(os_touch, os_touch))
    p = slabpool(*run)
    assert p.returncode == 0 and "all already durable" in p.stdout, p.stderr
    onnx_models.mlp(model, seed=7)  # same inputs and outputs, other weights
    one_line(slabpool(*run), "different job", "MODEL was sha256 ")


@pytest.mark.parametrize("change", [["--workers", "1"], ["--batch-size", "7"], ["--start-method", "spawn"],
                                    ["--max-attempts", "5"], ["--task-timeout", "30"], ["--max-failures", "3"]],
                         ids=lambda c: c[0])
def test_options_that_do_not_shape_the_output_may_change(change: list[str], tmp_path: Path,
                                                         models: SimpleNamespace) -> None:
    np.save(tmp_path / "in.npy", rows(40))
    run = ("run", models.mlp, tmp_path / "in.npy", "-o", tmp_path / "o.npz")
    assert slabpool(*run, "--workers", 2).returncode == 0
    p = slabpool(*run, *change)
    assert p.returncode == 0 and "all already durable" in p.stdout, p.stderr


def test_a_manifest_of_an_earlier_version_is_refused_clearly(tmp_path: Path, models: SimpleNamespace) -> None:
    np.save(tmp_path / "in.npy", rows(4))
    run = ("run", models.mlp, tmp_path / "in.npy", "-o", tmp_path / "o.npz")
    assert slabpool(*run).returncode == 0
    manifest = tmp_path / "o.npz.parts" / "manifest.json"
    old = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({"format": "slabpool-job/1", "job": {k: old["job"][k] for k in (
        "input", "count", "preprocess", "postprocess")}}))
    one_line(slabpool(*run), "made by an earlier slabpool", "--overwrite")


# -- progress and report figures -------------------------------------------------------------------


def _rate_of(line: str) -> float | None:
    shown = line.split(", ")[1]  # "progress: 40/40 items (100%), 61.3 items/s, eta 0 s, ..."
    return None if shown.startswith("-") else float(shown.split()[0])


@pytest.mark.parametrize(("kind", "n"), [("jsonl-slow", 40), ("npy-blocks", 20_000), ("npy-tiny", 3)])
def test_the_progress_rate_is_the_reports_throughput(kind: str, n: int, tmp_path: Path,
                                                     models: SimpleNamespace) -> None:
    """Both count items over the running phase alone (start-up and the final writes apart), so
    the last progress line and report.json agree; a phase too short for a rate shows none
    (never a million items/s from a 0.4 ms interval)."""
    if kind == "jsonl-slow":
        items = [{"i": i, "x": r.tolist(), "sleep": 0.02} for i, r in enumerate(rows(n))]
        src, extra = jsonl(tmp_path / "in.jsonl", items), ["--preprocess", "tests.cli_hooks:feeds"]
    else:
        np.save(tmp_path / "in.npy", rows(n))
        src, extra = tmp_path / "in.npy", []
    out = tmp_path / "o.npz"
    p = slabpool("run", models.mlp, src, "-o", out, "--workers", 2, "--log-every", 0.05, *extra)
    assert p.returncode == 0, p.stderr
    rep = json.loads(Path(f"{out}.parts/report.json").read_text())
    last = [ln for ln in p.stderr.splitlines() if "progress:" in ln][-1]
    assert f"{n}/{n} items" in last
    assert rep["startup_s"] + rep["running_s"] <= rep["elapsed_s"] + 1e-3
    if rep["running_s"] < 0.1:
        assert rep["throughput_items_per_s"] is None and _rate_of(last) is None
        assert "too short for a rate" in p.stdout, p.stdout
    else:
        assert rep["throughput_items_per_s"] == round(n / rep["running_s"], 2) or abs(
            rep["throughput_items_per_s"] - n / rep["running_s"]) <= 0.01 * rep["throughput_items_per_s"]
        assert _rate_of(last) == pytest.approx(rep["throughput_items_per_s"], abs=0.06)
        assert f"throughput {rep['throughput_items_per_s']:,.1f} items/s" in p.stdout
