"""Conventions a user brings from other tools: hook modules found in the current folder, a pipe
closed early is quiet, the runtimes' own chatter is silent unless asked for, a warning for more
workers than usable CPUs, `shutdown()` as on concurrent.futures executors.

The CLI runs as the installed `slabpool` command would: `python -m slabpool` from the user's
folder, with no PYTHONPATH pointing at that folder."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

from slabpool import Engine
from slabpool.engine.core.config import usable_cpus

REPO = Path(__file__).resolve().parent.parent
DEADLINE = 120  # only a hang reaches it


def cli(*args: object, cwd: Path, stdin: int | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", "slabpool", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=DEADLINE)


def test_a_hook_module_in_the_current_folder_is_found(tmp_path: Path, models) -> None:
    (tmp_path / "myhooks.py").write_text(textwrap.dedent("""
        import numpy as np

        def features(item):
            return {"x": np.full((1, 16), float(item["v"]), np.float32)}
    """))
    (tmp_path / "in.jsonl").write_text("".join(f'{{"v": {i}}}\n' for i in range(5)))
    out = cli("run", models.mlp, "in.jsonl", "-o", "out.npz", "--workers", "1",
              "--preprocess", "myhooks:features", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    with np.load(tmp_path / "out.npz") as z:
        assert z["logits"].shape[0] == 5


def test_a_missing_hook_module_says_where_it_looked(tmp_path: Path, models) -> None:
    (tmp_path / "in.jsonl").write_text('{"v": 1}\n')
    out = cli("run", models.mlp, "in.jsonl", "-o", "out.npz", "--preprocess", "nosuchmod:fn", cwd=tmp_path)
    assert out.returncode == 1
    assert "no module named 'nosuchmod'" in out.stderr and str(tmp_path) in out.stderr
    assert "PYTHONPATH" in out.stderr and "Traceback" not in out.stderr


def test_a_missing_hook_function_is_one_clear_line(tmp_path: Path, models) -> None:
    (tmp_path / "myhooks.py").write_text("def other(item):\n    return item\n")
    (tmp_path / "in.jsonl").write_text('{"v": 1}\n')
    out = cli("run", models.mlp, "in.jsonl", "-o", "out.npz", "--preprocess", "myhooks:features", cwd=tmp_path)
    assert out.returncode == 1
    assert "cannot import name 'features' from 'myhooks'" in out.stderr and "Traceback" not in out.stderr


def test_a_pipe_closed_early_is_quiet(tmp_path: Path, models) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    shell = f"{sys.executable} -m slabpool inspect {models.mlp} | head -c 1 >/dev/null; echo ${{PIPESTATUS[0]}}"
    out = subprocess.run(["bash", "-c", shell], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=DEADLINE)
    assert out.stderr == ""
    assert out.stdout.strip() in ("0", "141")  # 0: all was written before head left


def test_litert_chatter_is_silent_unless_verbose(tmp_path: Path, models) -> None:
    quiet = cli("inspect", models.tfl_mlp, cwd=tmp_path)
    assert quiet.returncode == 0, quiet.stderr
    assert "XNNPACK delegate" not in quiet.stderr and quiet.stderr == ""
    verbose = cli("--verbose", "inspect", models.tfl_mlp, cwd=tmp_path)
    assert verbose.returncode == 0, verbose.stderr
    assert "INFO slabpool.workers: litert: INFO: Created TensorFlow Lite XNNPACK delegate" in verbose.stderr


def test_doctor_says_what_it_could_not_read(tmp_path: Path) -> None:
    out = cli("doctor", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("cgroup memory")]
    assert "None" not in line


def test_more_workers_than_cpus_warns(models) -> None:
    too_many = usable_cpus() + 1
    with pytest.warns(UserWarning, match=rf"workers={too_many} but this process may use {usable_cpus()} CPUs"):
        eng = Engine(models.mlp, workers=too_many)
    eng.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Engine(models.mlp, workers=1).close()


def test_the_cli_prints_that_warning_as_one_line(tmp_path: Path, models) -> None:
    np.save(tmp_path / "in.npy", np.zeros((4, 16), np.float32))
    out = cli("run", models.mlp, "in.npy", "-o", "out.npy", "--workers", usable_cpus() + 1, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert f"slabpool: warning: workers={usable_cpus() + 1} but" in out.stderr
    assert "UserWarning" not in out.stderr


def test_shutdown_waits_for_every_task(models) -> None:
    eng = Engine(models.mlp, workers=1)
    futs = [eng.submit({"x": np.full((1, 16), i, np.float32)}) for i in range(8)]
    eng.shutdown()
    assert eng.state.name == "CLOSED"
    assert all(f.done() and f.result().outputs["logits"].shape[0] == 1 for f in futs)


def test_shutdown_cancel_futures_cancels_what_is_queued(models, tmp_path: Path) -> None:
    from slabpool import EngineClosed, TaskCancelled

    eng = Engine(models.mlp, workers=1, inflight_per_slot=1, preprocess="tests.hooks:gated")
    log, gate = tmp_path / "log", tmp_path / "gate"
    futs = [eng.submit({"x": np.full((1, 16), i, np.float32), "gate": str(gate), "log": str(log), "id": i})
            for i in range(6)]
    while not log.exists():  # task 0 runs (and waits at the gate); the rest are queued
        os.sched_yield()
    eng.shutdown(wait=False, cancel_futures=True)
    for f in futs[1:]:
        with pytest.raises(TaskCancelled):
            f.result(timeout=DEADLINE)
    with pytest.raises(EngineClosed, match=r"submit\(\) after close"):
        eng.submit({"x": np.zeros((1, 16), np.float32), "gate": str(gate)})
    gate.touch()
    assert futs[0].result(timeout=DEADLINE).outputs["logits"].shape[0] == 1
    eng.close()
    assert eng.state.name == "CLOSED" and log.read_text().split() == ["0"]


def test_shutdown_without_waiting_returns_and_still_finishes(models) -> None:
    eng = Engine(models.mlp, workers=1)
    futs = [eng.submit({"x": np.full((1, 16), i, np.float32)}) for i in range(8)]
    eng.shutdown(wait=False)
    assert all(f.result(timeout=DEADLINE).outputs["logits"].shape[0] == 1 for f in futs)
    eng.close()  # joins: nothing is left behind
    assert eng.state.name == "CLOSED"


def test_a_fully_resumed_run_says_there_was_nothing_to_compute(tmp_path: Path, models) -> None:
    np.save(tmp_path / "in.npy", np.random.default_rng(0).standard_normal((40, 16)).astype(np.float32))
    first = cli("run", models.mlp, "in.npy", "-o", "out.npy", "--workers", 1, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    again = cli("run", models.mlp, "in.npy", "-o", "out.npy", "--workers", 1, "--resume", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    lines = again.stdout.splitlines()
    assert lines[0] == "items 40: all already durable, nothing to compute" and lines[-1] == "output: out.npy"
    assert "inf" not in again.stderr and "0 workers" not in again.stdout


def test_ray_engine_without_ray_says_what_to_install() -> None:
    code = ("import sys\nsys.modules['ray'] = None  # as if Ray were not installed\nimport slabpool\n"
            "try:\n    slabpool.RayEngine\nexcept ModuleNotFoundError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "pip install 'slabpool[ray]'" in out.stdout, out
