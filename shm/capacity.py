"""How many bytes of shared memory this process may really use, and from where.

memfd slabs are not bounded by the /dev/shm mount but by RAM and the cgroup memory limit;
POSIX shm is bounded by the tmpfs mounted on /dev/shm. Both are read here, once, at start.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEV_SHM = "/dev/shm"


@dataclass(frozen=True)
class Headroom:
    available: int  # bytes
    source: str  # where the figure comes from, for error messages


def mem_available() -> Headroom:
    """MemAvailable from /proc/meminfo, lowered by the cgroup v2 limit when there is one."""
    best = Headroom(_meminfo_available(), "MemAvailable in /proc/meminfo")
    cg = _cgroup_headroom()
    if cg is not None and cg < best.available:
        best = Headroom(cg, "the cgroup memory limit (memory.max - memory.current)")
    return best


def dev_shm_available(path: str = DEV_SHM) -> Headroom:
    st = os.statvfs(path)
    return Headroom(st.f_bavail * st.f_frsize, f"free space on the tmpfs at {path}")


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _cgroup_headroom() -> int | None:
    """min(memory.max - memory.current) over this process's cgroup v2 path and its parents."""
    try:
        rel = Path("/proc/self/cgroup").read_text().strip().split("::", 1)[1]
    except (OSError, IndexError):
        return None
    root = Path("/sys/fs/cgroup")
    path = root / rel.lstrip("/")
    best: int | None = None
    while True:
        try:
            limit = (path / "memory.max").read_text().strip()
            current = int((path / "memory.current").read_text())
            if limit != "max":
                room = max(int(limit) - current, 0)
                best = room if best is None else min(best, room)
        except (OSError, ValueError):
            pass
        if path == root or root not in path.parents:
            return best
        path = path.parent
