"""Preprocess hooks for the CLI tests (tests/test_cli.py); workers import them by name.

Items are JSON objects: {"i": index, "x": [16 floats], ...} with optional marks:
  "log": path   append the index to this file each time the item is computed (resume counting)
  "sleep": s    take this long (so a test can interrupt a run in the middle)
  "poison": 1   kill the worker, every time (the engine ends the item with PoisonTask)
  "bad": 1      raise (the engine ends the item with SessionRunError)
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np


def feeds(item: Any) -> dict[str, np.ndarray]:
    """A JSON item -> the mlp's feeds (batch of one); honours every mark above."""
    if item.get("log"):
        fd = os.open(item["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{item['i']}\n".encode())
        finally:
            os.close(fd)
    if item.get("sleep"):
        time.sleep(float(item["sleep"]))
    if item.get("poison"):
        os.kill(os.getpid(), signal.SIGKILL)
    if item.get("bad"):
        raise ValueError(f"item {item['i']} is marked bad")
    return {"x": np.asarray(item["x"], dtype=np.float32)[None]}


def square(line: Any) -> dict[str, np.ndarray]:
    """Model-less: a text line holding a number -> its square (the whole task)."""
    v = float(line)
    return {"y": np.asarray([v, v * v], dtype=np.float64)}
