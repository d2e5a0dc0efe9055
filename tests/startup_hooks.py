"""Hooks whose module cannot be imported in a worker (tests/test_startup_errors.py): it
imports in the caller, and raises in any process that multiprocessing named a slabpool worker."""

from __future__ import annotations

import multiprocessing
from typing import Any

if multiprocessing.current_process().name.startswith("slabpool-worker-"):
    raise ImportError("tests.startup_hooks refuses to be imported in a worker (a missing native library, say)")


def pre(item: Any) -> Any:
    return item


def refuse_init() -> None:
    raise ValueError("the initializer refuses: no licence server")
