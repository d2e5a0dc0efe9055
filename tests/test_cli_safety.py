"""CLI data safety (issue 13, item 10): the job never destroys or invents data.

-o equal to INPUT (or inside an INPUT folder) is refused; an OUTPUT that exists and no job made
is refused without --overwrite (a rerun of a job's own OUTPUT resumes); outputs named like
np.savez's own keywords are stored; a journal line that claims rows its shard does not hold is
an error on resume, never NaN rows with exit 0; the resume hint never repeats --overwrite;
Ctrl-C at any moment (a storm of them) ends in 130 without a traceback; a wrong-dtype INPUT is
one error up front; --resume with --overwrite is refused; a full disk (a real tmpfs) names the
file and --resume completes the job once space is freed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from slabpool.engine.job.store import read_output, savez, write_atomic
from tests.models.onnx_models import mlp_reference
from tests.test_cli import CLI, DEADLINE, ENV, REPO, durable_indexes, jsonl, rows, slabpool, wait_until


def one_line(p: subprocess.CompletedProcess[str], text: str) -> None:
    assert p.returncode == 1, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and text in lines[0] and "Traceback" not in p.stderr, p.stderr


def test_output_equal_to_input_is_refused(tmp_path: Path, models: SimpleNamespace) -> None:
    x = rows(4)
    np.save(tmp_path / "in.npy", x)
    one_line(slabpool("run", models.mlp, tmp_path / "in.npy", "-o", tmp_path / "in.npy"), "is the INPUT")
    np.testing.assert_array_equal(np.load(tmp_path / "in.npy"), x)  # untouched
    one_line(slabpool("run", models.mlp, tmp_path / "in.npy", "-o", tmp_path / ".." / tmp_path.name / "in.npy"),
             "is the INPUT")
    one_line(slabpool("run", models.mlp, tmp_path / "in.npy", "-o", models.mlp), "is the MODEL")
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.txt").write_text("1\n")
    one_line(slabpool("run", tmp_path / "imgs", "-o", tmp_path / "imgs" / "out.npy", "--preprocess",
                      "tests.cli_hooks:square"), "lies inside the INPUT folder")
    assert sorted(p.name for p in (tmp_path / "imgs").iterdir()) == ["a.txt"]


def test_an_existing_output_no_job_made_is_refused(tmp_path: Path, models: SimpleNamespace) -> None:
    """A file (or a folder of files) at -o that no job wrote is never replaced without a word:
    one line naming it and --overwrite, exit 1, the bytes untouched; --overwrite replaces it."""
    np.save(tmp_path / "in.npy", rows(4))
    run = ("run", models.mlp, tmp_path / "in.npy", "--workers", 1)
    np.save(tmp_path / "precious.npy", np.arange(3))
    for name in ("precious.npy", "precious.npz", "precious.parquet"):
        out = tmp_path / name
        if not out.exists():
            out.write_bytes(b"precious")
        before = out.read_bytes()
        for again in ((), ("--resume",)):
            p = slabpool(*run, "-o", out, *again)
            one_line(p, f"OUTPUT {out} exists and no slabpool job wrote it")
            assert "pass --overwrite to replace it" in p.stderr
            assert out.read_bytes() == before and not Path(f"{out}.parts").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "report.json").write_text("mine\n")
    one_line(slabpool(*run, "-o", mine), f"OUTPUT {mine} is a folder of other files")
    assert [p.name for p in mine.iterdir()] == ["report.json"] and (mine / "report.json").read_text() == "mine\n"
    one_line(slabpool(*run, "-o", mine / "report.json"), "is a file, not a folder")
    (tmp_path / "dir.npz").mkdir()
    one_line(slabpool(*run, "-o", tmp_path / "dir.npz", "--overwrite"), "is a folder, not a .npz file")
    p = slabpool(*run, "-o", tmp_path / "precious.npy", "--overwrite")
    assert p.returncode == 0, p.stderr
    assert np.load(tmp_path / "precious.npy").shape == (4, 8)


def test_a_rerun_of_a_job_on_its_own_output_is_not_refused(tmp_path: Path, models: SimpleNamespace) -> None:
    """OUT exists because this job wrote it: the same command (or --resume) finds every item
    durable; --overwrite computes them again. An empty folder holds nothing to lose."""
    np.save(tmp_path / "in.npy", rows(4))
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "o.npy", tmp_path / "o.npz", tmp_path / "empty"):
        run = ("run", models.mlp, tmp_path / "in.npy", "-o", out, "--workers", 1)
        assert slabpool(*run).returncode == 0
        for again in ((), ("--resume",)):
            p = slabpool(*run, *again)
            assert p.returncode == 0 and "all already durable" in p.stdout, p.stdout + p.stderr
        p = slabpool(*run, "--overwrite")
        assert p.returncode == 0 and "computed 4 this run" in p.stdout, p.stdout + p.stderr
        parts = out if out.is_dir() else Path(f"{out}.parts")
        assert json.loads((parts / "report.json").read_text())["computed_this_run"] == 4


def test_outputs_named_like_savez_keywords(tmp_path: Path, models: SimpleNamespace) -> None:
    x = rows(5)
    np.save(tmp_path / "in.npy", x)
    for out in (tmp_path / "o.npz", tmp_path / "folder"):
        p = slabpool("run", models.mlp, tmp_path / "in.npy", "-o", out, "--workers", 1,
                     "--postprocess", "tests.cli_hooks:named_like_savez")
        assert p.returncode == 0, p.stderr
    with np.load(tmp_path / "o.npz") as z:
        got = dict(z)
    for arrays in (got, read_output(tmp_path / "folder")):
        assert sorted(arrays) == ["allow_pickle", "file"]
        assert arrays["file"].shape == (5, 8) and arrays["allow_pickle"].shape == (5, 8)
        np.testing.assert_allclose(arrays["file"].sum(axis=1), 1.0, rtol=1e-5)  # probs


def test_savez_writes_any_name_as_numpy_reads_it(tmp_path: Path) -> None:
    arrays = {"file": np.arange(3), "allow_pickle": np.ones((2, 2), np.float32), "a.b": np.zeros(0)}
    with open(tmp_path / "z.npz", "wb") as f:
        savez(f, arrays)
    with np.load(tmp_path / "z.npz") as z:
        assert sorted(z.files) == sorted(arrays)
        for k, v in arrays.items():
            np.testing.assert_array_equal(z[k], v)
            assert z[k].dtype == v.dtype
    assert all(i.compress_type == zipfile.ZIP_STORED for i in zipfile.ZipFile(tmp_path / "z.npz").infolist())


def test_journal_claiming_rows_no_shard_holds_is_an_error(tmp_path: Path, models: SimpleNamespace) -> None:
    np.save(tmp_path / "in.npy", rows(6))
    out = tmp_path / "res"
    assert slabpool("run", models.mlp, tmp_path / "in.npy", "-o", out, "--workers", 1).returncode == 0
    journal = out / "journal.jsonl"
    entry = json.loads(journal.read_text().splitlines()[0])
    shard = out / "shards" / entry["shard"]
    with np.load(shard) as z:
        kept = {k: z[k][:3] for k in z.files}  # a consistent shard of rows 0-2 ...
    with open(shard, "wb") as f:
        savez(f, kept)
    data = shard.read_bytes()
    entry.update(size=len(data), digest=hashlib.blake2b(data, digest_size=16).hexdigest())
    journal.write_text(json.dumps(entry) + "\n")  # ... under a valid line that still claims 0-5
    one_line(slabpool("run", models.mlp, tmp_path / "in.npy", "-o", out, "--resume"), "claims item(s) [3, 4, 5]")
    # a line with no shard and no failures claims rows out of thin air
    journal.write_text(json.dumps({"v": 1, "shard": None, "size": 0, "digest": "", "ranges": [[0, 6]],
                                   "failures": []}) + "\n")
    one_line(slabpool("run", models.mlp, tmp_path / "in.npy", "-o", out, "--resume"), "claims item(s) [0, 1, 2")


def slow_job_with_durable_items(tmp_path: Path, models: SimpleNamespace, n: int) -> subprocess.Popen[str]:
    """`slabpool run ... --overwrite` over n slow JSONL items, returned once 3 items are durable."""
    items = [{"i": i, "x": r.tolist(), "sleep": 0.03} for i, r in enumerate(rows(n))]
    out = tmp_path / "o.npy"
    args = [*CLI, "run", models.mlp, jsonl(tmp_path / "in.jsonl", items), "-o", out, "--workers", 2,
            "--preprocess", "tests.cli_hooks:feeds", "--durable-every", 0.05, "--overwrite"]
    cli = subprocess.Popen(list(map(str, args)), cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: len(durable_indexes(Path(f"{out}.parts"))) >= 3, "a first shard became durable")
    except BaseException:
        cli.kill()
        raise
    return cli


def test_ctrl_c_storm_exits_130_and_the_hint_drops_overwrite(tmp_path: Path, models: SimpleNamespace) -> None:
    """SIGINT every 20 ms from the first durable shard until the CLI exits: whichever phase each
    one lands in (drain, commit, close, final files), the exit is 130 without a traceback."""
    cli = slow_job_with_durable_items(tmp_path, models, 80)
    try:
        deadline = time.monotonic() + DEADLINE
        while cli.poll() is None and time.monotonic() < deadline:
            cli.send_signal(signal.SIGINT)
            time.sleep(0.02)
        _, err = cli.communicate(timeout=DEADLINE)
    finally:
        cli.kill()
    assert cli.returncode == 130, err
    assert "Traceback" not in err, err
    hint = next((ln for ln in err.splitlines() if "Resume with:" in ln), None)
    if hint is not None:  # printed when the run got to its end (not when stopped at start-up)
        assert "--overwrite" not in hint and "slabpool run" in hint, hint


def test_resume_hint_after_one_ctrl_c_drops_overwrite(tmp_path: Path, models: SimpleNamespace) -> None:
    cli = slow_job_with_durable_items(tmp_path, models, 60)
    try:
        cli.send_signal(signal.SIGINT)
        _, err = cli.communicate(timeout=DEADLINE)
    finally:
        cli.kill()
    assert cli.returncode == 130, err
    hint = next(ln for ln in err.splitlines() if "Resume with:" in ln)
    resume = hint.split("Resume with: ", 1)[1]
    assert "--overwrite" not in resume and "--preprocess tests.cli_hooks:feeds" in resume
    p = slabpool(*resume.split()[1:])  # the hint, as printed, resumes the job
    assert p.returncode == 0, p.stderr
    assert "resuming:" in p.stderr


def test_wrong_dtype_is_one_error_up_front(tmp_path: Path, models: SimpleNamespace) -> None:
    np.save(tmp_path / "in.npy", rows(300).astype(np.float64))
    out = tmp_path / "o.npy"
    p = slabpool("run", models.mlp, tmp_path / "in.npy", "-o", out, "--workers", 2)
    one_line(p, "does not fit the model")
    assert "expected dtype <f4 (float32), got <f8 (float64)" in p.stderr
    # the job never ran: its folder goes, and the rerun with the input fixed is not "a different
    # job" (was: refused so, a manifest left behind by a job that computed nothing)
    assert not Path(f"{out}.parts").exists() and not out.exists()
    np.save(tmp_path / "in.npy", rows(300))
    p = slabpool("run", models.mlp, tmp_path / "in.npy", "-o", out, "--workers", 2)
    assert p.returncode == 0, p.stderr
    np.testing.assert_allclose(read_probs(out), mlp_reference(rows(300))["probs"], rtol=1e-5, atol=1e-6)
    np.savez(tmp_path / "in.npz", x=rows(3).astype(np.float16))  # named inputs too
    one_line(slabpool("run", models.mlp, tmp_path / "in.npz", "-o", tmp_path / "o2.npz", "--workers", 1),
             "got <f2 (float16)")


def test_resume_and_overwrite_together_are_refused(tmp_path: Path, models: SimpleNamespace) -> None:
    np.save(tmp_path / "in.npy", rows(3))
    one_line(slabpool("run", models.mlp, tmp_path / "in.npy", "-o", tmp_path / "o.npy", "--resume", "--overwrite"),
             "not allowed with argument")


# -- a full disk: a real tmpfs, filled -------------------------------------------------------------


@contextlib.contextmanager
def small_disk(folder: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted on `folder` (skips where mounting is not permitted), unmounted
    after, whatever happened."""
    folder.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root and mount(8)")
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")
    try:
        yield folder
    finally:
        if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", str(folder)], check=True)


