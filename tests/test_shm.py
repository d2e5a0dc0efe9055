"""shm: the allocator against a brute-force model, arenas with real memfds and POSIX segments,
leases, capacity errors, and the sweep of names left by a dead instance."""

from __future__ import annotations

import mmap
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from slabpool.shm import (
    Arena,
    CapacityError,
    InstanceLock,
    LeaseError,
    Mapping,
    new_instance_id,
    sweep_dead_instances,
)
from slabpool.shm.alloc import ALIGN, RangeAllocator


def test_allocator_never_overlaps_and_coalesces_back_to_one_range():
    rnd = random.Random(0)
    alloc = RangeAllocator(1 << 16)
    live: dict[int, int] = {}
    for _ in range(5000):
        if live and rnd.random() < 0.5:
            off = rnd.choice(list(live))
            alloc.free(off)
            del live[off]
            starts, sizes = alloc._starts, alloc._sizes  # the free list: sorted, and coalesced
            assert all(a + n < b for a, n, b in zip(starts, sizes, starts[1:], strict=False))
            assert alloc.used == sum(alloc_size for alloc_size in alloc._used.values())
        else:
            size = rnd.randint(1, 3000)
            off = alloc.allocate(size)
            if off is None:
                continue
            assert off % ALIGN == 0
            for o, s in live.items():  # no overlap with any live range
                assert off + size <= o or o + s <= off
            live[off] = size
    for off in list(live):
        alloc.free(off)
    assert alloc.used == 0 and alloc.largest_free == 1 << 16
    with pytest.raises(KeyError, match="double free"):
        alloc.free(0)


@pytest.mark.parametrize("backend", ["memfd", "posix"])
def test_arena_leases_views_and_double_release(backend):
    arena = Arena("t", 4 << 20, backend=backend, instance="test", commit_step=1 << 20)
    try:
        a, b = arena.lease(1000), arena.lease(1 << 20)
        assert a.offset % 64 == 0 and b.offset >= a.offset + 1000
        view = arena.array(a.offset, np.dtype("<f4"), (250,))
        view[:] = 7
        assert arena.committed >= b.offset + (1 << 20)  # grown (fallocate + pre-fault) on demand
        arena.release(a)
        with pytest.raises(LeaseError):
            arena.release(a)
        with pytest.raises(CapacityError):
            arena.lease(8 << 20)
        with pytest.raises(TimeoutError):
            arena.lease(4 << 20, timeout=0.05)  # would fit an empty arena, but b holds 1 MiB
        got: list = []
        t = threading.Thread(target=lambda: got.append(arena.lease(3 << 20, timeout=30)))
        t.start()
        arena.release(b)  # wakes the waiter
        t.join(30)
        assert got and got[0].nbytes == 3 << 20
        del view
    finally:
        arena.close()
    assert not [n for n in os.listdir("/dev/shm") if "slabpool-test" in n]  # never a name left


def test_a_worker_mapping_reads_what_the_supervisor_wrote_and_cannot_resize_it():
    arena = Arena("t", 1 << 20, instance="test")
    try:
        lease = arena.lease(64)
        arena.array(lease.offset, np.dtype("<i8"), (8,))[:] = np.arange(8)
        fd = os.dup(arena.fd)
        m = Mapping(os.dup(fd), arena.capacity, writable=False)
        assert list(m.array(lease.offset, np.dtype("<i8"), (8,))) == list(range(8))
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)  # sealed: no holder can shrink it under the others (SIGBUS)
        with pytest.raises(ValueError, match="read-only"):
            m.array(lease.offset, np.dtype("<i8"), (8,))[0] = 1  # read-only for inputs
        os.close(fd)
        del m
    finally:
        arena.close()


DEAD_OWNER = textwrap.dedent(
    """
    import os, sys, time
    from slabpool.shm import InstanceLock
    lock = InstanceLock(sys.argv[1])
    fd = os.open("/dev/shm/slabpool-" + sys.argv[1] + "-in-0123456789abcdef", os.O_CREAT | os.O_RDWR, 0o600)
    print("ready", flush=True)
    time.sleep(600)
    """
)


