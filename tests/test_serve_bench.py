"""`python -m bench.serve` and `python -m bench.serve_ab` run end to end (slabpool only, a second
of load): the benchmarks of docs/serve.md do not rot. They need Debian's `wrk`; without it the
cases are skipped."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("wrk") is None, reason="needs wrk (apt-get install wrk)")
def test_the_serving_benchmark_smoke_runs(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    subprocess.run([sys.executable, "-m", "bench.serve", "--only", "slabpool", "--duration", "1",
                    "--concurrency", "1,8", "--crash-seconds", "3", "--overhead-requests", "200", "--out", str(out)],
                   cwd=REPO, check=True, capture_output=True, timeout=240)
    result = json.loads(out.read_text())["servers"]["slabpool"]
    assert result["correct"] and [x["concurrency"] for x in result["loads"]] == [1, 8]
    assert all(x["requests"] > 0 and x["non_2xx"] == 0 and x["lost"] == 0 for x in result["loads"])
    crash = result["crash"]
    assert crash["kills"] >= 1 and crash["load"]["non_2xx"] == 0 and crash["load"]["lost"] == 0
    assert crash["serving_after"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("wrk") is None, reason="needs wrk (apt-get install wrk)")
def test_the_side_by_side_benchmark_smoke_runs() -> None:
    out = subprocess.run([sys.executable, "-m", "bench.serve_ab", "--rounds", "1", "--duration", "1",
                          "--concurrency", "2", "this=.", "batched=. --max-batch-size 4"],
                         cwd=REPO, check=True, capture_output=True, text=True, timeout=240).stdout
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert {"this", "batched"} <= set(rows), out
