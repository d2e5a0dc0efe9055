"""Named objects, only for the POSIX fallback: an instance lock, and the sweep of the dead.

memfd slabs have no name and cannot outlive their last holder. The POSIX fallback names a
segment for the microseconds between shm_open and shm_unlink; a SIGKILL in that window would
leave it behind. So every instance that uses names first takes an flock on
`/dev/shm/slabpool-<instance>.lock`, held for its lifetime. The kernel drops the lock when the
process dies, whatever kills it, so "the owner is dead" is "the lock can be taken" (never a pid
check: pids are reused and per-namespace). A later start sweeps the names of dead instances.

/dev/shm is writable by anyone, so a name that looks like ours proves nothing. The sweep
removes only what it can prove is a dead instance's own:

- a lock file: our exact name (`slabpool-<16 hex>.lock`), a regular file (never a symlink: it
  is opened with O_NOFOLLOW and checked by fstat), owned by our uid, mode 0600, holding our
  marker, and its flock taken by the sweep itself (the owner is dead; it stays held while
  the instance's names go, so two sweeps never race);
- a segment: our exact name (`slabpool-<16 hex>-<label>-<16 hex>`), a regular file owned by
  our uid, of an instance whose lock the sweep holds.

Anything else (a directory, another user's file, a file of ours without the marker, a name
that does not parse, a permission error) is left alone, and the sweep goes on.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import secrets
import stat
from collections.abc import Iterator

from slabpool.shm.capacity import DEV_SHM

PREFIX = "slabpool-"
MARKER = b"slabpool instance lock v1\n"  # a lock file's whole content: what the sweep checks
_LOCK = re.compile(rf"{PREFIX}(?P<inst>[0-9a-f]{{16}})\.lock")
_SEGMENT = re.compile(rf"{PREFIX}(?P<inst>[0-9a-f]{{16}})-[a-z]+-[0-9a-f]{{16}}")
log = logging.getLogger("slabpool.shm")


def new_instance_id() -> str:
    return secrets.token_hex(8)


class InstanceLock:
    """flock held for the life of one instance; `release()` removes the lock file.

    The file gets its name only once it is locked (O_TMPFILE, then linked): a sweep never
    sees it free while its owner lives."""

    def __init__(self, instance: str, directory: str = DEV_SHM) -> None:
        if not re.fullmatch(r"[0-9a-f]{16}", instance):
            raise ValueError(f"instance id must be 16 lowercase hex digits (new_instance_id()), got {instance!r}")
        self.path = os.path.join(directory, f"{PREFIX}{instance}.lock")
        self._fd: int | None = _locked_file(directory, self.path)

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None


def _locked_file(directory: str, path: str) -> int:
    """A new file at `path` holding MARKER, flocked before it has its name where the system
    allows (else named first and locked at once)."""
    fd = _nameless_locked(directory, path)
    if fd is not None:
        return fd
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, MARKER)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _nameless_locked(directory: str, path: str) -> int | None:
    """O_TMPFILE, flock, MARKER, then linkat(AT_SYMLINK_FOLLOW) of /proc/self/fd/N to `path`
    (os.link uses linkat, which follows, only when given a dir fd). None where the filesystem
    has no O_TMPFILE or /proc is not mounted; FileExistsError if the name is taken."""
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            return None
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, MARKER)
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.link(f"/proc/self/fd/{fd}", os.path.basename(path), src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
    except FileNotFoundError:  # no /proc: the file is dropped with its fd
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def sweep_dead_instances(directory: str = DEV_SHM) -> list[str]:
    """Unlink the names of every dead instance that provably is ours; return them."""
    try:
        with os.scandir(directory) as it:
            entries = [e for e in it if e.name.startswith(PREFIX)]
    except OSError:
        return []
    segments: dict[str, list[os.DirEntry[str]]] = {}
    for e in entries:
        m = _SEGMENT.fullmatch(e.name)
        if m:
            segments.setdefault(m["inst"], []).append(e)
    swept: list[str] = []
    for e in entries:
        m = _LOCK.fullmatch(e.name)
        if m is None:
            continue
        with _dead_lock(e) as dead:
            if dead:
                swept += [s.name for s in segments.get(m["inst"], []) if _ours(s) and _unlink(s.path)]
                if _unlink(e.path):  # last, while still locked: a crash here leaves it for the next
                    swept.append(e.name)
    if swept:
        log.warning("swept %d shared-memory name(s) left by dead slabpool instances", len(swept))
    return swept


def _ours(entry: os.DirEntry[str]) -> bool:
    """A regular file (not followed if a link) owned by this user."""
    try:
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


@contextlib.contextmanager
def _dead_lock(entry: os.DirEntry[str]) -> Iterator[bool]:
    """True (the flock held until exit) if `entry` is a lock file of ours whose owner is dead."""
    if not _ours(entry):
        yield False
        return
    try:
        fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        yield False
        return
    try:
        yield _is_dead_lock(fd, entry)
    finally:
        os.close(fd)


def _is_dead_lock(fd: int, entry: os.DirEntry[str]) -> bool:
    try:
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o600):
            return False
        if st.st_ino != entry.inode() or os.pread(fd, len(MARKER) + 1, 0) != MARKER:
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # BlockingIOError: the owner lives
        return False
    return True


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
    except OSError as exc:  # gone already, or not ours to remove after all
        if exc.errno != errno.ENOENT:
            log.debug("sweep left %s: %s", path, exc)
        return False
    return True
