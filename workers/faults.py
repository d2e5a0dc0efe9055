"""Test-only fault injection, pinned to a stage by the task itself, never by timing.

A task carries a `FaultSpec(stage, action, once_file)`; the worker calls `inject(spec, stage)`
at each stage (init, preprocess, run, postprocess, write_outputs). With `once_file`, the fault
fires only the first time any process reaches it (the file is created atomically), so a
replay of the same task succeeds. The engine passes FaultSpecs only when built with
`engine.caller.faults` (tests only: `faults.build(Engine, ...)`).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time

from slabpool.workers.protocol import FaultSpec

STAGES = ("init", "preprocess", "run", "postprocess", "write_outputs")


def inject(spec: FaultSpec | None, stage: str) -> None:
    if spec is None or spec.stage != stage:
        return
    if spec.once_file is not None:
        try:
            os.close(os.open(spec.once_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            return
    act(spec.action)


def act(action: str) -> None:
    if action == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "sigsegv":
        faulthandler._sigsegv()  # type: ignore[attr-defined]
    elif action == "sigbus":
        os.kill(os.getpid(), signal.SIGBUS)
    elif action.startswith("exit"):
        os._exit(int(action[4:]))
    elif action == "raise":
        raise RuntimeError("injected fault")
    elif action == "hang":
        while True:
            time.sleep(60)
    else:
        raise ValueError(f"unknown fault action {action!r}")
    time.sleep(60)  # a signal is on its way
