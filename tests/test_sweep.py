"""The start-up sweep of the POSIX fallback (shm/sweep.py) removes a dead instance's own names
and nothing else, and survives whatever else /dev/shm holds: anyone may write there.

Dead instances are real: a child process takes its lock (and names its segments) and exits
without releasing it; the kernel drops the flock. The family runs in a private directory;
one test starts a real Engine past hostile names in /dev/shm itself.
"""

from __future__ import annotations

import ast
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from slabpool import Engine
from slabpool.shm import InstanceLock, new_instance_id, sweep_dead_instances

NOBODY = 65534
TOKEN = "0123456789abcdef"
_DIE_HOLDING = textwrap.dedent(
    """
    import os, sys
    from slabpool.shm import InstanceLock
    directory, instances = sys.argv[1], sys.argv[2:]
    for inst in instances:
        InstanceLock(inst, directory)  # never released: dies with this process
        for label in ("in", "out"):
            open(os.path.join(directory, f"slabpool-{inst}-{label}-0123456789abcdef"), "w").close()
    os._exit(0)
    """
)


def _dead(directory: Path, *instances: str) -> None:
    """Each instance's lock and two segments, left by a process that died holding them."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    subprocess.run([sys.executable, "-c", _DIE_HOLDING, str(directory), *instances], check=True, env=env)


def _names(inst: str) -> list[str]:
    return [f"slabpool-{inst}-in-{TOKEN}", f"slabpool-{inst}-out-{TOKEN}", f"slabpool-{inst}.lock"]


def _lock_name(inst: str) -> str:
    return f"slabpool-{inst}.lock"


# -- what must survive. Each builds its names in directory d (which also holds a dead
# instance of ours, swept) and returns the names of d that the sweep must leave as they are.

def _directories(d: Path) -> list[str]:
    names = [_lock_name(new_instance_id()), f"slabpool-{new_instance_id()}-in-{TOKEN}", "slabpool-x"]
    for n in names:
        (d / n).mkdir()
        (d / n / "inside").write_text("kept")
    inst = new_instance_id()  # and a dead instance of ours whose segment name is a directory
    _dead(d, inst)
    os.unlink(d / f"slabpool-{inst}-in-{TOKEN}")
    os.mkdir(d / f"slabpool-{inst}-in-{TOKEN}")
    _SWEPT.extend([f"slabpool-{inst}-out-{TOKEN}", _lock_name(inst)])
    return [*names, f"slabpool-{inst}-in-{TOKEN}"]


def _foreign_names(d: Path) -> list[str]:
    names = ["slabpool-notours", "slabpool-", "slabpool-ABCDEF0123456789.lock", f"slabpool-{TOKEN}-in-short",
             f"slabpool-{TOKEN}.lock.bak", f"slabpool-{TOKEN}-in-{TOKEN}"]  # last: a segment with no lock
    for n in names:
        (d / n).write_text("someone else's")
    return names


def _locks_without_marker(d: Path) -> list[str]:
    kept = []
    for content in (b"", b"not a slabpool lock\n", b"slabpool instance lock v1\nand more\n"):
        inst = new_instance_id()
        (d / _lock_name(inst)).write_bytes(content)
        os.chmod(d / _lock_name(inst), 0o600)
        (d / f"slabpool-{inst}-in-{TOKEN}").write_text("data")
        kept += [_lock_name(inst), f"slabpool-{inst}-in-{TOKEN}"]
    return kept


def _lock_of_another_mode(d: Path) -> list[str]:
    _dead(d, inst := new_instance_id())
    os.chmod(d / _lock_name(inst), 0o644)
    return _names(inst)


def _other_users(d: Path) -> list[str]:
    if os.geteuid() != 0:
        pytest.skip("needs root to make files of another user")
    _dead(d, inst := new_instance_id(), other := new_instance_id())
    for n in _names(inst):  # a whole instance of another user
        os.chown(d / n, NOBODY, NOBODY)
    os.chown(d / f"slabpool-{other}-in-{TOKEN}", NOBODY, NOBODY)  # one segment in a dead one of ours
    _SWEPT.extend([f"slabpool-{other}-out-{TOKEN}", _lock_name(other)])
    return [*_names(inst), f"slabpool-{other}-in-{TOKEN}"]


def _symlinks(d: Path) -> list[str]:
    """Links named like ours, to a real dead instance elsewhere: never followed, never removed
    (the outside directory is checked to be intact by the test)."""
    outside = d.parent / "outside"
    outside.mkdir()
    _dead(outside, target := new_instance_id())
    inst = new_instance_id()
    links = {_lock_name(inst): _lock_name(target), f"slabpool-{inst}-in-{TOKEN}": f"slabpool-{target}-in-{TOKEN}"}
    _dead(d, dead := new_instance_id())  # a dead instance of ours with a segment that is a link
    os.unlink(d / f"slabpool-{dead}-out-{TOKEN}")
    links[f"slabpool-{dead}-out-{TOKEN}"] = f"slabpool-{target}-out-{TOKEN}"
    for name, to in links.items():
        os.symlink(outside / to, d / name)
    _SWEPT.extend([f"slabpool-{dead}-in-{TOKEN}", _lock_name(dead)])
    return list(links)


def _fifos(d: Path) -> list[str]:
    names = [_lock_name(new_instance_id()), f"slabpool-{new_instance_id()}-in-{TOKEN}"]
    for n in names:
        os.mkfifo(d / n, 0o600)  # opening a FIFO for reading would block: it is never opened
    return names


def _a_live_instance(d: Path) -> list[str]:
    inst = new_instance_id()
    _LIVE.append(InstanceLock(inst, str(d)))
    (d / f"slabpool-{inst}-in-{TOKEN}").write_text("in use")
    return [_lock_name(inst), f"slabpool-{inst}-in-{TOKEN}"]


_LIVE: list[InstanceLock] = []  # locks a case holds (released after it)
_SWEPT: list[str] = []  # more names a case expects swept
KEPT: dict[str, Callable[[Path], list[str]]] = {
    "directories": _directories, "foreign names": _foreign_names, "locks without marker": _locks_without_marker,
    "lock of another mode": _lock_of_another_mode, "other users": _other_users, "symlinks": _symlinks,
    "fifos": _fifos, "a live instance": _a_live_instance,
}


@pytest.mark.parametrize("case", list(KEPT))
def test_the_sweep_removes_a_dead_instance_and_keeps_what_is_not_provably_its(tmp_path, case) -> None:  # type: ignore[no-untyped-def]
    d = tmp_path / "shm"
    d.mkdir()
    _dead(d, dead := new_instance_id())
    _SWEPT.clear()
    try:
        kept = {n: _identity(d / n) for n in KEPT[case](d)}
        outside = _tree(tmp_path / "outside")
        swept = sweep_dead_instances(str(d))
        assert sorted(swept) == sorted([*_names(dead), *_SWEPT])
        assert {n: _identity(d / n) for n in os.listdir(d)} == kept  # each as it was, none replaced
        assert _tree(tmp_path / "outside") == outside
        assert sweep_dead_instances(str(d)) == []  # nothing more on a second pass
    finally:
        while _LIVE:
            _LIVE.pop().release()


def _identity(p: Path) -> tuple[int, int, int]:
    st = os.lstat(p)
    return st.st_ino, stat.S_IFMT(st.st_mode), st.st_size


def _tree(p: Path) -> dict[str, tuple[int, int, int]]:
    return {n: _identity(p / n) for n in os.listdir(p)} if p.exists() else {}


def test_a_lock_file_is_never_seen_free_while_its_owner_lives(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The lock is taken before the file has its name; it holds the marker the sweep checks."""
    inst = new_instance_id()
    lock = InstanceLock(inst, str(tmp_path))
    try:
        st = os.stat(lock.path)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
        assert sweep_dead_instances(str(tmp_path)) == []
        with pytest.raises(FileExistsError):
            InstanceLock(inst, str(tmp_path))
    finally:
        lock.release()
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="16 lowercase hex digits"):
        InstanceLock("../etc", str(tmp_path))


