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
    ("--task-timeout", "soon", "a positive number"),
    ("--durable-every", "0", "a positive number"),
    ("--log-every", "nan", "a positive number"),
]


@pytest.mark.parametrize(("option", "value", "accepts"), BAD_VALUES, ids=[f"{o}={v}" for o, v, _ in BAD_VALUES])
def test_a_bad_value_names_the_option_and_what_it_accepts(option: str, value: str, accepts: str,
                                                          tmp_path: Path, models: SimpleNamespace) -> None:
    np.save(tmp_path / "in.npy", rows(3))
    p = slabpool("run", models.mlp, tmp_path / "in.npy", "-o", tmp_path / "o.npy", option, value)
    line = one_line(p, f"argument {option}", accepts, repr(value))
    assert "_positive" not in line and "invalid" not in line, line  # never a private function's name


@pytest.mark.parametrize("spelled", ["auto", "AUTO"])
def test_batch_size_auto_is_the_default(spelled: str, tmp_path: Path, models: SimpleNamespace) -> None:
    x = rows(700)
    np.save(tmp_path / "in.npy", x)
    items = [{"i": i, "x": r.tolist()} for i, r in enumerate(x[:50])]
    for src, out, extra in [
        (tmp_path / "in.npy", tmp_path / "o.npy", []),  # blocks: sized from the measured time per row
        (jsonl(tmp_path / "in.jsonl", items), tmp_path / "o.npz", ["--preprocess", "tests.cli_hooks:feeds"]),
        (tmp_path / "in.jsonl", tmp_path / "b.npz", ["--preprocess", "tests.cli_hooks:feeds_batch"]),  # batched
    ]:
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
