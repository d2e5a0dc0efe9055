"""The stop path cannot be stopped (issue 19, items 6-7; issue 20, item 7): a rebuilt worker
that never finishes starting, a late wake-up, an error inside the stop itself. Every Future
ends, every arena is freed, close(timeout=) returns."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import CancelledError
from pathlib import Path

import numpy as np
import pytest

from slabpool import Engine
from slabpool.engine.caller import faults
from slabpool.engine.core.coordinator import MAX_STARTUP_FAILURES
from slabpool.workers.errors import SessionInitError, TaskCancelled
from slabpool.workers.protocol import FaultSpec
from tests.models import onnx_models
from tests.owner_hooks import DEADLOCK_S
from tests.ray_support.plugin import build
from tests.reference import ort_run
from tests.test_cancel_replay import wait_until

X = np.random.default_rng(3).standard_normal((2, 16)).astype(np.float32)


def test_a_late_wake_never_writes_into_an_fd_reused_after_the_stop(models):
    """The wake-up pipe was closed before the loop said it had stopped; a caller's wake() in
    between wrote a byte into whatever took the fd number next (another engine's pipe, a
    file). Here the numbers are taken by files at once, and the late wake-up comes after."""
    eng = Engine(models.mlp, workers=1)
    eng.infer(X)
    sup = eng._transport.selector
    numbers = sorted((sup._wake_r, sup._wake_w))
    eng.close()
    held = []
    try:
        while len(held) < 64 and not set(numbers) <= {fd for pair in held for fd in pair}:
            held.append(os.pipe())  # the lowest free numbers: those the wake-up pipe had, soon
        sup._wake_pending = False  # (as after any step that read the pipe)
        sup.wake()  # what a late call() or submit does
        for r, _ in held:
            os.set_blocking(r, False)
            with pytest.raises(BlockingIOError):
                os.read(r, 1)  # nothing was written into a pipe that is not the engine's
    finally:
        for r, w in held:
            os.close(r)
            os.close(w)


def _crash_then_hold(models, tmp_path, start_method, **kw):
    """An engine whose worker 2 (the first rebuilt) never finishes its initializer: worker 1
    is killed by its task, worker 2 waits on hold-2 (the hook's own deadline is long past
    startup_timeout)."""
    with faults.injecting():  # `start_method`: a start method, or "ray"
        eng = build(start_method, models.mlp, workers=1, initializer="tests.owner_hooks:hold_rebuilt",
                    initargs=(str(tmp_path),), **kw)
    (tmp_path / "hold-2").touch()
    killer = faults.submit(eng, X, FaultSpec("run", "sigkill", str(tmp_path / "fired")))
    wait_until((tmp_path / "started-2").exists, "worker 2 in its initializer")
    return eng, killer


def test_a_rebuilt_worker_that_never_starts_is_bounded_by_startup_timeout(models, tmp_path, start_method, caplog):
    """startup_timeout held only at construction: the slot stayed STARTING for ever, its
    queued tasks never ran, close() never returned. Now the start-up is killed at the limit
    and retried after a back-off; worker 3 starts, and every task completes."""
    eng, killer = _crash_then_hold(models, tmp_path, start_method, startup_timeout=8.0)
    with eng:
        futs = [eng.submit(X) for _ in range(4)]
        results = [f.result(timeout=DEADLOCK_S) for f in [killer, *futs]]
        st = eng.stats()
    assert all(r.outputs["probs"].shape == (2, 8) for r in results) and results[0].attempts == 2
    assert (tmp_path / "started-3").exists() and st.restarts == 2 and st.failed == 0
    assert any("startup_timeout=8.0 s" in r.getMessage() for r in caplog.records)


def test_a_slot_that_never_starts_fails_the_engine_clearly(models, tmp_path):
    """Every rebuild hangs: after MAX_STARTUP_FAILURES the engine fails, each task with a
    SessionInitError that says why; close() returns."""
    for k in range(2, 2 + MAX_STARTUP_FAILURES):
        (tmp_path / f"hold-{k}").touch()
    eng, killer = _crash_then_hold(models, tmp_path, "forkserver", startup_timeout=3.0)
    with eng:
        waiting = [eng.submit(X) for _ in range(3)]
        for f in [killer, *waiting]:
            with pytest.raises(SessionInitError, match=r"startup_timeout=3\.0 s"):
                f.result(timeout=DEADLOCK_S)


def test_a_slot_whose_starts_keep_dying_leaves_the_serving_slot_serving(models, tmp_path, caplog):
    """Two slots; one is killed by its task, and each of its next MAX_STARTUP_FAILURES + 1
    starts is SIGKILLed (from outside, as the OOM killer would): the engine does not stop (was:
    stopped at the fifth, and every task then failed with SessionInitError while the other
    slot could serve). Calls made meanwhile are served by the other slot; the killing task is
    replayed there, once; the failing slot is retried until it starts, and serves again."""
    last = 2 + MAX_STARTUP_FAILURES + 1  # workers 1, 2 start; 3..last are the killed rebuilds
    with faults.injecting():
        eng = Engine(models.mlp, workers=2, initializer="tests.owner_hooks:kill_rebuilt",
                     initargs=(str(tmp_path), 3, last))
    with eng:
        want = eng.infer(X)["probs"]
        killer = faults.submit(eng, X, FaultSpec("run", "sigkill", str(tmp_path / "fired")))
        served = []
        while not (tmp_path / f"started-{last}").exists():  # (the other slot serves meanwhile)
            served.append(eng.infer(X)["probs"])
        replayed = killer.result(timeout=DEADLOCK_S)
        wait_until(lambda: all(s.state.can_take for s in eng._sup.slots), "the failing slot started")
        after = [f.result(timeout=DEADLOCK_S).outputs["probs"] for f in [eng.submit(X) for _ in range(8)]]
        st = eng.stats()
    assert (tmp_path / f"started-{last + 1}").exists() and replayed.attempts == 2
    assert all(g.tobytes() == want.tobytes() for g in [replayed.outputs["probs"], *served, *after])
    assert st.failed == 0 and st.restarts == 1 + MAX_STARTUP_FAILURES + 1
    assert any("the other slots serve on" in r.getMessage() for r in caplog.records)


def test_every_slot_whose_starts_keep_dying_fails_the_engine_clearly(models, tmp_path):
    """Two slots, both workers SIGKILLed from outside and every start after that SIGKILLed:
    once each slot has failed MAX_STARTUP_FAILURES times in a row (none serves), the engine
    fails, every waiting task with a SessionInitError that says why; never a silent respawn
    loop. (The waiting tasks were sent to no worker that ran them: none is charged.)"""
    eng = Engine(models.mlp, workers=2, initializer="tests.owner_hooks:kill_rebuilt",
                 initargs=(str(tmp_path), 3, 10**6))
    with eng:
        eng.infer(X)
        for slot in eng._sup.slots:  # type: ignore[attr-defined]
            os.kill(slot.pid, signal.SIGKILL)
        waiting = [eng.submit(X) for _ in range(3)]  # (the engine fails ~1.5 s later, at the earliest)
        for f in waiting:
            with pytest.raises(SessionInitError, match=rf"failed to start {MAX_STARTUP_FAILURES} times in a row, "
                                                       "and no other slot serves"):
                f.result(timeout=DEADLOCK_S)
        failures = [s.startup_failures for s in eng._sup.slots]  # type: ignore[attr-defined]
    assert all(n >= MAX_STARTUP_FAILURES for n in failures), failures  # (the first there was retried meanwhile)


@pytest.mark.parametrize("timeout", [0.5, 3.0])
def test_close_with_a_timeout_returns_while_a_rebuilt_worker_hangs(models, tmp_path, backend, timeout):
    """A slot held in STARTING with tasks waiting for it (on Ray, an actor Ray restarted, in
    its constructor): close(timeout=) returns, every Future has ended (cancelled), and nothing
    is left (the conftest checks)."""
    eng, killer = _crash_then_hold(models, tmp_path, "forkserver" if backend == "local" else backend)
    waiting = [eng.submit(X) for _ in range(3)]
    done = threading.Event()
    closer = threading.Thread(target=lambda: (eng.close(timeout=timeout), done.set()), daemon=True)
    closer.start()
    assert done.wait(DEADLOCK_S), "close(timeout=) never returned"
    for f in [killer, *waiting]:
        with pytest.raises(CancelledError):
            f.result(timeout=DEADLOCK_S)
    eng._owner.join(DEADLOCK_S)  # the workers' stop may finish after close() returned


@pytest.mark.parametrize("timeout", [0.0, 0.05])
def test_close_with_a_timeout_too_short_to_drain_returns_with_every_future_done(models, tmp_path, timeout):
    """close(cancel_pending=True, timeout=0): a stacked batch held in its worker is cancelled,
    and every Future is done when close() returns (was, a hostile run: the abort's cancels were
    made after it returned, 16 Futures of two held batches not yet done)."""
    gate = tmp_path / "gate"
    eng = Engine(models.mlp, workers=1, preprocess="tests.hooks:gated", max_batch_size=8, max_batch_wait_ms=50)
    try:
        futs = [eng.submit({"x": np.ones((1, 16), np.float32), "gate": str(gate), "log": str(tmp_path / "ran")})
                for _ in range(24)]
        wait_until(lambda: (tmp_path / "ran").exists(), "the first batch held in its worker")
        eng.close(cancel_pending=True, timeout=timeout)
        assert all(f.done() for f in futs), sum(not f.done() for f in futs)
        ended = [f.cancelled() or isinstance(f.exception(), TaskCancelled) for f in futs]
        assert sum(ended) >= 8  # (the held batch at least: nothing of it ran)
    finally:
        gate.touch()
        eng._owner.join(DEADLOCK_S)  # the workers' stop may finish after close() returned


def test_a_close_cut_by_ctrl_c_leaves_the_next_close_waiting_for_real(models, tmp_path):
    """Ctrl-C while close() waits for the owner thread to drain (a task held in its worker),
    then close() again once the task is let go: the second close() returns only when every
    Future is done and no worker is left. Was: a KeyboardInterrupt inside Thread.join() marks
    the thread stopped while it still runs (CPython 3.11), so the second close() returned at
    once with the Futures pending and the workers alive, and the exit-time stop was skipped
    (multiprocessing's exit handler then SIGTERMed workers the owner thread was reaping)."""
    import sys as _sys
    import time

    assert threading.current_thread() is threading.main_thread()  # (only it runs handlers)
    gate, ran = tmp_path / "gate", tmp_path / "ran"
    eng = Engine(models.mlp, workers=1, preprocess="tests.hooks:gated")
    try:
        futs = [eng.submit({"x": np.ones((1, 16), np.float32), "gate": str(gate), "log": str(ran)}) for _ in range(2)]
        wait_until(ran.exists, "the first task held in its worker")
        pids = [s.pid for s in eng.stats().slots]
        main = threading.main_thread().ident

        def ctrl_c_in_the_join() -> None:  # once the main thread waits in the owner's join
            deadline = time.monotonic() + DEADLOCK_S
            while time.monotonic() < deadline:
                frame = _sys._current_frames().get(main)
                names = set()
                while frame is not None:
                    names.add((frame.f_code.co_name, Path(frame.f_code.co_filename).name))
                    frame = frame.f_back
                if ("join", "owner.py") in names:
                    signal.pthread_kill(main, signal.SIGINT)  # type: ignore[arg-type]
                    return
                time.sleep(0.001)

        t = threading.Thread(target=ctrl_c_in_the_join)
        t.start()
        with pytest.raises(KeyboardInterrupt):
            eng.close()
        t.join()
        assert not all(f.done() for f in futs)  # (still held: the interrupt came inside the wait)
        gate.touch()
        eng.close()
        assert all(f.done() for f in futs) and [f.exception() for f in futs] == [None, None]
        assert eng.state.name == "CLOSED"
        assert not [p for p in pids if os.path.exists(f"/proc/{p}") and "Z" not in
                    open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0]]
    finally:
        gate.touch()
        eng.close()


