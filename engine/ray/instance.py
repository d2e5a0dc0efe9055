"""The Ray instance a RayEngine starts when none is running: one per process, shared by every
RayEngine made while it runs, shut down when the last of them closes.

    RayEngine A: Ray not running  -> ray.init()      uses 1
    RayEngine B: Ray running       -> joins it        uses 2
    A.close()                      -> release         uses 1   (Ray stays up: B runs on it)
    B.close()                      -> release         uses 0   ray.shutdown()

Was: each engine kept its own "I started Ray", so A's close() shut Ray down under B, whose
tasks then never ended. A Ray the user started (`ray.init()` before the engine, or after
shutting down ours) is never shut down here: an instance is told apart by its driver's job id
and node id (`_job`).
"""

from __future__ import annotations

import threading
from typing import Any

import ray

_lock = threading.Lock()
_ours = ""  # the job id of the instance started here, while it runs ("": none)
_uses = 0  # live engines on it


def acquire(init: dict[str, Any]) -> str:
    """Start Ray with `init` if it is not running, or join the instance started here; the
    use (the instance's job id; "": the running Ray is the user's, never stopped here)."""
    global _ours, _uses
    with _lock:
        if not ray.is_initialized():
            ray.init(**init)
            _ours, _uses = _job(), 0
        elif not _ours or _job() != _ours:
            return ""
        _uses += 1
        return _ours


def release(use: str) -> None:
    """An engine's use ends: the last one of the instance started here shuts it down."""
    global _ours, _uses
    with _lock:
        if not use or use != _ours:
            return  # (the user's Ray, or an instance gone since)
        _uses -= 1
        if _uses == 0:
            _ours = ""
            if ray.is_initialized() and _job() == use:
                ray.shutdown()


def identity() -> str:
    """The Ray instance this process is connected to now ("": none)."""
    return _job() if ray.is_initialized() else ""


def _job() -> str:
    """The running instance as this driver sees it: its job id and its node's id. The job id
    alone names no instance: every fresh local Ray gives its first driver 01000000, so a
    Ray the user started after shutting down ours was taken for ours, and shut down by an
    engine's close()."""
    ctx = ray.get_runtime_context()
    return f"{ctx.get_job_id()}@{ctx.get_node_id()}"
