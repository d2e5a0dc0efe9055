"""A short probe of one model on this host, run in a process of its own before a pool of
`workers="auto"` is shaped (engine.core.shape decides from it).

It builds the session as a worker would (the same spec: the pinned, shared form of the weights
where there is one, which the workers then find made), runs a few calls, and measures what a
worker costs: its private memory, the weights it maps (counted once for the whole pool), and
the time per row at one intra-op thread, and (`time_at`) at the thread count the pool might need.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field

import numpy as np

from slabpool.workers.protocol import TensorSpec
from slabpool.workers.session import ModelSession, SessionSpec, load_session

PROBE_ROWS = 8  # rows a call (the first call of batch_size="auto" is as large)
PROBE_S = 0.15  # timed calls per thread count, at most this long


@dataclass(frozen=True)
class Probe:
    private_bytes: int  # what one worker holds alone (its USS, less the weights it maps)
    shared_bytes: int  # the weights' file pages it maps: one copy for every worker
    row_s: dict[int, float] = field(default_factory=dict)  # intra-op threads -> seconds a row
    rows: int = 0  # rows a timed call (0: not timed)
    note: str = ""  # why the time was not measured, if it was not


def probe(spec: SessionSpec) -> Probe:
    """Load `spec` at 1 thread: the memory it takes, and its time a row."""
    import psutil

    session = load_session(dataclasses.replace(spec, threads=1))
    feeds, why = _feeds(session.info.inputs)
    row_s: dict[int, float] = {}
    if feeds:
        try:
            row_s[1] = _time(session, feeds)
        except Exception as exc:  # noqa: BLE001 - the model's own: values it refuses (an index past a table)
            why = f"the model refused made-up inputs ({type(exc).__name__}: {str(exc)[:200]}): not timed"
            feeds = {}
    me = psutil.Process()
    pinned = getattr(session, "pinned", None)  # the adapters' workers.weights.Pinned
    folder = os.path.dirname(os.path.abspath(pinned.path)) if pinned is not None and pinned.shared else ""
    mapped = sum(m.rss for m in me.memory_maps() if folder and m.path.startswith(folder + os.sep))
    private = max(me.memory_full_info().uss - mapped, 0)
    session.close()
    return Probe(private, mapped, row_s, _rows(feeds) if feeds else 0, why)


def time_at(spec: SessionSpec, threads: int) -> float | None:
    """Seconds a row at `threads` intra-op threads (None: the inputs cannot be made up)."""
    session = load_session(dataclasses.replace(spec, threads=threads))
    feeds, _ = _feeds(session.info.inputs)
    try:
        return _time(session, feeds) if feeds else None
    except Exception:  # noqa: BLE001 - (as probe: values the model refuses)
        return None
    finally:
        session.close()


def _feeds(inputs: tuple[TensorSpec, ...]) -> tuple[dict[str, np.ndarray], str]:
    """Random inputs of PROBE_ROWS rows, or ({}, why) when a dim other than the batch is dynamic."""
    rng = np.random.default_rng(0)
    feeds = {}
    for t in inputs:
        if any(d is None for d in t.shape[1:]):
            return {}, f"input {t.name!r} has a dynamic dimension past the batch: not timed"
        shape = tuple(PROBE_ROWS if d is None else d for d in t.shape)
        dt = np.dtype(t.dtype)
        values = rng.integers(0, 2, shape) if dt.kind in "iub" else rng.standard_normal(shape)
        feeds[t.name] = values.astype(dt)
    return feeds, ""


def _time(session: ModelSession, feeds: dict[str, np.ndarray]) -> float:
    """The fastest call's seconds a row, over calls for up to PROBE_S (one warm-up first)."""
    run = session.run
    run(feeds)
    rows = _rows(feeds)
    best, end = float("inf"), time.perf_counter() + PROBE_S
    for _ in range(50):
        t0 = time.perf_counter()
        run(feeds)
        best = min(best, time.perf_counter() - t0)
        if t0 > end:
            break
    return best / max(rows, 1)


def _rows(feeds: dict[str, np.ndarray]) -> int:
    """Rows a call of `feeds` runs: the longest axis 0 among them (a scalar input has none;
    was: the first input's, an IndexError for a scalar one, and 1 for a fixed first input)."""
    return max((a.shape[0] for a in feeds.values() if a.ndim), default=1)
