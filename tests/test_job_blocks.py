"""`slabpool run` by row blocks (.npy/.npz) and by item chunks (per-item sources), end to end.

The real CLI in a subprocess: rows of a memory-mapped .npy go as blocks of --batch-size rows
(byte-identical to the same blocks run one after another in one session), the journal commits
blocks, not rows; a row that fails (a runtime error) fails alone, listed with its own error;
a job SIGKILLed mid-run resumes without computing a durable row again and ends byte-identical;
tiny JSONL items go many to a task, a poison item inside a chunk failing alone.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import psutil
import pytest

from slabpool.engine.job.store import read_output
from tests.reference import ort_run
from tests.test_cli import CLI, durable_indexes, jsonl, slabpool
from tests.test_cli_signals import Held

RNG = np.random.default_rng(121)


def serial_blocks(model: Path, feeds: dict[str, np.ndarray], size: int) -> dict[str, np.ndarray]:
    n = next(iter(feeds.values())).shape[0]
    parts = [ort_run(model, {k: v[lo : lo + size] for k, v in feeds.items()}) for lo in range(0, n, size)]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def journal(parts: Path) -> list[dict[str, object]]:
    return [json.loads(ln) for ln in (parts / "journal.jsonl").read_text().splitlines()]


def kill_mid_run_then_resume(args: list[object], parts: Path, n: int, size: int) -> set[int]:
    """Run the job, SIGKILL it while it is held after its first commit (the test's chosen
    block: engine.job.signals, SLABPOOL_TEST_HOLD), resume it; what was durable then. With
    --durable-every 0.001 the first commit holds the first blocks settled, never the job."""
    held = Held(parts.parent, "commit:1", list(args[len(CLI):]))
    workers = psutil.Process(held.cli.pid).children(recursive=True)
    held.cli.send_signal(signal.SIGKILL)
    held.finish()
    psutil.wait_procs(workers, timeout=20)
    durable = durable_indexes(parts)
    assert 0 < len(durable) < n and len(durable) % size == 0
    p = slabpool(*args[len(CLI):], "--resume")
    assert p.returncode == 0, p.stderr
    return set(durable)


def test_npy_goes_by_blocks_byte_identical(tmp_path: Path, models: SimpleNamespace) -> None:
    x = RNG.standard_normal((20_000, 16)).astype(np.float32)
    np.save(tmp_path / "in.npy", x)
    out = tmp_path / "out.npz"
    # a model whose rows depend on their block's other rows: equal bytes mean the same blocks
    p = slabpool("run", models.centered, tmp_path / "in.npy", "-o", out, "--workers", 2, "--batch-size", 1000)
    assert p.returncode == 0, p.stderr
    want = serial_blocks(models.centered, {"x": x}, 1000)
    with np.load(out) as z:
        for k, v in want.items():
            assert z[k].tobytes() == v.tobytes(), k
    parts = Path(f"{out}.parts")
    report = json.loads((parts / "report.json").read_text())
    assert report["dispatch"] == "blocks" and report["batch_size"] == 1000
    tasks = sum(s["tasks_done"] for s in report["slots"])
    assert 2 <= tasks <= 20  # session calls of 1000 rows, one or several a task
    entries = journal(parts)
    assert len(entries) <= tasks  # the journal commits tasks (a shard holds whole ones), not rows
    for e in entries:
        for a, b in e["ranges"]:  # type: ignore[union-attr]
            assert a % 1000 == 0 and (b % 1000 == 0 or b == 20_000)


def test_auto_block_size_and_a_directory_output(tmp_path: Path, models: SimpleNamespace) -> None:
    x = RNG.standard_normal((30_000, 16)).astype(np.float32)
    np.save(tmp_path / "in.npy", x)
    p = slabpool("run", models.mlp, tmp_path / "in.npy", "-o", tmp_path / "res", "--workers", 2)
    assert p.returncode == 0, p.stderr
    got = read_output(tmp_path / "res")
    for k, v in ort_run(models.mlp, {"x": x}).items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-6)
    report = json.loads((tmp_path / "res" / "report.json").read_text())
    tasks = sum(s["tasks_done"] for s in report["slots"])
    assert report["batch_size"] == "auto" and 2 <= tasks < 30_000 // 256  # a probe, then grown blocks


def test_failing_rows_of_an_npz_fail_alone(tmp_path: Path, models: SimpleNamespace) -> None:
    n = 3000
    idx = RNG.integers(-10, 10, n).astype(np.int64)
    bad = [17, 1500, 2999]
    idx[bad] = 77  # outside the table: a runtime error for these rows only
    x = RNG.standard_normal((n, 4)).astype(np.float32)
    np.savez(tmp_path / "in.npz", idx=idx, x=x)
    out = tmp_path / "out.npy"
    p = slabpool("run", models.poison, tmp_path / "in.npz", "-o", out, "--workers", 2, "--batch-size", 256)
    assert p.returncode == 2, p.stderr
    assert "onnxruntime" not in p.stderr, p.stderr  # (was: ORT's own log line of each failing call, ~20)
    failures = [json.loads(ln) for ln in Path(f"{out}.parts/failures.jsonl").read_text().splitlines()]
    assert [(f["index"], f["error"]) for f in failures] == [(i, "SessionRunError") for i in bad]
    y = np.load(out)
    assert np.isnan(y[bad]).all()
    good = np.setdiff1d(np.arange(n), bad)
    np.testing.assert_allclose(y[good], x[good] + (np.arange(40, dtype=np.float32) / 8).reshape(10, 4)[idx[good]],
                               rtol=1e-6)


def test_a_run_where_every_item_fails_says_no_output_and_no_latency(tmp_path: Path, models: SimpleNamespace) -> None:
    """Every row fails (--max-failures 100%): exit 2, the summary says OUTPUT was not written
    and names no "output:" (was: both), and latency is "-" / null (was: 0.0 ms, no task timed)."""
    n = 20
    np.savez(tmp_path / "in.npz", idx=np.full(n, 77, np.int64), x=np.ones((n, 4), np.float32))
    out = tmp_path / "out.npz"
    p = slabpool("run", models.poison, tmp_path / "in.npz", "-o", out, "--workers", 2, "--max-failures", "100%")
    assert p.returncode == 2, p.stderr
    assert f"no item succeeded: {out} was not written" in p.stdout and "output:" not in p.stdout, p.stdout
    assert "latency - (no task ended well)" in p.stdout and not out.exists()
    report = json.loads(Path(f"{out}.parts/report.json").read_text())
    assert report["failed"] == n and report["latency_s"] == {"p50": None, "p95": None, "p99": None}


@pytest.mark.slow
def test_sigkill_mid_run_resumes_by_blocks(tmp_path: Path, models: SimpleNamespace) -> None:
    n, size = 4000, 40
    x = RNG.standard_normal((n, 512)).astype(np.float32)
    np.save(tmp_path / "in.npy", x)
    out = tmp_path / "out.npy"
    parts = Path(f"{out}.parts")
    args = [*CLI, "run", models.slow, tmp_path / "in.npy", "-o", out, "--workers", 2, "--batch-size", size,
            "--durable-every", 0.001]
    durable = kill_mid_run_then_resume(args, parts, n, size)
    report = json.loads((parts / "report.json").read_text())
    assert report["skipped_durable"] == len(durable) and report["computed_this_run"] == n - len(durable)
    want = serial_blocks(models.slow, {"x": x}, size)  # blocks stay aligned across the resume
    assert np.load(out).tobytes() == next(iter(want.values())).tobytes()


def test_tiny_jsonl_items_go_in_chunks_a_poison_item_fails_alone(tmp_path: Path, models: SimpleNamespace) -> None:
    n = 600
    x = RNG.standard_normal((n, 16)).astype(np.float32)
    items = [{"i": i, "x": r.tolist()} for i, r in enumerate(x)]
    items[450]["poison"] = 1
    items[100]["bad"] = 1
    out = tmp_path / "out.npy"
    p = slabpool("run", models.mlp, jsonl(tmp_path / "in.jsonl", items), "-o", out, "--workers", 2,
                 "--preprocess", "tests.cli_hooks:feeds", "--max-attempts", 2)
    assert p.returncode == 2, p.stderr
    failures = [json.loads(ln) for ln in Path(f"{out}.parts/failures.jsonl").read_text().splitlines()]
    assert [(f["index"], f["error"]) for f in failures] == [(100, "SessionRunError"), (450, "PoisonTask")]
    report = json.loads(Path(f"{out}.parts/report.json").read_text())
    assert report["dispatch"] == "chunks"
    assert report["quarantines"] == 1  # the poison item (was: its chunk's task, then its own: items or tasks)
    # items shared tasks: fewer tasks than items. Not a tighter bound: map()'s chunks grow with
    # the measured run time per item (~20 ms of work each, up to MAX_CHUNK items), and the
    # poison item's chunk runs again item by item, a task per item; so the faster the items, the
    # larger that chunk and the more tasks its rerun takes (n // 2 held until calls got
    # cheaper: 303 of 600 in a CI run). Fewer tasks than items holds at any speed: every
    # other chunk of two items or more saves one
    assert sum(s["tasks_done"] for s in report["slots"]) < n
    y = np.load(out)
    good = [i for i in range(n) if i not in (100, 450)]
    want = ort_run(models.mlp, {"x": x[good]})  # item by item in the workers: compare loosely
    np.testing.assert_allclose(y[good], want["probs"], rtol=1e-5, atol=1e-6)
    assert np.isnan(y[[100, 450]]).all()


# -- .npy/.npz OUTPUT: rows written in place (direct/), no shards, no assembly ---------------------


def test_npy_output_is_written_in_place_then_linked(tmp_path: Path, models: SimpleNamespace) -> None:
    """The rows go straight into parts/direct/00.npy (no shard files); OUTPUT is that file,
    hard-linked; --overwrite makes a new file, so the bytes of an earlier OUTPUT stay as they were."""
    x = RNG.standard_normal((5000, 16)).astype(np.float32)
    np.save(tmp_path / "in.npy", x)
    out = tmp_path / "out.npy"
    parts = Path(f"{out}.parts")
    p = slabpool("run", models.mlp, tmp_path / "in.npy", "-o", out, "--workers", 2, "--batch-size", 500,
                 "--durable-every", 0.001)
    assert p.returncode == 0, p.stderr
    assert "holds output 'probs', the first of 2" in p.stdout + p.stderr
    want = serial_blocks(models.mlp, {"x": x}, 500)
    assert np.load(out).tobytes() == want["probs"].tobytes()
    assert not list((parts / "shards").iterdir())
    assert os.stat(out).st_ino == os.stat(parts / "direct" / "00.npy").st_ino
    entries = journal(parts)
    assert len(entries) > 1 and all(e["direct"] and e["shard"] is None for e in entries)
    np.testing.assert_array_equal(read_output(parts)["probs"], want["probs"])  # the parts read back

    os.link(out, tmp_path / "first.npy")  # another name for the first run's OUTPUT
    np.save(tmp_path / "in.npy", x[::-1].copy())
    p = slabpool("run", models.mlp, tmp_path / "in.npy", "-o", out, "--workers", 2, "--batch-size", 500,
                 "--overwrite")
    assert p.returncode == 0, p.stderr
    assert np.load(tmp_path / "first.npy").tobytes() == want["probs"].tobytes()
    assert np.load(out).tobytes() == serial_blocks(models.mlp, {"x": x[::-1].copy()}, 500)["probs"].tobytes()


def test_damaged_direct_rows_run_again(tmp_path: Path, models: SimpleNamespace) -> None:
    """A commit whose rows no longer have their CRC (the file changed after the journal line) is
    dropped on --resume: only its rows are computed again, the .npz ends byte-identical."""
    x = RNG.standard_normal((30000, 16)).astype(np.float32)  # 100 blocks: commits every ~ms, many
    np.save(tmp_path / "in.npy", x)
    out = tmp_path / "out.npz"
    parts = Path(f"{out}.parts")
    args = ["run", models.mlp, tmp_path / "in.npy", "-o", out, "--workers", 2, "--batch-size", 300,
            "--durable-every", 0.001]
    assert slabpool(*args).returncode == 0
    with np.load(out) as z:
        first = {k: z[k].copy() for k in z.files}
    entries = journal(parts)
    assert all(e["direct"] for e in entries) and len(entries) > 2
    a, b = entries[1]["ranges"][0]  # type: ignore[index]
    direct = parts / "direct" / "01.npy"  # logits
    mm = np.load(direct, mmap_mode="r+")
    mm[a + 1] = 0.0
    mm.flush()
    del mm
    p = slabpool(*args, "--resume")
    assert p.returncode == 0, p.stderr
    assert "1 journal line(s) failed validation" in p.stderr
    assert json.loads((parts / "report.json").read_text())["computed_this_run"] == b - a
    with np.load(out) as z:
        for k, v in first.items():
            assert z[k].tobytes() == v.tobytes(), k


def test_resume_over_shards_of_an_earlier_version(tmp_path: Path, models: SimpleNamespace) -> None:
    """A .npy job begun by a version that kept shards resumes: those rows are copied into the
    direct file once, the rest computed, the OUTPUT complete."""
    from slabpool.engine.job.sources import open_source
    from slabpool.engine.job.spec import JobSpec, fingerprint
    from slabpool.engine.job.store import Store

    x = RNG.standard_normal((1000, 16)).astype(np.float32)
    np.save(tmp_path / "in.npy", x)
    out = tmp_path / "out.npy"
    spec = JobSpec(models.mlp, tmp_path / "in.npy", out)
    store = Store.open(spec.parts, fingerprint(spec, open_source(spec.input, hook=False)), resume=False,
                       overwrite=False)  # the shard layout
    done = np.arange(200, 450)
    store.commit(done, ort_run(models.mlp, {"x": x[done]}), [])
    store.close()
    p = slabpool("run", models.mlp, tmp_path / "in.npy", "-o", out, "--workers", 2, "--resume")
    assert p.returncode == 0, p.stderr
    assert json.loads((spec.parts / "report.json").read_text())["computed_this_run"] == 1000 - len(done)
    np.testing.assert_allclose(np.load(out), ort_run(models.mlp, {"x": x})["probs"], rtol=1e-5, atol=1e-6)


def test_items_that_do_not_fit_the_first_rows_fail_alone(tmp_path: Path) -> None:
    """Items settle one by one into columns: an item whose row differs from the first in shape
    or dtype is a RowError of its own, the others stored in order (no model: the hook's rows)."""
    items = [{"i": i, "n": 3} for i in range(300)]
    items[7]["n"] = 4
    items[150]["dtype"] = "float64"
    out = tmp_path / "o.npy"
    p = slabpool("run", jsonl(tmp_path / "in.jsonl", items), "-o", out, "--workers", 2, "--preprocess",
                 "tests.cli_hooks:shaped")
    assert p.returncode == 2, p.stderr
    failures = [json.loads(ln) for ln in Path(f"{out}.parts/failures.jsonl").read_text().splitlines()]
    assert [(f["index"], f["error"]) for f in failures] == [(7, "RowError"), (150, "RowError")]
    y = np.load(out)
    good = [i for i in range(300) if i not in (7, 150)]
    np.testing.assert_array_equal(y[good], np.arange(3, dtype=np.float32) + np.array(good, np.float32)[:, None])
    assert np.isnan(y[[7, 150]]).all()


def test_pending_blocks_cover_exactly_the_runs_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Resume hands the job runs of items still to do: the spans of the source's blocks it
    reads are those items, each once, in order, whatever the block and run boundaries."""
    from slabpool.engine.job import dispatch
    from slabpool.engine.job.sources import open_source

    n = 103
    (tmp_path / "in.txt").write_text("".join(f"line {i}\n" for i in range(n)))
    rng = np.random.default_rng(5)
    for read_rows in (1, 7, 50, 4096):
        monkeypatch.setattr(dispatch, "READ_ROWS", read_rows)
        for _ in range(30):
            cuts = sorted(set(rng.integers(0, n + 1, int(rng.integers(0, 12))).tolist()) | {0, n})
            todo = [(a, b) for a, b in itertools.pairwise(cuts) if b > a and rng.random() < 0.6]
            src = open_source(tmp_path / "in.txt", hook=True)
            got = [b.start + j for b, j0, j1 in dispatch.pending_blocks(src, todo) for j in range(j0, j1)]
            assert got == [i for a, b in todo for i in range(a, b)], (read_rows, todo)
            items = [get() for _, get, _ in dispatch.pending_items(src, todo)]
            assert items == [f"line {i}" for a, b in todo for i in range(a, b)]


@pytest.mark.parametrize("model", ["multi_io", "nonzero"])
def test_a_model_whose_output_holds_no_rows_goes_item_by_item(tmp_path: Path, models: SimpleNamespace,
                                                               model: str) -> None:
    """multi_io's total[1] (axis 0 fixed) and NonZero's idx[2, nz] hold no rows of a block: the
    job goes item by item, each item's outputs its own model call's (was: the job chose blocks
    and failed at its first, exit 1, "rows must lie on axis 0")."""
    n = 40
    if model == "multi_io":
        feeds = {"feats": RNG.standard_normal((n, 4)).astype(np.float32), "ids": np.arange(n, dtype=np.int64)}
    else:
        feeds = {"x": RNG.integers(-1, 2, (n, 8)).astype(np.float32)}
    np.savez(tmp_path / "in.npz", **feeds)
    out = tmp_path / "out"
    p = slabpool("run", getattr(models, model), tmp_path / "in.npz", "-o", out, "--workers", 2)
    if model == "nonzero":  # (no batch axis at all: every item fails alike, and the job says why)
        assert p.returncode == 1 and "output 'idx' has shape (2, " in p.stderr and "batch axis" in p.stderr, p.stderr
        return
    assert p.returncode == 0, p.stderr
    assert json.loads((out / "report.json").read_text())["dispatch"] != "blocks"
    got = read_output(out)
    for i in range(n):
        want = ort_run(getattr(models, model), {k: v[i:i + 1] for k, v in feeds.items()})
        for k, v in want.items():
            assert np.asarray(got[k][i]).tobytes() == v.reshape(np.asarray(got[k][i]).shape).tobytes(), (i, k)
