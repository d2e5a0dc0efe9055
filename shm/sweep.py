"""Named objects, only for the POSIX fallback: an instance lock, and the sweep of the dead.

memfd slabs have no name and cannot outlive their last holder. The POSIX fallback names a
segment for the microseconds between shm_open and shm_unlink; a SIGKILL in that window would
leave it behind. So every instance that uses names first takes an flock on
`/dev/shm/slabpool-<instance>.lock`, held for its lifetime. The kernel drops the lock when the
process dies, whatever kills it, so "the owner is dead" is "the lock can be taken" (never a pid
check: pids are reused and per-namespace). A later start sweeps the names of dead instances.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets

from slabpool.shm.capacity import DEV_SHM

PREFIX = "slabpool-"
log = logging.getLogger("slabpool.shm")


def new_instance_id() -> str:
    return secrets.token_hex(8)


class InstanceLock:
    """flock held for the life of one instance; `release()` removes the lock file."""

    def __init__(self, instance: str, directory: str = DEV_SHM) -> None:
        self.path = os.path.join(directory, f"{PREFIX}{instance}.lock")
        self._fd: int | None = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None


def sweep_dead_instances(directory: str = DEV_SHM) -> list[str]:
    """Unlink every `slabpool-*` name whose instance lock is free (owner dead); return them."""
    try:
        names = [n for n in os.listdir(directory) if n.startswith(PREFIX)]
    except OSError:
        return []
    dead = {n[len(PREFIX) : -len(".lock")] for n in names if n.endswith(".lock")}
    dead = {inst for inst in dead if _owner_is_dead(os.path.join(directory, f"{PREFIX}{inst}.lock"))}
    live_locks = {n[len(PREFIX) : -len(".lock")] for n in names if n.endswith(".lock")} - dead
    swept = []
    for name in names:
        inst = name[len(PREFIX) :].split("-", 1)[0].removesuffix(".lock")
        if inst in live_locks:
            continue
        if inst in dead or not name.endswith(".lock"):
            # a segment with no lock file at all is orphaned too: locks are taken before names
            try:
                os.unlink(os.path.join(directory, name))
                swept.append(name)
            except FileNotFoundError:
                pass
    if swept:
        log.warning("swept %d shared-memory name(s) left by dead slabpool instances", len(swept))
    return swept


def _owner_is_dead(lock_path: str) -> bool:
    try:
        fd = os.open(lock_path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