def fill(disk: Path, leave: int) -> Path:
    """A ballast file that leaves about `leave` bytes free on `disk`."""
    ballast = disk / "ballast"
    free = shutil.disk_usage(disk).free
    with open(ballast, "wb") as f:
        f.write(b"\0" * max(free - leave, 0))
    return ballast


def test_write_atomic_reports_a_full_disk_once_naming_the_file(tmp_path: Path) -> None:
    """A buffered write (a .npz) that runs out of space: closing the file fails the same way
    again, and that bare "[Errno 28]" must not replace the error that names the file."""
    with small_disk(tmp_path / "disk", "1m") as disk:
        path = disk / "a.npz"
        with pytest.raises(OSError, match=rf"could not write {path}: no space left on device") as info:
            write_atomic(path, lambda f: savez(f, {"x": np.zeros(1 << 19, np.float32)}))
        assert "bytes free there" in str(info.value)
        assert not list(disk.iterdir())  # no torn file either


def test_write_atomic_called_off_before_the_rename_leaves_the_old_file(tmp_path: Path) -> None:
    """`ready` raising once the file is whole (the job's check for a signal that came during
    its final write): the old file stays, and no temporary file is left beside it. Was: a
    Ctrl-C during a Parquet OUTPUT's last row group wrote OUTPUT and exited 130 anyway."""
    path = tmp_path / "o.npy"
    np.save(path, np.zeros(3))

    def called_off() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomic(path, lambda f: np.save(f, np.ones(3)), ready=called_off)
    assert np.load(path).tolist() == [0, 0, 0] and sorted(p.name for p in tmp_path.iterdir()) == ["o.npy"]


