"""Preprocess hooks for the two-backend contract suite. Each fault is pinned to a stage by the
task itself (a marked item), never by timing; both backends import them by reference."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import numpy as np


def staged(item: dict[str, Any]) -> dict[str, np.ndarray]:
    """item {"x": arr, optional "gate", "kill_once", "poison"} -> the mlp's feeds.

    gate:      wait until this file exists (holds the slot busy without sleeping on a guess)
    kill_once: SIGKILL this process the first time any process sees the item (a file marks it)
    poison:    SIGKILL this process every time
    """
    gate = item.get("gate")
    if gate is not None:
        deadline = time.monotonic() + 60  # only a deadlock reaches it
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.01)
    mark = item.get("kill_once")
    if mark is not None:
        try:
            os.close(os.open(str(mark), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
        except FileExistsError:
            pass
    if item.get("poison"):
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    return {"x": np.ascontiguousarray(item["x"], dtype=np.float32)}


def label(outputs: dict[str, np.ndarray], batch: dict[str, Any]) -> dict[str, np.ndarray]:
    """A Ray Data postprocess: keep the id column, add the arg-max label."""
    return {"id": batch["id"], "label": outputs["probs"].argmax(axis=-1)}


@dataclass
class Boxed:
    """A postprocess's own object holding an output (the caller must get it writable)."""

    probs: np.ndarray


def boxed(outputs: dict[str, np.ndarray], item: Any) -> Boxed:
    return Boxed(outputs["probs"])
