"""The pipes cannot deadlock (issue 19, item 5): no side blocks on a send while the other may
be blocked sending, whatever the message sizes and the log volume.

It took a RunBatch and a BatchDone each larger than what the pipe holds: the supervisor
blocked writing the next batch while the worker blocked writing its answer, neither reading,
for ever. Made deterministic two ways: megabyte messages through pipes of the default size, and
kilobyte messages through pipes shrunk to their minimum (tests.owner_hooks.shrink_sockets, on
the worker's end in its initializer and on the supervisor's end in the test). Log records
travel the same pipe. Each case has a deadline that only a deadlock reaches.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slabpool import Engine
from tests.conftest import our_children
from tests.owner_hooks import DEADLOCK_S, shrink_sockets

X = np.random.default_rng(2).standard_normal((1, 16)).astype(np.float32)


def engine(model: Any, tiny: bool, **kw: Any) -> Engine:
    eng = Engine(model, initializer="tests.owner_hooks:shrink_sockets" if tiny else None, **kw)
    if tiny:
        assert shrink_sockets() >= kw.get("workers", 1)  # the supervisor's ends too
    return eng


def within_deadline(fn: Any) -> Any:
    """fn() on a thread: its result, or a failure naming the deadlock (never a hung suite)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # handed to the test thread
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(DEADLOCK_S)
    if t.is_alive():  # end it (the workers die, a blocked send fails), so that the test can fail
        for p in our_children():
            p.kill()
        raise AssertionError(f"still blocked after {DEADLOCK_S} s: a deadlock")
    if "error" in out:
        raise out["error"]
    return out["value"]


# (item bytes each way, pipes shrunk to 4 KiB): megabytes through default pipes, kilobytes
# through tiny ones; each message both ways is larger than the pipe holds
SIZES = [(1 << 20, False), (2 << 10, True), (64 << 10, True)]


@pytest.mark.parametrize("nbytes,tiny", SIZES, ids=[f"{n >> 10}KiB-{'tiny' if t else 'default'}" for n, t in SIZES])
def test_map_with_large_strings_each_way(nbytes, tiny, start_method):
    """map() with a preprocess that returns strings (no model: it is the whole task); chunks
    of items go out in one RunBatch and come back in one BatchDone."""
    items = [{"c": chr(97 + i % 26), "n": nbytes, "pad": "p" * nbytes} for i in range(48)]
    with engine(None, tiny, workers=2, preprocess="tests.owner_hooks:big_text", start_method=start_method) as eng:
        out = within_deadline(lambda: [r.outputs for r in eng.map(items, chunk=4)])
    assert [len(s) for s in out] == [nbytes] * len(items)
    assert all(s == item["c"] * nbytes for s, item in zip(out, items, strict=True))


@pytest.mark.parametrize("tiny", [False, True], ids=["default", "tiny"])
def test_a_warning_logged_per_item(models, tiny, caplog):
    """Log records cross the same pipe: thousands of warnings while batches are sent ahead."""
    items = [{"x": X, "i": i, "logs": 50} for i in range(200)]
    with caplog.at_level("WARNING", logger="tests.owner_hooks"), \
            engine(models.mlp, tiny, workers=2, preprocess="tests.owner_hooks:chatty") as eng:
        out = within_deadline(lambda: list(eng.map(items)))
        singles = within_deadline(lambda: [f.result() for f in [eng.submit(it) for it in items[:64]]])
    assert len(out) == len(items) and len(singles) == 64
    assert sum(r.name == "tests.owner_hooks" for r in caplog.records) == 50 * (len(items) + 64)


def test_close_returns_within_its_timeout_with_a_wedged_worker(models, tmp_path):
    """A worker that never answers (its task hangs) and a pipe full both ways: close(timeout=)
    still returns, every Future ends, nothing is left behind (the conftest checks)."""
    items = [{"c": "z", "n": 64 << 10, "pad": "p" * (64 << 10)} for _ in range(16)]
    with engine(None, True, workers=1, preprocess="tests.fault_hooks:pre") as eng:
        hung = eng.submit({"fault": "hang"})
        futs = [eng.submit(it) for it in items]
        t0 = time.monotonic()
        within_deadline(lambda: eng.close(timeout=2.0))
        took = time.monotonic() - t0
    assert hung.done() and all(f.done() for f in futs)
    assert took < DEADLOCK_S  # (a bound that only a deadlock reaches: no timing is asserted)


def test_cli_text_lines_with_a_preprocess_returning_strings(tmp_path):
    """`slabpool run texts.txt --preprocess ... --text`: 6.6 MB of lines out, as many back
    (it hung for ever, and its SIGTERM did nothing)."""
    pq = pytest.importorskip("pyarrow.parquet")
    src, out = tmp_path / "texts.txt", tmp_path / "out.parquet"
    lines = [f"{i:06d} " + "w" * 1000 for i in range(6600)]
    src.write_text("\n".join(lines) + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "slabpool", "run", str(src), "-o", str(out), "--text",
         "--preprocess", "tests.owner_hooks:upper_line", "--workers", "2"],
        capture_output=True, text=True, timeout=DEADLOCK_S, cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = pq.read_table(out).column("output").to_pylist()
    assert got == [line.upper() for line in lines]