def test_a_dead_runs_temporary_file_beside_output_is_removed(tmp_path: Path, models: SimpleNamespace) -> None:
    """A run SIGKILLed during its final write leaves `.OUTPUT.tmp-PID`; the next run's own has
    another pid, so it used to stay for good. Now the temporary files of processes that are
    gone go when the next one is made; a live process's is left alone."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    for suffix in (".npz", ".parquet", ".npy"):
        out = tmp_path / f"o{suffix}"
        stale, live = tmp_path / f".{out.name}.tmp-{dead.pid}", tmp_path / f".{out.name}.tmp-{os.getppid()}"
        stale.write_bytes(b"torn"), live.write_bytes(b"someone's")
        np.save(tmp_path / "in.npy", rows(5))
        p = slabpool("run", models.mlp, tmp_path / "in.npy", "-o", out, "--workers", 1)
        assert p.returncode == 0, p.stderr
        assert out.exists() and not stale.exists() and live.read_bytes() == b"someone's"
        live.unlink()


def read_probs(out: Path) -> np.ndarray:
    if out.suffix == ".npy":
        return np.load(out)
    if out.suffix == ".npz":
        with np.load(out) as z:
            return z["probs"]
    if out.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(out).column("probs").combine_chunks().flatten().to_numpy().reshape(-1, 8)
    return read_output(out)["probs"]


@pytest.mark.parametrize("name", ["o.npy", "o.npz", "folder", "o.parquet"])
def test_a_full_disk_names_the_file_and_resume_completes(tmp_path: Path, models: SimpleNamespace, name: str) -> None:
    """The OUTPUT's disk fills up: one line that says so, names the file and says --resume;
    no temporary file stays. Once space is freed, --resume completes the same rows."""
    if name.endswith(".parquet"):
        pytest.importorskip("pyarrow")
    x = rows(100_000)  # 3.2 MB of probs, 6.4 MB with logits: more than the 1 MB left
    np.save(tmp_path / "in.npy", x)
    with small_disk(tmp_path / "disk", "32m") as disk:
        ballast = fill(disk, 1 << 20)
        out = disk / name
        run = ("run", models.mlp, tmp_path / "in.npy", "-o", out, "--workers", 1)
        p = slabpool(*run)
        one_line(p, "no space left on device")
        assert f"could not write {disk}/" in p.stderr and f"resume with: slabpool run {models.mlp}" in p.stderr
        assert "--resume" in p.stderr and "[Errno 28] No space left on device\n" not in p.stderr
        assert not list(disk.rglob(".*.tmp-*"))
        ballast.unlink()
        p = slabpool(*run, "--resume")
        assert p.returncode == 0, p.stderr
        np.testing.assert_allclose(read_probs(out), mlp_reference(x)["probs"], rtol=1e-5, atol=1e-6)
