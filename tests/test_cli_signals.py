"""Ctrl-C and SIGTERM at every stage of `slabpool run` (issue 19, item 10): real CLI processes,
real signals, each delivered while the job is held at a chosen stage (SLABPOOL_TEST_HOLD,
engine.job.signals: the job waits on a fifo there until the test releases it), never by
timing. The first signal stops the job cleanly there: exit 130/143, one message, no
traceback, nothing durable lost; a rerun (--resume where a job was begun) ends with output
byte-identical to an uninterrupted run. A second signal exits at once, even while held.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from slabpool.engine.job.signals import HOLD
from slabpool.engine.job.store import read_output
from tests.test_cli import CLI, DEADLINE, ENV, REPO, jsonl, rows, slabpool, wait_until


class Held:
    """A CLI started with SLABPOOL_TEST_HOLD=STAGE@FOLDER, and the means to release it."""

    def __init__(self, tmp: Path, stage: str, args: list[Any]) -> None:
        self.folder = tmp / f"hold-{stage.replace(':', '-')}"
        self.folder.mkdir()
        os.mkfifo(self.folder / "go")
        env = {**ENV, HOLD: f"{stage}@{self.folder}"}
        self.cli = subprocess.Popen([*CLI, *map(str, args)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
        try:
            wait_until(lambda: (self.folder / "held").exists() or self.cli.poll() is not None, f"held at {stage}")
            assert self.cli.poll() is None, self.cli.communicate()
            assert (self.folder / "held").read_text().startswith(stage)
        except BaseException:
            self.cli.kill()  # and reaped: a failed start leaves no process (nor zombie) behind
            self.cli.communicate()
            raise

    def release(self) -> None:
        """Open the fifo for writing: the held job's open returns. ENXIO: its reader is not
        there yet (it writes `held` first), or no longer (it exited): retried until it is, or
        until the job has exited."""
        while True:
            try:
                os.close(os.open(self.folder / "go", os.O_WRONLY | os.O_NONBLOCK))
                return
            except OSError as exc:
                if exc.errno != errno.ENXIO or self.cli.poll() is not None:
                    return
            time.sleep(0.01)

    def finish(self) -> tuple[int, str, str]:
        try:
            out, err = self.cli.communicate(timeout=DEADLINE)
        finally:
            self.cli.kill()
        return self.cli.returncode, out, err


# -- the jobs: each input kind with its OUTPUT, read back as bytes -----------------------------------


Job = Callable[[Path, SimpleNamespace], tuple[list[Any], Path]]


def _npy_blocks(tmp: Path, m: SimpleNamespace) -> tuple[list[Any], Path]:
    np.save(tmp / "in.npy", rows(3000, seed=1))
    return [m.mlp, tmp / "in.npy", "--batch-size", 100], tmp / "o.npy"


def _jsonl_chunks(tmp: Path, m: SimpleNamespace) -> tuple[list[Any], Path]:
    items = [{"i": i, "x": r.tolist()} for i, r in enumerate(rows(400, seed=2))]
    return [m.mlp, jsonl(tmp / "in.jsonl", items), "--preprocess", "tests.cli_hooks:feeds"], tmp / "o.npz"


def _parquet_table(tmp: Path, m: SimpleNamespace) -> tuple[list[Any], Path]:
    x = rows(2000, seed=3)
    t = pa.table({"id": list(range(2000)), "x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 16)})
    pq.write_table(t, tmp / "t.parquet", row_group_size=300)
    return [m.mlp, tmp / "t.parquet", "--keep", "id", "--batch-size", 64], tmp / "o.parquet"


def _csv_batched(tmp: Path, m: SimpleNamespace) -> tuple[list[Any], Path]:
    pacsv.write_csv(pa.table({"i": list(range(900))}), tmp / "in.csv")
    return [tmp / "in.csv", "--preprocess", "tests.cli_hooks:zeros_batch", "--batch-size", 32], tmp / "o.npy"


def _folder(tmp: Path, m: SimpleNamespace) -> tuple[list[Any], Path]:
    (tmp / "files").mkdir()
    for i in range(120):
        (tmp / "files" / f"{i}.txt").write_text("x")
    return [tmp / "files", "--preprocess", "tests.cli_hooks:zeros_batch", "--batch-size", 8], tmp / "res"


def output_bytes(out: Path) -> Any:
    if out.is_dir():
        return {k: v.tobytes() for k, v in read_output(out).items()}
    return out.read_bytes()


def args_of(job: Job, tmp: Path, models: SimpleNamespace, name: str) -> tuple[list[Any], Path]:
    head, out = job(tmp, models)
    out = out.with_name(name + out.suffix)
    return ["run", *head, "-o", out, "--workers", 2, "--durable-every", 0.001], out


# (stage, signal, job): every stage under both signals, each input kind somewhere
CASES = [
    ("imports", signal.SIGINT, _jsonl_chunks), ("imports", signal.SIGTERM, _npy_blocks),
    ("open", signal.SIGINT, _parquet_table), ("open", signal.SIGTERM, _csv_batched),
    ("engine", signal.SIGINT, _npy_blocks), ("engine", signal.SIGTERM, _folder),
    ("commit:1", signal.SIGINT, _csv_batched), ("commit:1", signal.SIGTERM, _jsonl_chunks),
    ("final", signal.SIGINT, _folder), ("final", signal.SIGTERM, _parquet_table),
    ("final", signal.SIGINT, _npy_blocks), ("commit:2", signal.SIGTERM, _parquet_table),
]


@pytest.mark.parametrize(("stage", "signum", "job"), CASES,
                         ids=[f"{s}-{signal.Signals(g).name}-{j.__name__[1:]}" for s, g, j in CASES])
def test_a_first_signal_at_each_stage_stops_cleanly_and_resumes(
    stage: str, signum: int, job: Job, tmp_path: Path, models: SimpleNamespace,
) -> None:
    args, out = args_of(job, tmp_path, models, "o")
    held = Held(tmp_path, stage, args)
    held.cli.send_signal(signum)
    held.release()
    status, stdout, err = held.finish()
    assert status == 128 + signum, (stdout, err)
    assert "Traceback" not in err and "interrupted" in err and f"{signal.Signals(signum).name}: stopping cleanly" in err, err
    begun = stage != "imports"
    if begun:
        assert "Resume with: slabpool run" in err, err
    else:
        assert "nothing was written" in err and not Path(f"{out}.parts").exists() and not out.exists(), err
    if stage == "final" and out.suffix:
        assert not out.exists(), "OUTPUT written after the signal"

    p = slabpool(*args, *(["--resume"] if begun else []))
    assert p.returncode == 0, p.stderr
    (tmp_path / "ref").mkdir()
    ref_args, ref = args_of(job, tmp_path / "ref", models, "o")
    q = slabpool(*ref_args)
    assert q.returncode == 0, q.stderr
    assert output_bytes(out) == output_bytes(ref)


@pytest.mark.parametrize("stage", ["imports", "open", "engine", "commit:1", "final"])
def test_a_second_sigint_exits_at_once(stage: str, tmp_path: Path, models: SimpleNamespace) -> None:
    """Two signals while the job is held (never released): it exits by the second, 130, and a
    rerun completes the job."""
    args, out = args_of(_jsonl_chunks, tmp_path, models, "o")
    held = Held(tmp_path, stage, args)
    held.cli.send_signal(signal.SIGINT)
    assert held.cli.stderr is not None
    said = [held.cli.stderr.readline()]  # the first is handled (and said) before the second is sent:
    while "stopping cleanly" not in said[-1] and said[-1]:  # two at once would be one to the kernel
        said.append(held.cli.stderr.readline())
    held.cli.send_signal(signal.SIGINT)
    status, stdout, err = held.finish()
    err = "".join(said) + err
    assert status == 130 and "Traceback" not in err, (stdout, err)
    assert "stopping now" in err, err
    p = slabpool(*args)
    assert p.returncode == 0, p.stderr
    with np.load(out) as z:
        assert len(z["probs"]) == 400 and not np.isnan(z["probs"]).any()


def test_ctrl_c_stops_a_companion_command_at_once(tmp_path: Path, models: SimpleNamespace) -> None:
    """Only `run` drains on a first signal; `bench` (no job to keep) stops on the first one."""
    cli = subprocess.Popen([*CLI, "bench", str(models.slow), "--items", "100000", "--workers", "1"], cwd=REPO,
                           env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert cli.stdout is not None
        assert "workers" in cli.stdout.readline()  # the header: the command runs its loop now
        cli.send_signal(signal.SIGINT)
        _, err = cli.communicate(timeout=DEADLINE)
    finally:
        cli.kill()
    assert cli.returncode == 130 and "interrupted" in err and "Traceback" not in err, err