def _sweep_as(uid: int, directory: Path) -> str:
    """sweep_dead_instances(directory) in a forked child running as `uid`: what it returned,
    or the error it raised."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: syscalls only, then _exit
        try:
            os.close(r)
            os.setgid(uid)
            os.setuid(uid)
            out = repr(sweep_dead_instances(str(directory)))
        except BaseException as exc:
            out = f"raised {exc!r}"
        os.write(w, out.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        got = f.read()
    assert os.waitpid(pid, 0)[1] == 0
    return got


def test_a_permission_error_leaves_the_names_and_the_sweep_goes_on() -> None:
    """A sweeper that may not remove what it found (a read-only directory) removes nothing
    and does not raise; once it may, it removes them (so it did look)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run the sweep as another user")
    d = Path(tempfile.mkdtemp(prefix="slabpool-sweep-test-", dir="/tmp"))  # pytest's tmp is root's alone
    try:
        _dead(d, inst := new_instance_id())
        for p in [d, *d.iterdir()]:
            os.chown(p, NOBODY, NOBODY)
        os.chmod(d, 0o555)
        assert _sweep_as(NOBODY, d) == "[]"
        assert sorted(os.listdir(d)) == sorted(_names(inst))
        os.chmod(d, 0o755)
        assert sorted(ast.literal_eval(_sweep_as(NOBODY, d))) == sorted(_names(inst))
    finally:
        shutil.rmtree(d)


def test_an_engine_starts_past_hostile_names_in_dev_shm_and_leaves_them() -> None:
    """The issue's case: a directory named like ours stopped every start (IsADirectoryError),
    and a plain file named like ours was deleted."""
    inst = new_instance_id()
    hostile = [f"/dev/shm/slabpool-{inst}.lock", f"/dev/shm/slabpool-{inst}-in-{TOKEN}"]
    foreign = "/dev/shm/slabpool-foreign-file"
    os.mkdir(hostile[0])
    os.mkdir(hostile[1])
    Path(foreign).write_text("not slabpool's")
    try:
        with Engine(None, workers=1, preprocess="tests.hooks:double", shm_backend="posix") as eng:
            assert eng.infer({"x": np.arange(3.0)})["y"].tolist() == [0.0, 2.0, 4.0]
        assert os.path.isdir(hostile[0]) and os.path.isdir(hostile[1])
        assert Path(foreign).read_text() == "not slabpool's"
    finally:
        os.rmdir(hostile[0])
        os.rmdir(hostile[1])
        os.unlink(foreign)