OOM_SCRIPT = '''
import os, resource, sys
import numpy as np
from slabpool import Engine

def main():
    big = np.ones((4 << 20, 4), np.float32)  # 64 MiB in; its 64 MiB out cannot be copied out
    small = np.ones((2, 4), np.float32)
    eng = Engine(sys.argv[1], workers=2, start_method=sys.argv[2], shm_capacity=512 << 20)
    eng.infer(small)
    vm = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (vm + (24 << 20), resource.RLIM_INFINITY))  # a real limit
    futs = [eng.submit(big if i % 3 == 0 else small) for i in range(30)]
    outcomes = []
    for f in futs:
        try:
            outcomes.append(f.result(timeout=60).outputs["y"].shape[0])
        except Exception as exc:
            outcomes.append(type(exc).__name__ + ": " + str(exc)[:80])
    eng.close(timeout=60)
    fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
           if os.path.exists(f"/proc/self/fd/{fd}")]
    print(repr((outcomes, eng.state.name, sum(t.startswith("/memfd:slabpool") for t in fds))))

if __name__ == "__main__":
    main()
'''


def test_out_of_memory_copying_one_tasks_outputs_fails_that_task_alone(models, tmp_path, start_method):
    """A real MemoryError (RLIMIT_AS in a process of its own) while copying outputs out: it
    failed the supervisor, recurred in the stop path, and left Futures pending, the engine
    DRAINING and its memfds held. Now the task whose outputs cannot be copied fails alone,
    the others complete, and the engine closes and frees everything."""
    script = tmp_path / "oom.py"
    script.write_text(OOM_SCRIPT)
    model = onnx_models.identity(tmp_path / "id.onnx", dim=4)
    proc = subprocess.run([sys.executable, str(script), str(model), start_method], capture_output=True, text=True,
                          timeout=DEADLOCK_S, cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outcomes, state, memfds = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    for i, got in enumerate(outcomes):
        if i % 3 == 0:
            assert got.startswith("TaskDataError") and "ran out of memory" in got, got
        else:
            assert got == 2
    assert (state, memfds) == ("CLOSED", 0)


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_a_start_killed_from_outside_while_the_engine_is_built_is_retried(models, tmp_path, start_method):
    """Engine() with 2 workers; the first worker to start is SIGKILLed (from outside, as the OOM
    killer would) before its Ready: its slot is retried after the back-off and Engine() returns
    a serving engine (was: Engine() raised "died during start-up", and a `slabpool run` job
    failed saying the model failed to load, with the model and the other worker fine)."""
    eng = Engine(models.mlp, workers=2, start_method=start_method, initializer="tests.owner_hooks:kill_rebuilt",
                 initargs=(str(tmp_path), 1, 1))
    with eng:
        got = eng.infer(X)["probs"]
        st = eng.stats()
    assert (tmp_path / "started-3").exists()  # (the killed start was made again)
    assert st.restarts == 1 and all(s.state == "READY" for s in st.slots)
    assert got.tobytes() == ort_run(models.mlp, {"x": X})["probs"].tobytes()


def test_starts_killed_again_and_again_while_the_engine_is_built_fail_it_saying_so(models, tmp_path):
    """Every start SIGKILLed: Engine() raises once a slot has failed MAX_STARTUP_FAILURES times
    in a row, naming the signal and the retries; never a silent respawn loop, nothing left."""
    with pytest.raises(SessionInitError, match=r"died during start-up[\s\S]*SIGKILL[\s\S]*failed 4 time\(s\) before"):
        Engine(models.mlp, workers=2, initializer="tests.owner_hooks:kill_rebuilt", initargs=(str(tmp_path), 1, 10**6))
    assert MAX_STARTUP_FAILURES == 5
