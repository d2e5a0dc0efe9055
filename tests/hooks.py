"""Importable hooks that tests hand to workers (preprocess, postprocess, initializer)."""

from __future__ import annotations

import os
import random
import signal
from typing import Any

import numpy as np

from slabpool.workers import context


def double(item: Any) -> Any:
    """A pure-CPU 'preprocess': the whole task when model=None."""
    return {"y": np.asarray(item["x"]) * 2}


def to_feeds(item: Any) -> dict[str, np.ndarray]:
    """Preprocess for the mlp: item {"x": arr, ...} -> feeds."""
    return {"x": np.ascontiguousarray(item["x"], dtype=np.float32)}


def augment(item: Any) -> dict[str, np.ndarray]:
    """Random augmentation: replays must draw the same numbers (per-task seeds)."""
    x = np.asarray(item["x"], dtype=np.float32)
    noise = np.random.standard_normal(x.shape).astype(np.float32) * 0.01 + random.random()
    return {"x": x + noise}


def argmax_post(outputs: dict[str, np.ndarray], item: Any) -> dict[str, Any]:
    return {"label": outputs["probs"].argmax(axis=-1), "n": int(outputs["probs"].shape[0])}


def read_context(item: Any) -> dict[str, Any]:
    """Return what the task sees as its context (and raise if asked to, to test clearing)."""
    seen = dict(context.current())
    if item.get("raise"):
        raise RuntimeError("asked to fail")
    return {"seen": seen}


def kill_marked(item: Any) -> Any:
    """Kill this worker the first time a marked item is seen (a file marks 'seen')."""
    mark = item.get("kill_once")
    if mark is not None:
        try:
            os.close(os.open(str(mark), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            os.kill(os.getpid(), signal.SIGKILL)
        except FileExistsError:
            pass
    return {"x": np.asarray(item["x"], dtype=np.float32)}


def slow_preprocess(item: Any) -> Any:
    """A preprocess that spins in Python for item["seconds"] (a hung-task stand-in)."""
    import time

    end = time.monotonic() + float(item.get("seconds", 0))
    while time.monotonic() < end:
        pass
    return {"x": np.asarray(item["x"], dtype=np.float32)}


def gated(item: Any) -> Any:
    """Record that the task ran (item["log"]), then wait until the file item["gate"] exists.

    Holds a worker deterministically: the test opens the gate when it is ready."""
    import time

    if item.get("log"):
        with open(item["log"], "a") as f:
            f.write(f"{item.get('id', '?')}\n")
    gate = item.get("gate")
    deadline = time.monotonic() + 120  # only a broken test reaches it
    while gate and not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.005)
    if item.get("seconds"):
        return slow_preprocess(item)
    return {"x": np.asarray(item["x"], dtype=np.float32)}


def gil_stall(item: Any) -> Any:
    """Record that the task ran (item["log"]), then sleep item["stall"] seconds in native code
    that holds the GIL (libc's sleep through ctypes.PyDLL): a worker where no Python thread
    can run, as a native deadlock leaves it."""
    import ctypes

    if item.get("log"):
        with open(item["log"], "a") as f:
            f.write("stalled\n")
    ctypes.PyDLL(None).sleep(int(item.get("stall", 0)))
    return {"x": np.asarray(item["x"], dtype=np.float32)}


def kill_flagged(item: Any) -> Any:
    """Kill this worker every time an item flagged "kill" is seen (a poison item)."""
    if item.get("kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    return {"x": np.asarray(item["x"], dtype=np.float32)}


def kill_rows(block: Any) -> Any:
    """A block of rows {"x", "kill"}: kill this worker whenever a row flagged in "kill" is in it."""
    if np.asarray(block["kill"]).any():
        os.kill(os.getpid(), signal.SIGKILL)
    return {"x": np.ascontiguousarray(block["x"], dtype=np.float32)}


def fail_rows(block: Any) -> Any:
    """A block of rows {"x", "bad"}: raise whenever a row flagged in "bad" is in it."""
    bad = np.flatnonzero(np.asarray(block["bad"]))
    if bad.size:
        raise ValueError(f"{bad.size} bad row(s) in this block")
    return {"x": np.ascontiguousarray(block["x"])}


def center_rows(block: Any) -> Any:
    """A block of rows x -> x less its mean over the block's rows (a hook that looks across rows)."""
    x = np.asarray(block)
    return x - x.mean(axis=0)
