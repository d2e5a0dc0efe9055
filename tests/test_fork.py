"""os.fork() of a process that holds an Engine (engine/local/forks.py): whatever the child does
with the engine it inherited, and however it exits, the parent's workers get no signal, and
its task in flight and later tasks succeed. Each case is a real script (tests/fork_script.py):
a child that returns from pytest's own code would go on running the test session."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("fork_script.py")
CASES = [  # (what the child does, start method, shm backend)
    *[(how, "forkserver", "memfd") for how in ("exit", "sys.exit", "raise", "close", "submit", "cancel_queued", "drop",
                                                "new_engine")],
    *[(how, "spawn", "memfd") for how in ("exit", "close", "new_engine")],
    ("close", "forkserver", "posix"),  # the child never unlinks the parent's instance lock
]
EXIT = {"sys.exit": 3, "raise": 1}


def _run(model: Path, tmp: Path, how: str, method: str, backend: str) -> tuple[dict[str, object], str, str]:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, str(SCRIPT), str(model), method, how, str(tmp), backend],
                         capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, (out.stdout, out.stderr)
    return json.loads(lines[0]), out.stdout, out.stderr


@pytest.mark.parametrize(("how", "method", "backend"), CASES)
def test_a_forked_child_never_touches_the_parents_workers(models, tmp_path, how, method, backend) -> None:  # type: ignore[no-untyped-def]
    seen, stdout, stderr = _run(models.mlp, tmp_path, how, method, backend)
    assert seen == {"child_exit": EXIT.get(how, 0), "first": ["logits", "probs"], "later": 4, "restarts": 0,
                    "same_pids": True, "failed": 0, "lock_kept": True}, stderr
    assert "SIGTERM" not in stderr and "died" not in stderr and "Exception ignored" not in stderr, stderr
    if how == "submit":  # submit, infer and reload say why; cancel does not hang
        said = [ln for ln in stdout.splitlines() if ln.startswith("child: EngineClosed")]
        assert len(said) == 3 and all("inherited it through fork()" in ln for ln in said), stdout
        assert "child: cancel -> False" in stdout
    if how == "cancel_queued":  # was: True, and the child's copies of the queue and memory were touched
        assert "child: queued cancel -> False False False" in stdout and "parent: queued ['logits', 'probs']" in stdout
    if how == "new_engine":
        assert "child: own engine ['logits', 'probs']" in stdout


ORPHAN_SCRIPT = '''
import json, os, sys, time
import numpy as np
from slabpool import Engine

if __name__ == "__main__":
    eng = Engine(sys.argv[1], workers=2, start_method=sys.argv[2])
    eng.infer({"x": np.ones((1, 16), np.float32)})
    workers = [s.pid for s in eng.stats().slots]
    child = os.fork()
    if child == 0:  # a child that lives on and never touches the engine (a daemon, a logger)
        time.sleep(120)
        os._exit(0)
    print(json.dumps({"workers": workers, "child": child}), flush=True)
    time.sleep(120)
'''


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_workers_exit_when_their_parent_is_killed_while_a_child_it_forked_lives(models, tmp_path, method) -> None:  # type: ignore[no-untyped-def]
    """The engine's process forks a child that lives on, then is SIGKILLed: its workers exit
    on their own (the parent-death watch) while that child still lives. Was: they lived as
    long as the child, which held the parent's ends of their pipes."""
    import signal
    import time

    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, str(script), str(models.mlp), method], stdout=subprocess.PIPE,
                            text=True, env=env)
    seen: dict[str, object] = {}
    try:
        assert proc.stdout is not None
        seen = json.loads(proc.stdout.readline())
        proc.kill()
        proc.wait(60)
        workers = seen["workers"]
        assert isinstance(workers, list) and len(workers) == 2
        deadline = time.monotonic() + 60  # (the watch sees it at once; this only catches a hang)
        while not all(_gone(p) for p in workers):
            assert time.monotonic() < deadline, "the workers outlived their killed parent"
            time.sleep(0.01)
        assert not _gone(int(seen["child"]))  # type: ignore[call-overload]  # (the child lives on meanwhile)
    finally:
        proc.kill()
        for pid in [*seen.get("workers", []), seen.get("child")]:  # type: ignore[misc]
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
