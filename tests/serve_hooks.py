"""Hooks for the `slabpool serve` fault tests: a request carries its fault in a BYTES input
"fault" (so it is pinned to that request and that stage, never to timing), and the rest of
its inputs go to the mlp.

    fault = [b"kill"]              SIGKILL the worker every time (a poison request)
    fault = [b"kill-once:PATH"]    SIGKILL the worker the first time (PATH records it); the replay runs
    fault = [b"segv-once:PATH"]    the same with a segfault
    fault = [b"hold:PATH"]         wait in the worker until PATH exists (a request held by a worker)
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from typing import Any

import numpy as np

GATE_ENV = "SLABPOOL_TEST_GATE"
REFUSE_ENV = "SLABPOOL_TEST_REFUSE"


def _first(path: str) -> bool:
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    return True


def marked(inputs: dict[str, Any]) -> dict[str, Any]:
    """A preprocess: the fault named by inputs["fault"], then the mlp's feeds."""
    for raw in inputs.get("fault") or ():
        kind, _, arg = raw.decode().partition(":")
        if kind == "kill" or (kind == "kill-once" and _first(arg)):
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "segv-once" and _first(arg):
            ctypes.string_at(0)
        if kind == "hold":
            while not os.path.exists(arg):
                time.sleep(0.01)
    return {"x": np.ascontiguousarray(inputs["x"], dtype=np.float32)}


def gate() -> None:
    """An initializer: a worker that starts while the file named by $SLABPOOL_TEST_GATE exists
    waits until it is gone (its slot stays STARTING: the test sees the model not ready)."""
    path = os.environ.get(GATE_ENV)
    while path and os.path.exists(path):
        time.sleep(0.01)


def refuse() -> None:
    """An initializer: a worker that starts while the file named by $SLABPOOL_TEST_REFUSE
    exists fails its start-up (again and again: the engine stops, docs/faults.md)."""
    path = os.environ.get(REFUSE_ENV)
    if path and os.path.exists(path):
        raise RuntimeError(f"refused to start: {path} exists")
