"""Importable preprocess hooks for the async, metrics and log tests.

Gates are files, not sleeps: a task marks that it started (`started-<tag>`), then waits until
the test creates `<dir>/open`. The wait has a deadline that only a deadlock reaches.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

GATE_DEADLINE_S = 60.0


def mark(directory: str | os.PathLike[str], name: str) -> None:
    Path(directory, name).touch()


def gated(item: Any) -> dict[str, np.ndarray]:
    """Preprocess for the mlp. `{"x", "dir", "tag", "wait"}`: mark `started-<tag>` in `dir`;
    with `wait`, block until `dir/open` exists."""
    d = item.get("dir")
    if d is not None:
        mark(d, f"started-{item['tag']}")
        if item.get("wait"):
            deadline = time.monotonic() + GATE_DEADLINE_S
            while not os.path.exists(os.path.join(d, "open")):
                if time.monotonic() > deadline:
                    raise TimeoutError("the test never opened the gate")
                time.sleep(0.002)
    return {"x": np.ascontiguousarray(item["x"], dtype=np.float32)}


def log_and_feed(item: Any) -> dict[str, np.ndarray]:
    """Preprocess for the mlp that logs a warning (no data in it), and fails when asked to,
    with the input's values in the exception message (which must not reach any log)."""
    x = np.ascontiguousarray(item["x"], dtype=np.float32)
    logging.getLogger("userhook").warning("preprocess saw %d rows", x.shape[0])
    if item.get("fail"):
        raise RuntimeError(f"refusing input {x.ravel().tolist()}")
    return {"x": x}
