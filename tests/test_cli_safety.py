"""CLI data safety (issue 13, item 10): the job never destroys or invents data.

-o equal to INPUT (or inside an INPUT folder) is refused; outputs named like np.savez's own
keywords are stored; a journal line that claims rows its shard does not hold is an error on
resume, never NaN rows with exit 0; the resume hint never repeats --overwrite; Ctrl-C at any
moment (a storm of them) ends in 130 without a traceback; a wrong-dtype INPUT is one error up
front; --resume with --overwrite is refused.
"""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from slabpool.engine.job.store import savez
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


def test_outputs_named_like_savez_keywords(tmp_path: Path, models: SimpleNamespace) -> None:
    x = rows(5)
    np.save(tmp_path / "in.npy", x)
    for out in (tmp_path / "o.npz", tmp_path / "folder"):
        p = slabpool("run", models.mlp, tmp_path / "in.npy", "-o", out, "--workers", 1,
                     "--postprocess", "tests.cli_hooks:named_like_savez")
        assert p.returncode == 0, p.stderr
    from slabpool.engine.job.store import read_output

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
    assert not durable_indexes(Path(f"{out}.parts")) and not out.exists()
    np.savez(tmp_path / "in.npz", x=rows(3).astype(np.float16))  # named inputs too
    one_line(slabpool("run", models.mlp, tmp_path / "in.npz", "-o", tmp_path / "o2.npz", "--workers", 1),
             "got <f2 (float16)")


def test_resume_and_overwrite_together_are_refused(tmp_path: Path, models: SimpleNamespace) -> None:
    np.save(tmp_path / "in.npy", rows(3))
    one_line(slabpool("run", models.mlp, tmp_path / "in.npy", "-o", tmp_path / "o.npy", "--resume", "--overwrite"),
             "not allowed with argument")
