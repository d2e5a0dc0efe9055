"""`slabpool` end to end: the real CLI in a subprocess, real workers, real signals.

Each input kind gives what Engine.map gives on the same items; a job killed (SIGKILL, SIGTERM,
SIGINT) mid-run resumes to the same output without computing a durable item again; a poison
item is listed, not fatal (exit 2, NaN row); bad arguments and a corrupt model exit 1 with one
line; the demo, inspect, doctor and bench run.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import psutil
import pytest

from slabpool import Engine
from slabpool.engine.job.store import read_output
from tests.reference import ort_run

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
CLI = [sys.executable, "-m", "slabpool.engine.job.cli"]
DEADLINE = 120  # only a hang reaches it


def slabpool(*args: Any, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *map(str, args)], cwd=cwd or REPO, env=ENV, capture_output=True,
                          text=True, errors="surrogateescape", timeout=DEADLINE)  # (a name of no UTF-8 text)


def engine_map(model: Path | None, items: list[Any], preprocess: str | None = None) -> list[dict[str, Any]]:
    """What the library gives for the same items (one item per task)."""
    with Engine(model, workers=1, preprocess=preprocess) as eng:
        return [r.outputs for r in eng.map(items)]


def stacked(outputs: list[dict[str, Any]], strip: bool) -> dict[str, np.ndarray]:
    return {k: np.stack([o[k][0] if strip else o[k] for o in outputs]) for k in outputs[0]}


def jsonl(path: Path, items: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(it) + "\n" for it in items))
    return path


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 16)).astype(np.float32)


# -- each input kind, against Engine.map ------------------------------------------------------------


def _npy(tmp: Path, m: SimpleNamespace) -> tuple[list[Any], Path, Path, str | None]:
    x = rows(12)
    np.save(tmp / "in.npy", x)
    return [x[i : i + 1] for i in range(12)], tmp / "in.npy", tmp / "out.npy", None


def _npz(tmp: Path, m: SimpleNamespace) -> tuple[list[Any], Path, Path, str | None]:
    x = rows(10)
    np.savez(tmp / "in.npz", x=x)
    return [{"x": x[i : i + 1]} for i in range(10)], tmp / "in.npz", tmp / "out.npz", None


def _folder(tmp: Path, m: SimpleNamespace) -> tuple[list[Any], Path, Path, str | None]:
    x = rows(7)
    (tmp / "items").mkdir()
    for i in range(7):  # one item per file, without the batch axis (.npy) or with it (.npz)
        if i % 2:
            np.save(tmp / "items" / f"{i:03d}.npy", x[i])
        else:
            np.savez(tmp / "items" / f"{i:03d}.npz", x=x[i : i + 1])
    return [x[i : i + 1] for i in range(7)], tmp / "items", tmp / "out", None


def _jsonl(tmp: Path, m: SimpleNamespace) -> tuple[list[Any], Path, Path, str | None]:
    items = [{"i": i, "x": r.tolist()} for i, r in enumerate(rows(9))]
    return items, jsonl(tmp / "in.jsonl", items), tmp / "out.npz", "tests.cli_hooks:feeds"


INPUT_KINDS: dict[str, Callable[[Path, SimpleNamespace], tuple[list[Any], Path, Path, str | None]]] = {
    "npy": _npy, "npz": _npz, "folder": _folder, "jsonl+preprocess": _jsonl,
}


@pytest.mark.parametrize("kind", INPUT_KINDS)
def test_input_kinds_match_engine_map(kind: str, tmp_path: Path, models: SimpleNamespace) -> None:
    items, src, out, pre = INPUT_KINDS[kind](tmp_path, models)
    p = slabpool("run", models.mlp, src, "-o", out, "--workers", 2,
                 *(["--preprocess", pre] if pre else []))
    assert p.returncode == 0, p.stderr
    if kind in ("npy", "npz"):  # rows go as blocks: one block here (fewer rows than the first, probe block)
        feeds = {"x": np.concatenate([it["x"] if isinstance(it, dict) else it for it in items])}
        want = ort_run(models.mlp, feeds)
    else:
        want = stacked(engine_map(models.mlp, items, pre), strip=True)
    if out.suffix == ".npy":
        assert "first of 2" in p.stdout  # a .npy OUTPUT keeps the first output, and says so
        got = {"probs": np.load(out)}
    elif out.suffix == ".npz":
        with np.load(out) as z:
            got = dict(z)
    else:
        got = read_output(out)
        assert {"manifest.json", "journal.jsonl", "report.json", "failures.jsonl"} <= {p.name for p in out.iterdir()}
    for name, arr in got.items():
        np.testing.assert_array_equal(arr, want[name])
    report = json.loads(((out if out.is_dir() else Path(f"{out}.parts")) / "report.json").read_text())
    assert report["items"] == len(items) and report["failed"] == 0 and report["complete"]


def test_model_less_text_lines(tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_text("1\n2.5\n\n-3\n")  # blank lines are not items
    p = slabpool("run", tmp_path / "in.txt", "-o", tmp_path / "out.npy", "--workers", 2,
                 "--preprocess", "tests.cli_hooks:square")
    assert p.returncode == 0, p.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), [[1, 1], [2.5, 6.25], [-3, 9]])


# -- failures are listed, not fatal ------------------------------------------------------------------


def test_poison_and_failing_items_are_listed(tmp_path: Path, models: SimpleNamespace) -> None:
    x = rows(8)
    items = [{"i": i, "x": r.tolist()} for i, r in enumerate(x)]
    marked = [dict(it, poison=1) if it["i"] == 3 else dict(it, bad=1) if it["i"] == 5 else it for it in items]
    marked = [dict(it, sleep=0.1) for it in marked]  # >= 0.4 s of work: progress lines at 0.05 s
    out = tmp_path / "out.npy"
    p = slabpool("run", models.mlp, jsonl(tmp_path / "in.jsonl", marked), "-o", out, "--workers", 2,
                 "--preprocess", "tests.cli_hooks:feeds", "--max-attempts", 2, "--log-every", 0.05)
    assert p.returncode == 2, p.stderr
    failures = [json.loads(ln) for ln in Path(f"{out}.parts/failures.jsonl").read_text().splitlines()]
    assert [(f["index"], f["error"], f["attempts"]) for f in failures] == [
        (3, "PoisonTask", 2), (5, "SessionRunError", 1)]
    got = np.load(out)
    assert np.isnan(got[[3, 5]]).all()
    good = [i for i in range(8) if i not in (3, 5)]
    want = stacked(engine_map(models.mlp, [items[i] for i in good], "tests.cli_hooks:feeds"), strip=True)
    np.testing.assert_array_equal(got[good], want["probs"])
    # not a terminal: plain progress lines, periodic, the last one complete; no bar
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("slabpool: progress:")]
    assert len(lines) >= 2 and "8/8 items" in lines[-1] and "failed 2" in lines[-1], p.stderr
    assert "\r" not in p.stderr
    report = json.loads(Path(f"{out}.parts/report.json").read_text())
    assert report["failed"] == 2 and report["restarts"] >= 2 and report["exit_status"] == 2


# -- resume after an interruption ------------------------------------------------------------------


def durable_indexes(parts: Path) -> set[int]:
    """What the journal says is durable, counting only entries whose shard is on disk."""
    done: set[int] = set()
    journal = parts / "journal.jsonl"
    for line in journal.read_text().splitlines() if journal.exists() else []:
        try:
            e = json.loads(line)
        except ValueError:
            continue  # a torn last line
        if e["shard"] is None or (parts / "shards" / e["shard"]).exists():
            done.update(i for a, b in e["ranges"] for i in range(a, b))
    return done


def wait_until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not cond():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "status"), [(signal.SIGKILL, -9), (signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_resume_after_interrupt(signum: int, status: int, tmp_path: Path, models: SimpleNamespace) -> None:
    # more items than the job holds accepted at once (its window): what it finishes after
    # the signal cannot be all of them (at 60, SIGINT's drain once made every item durable)
    n = 200
    log = tmp_path / "computed.log"
    items = [{"i": i, "x": r.tolist(), "log": str(log), "sleep": 0.03} for i, r in enumerate(rows(n))]
    src, out = jsonl(tmp_path / "in.jsonl", items), tmp_path / "out.npy"
    parts = Path(f"{out}.parts")
    args = [*CLI, "run", models.mlp, src, "-o", out, "--workers", 2, "--preprocess", "tests.cli_hooks:feeds",
            "--durable-every", 0.1]
    cli = subprocess.Popen(list(map(str, args)), cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: len(durable_indexes(parts)) >= 5, "a first shard became durable")
        assert cli.poll() is None, "the job ended before it could be interrupted"
        workers = psutil.Process(cli.pid).children(recursive=True)
        cli.send_signal(signum)
        _, err = cli.communicate(timeout=DEADLINE)
    finally:
        cli.kill()
    assert cli.returncode == status, err
    _, alive = psutil.wait_procs(workers, timeout=20)  # they exit on their own when it dies
    assert not alive, f"workers outlived the CLI: {alive}"
    if signum != signal.SIGKILL:
        assert "Resume with: slabpool run" in err
    durable = durable_indexes(parts)
    assert 0 < len(durable) < n
    before = len(log.read_text().splitlines())

    p = slabpool(*args[len(CLI):], "--resume")
    assert p.returncode == 0, p.stderr
    assert f"resuming: {len(durable)} of {n}" in p.stderr
    again = [int(s) for s in log.read_text().splitlines()[before:]]
    assert not durable & set(again), "durable items were computed again"
    assert set(again) | durable == set(range(n))
    plain = [{k: v for k, v in it.items() if k != "log"} for it in items]
    want = stacked(engine_map(models.mlp, plain, "tests.cli_hooks:feeds"), strip=True)
    np.testing.assert_array_equal(np.load(out), want["probs"])


def test_torn_shard_is_not_read_as_done(tmp_path: Path, models: SimpleNamespace) -> None:
    x = rows(6)
    np.save(tmp_path / "in.npy", x)
    out = tmp_path / "res"
    assert slabpool("run", models.mlp, tmp_path / "in.npy", "-o", out, "--workers", 1).returncode == 0
    want = read_output(out)
    shard = next((out / "shards").iterdir())
    shard.write_bytes(shard.read_bytes()[:-7])  # torn: same name, wrong bytes
    with (out / "journal.jsonl").open("a") as j:
        j.write('{"v": 1, "shard": "shard-0000')  # and a torn journal line
    p = slabpool("run", models.mlp, tmp_path / "in.npy", "-o", out, "--workers", 1)
    assert p.returncode == 0, p.stderr
    assert "failed validation" in p.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["computed_this_run"] == 6
    for k, v in read_output(out).items():
        np.testing.assert_array_equal(v, want[k])


# -- the job cannot run: exit 1, one line ----------------------------------------------------------


BAD_RUNS: list[tuple[str, Callable[[Path, SimpleNamespace], list[Any]], str]] = [
    ("no input", lambda t, m: ["run", m.mlp], "missing INPUT"),
    ("no output", lambda t, m: ["run", m.mlp, t / "in.npy"], "missing -o OUTPUT"),
    ("missing model", lambda t, m: ["run", t / "nope.onnx", t / "in.npy", "-o", t / "o.npy"], "model not found"),
    ("missing input", lambda t, m: ["run", m.mlp, t / "nope.npy", "-o", t / "o.npy"], "input not found"),
    ("text without preprocess", lambda t, m: ["run", m.mlp, t / "in.txt", "-o", t / "o.npy"], "needs --preprocess"),
    ("zero workers", lambda t, m: ["run", m.mlp, t / "in.npy", "-o", t / "o.npy", "--workers", 0], "positive"),
    ("unknown command", lambda t, m: ["frobnicate"], "invalid choice"),
    ("unknown hook", lambda t, m: ["run", m.mlp, t / "in.npy", "-o", t / "o.npy", "--preprocess", "tests.nope:f"],
     "cannot start"),
    ("corrupt model", lambda t, m: ["run", t / "corrupt.onnx", t / "in.npy", "-o", t / "o.npy"],
     "the model failed to load"),
    ("other job in OUTPUT", lambda t, m: ["run", m.mlp, t / "in.npy", "-o", t / "used"], "different job"),
]


@pytest.mark.parametrize(("case", "argv", "reason"), BAD_RUNS, ids=[c[0] for c in BAD_RUNS])
def test_cannot_run_exits_1_with_one_line(
    case: str, argv: Callable[[Path, SimpleNamespace], list[Any]], reason: str, tmp_path: Path,
    models: SimpleNamespace,
) -> None:
    np.save(tmp_path / "in.npy", rows(3))
    (tmp_path / "in.txt").write_text("a\n")
    (tmp_path / "corrupt.onnx").write_bytes(b"\x08\x07 this is not a model" * 10)
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "manifest.json").write_text('{"job": {"other": 1}}')
    p = slabpool(*argv(tmp_path, models))
    assert p.returncode == 1, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and reason in lines[0], p.stderr
    assert "Traceback" not in p.stderr


def test_one_writer_per_output(tmp_path: Path, models: SimpleNamespace) -> None:
    np.save(tmp_path / "in.npy", rows(3))
    (tmp_path / "out").mkdir()
    fd = os.open(tmp_path / "out" / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as a running job holds it
        p = slabpool("run", models.mlp, tmp_path / "in.npy", "-o", tmp_path / "out")
    finally:
        os.close(fd)
    assert p.returncode == 1 and "another slabpool run is writing" in p.stderr, p.stderr


# -- the demo and the companion commands -----------------------------------------------------------


def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("slabpool")
    cmd = [str(script), "run"] if script.exists() else [*CLI, "run"]
    p = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=DEADLINE)
    assert p.returncode == 0, p.stderr
    out = tmp_path / "slabpool-demo" / "outputs.npy"
    assert np.load(out).shape == (512, 10)
    assert "throughput" in p.stdout and str(out) in p.stdout


@pytest.mark.parametrize(("argv", "expected"), [
    (lambda m: ["inspect", m.mlp], ["x", "float32", "[?, 16]", "dynamic axes: [0]", "probs", "CPUExecutionProvider"]),
    (lambda m: ["inspect", m.tfl_mlp], ["litert", "dynamic axes"]),
    (lambda m: ["doctor"], ["/dev/shm", "MemAvailable", "usable", "numpy", "onnxruntime", "ai-edge-litert"]),
    (lambda m: ["bench", m.mlp, "--items", 32, "--workers", "1,2"], ["items/s", "1.00x"]),
    (lambda m: ["--help"], ["example", "run"]),
    (lambda m: ["run", "--help"], ["examples:", "--resume", "Exit status"]),
], ids=["inspect-onnx", "inspect-tflite", "doctor", "bench", "help", "run-help"])
def test_companion_commands(argv: Callable[[SimpleNamespace], list[Any]], expected: list[str],
                            models: SimpleNamespace) -> None:
    p = slabpool(*argv(models))
    assert p.returncode == 0, p.stderr
    for text in expected:
        assert text in p.stdout, p.stdout
