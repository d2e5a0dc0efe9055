"""Smoke runs of `python -m bench` and `python -m bench.latency` on tiny sizes, so the benchmarks cannot rot.

It checks that the run writes its JSON, markdown and PNG, that every contender has a row
(measured, or skipped with a reason), and that every measured contender's outputs were
checked against the serial reference. It asserts no timing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONTENDERS = ("serial", "ort-threads", "slabpool", "slabpool+batch", "slabpool map", "ProcessPoolExecutor",
              "loky", "pebble", "mp.Pool", "mp.Pool imap", "ray")


@pytest.mark.slow
def test_bench_smoke_run_writes_every_contender(tmp_path: Path) -> None:
    # A subprocess: the bench's pools (and Ray, when installed) live and die in its own tree.
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--workers", "1", "--workloads", "mlp,noop",
         "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("latest.json", "latest.md", "latest.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert (tmp_path / "latest.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    report = json.loads((tmp_path / "latest.json").read_text())
    rows = {(m["workload"], m["contender"]): m for m in report["measurements"]}
    for workload in ("mlp", "noop"):
        for contender in CONTENDERS:
            m = rows[(workload, contender)]
            assert m["status"] in ("ok", "skipped"), m
            if m["status"] == "ok":
                assert m["items"] > 0 and m["items_per_s"] > 0 and m["checked"] > 0, m
                assert m["caller_cpu_us"] > 0 and m["workers_cpu_us"] >= 0, m  # where the CPU went
            else:
                assert contender == "ray" and m["error"], m  # only Ray may be absent
    assert report["crash"] and not report["crash"][0]["error"]
    assert report["crash"][0]["recovery_serving_s"] and report["crash"][0]["checked"] > 0
    assert {m["workload"] for m in report["memory"]} == {"mlp", "noop"}
    assert report["targets"] and not report["leftovers"]

    table = (tmp_path / "latest.md").read_text()
    for contender in CONTENDERS:
        assert f"| {contender} |" in table, contender
    for contender in CONTENDERS:  # the printed table too
        assert f" {contender} " in proc.stdout, contender


@pytest.mark.slow
def test_latency_bench_smoke_run_writes_every_contender(tmp_path: Path) -> None:
    # `python -m bench.latency` on tiny cells: every default contender has a row of measured calls.
    out = tmp_path / "latency.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.latency", "--seconds", "0.2", "--concurrency", "1,2", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {(r["contender"], r["concurrency"]): r for r in json.loads(out.read_text())}
    assert set(rows) == {("pipe floor", 1)} | {
        (name, c) for name in ("in-process", "ProcessPoolExecutor", "batching floor (no engine)", "loky",
                               "Engine.infer", "Engine.infer_async")
        for c in (1, 2)}
    for row in rows.values():
        assert row["calls"] > 0 and row["p50_us"] > 0 and row["p999_us"] >= row["p50_us"], row
    assert "vs ProcessPoolExecutor" in proc.stdout
