"""Crash isolation: a worker may die at any instant; the slot alone is rebuilt, its accepted
tasks replay exactly once in acceptance order, poison is quarantined.

Every fault is triggered by the task itself at a chosen stage (workers.faults), never by
sleeping and hoping. Timeouts here only catch deadlocks.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import psutil
import pytest

from slabpool import Engine
from slabpool.engine.caller import faults
from slabpool.workers.errors import PoisonTask, SessionInitError, TaskTimeout, WorkerCrashed
from slabpool.workers.protocol import FaultSpec
from tests.models import onnx_models
from tests.ray_support.plugin import RAY, build
from tests.reference import ort_run

X = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)

# (stage, action, engine settings) -> the task still completes, on its second attempt
RAY_CRASHES = {("preprocess", "sigsegv"), ("run", "exit3"), ("postprocess", "sigkill")}
CRASH_CASES = [
    ("preprocess", "sigsegv", {}),
    ("preprocess", "exit0", {}),  # exit code 0 while holding a task is a death too
    ("run", "sigkill", {}),
    ("run", "exit3", {}),
    ("run", "sigbus", {}),
    ("postprocess", "sigkill", {"postprocess": "tests.hooks:argmax_post"}),
    ("write_outputs", "sigkill", {}),
    ("write_outputs", "exit0", {}),
]


@pytest.mark.parametrize("stage,action,settings", CRASH_CASES, ids=[f"{s}-{a}" for s, a, _ in CRASH_CASES])
def test_a_crash_replays_the_task_and_rebuilds_only_that_slot(models, tmp_path, start_or_ray, stage, action, settings):
    if start_or_ray == RAY and stage == "write_outputs":
        pytest.skip("write_outputs is a local worker's stage (into the shared-memory output arena): "
                    "an actor's outputs go back through Ray's object store")
    if start_or_ray == RAY and (stage, action) not in RAY_CRASHES:
        pytest.skip("a death is a death to Ray (it says no signal): Ray runs SIGSEGV in preprocess, os._exit in "
                    "run and SIGKILL in postprocess (test_ray SIGKILL in run); the other actions are the local "
                    "run's, to keep the confined run's time")
    with faults.injecting(), build(start_or_ray, models.mlp, workers=2, **settings) as eng:
        want = eng.infer(X)
        before = {s.slot: s.pid for s in eng.stats().slots}
        fault = FaultSpec(stage, action, str(tmp_path / "fired"))
        futs = [eng.submit(X) for _ in range(3)] + [faults.submit(eng, X, fault)] + [eng.submit(X) for _ in range(3)]
        results = [f.result(timeout=60) for f in futs]
        if start_or_ray == RAY:  # Ray says a restarted actor's pid once it is up; till then, the last one's
            ready_again(eng)
        st = eng.stats()
    assert results[3].attempts == 2
    for r in results:
        for k, v in want.items():
            assert r.outputs[k].tobytes() == v.tobytes() if isinstance(v, np.ndarray) else r.outputs[k] == v
    assert st.restarts == 1 and st.completed == 8 and st.failed == 0 and st.replayed >= 1
    dead = next(s for s in st.slots if s.restarts == 1)
    other = st.slots[1 - dead.slot]
    assert dead.pid != before[dead.slot] and dead.state in ("STARTING", "READY", "BUSY")  # rebuilt in place
    assert other.pid == before[other.slot] and other.restarts == 0  # untouched


def ready_again(eng: Engine) -> None:
    deadline = time.monotonic() + 60  # only a deadlock reaches it
    while any(s.state == "STARTING" for s in eng.stats().slots):
        assert time.monotonic() < deadline, "a slot never came back"
        time.sleep(0.01)


def test_poison_task_is_quarantined_and_its_slot_mates_are_not(models, backend):
    """One worker: the poison runs, the innocent waits in the pipe (on Ray, a call queued at
    the actor); only the running one counts an attempt against itself. (Ray does not say how
    an actor died: its crashes name no signal.)"""
    poison = FaultSpec("run", "sigkill")
    signal_seen = "SIGKILL(-9)" if backend == "local" else ""
    with faults.injecting(), build(backend, models.mlp, workers=1, max_attempts=3) as eng:
        bad = faults.submit(eng, X, poison)
        good = eng.submit(X)
        with pytest.raises(PoisonTask) as info:
            bad.result(timeout=60)
        res = good.result(timeout=60)
        after = eng.infer(X)  # the engine keeps serving
        st = eng.stats()
    err = info.value
    assert err.task_id == 0 and len(err.crashes) == 3
    assert all(c.signal == signal_seen for c in err.crashes)
    assert isinstance(err.__cause__, WorkerCrashed) and err.__cause__.signal == signal_seen
    assert res.attempts >= 2 and after["probs"].shape == (2, 8)
    assert (st.quarantined, st.failed, st.restarts) == (1, 1, 3)
    assert st.accepted == st.completed + st.failed + st.cancelled


def test_sigbus_is_reported_as_a_shared_memory_problem(models):
    with faults.build(Engine, models.mlp, workers=1, max_attempts=1) as eng:
        with pytest.raises(PoisonTask) as info:
            faults.submit(eng, X, FaultSpec("run", "sigbus")).result(timeout=60)
    cause = info.value.__cause__
    assert isinstance(cause, WorkerCrashed) and cause.signal == "SIGBUS(-7)"
    assert "shared-memory" in str(cause) and "--shm-size" in str(cause)


def test_replay_is_deterministic_with_random_augmentation(models, tmp_path, backend):
    """Each task's seed comes from (engine seed, task id) and is set before preprocess (the
    actor draws it as a local worker does: workers.pipeline.seed_task)."""
    items = [{"x": X} for _ in range(4)]
    with build(backend, models.mlp, workers=1, preprocess="tests.hooks:augment", seed=7) as eng:
        clean = [r.outputs["probs"] for r in eng.map(items)]
    fault = FaultSpec("run", "sigkill", str(tmp_path / "once"))
    with faults.injecting(), build(backend, models.mlp, workers=1, preprocess="tests.hooks:augment", seed=7) as eng:
        futs = [faults.submit(eng, it, fault if i == 2 else None) for i, it in enumerate(items)]
        replayed = [f.result(timeout=60) for f in futs]
    assert replayed[2].attempts == 2
    assert [r.outputs["probs"].tobytes() for r in replayed] == [c.tobytes() for c in clean]
    assert clean[0].tobytes() != clean[1].tobytes()  # the augmentation really is random per task


def test_hung_task_in_python_kills_its_slot_and_others_replay(models, backend):
    with build(backend, models.mlp, workers=1, preprocess="tests.hooks:slow_preprocess", task_timeout=0.5) as eng:
        pid = eng.stats().slots[0].pid
        hung = eng.submit({"x": X, "seconds": 3600})
        after = eng.submit({"x": X})
        with pytest.raises(TaskTimeout, match="task_timeout"):
            hung.result(timeout=60)
        res = after.result(timeout=60)
        st = eng.stats()
    assert res.pid != pid and res.attempts == 2
    assert st.timeouts == 1 and st.failed == 1 and st.completed == 1


def test_long_onnx_run_is_stopped_cleanly_without_killing_the_worker(tmp_path, backend):
    """ONNX Runtime's RunOptions.terminate stops the run; the slot survives.

    ORT sees the flag between nodes (20-80 ms each here, 64 of them: a run of 1.3-5 s): the
    limit (1 s) leaves it a second until the supervisor's kill at twice the limit, a dozen
    nodes' worth on a loaded machine (at a 0.3 s limit, 16 nodes, a loaded run's kill came
    first once; at 0.05 s the two had raced)."""
    model = onnx_models.slow(tmp_path / "slower.onnx", k=64, dim=512)
    big = np.random.default_rng(0).standard_normal((8192, 512)).astype(np.float32)
    with build(backend, model, workers=1, task_timeout=1.0) as eng:
        pid = eng.stats().slots[0].pid
        with pytest.raises(TaskTimeout, match="terminated"):
            eng.submit({"x": big}).result(timeout=60)
        small = eng.submit({"x": big[:1]}).result(timeout=60)
        st = eng.stats()
    assert small.pid == pid and st.restarts == 0 and st.timeouts == 1


def test_death_during_session_start_up_at_construction_fails_fast(models, tmp_path, start_method):
    t0 = time.monotonic()
    with pytest.raises(SessionInitError, match="SIGSEGV"):
        faults.build(Engine, models.mlp, workers=2, start_method=start_method, init=FaultSpec("init", "sigsegv"))
    assert time.monotonic() - t0 < 30


def test_death_during_a_respawn_start_up_backs_off_and_recovers(models, tmp_path):
    with faults.build(Engine, models.mlp, workers=1) as eng:
        faults.set_init_fault(eng, FaultSpec("init", "exit3", str(tmp_path / "init-once")))
        res = faults.submit(eng, X, FaultSpec("run", "sigkill", str(tmp_path / "run-once"))).result(timeout=60)
        st = eng.stats()
    assert res.attempts == 2 and st.restarts == 2  # the crash, then the failed start


def test_repeated_start_up_deaths_fail_the_engine_with_a_clear_error(models):
    with faults.build(Engine, models.mlp, workers=1) as eng:
        faults.set_init_fault(eng, FaultSpec("init", "exit3"))
        fut = faults.submit(eng, X, FaultSpec("run", "sigkill"))
        with pytest.raises(SessionInitError, match="failed to start 5 times"):
            fut.result(timeout=60)
        with pytest.raises(SessionInitError):
            eng.submit(X)  # while the owner thread stops the engine, or after: the same error
        assert eng._owner.join(30) and eng._state.name == "CLOSED"
        with pytest.raises(SessionInitError, match="failed to start 5 times"):
            eng.submit(X)  # the engine failed: submit() says why, not "after close()"


@pytest.mark.parametrize("spare", [2, 3, 4, 6])
def test_an_engine_made_in_a_process_out_of_file_descriptors_says_so(models, spare):
    """Engine() in a process at its limit on open files, a few to spare: SessionInitError
    naming RLIMIT_NOFILE, whichever part of the start ran out (its selector's pipe, an arena,
    a worker), and nothing left behind. Was, with fewer than ~4 to spare: a bare OSError from
    the selector's os.pipe(), and with 3 an arena's memfd left open (mmap dups the fd, and
    failed). (With one or none, the model file's own open says so: OSError, its name.)"""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 64, hard))
    try:
        with contextlib.suppress(OSError):  # every fd the limit allows taken, then `spare` given back
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        for _ in range(spare):
            os.close(held.pop())
        with pytest.raises(SessionInitError, match=r"out of file descriptors.*RLIMIT_NOFILE"):
            Engine(models.mlp, workers=1)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_rebuild_in_a_process_out_of_file_descriptors_is_retried_and_the_other_slot_serves(
    models, method, caplog, out_of_fds
):
    """A server at its limit on open files when a worker dies: its slot's new process cannot
    be made (EMFILE). That start fails alone, named, and is retried after the back-off; the
    other slot (the same process: not taken down with it) serves every call meanwhile; once
    files are closed the slot comes back. (The OSError stopped the whole engine from the owner
    thread; through the forkserver, a start that failed midway killed it, and every worker
    it had started read as dead.)"""

    def until(cond, what: str) -> None:
        deadline = time.monotonic() + 60  # (a deadlock guard: the back-off is at most 5 s)
        while not cond():
            assert time.monotonic() < deadline, f"never: {what}"
            time.sleep(0.01)

    want = ort_run(models.mlp, {"x": X})["probs"].tobytes()
    with caplog.at_level("WARNING", logger="slabpool.engine"), \
            Engine(models.mlp, workers=2, start_method=method) as eng:
        assert eng.infer(X)["probs"].tobytes() == want
        pids = [s.pid for s in eng.stats().slots]
        slots = eng._owner.slots  # (no stats() while out of files: it reads /proc)
        with out_of_fds(32):
            os.kill(pids[0], signal.SIGKILL)
            until(lambda: "could not be started" in caplog.text, "the rebuild refused")
            served = [eng.infer(X)["probs"].tobytes() for _ in range(20)]
            assert slots[0].state.name == "DEAD" and slots[1].state.name in ("READY", "BUSY")
        until(lambda: all(s.state.name == "READY" for s in slots), "slot 0 back")
        after = eng.infer(X)["probs"].tobytes()
        st = eng.stats()
    assert served == [want] * 20 and after == want
    assert st.slots[1].pid == pids[1] and st.slots[0].pid != pids[0]
    assert st.state == "ACCEPTING" and st.failed == 0 and st.restarts >= 2
    assert "RLIMIT_NOFILE" in caplog.text and "the engine stopped" not in caplog.text


def test_recycling_by_task_count_and_memory_loses_nothing(models, backend):
    xs = [X + i for i in range(12)]
    for settings in ({"max_tasks_per_worker": 3}, {"worker_memory_limit": 1}):
        with build(backend, models.mlp, workers=2, **settings) as eng:
            results = list(eng.map(xs))
            st = eng.stats()
        assert [r.attempts for r in results] == [1] * 12
        assert len({r.pid for r in results}) >= 4 and st.restarts == 0 and st.completed == 12
        for x, r in zip(xs, results):
            assert r.outputs["probs"].tobytes() == ort_run(models.mlp, {"x": x})["probs"].tobytes()


@pytest.mark.slow
def test_chaos_random_sigkills_every_task_ends_exactly_once(models, start_method):
    r = np.random.default_rng(3)
    xs = [r.standard_normal((int(n), 16)).astype(np.float32) for n in r.integers(1, 8, 2000)]
    kills: list[int] = []
    due = threading.Semaphore(0)  # released every 80 completions: kills keep pace with the work
    done = threading.Event()
    with Engine(models.mlp, workers=2, max_attempts=1000, start_method=start_method) as eng:

        def killer() -> None:
            rnd = random.Random(5)
            while not done.is_set():
                if not due.acquire(timeout=0.1):
                    continue
                while not done.is_set():
                    busy = [s.pid for s in eng.stats().slots  # a killed one may still read BUSY
                            if s.state == "BUSY" and s.pid and s.pid not in kills]  # until reaped
                    if busy:
                        pid = rnd.choice(busy)
                        try:
                            os.kill(pid, signal.SIGKILL)
                            kills.append(pid)
                            break
                        except ProcessLookupError:
                            pass
                    time.sleep(0.001)

        t = threading.Thread(target=killer, daemon=True)
        t.start()
        completions: list = []

        def completed(f) -> None:
            completions.append(f)
            if len(completions) % 80 == 0:
                due.release()

        try:
            futs = []
            for x in xs:
                futs.append(eng.submit({"x": x}))
                futs[-1].add_done_callback(completed)
            results = [f.result(timeout=120) for f in futs]
        finally:
            done.set()
            t.join()
        deadline = time.monotonic() + 60  # only a deadlock reaches it: the last death is settled
        while eng.stats().restarts < len(kills) and time.monotonic() < deadline:
            time.sleep(0.01)
        st = eng.stats()
    assert len(kills) >= 10 and st.restarts == len(kills)  # each kill one death, one rebuild
    assert len(completions) == len(futs) and st.completed == len(xs) and st.failed == 0
    for x, res in zip(xs, results):
        assert res.outputs["probs"].tobytes() == ort_run(models.mlp, {"x": x})["probs"].tobytes()


@pytest.mark.slow
def test_chaos_with_outputs_written_in_place(models):
    """SIGKILLs while ONNX Runtime writes 1 MiB outputs straight into the output arena: a
    dead worker's half-written region is never read, every task ends once, byte-identical."""
    r = np.random.default_rng(4)
    xs = [r.standard_normal((1, 256 * 1024)).astype(np.float32) for _ in range(600)]
    kills: list[int] = []
    with Engine(models.payload, workers=2, max_attempts=1000) as eng:
        futs = []
        for i, x in enumerate(xs):
            futs.append(eng.submit({"x": x}))
            if i % 40 == 39:  # a kill per 40 submissions, of a worker that holds work
                busy = [s.pid for s in eng.stats().slots if s.state == "BUSY" and s.pid]
                if busy:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(busy[i % len(busy)], signal.SIGKILL)
                        kills.append(busy[i % len(busy)])
        results = [f.result(timeout=120) for f in futs]
        st = eng.stats()
    assert len(kills) >= 5 and st.restarts >= 5 and st.failed == 0 and st.completed == len(xs)
    assert st.outputs_in_place > len(xs) // 2
    for x, res in zip(xs, results):
        assert res.outputs["y"].tobytes() == (x * 2).tobytes()


SUPERVISOR = textwrap.dedent(
    """
    import sys, time
    from slabpool import Engine
    if __name__ == "__main__":
        eng = Engine(sys.argv[1], workers=2, shm_backend=sys.argv[2])
        eng.infer(__import__("numpy").zeros((1, 16), "float32"))
        print(" ".join(str(s.pid) for s in eng.stats().slots), eng._instance, flush=True)
        time.sleep(600)
    """
)


@pytest.mark.parametrize("backend", ["memfd", "posix"])
def test_supervisor_sigkill_leaves_no_worker_and_no_shared_memory(models, tmp_path, backend):
    script = tmp_path / "supervisor.py"
    script.write_text(SUPERVISOR)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, str(script), str(models.mlp), backend], stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline().split()
    pids, instance = [int(p) for p in line[:-1]], line[-1]
    proc.kill()
    proc.wait()
    proc.stdout.close()
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), "workers outlived their supervisor"
    assert not _memfds_of(instance), "a memfd of the dead instance is still mapped somewhere"
    leftovers = [n for n in os.listdir("/dev/shm") if instance in n]
    if backend == "posix":  # only the instance lock can remain; the next start sweeps it
        assert leftovers == [f"slabpool-{instance}.lock"]
        Engine(None, workers=1, preprocess="tests.hooks:double", shm_backend="posix").close()
    assert not [n for n in os.listdir("/dev/shm") if instance in n]


