"""Preprocess hooks that misbehave as user code may (tests/test_user_code.py). Each acts only
on an item marked for it; any other item becomes the mlp's feeds."""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np


class BadStr(Exception):
    """An exception whose str() raises (a user's broken __str__)."""

    def __str__(self) -> str:
        raise RuntimeError("str refuses")


_BASE = {"SystemExit(0)": lambda: SystemExit(0), "SystemExit(3)": lambda: SystemExit(3),
         "KeyboardInterrupt": lambda: KeyboardInterrupt("from the hook"),
         "GeneratorExit": lambda: GeneratorExit("from the hook")}


def misbehave(item: dict[str, Any]) -> dict[str, np.ndarray]:
    """item {"x": arr, one of: "bad_str", "base": a _BASE key, "thread", "fork"}.

    bad_str: raise BadStr; base: raise that BaseException; thread: leave a non-daemon thread
    that never ends; fork: os.fork(), and both processes return (the child does not os._exit).
    """
    if item.get("bad_str"):
        raise BadStr()
    if item.get("base"):
        raise _BASE[item["base"]]()
    if item.get("thread"):
        threading.Thread(target=threading.Event().wait, name="left-by-a-hook").start()
    if item.get("fork"):
        os.fork()
    return {"x": np.asarray(item["x"], dtype=np.float32)}
