"""`python -m bench.serve` runs end to end (slabpool only, a second of load): the benchmark of
docs/serve.md does not rot. It needs Debian's `wrk`; without it the case is skipped."""

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
                    "--concurrency", "1,8", "--crash-seconds", "3", "--out", str(out)],
                   cwd=REPO, check=True, capture_output=True, timeout=240)
    result = json.loads(out.read_text())["servers"]["slabpool"]
    assert result["correct"] and [x["concurrency"] for x in result["loads"]] == [1, 8]
    assert all(x["requests"] > 0 and x["non_2xx"] == 0 and x["lost"] == 0 for x in result["loads"])
    crash = result["crash"]
    assert crash["kills"] >= 1 and crash["load"]["non_2xx"] == 0 and crash["load"]["lost"] == 0
    assert crash["serving_after"]
