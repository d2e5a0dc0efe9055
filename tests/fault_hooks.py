"""Hooks for the fault-containment tests: each item says which fault it carries, so a fault is
pinned to one task and one stage by the task itself (never by timing)."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import numpy as np


class TwoArgError(Exception):
    """Pickles (its args are one string) but does not unpickle: __init__ wants two arguments."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__(a)
        self.b = b


class Unpicklable:
    """Pickles in one process, fails to unpickle in any other (its __reduce__ says so)."""

    def __reduce__(self) -> Any:
        return (_refuse, ("refused on purpose",))


def _refuse(why: str) -> Any:
    raise TypeError(why)


def pre(item: Any) -> Any:
    """A preprocess: the item's "fault" decides what happens to it (None: nothing)."""
    fault = item.get("fault")
    if fault == "raise":
        raise RuntimeError("bad item: asked to fail")
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "exit1":
        os._exit(1)
    if fault == "hang":
        while True:
            time.sleep(0.05)
    if fault == "sleep":
        time.sleep(float(item["seconds"]))
    if fault == "big":
        return {"y": np.zeros(int(item["nbytes"]) // 4, dtype=np.float32)}
    if fault == "lock":
        return {"y": np.asarray(item["x"]), "lock": threading.Lock()}
    if fault == "twoarg":
        return {"y": np.asarray(item["x"]), "err": TwoArgError("a", "b")}
    if fault == "deep":  # nested deeper than the recursion limit: cannot be walked or pickled
        deep: list[Any] = []
        for _ in range(5000):
            deep = [deep]
        return {"y": np.asarray(item["x"]), "deep": deep}
    return {"y": np.asarray(item["x"]) * 2}


def to_feeds(item: Any) -> Any:
    """A preprocess for the mlp (x float32), with the same faults as `pre` before the run."""
    fault = item.get("fault")
    if fault in ("raise", "kill", "exit1", "hang", "sleep"):
        pre(item)
    return {"x": np.ascontiguousarray(item["x"], dtype=np.float32)}


def post(outputs: dict[str, np.ndarray], item: Any) -> Any:
    """A postprocess: a result that will not pickle, or will not unpickle, on demand."""
    fault = item.get("post")
    if fault == "lock":
        return {"probs": outputs["probs"], "lock": threading.Lock()}
    if fault == "twoarg":
        return {"probs": outputs["probs"], "err": TwoArgError("a", "b")}
    if fault == "raise":
        raise ValueError("postprocess refused this item")
    return outputs


def sigint_parent(once_file: str) -> None:
    """An initializer: Ctrl-C the process that is building the engine (once: the first worker
    to get here), then never finish."""
    import multiprocessing

    try:
        os.close(os.open(once_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        pass
    else:
        parent = multiprocessing.parent_process()
        assert parent is not None and parent.pid is not None
        os.kill(parent.pid, signal.SIGINT)
    while True:
        time.sleep(0.05)