STALLED = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    from slabpool import Engine
    if __name__ == "__main__":
        eng = Engine(sys.argv[1], workers=2, start_method=sys.argv[2], preprocess="tests.hooks:gil_stall")
        eng.infer({"x": np.zeros((1, 16), "float32")})
        pids = [s.pid for s in eng.stats().slots]
        eng.submit({"x": np.zeros((1, 16), "float32"), "stall": 300, "log": sys.argv[3]})
        while not os.path.exists(sys.argv[3]):
            time.sleep(0.005)
        print(" ".join(map(str, pids)), flush=True)
        time.sleep(600)
    """
)


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_supervisor_sigkill_ends_a_worker_stuck_holding_the_gil(models, tmp_path, start_method):
    """A worker stuck in native code that holds the GIL (no Python thread of it can run) when
    the supervisor is SIGKILLed: it is killed at once all the same, the other too (the
    kernel signals a pipe's reader when its last writer closes: workers/main._watch_parent).
    Was: the stuck worker, its forkserver and the resource tracker outlived the supervisor
    for as long as the native code held on."""
    script = tmp_path / "stalled.py"
    script.write_text(STALLED)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, str(script), str(models.mlp), start_method, str(tmp_path / "stalled")],
                            stdout=subprocess.PIPE, text=True, env=env)
    pids: list[int] = []
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        tree = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 30  # (at once, in fact: this only catches a worker left)
        while any(_alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(pids) == 2 and not [p for p in tree if _alive(p)], "processes outlived their supervisor"
    finally:
        proc.kill()
        proc.stdout.close()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (it may vanish while we look)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _memfds_of(instance: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if instance in os.readlink(f"/proc/{pid}/fd/{fd}"):
                    found.append(pid)
            with open(f"/proc/{pid}/maps") as f:
                if instance in f.read():
                    found.append(pid)
        except OSError:
            continue
    return found


def test_an_internal_bug_mid_completion_fails_every_task_it_held(models, backend):
    """A bug on the supervisor thread while a batch is out of its slot and not yet settled
    (what a completion does) fails the engine loudly: that batch's task gets the
    EngineInternalError, like every other, and nothing waits for ever."""
    from slabpool.workers.errors import EngineInternalError

    with build(backend, None, workers=1, preprocess="tests.fault_hooks:pre") as eng:
        hung = eng.submit({"x": np.ones(3), "fault": "hang"})
        sup = eng._owner
        deadline = time.monotonic() + 60  # only a deadlock reaches it
        while not any(s.batches for s in sup.slots) and time.monotonic() < deadline:
            time.sleep(0.01)

        def bug() -> None:
            next(s for s in sup.slots if s.batches).batches.popleft()  # mid-completion ...
            raise RuntimeError("a bug in the supervisor")  # ... a bug

        with pytest.raises(RuntimeError, match="a bug in the supervisor"):
            sup.call(bug).result(timeout=30)
        with pytest.raises(EngineInternalError, match="a bug in the supervisor"):
            hung.result(timeout=60)


def test_a_failed_engine_tells_its_callers_before_it_stops_its_workers(models, monkeypatch):
    """The engine fails (a bug on the supervisor thread) while a worker hangs, and that
    worker's death is slow to come (an actor's on Ray, a process in the kernel's hands; here
    the failure's SIGKILL left out and the graces 600 s): the callers get the error at once,
    while it is still alive, not after the stop path has waited for it."""
    from slabpool.engine.core import coordinator, stopping
    from slabpool.engine.local import transport
    from slabpool.workers.errors import EngineInternalError

    monkeypatch.setattr(stopping, "SHUTDOWN_GRACE", 600.0)
    monkeypatch.setattr(transport, "RETIRE_GRACE", 600.0)
    with build("local", None, workers=1, preprocess="tests.fault_hooks:pre") as eng:
        hung = eng.submit({"x": np.ones(3), "fault": "hang"})
        queued = eng.submit({"x": np.ones(3)})
        sup = eng._owner
        deadline = time.monotonic() + 60  # only a deadlock reaches it
        while not any(s.batches for s in sup.slots) and time.monotonic() < deadline:
            time.sleep(0.01)
        pid = eng.stats().slots[0].pid
        monkeypatch.setattr(coordinator.Coordinator, "kill", lambda *a: None)  # (its death: slow to come)

        def bug() -> None:
            raise RuntimeError("a bug in the supervisor")

        with pytest.raises(RuntimeError, match="a bug in the supervisor"):
            sup.call(bug).result(timeout=30)
        for fut in (hung, queued):
            with pytest.raises(EngineInternalError, match="a bug in the supervisor"):
                fut.result(timeout=60)
        assert psutil.Process(pid).status() != psutil.STATUS_ZOMBIE  # still alive: told first
        os.kill(pid, signal.SIGKILL)  # (the stop path's wait ends with its death)
