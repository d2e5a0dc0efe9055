"""Run by tests/test_fork.py: an engine with a task in flight, then os.fork(); the child does
one thing with the engine it inherited (argv[3]) and exits as that thing makes it exit, atexit
handlers and all; the parent then finishes the task and more, and prints what it saw (JSON)."""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from slabpool import Engine, EngineClosed


def child(eng: Engine, how: str, model: str, fut: Any, queued: Any) -> None:
    if how == "exit":
        return  # falls off the end of the script
    if how == "sys.exit":
        sys.exit(3)
    if how == "raise":
        raise RuntimeError("the child fails")
    if how == "close":
        eng.close()
        eng.close(timeout=1)
    elif how == "submit":
        for call in (lambda: eng.submit({"x": np.zeros((1, 16), np.float32)}), lambda: eng.infer({"x": 0}),
                     lambda: eng.reload(model)):
            try:
                call()
                print("child: no error", flush=True)
            except EngineClosed as exc:
                print(f"child: EngineClosed: {exc}", flush=True)
        print(f"child: cancel -> {fut.cancel()}", flush=True)
    elif how == "cancel_queued":  # the parent's queue, memory and their locks are the parent's
        print(f"child: queued cancel -> {queued.cancel()} {eng.cancel(queued)} {queued.cancelled()}", flush=True)
    elif how == "drop":
        del eng
        gc.collect()
    elif how == "new_engine":
        with Engine(model, workers=1, start_method=sys.argv[2]) as own:
            out = own.infer({"x": np.ones((1, 16), np.float32)})
            print(f"child: own engine {sorted(out)}", flush=True)


def parent(eng: Engine, pid: int, fut: Any, queued: Any, gate: Path, pids: list[int]) -> None:
    _, status = os.waitpid(pid, 0)
    lock = Path(f"/dev/shm/slabpool-{eng._instance}.lock")
    lock_kept = lock.exists() if eng.config.shm_backend == "posix" else True
    gate.touch()  # the task in flight may end now
    first = fut.result(timeout=60)
    if queued is not None:
        print(f"parent: queued {sorted(queued.result(timeout=60).outputs)}", flush=True)
    later = [eng.infer({"x": np.full((1, 16), k, np.float32), "gate": ""}) for k in range(4)]
    st = eng.stats()
    eng.close()
    print(json.dumps({
        "child_exit": os.waitstatus_to_exitcode(status), "first": sorted(first.outputs), "later": len(later),
        "restarts": st.restarts, "same_pids": [s.pid for s in st.slots] == pids, "failed": st.failed,
        "lock_kept": lock_kept,
    }), flush=True)


if __name__ == "__main__":
    model, method, how, tmp, backend = sys.argv[1:6]
    gate, log = Path(tmp) / "gate", Path(tmp) / "log"
    eng = Engine(model, workers=1, start_method=method, preprocess="tests.hooks:gated", shm_backend=backend)
    pids = [s.pid for s in eng.stats().slots]
    fut = eng.submit({"x": np.zeros((1, 16), np.float32), "gate": str(gate), "log": str(log)})
    deadline = time.monotonic() + 60  # only a deadlock reaches it
    while not log.exists() and time.monotonic() < deadline:
        time.sleep(0.005)  # until the task is in a worker's hands
    queued = eng.submit({"x": np.ones((1, 16), np.float32), "gate": ""}) if how == "cancel_queued" else None
    pid = os.fork()
    if pid == 0:
        child(eng, how, model, fut, queued)
    else:
        parent(eng, pid, fut, queued, gate, pids)