def test_sweep_removes_names_of_a_dead_instance_only(tmp_path):
    live, dead = new_instance_id(), new_instance_id()
    live_seg = f"/dev/shm/slabpool-{live}-in-0123456789abcdef"
    live = InstanceLock(live)
    open(live_seg, "w").close()
    script = tmp_path / "owner.py"
    script.write_text(DEAD_OWNER)
    proc = subprocess.Popen([sys.executable, str(script), dead], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert sweep_dead_instances() == []  # the owner is alive: its lock is held
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        swept = sorted(sweep_dead_instances())
        assert swept == [f"slabpool-{dead}-in-0123456789abcdef", f"slabpool-{dead}.lock"]
        assert os.path.exists(live_seg)  # a live instance's names are never touched
    finally:
        proc.stdout.close()
        os.unlink(live_seg)
        live.release()


def test_mmap_page_alignment_assumption():
    assert mmap.PAGESIZE % ALIGN == 0


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `addr` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.parametrize("nbytes", [64, 4 << 20, 9 << 20])
def test_private_copies_are_owned_and_large_ones_ask_for_ordinary_pages(nbytes):
    from slabpool.shm.pages import HUGE, private_copy

    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)[::1]
    view = src.view(np.float32).reshape(-1, 4) if nbytes % 16 == 0 else src
    got = private_copy(view)
    assert got.tobytes() == view.tobytes() and got.flags.owndata and got.flags.writeable and got.flags.c_contiguous
    if nbytes >= HUGE:  # MADV_NOHUGEPAGE shows as "nh" on the mapping that holds it
        assert "nh" in _vm_flags(got.ctypes.data + got.nbytes // 2)


_RUNS_OUT = """
import os
import numpy as np
from slabpool import Engine
from slabpool.workers.errors import ShmCapacityError

def main():
    with Engine(None, workers=1, preprocess="tests.fault_hooks:pre", shm_capacity=16 << 20,
                shm_backend="posix") as eng:
        assert list(eng.submit({"x": np.ones(3)}).result(60).outputs) == ["y"]
        free = os.statvfs("/dev/shm")
        with open("/dev/shm/filler", "wb") as f:  # another program takes all but 1 MiB
            os.posix_fallocate(f.fileno(), 0, free.f_bavail * free.f_frsize - (1 << 20))
        try:
            eng.submit({"x": np.ones(3), "fault": "big", "nbytes": 12 << 20}).result(60)
            raise SystemExit("12 MiB of outputs: no error")
        except ShmCapacityError as exc:
            assert "could not be backed" in str(exc) and "No space left" in str(exc), exc
        try:
            eng.submit({"x": np.ones(1536 << 10)})
            raise SystemExit("12 MiB of inputs: no error")
        except ShmCapacityError as exc:
            assert "in arena" in str(exc) and "No space left" in str(exc), exc
        assert list(eng.submit({"x": np.ones(3)}).result(60).outputs) == ["y"]
        st = eng.stats()
        assert (st.state, st.accepted, st.completed, st.failed) == ("ACCEPTING", 3, 2, 1), st
        os.unlink("/dev/shm/filler")
    print("served on")

if __name__ == "__main__":
    main()
"""


def test_shared_memory_that_runs_out_after_the_start_fails_the_task_not_the_engine(tmp_path):
    """/dev/shm fills up (another program) after the engine started, so an arena cannot grow
    past what it has backed: a task whose outputs need more fails with ShmCapacityError, and
    so does a submit whose inputs need more; the engine serves on. (The output arena's
    failure went up the owner thread and stopped the engine; the input's was the shm package's
    own CapacityError.) In a mount namespace with a /dev/shm of 40 MiB of its own."""
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs a mount namespace of its own (unshare -m, as root) for a small /dev/shm")
    script = tmp_path / "runs_out.py"
    script.write_text(_RUNS_OUT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    got = subprocess.run(
        ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size=40m tmpfs /dev/shm && exec "{sys.executable}" "{script}"'],
        capture_output=True, text=True, timeout=300, cwd=root, env=env)  # (a deadlock guard)
    assert got.returncode == 0 and "served on" in got.stdout, got.stderr[-4000:]
