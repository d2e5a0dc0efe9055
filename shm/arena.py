"""An arena: one shared-memory segment, committed as it grows, leased out in 64-byte ranges.

The supervisor creates every arena and is its only owner: it alone leases, releases, grows
and closes. A worker maps the same memory from a passed fd (`slabpool.shm.mapping`), cannot resize it
(memfd seals) and can read only the ranges a task names.

    create: memfd_create (no name, freed with its last fd or mapping)
            -> ftruncate(capacity) -> seal shrink/grow/seal -> mmap
    grow:   posix_fallocate the next step (ENOSPC here, never SIGBUS later) -> pre-fault it
    lease:  first-fit range, blocking while full; release: coalesce and wake waiters
    close:  munmap, close fd; the memory goes when the last worker's mapping goes

Fallback where memfd is missing or refused: shm_open with a random `slabpool-` name,
O_EXCL, mode 0600, unlinked at once (see `slabpool.shm.sweep` for the microseconds it has a name).
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import math
import mmap
import os
import secrets
import threading
import time
from collections.abc import Iterable
from typing import Literal, NamedTuple

import numpy as np

from slabpool.shm.alloc import RangeAllocator, align_up
from slabpool.shm.capacity import Headroom, dev_shm_available, mem_available
from slabpool.shm.errors import CapacityError, LeaseError
from slabpool.shm.sweep import PREFIX

Backend = Literal["memfd", "posix"]
MiB = 1 << 20
PAGE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_generation = itertools.count(1)
KEEP_MAX = 64 << 10  # released ranges up to this size are kept for the next lease of their size
KEEP_EACH = 4  # ... at most this many of each size


class Lease(NamedTuple):
    """A leased range of one arena. Plain data: it travels in control messages."""

    arena: str
    offset: int
    nbytes: int
    gen: int


class Arena:
    """One shared-memory segment of `capacity` bytes, leased out in ranges. Thread-safe."""

    def __init__(
        self,
        label: str,
        capacity: int,
        *,
        backend: Backend = "memfd",
        instance: str = "",
        commit_step: int = 64 * MiB,
        initial_commit: int | None = None,
    ) -> None:
        self.label = label
        self.capacity = align_up(capacity, PAGE)
        self.backend = backend
        self._step = align_up(commit_step, PAGE)
        # one lock, taken directly by `with` (a Condition's own __enter__/__exit__ are Python
        # calls); the Condition waits on it, and is notified only while someone waits
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._waiters = 0
        self._alloc = RangeAllocator(self.capacity)
        self._leases: dict[int, Lease] = {}
        # small ranges released are kept allocated for the next lease of their size (a call's
        # inputs and outputs, leased and released on every call: the first fit and the
        # coalescing were ~300 opcodes a call, docs/latency.md); all go back to the allocator
        # when a lease does not fit or someone waits for room
        self._kept: dict[int, list[int]] = {}  # aligned size -> offsets
        self._kept_bytes = 0
        self.committed = 0
        self.fd = _create_fd(backend, label, instance, self.capacity)
        self._map: mmap.mmap | None = None
        try:  # (mmap dups the fd: at the limit on open files it fails, and the fd was left open)
            self._map = mmap.mmap(self.fd, self.capacity)
            self._bytes = np.frombuffer(self._map, dtype=np.uint8)
            self._commit(min(self.capacity, initial_commit if initial_commit is not None else self._step))
        except BaseException:
            if self._map is None:
                os.close(self.fd)
            else:
                self.close()
            raise

    # -- leasing ------------------------------------------------------------------------------

    def lease(self, nbytes: int, *, timeout: float | None = None) -> Lease:
        """Lease `nbytes`, waiting up to `timeout` (None: forever) for space; TimeoutError then."""
        if align_up(max(nbytes, 1)) > self.capacity:
            raise CapacityError(
                f"a request of {nbytes} bytes cannot fit the {self.label} arena of "
                f"{self.capacity} bytes; raise shm_capacity",
                needed=nbytes,
                available=self.capacity,
            )
        with self._lock:
            got = self._try_lease_locked(nbytes)
            if got is not None:
                return got
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"no {nbytes} bytes free in the {self.label} arena")
                self._waiters += 1
                try:
                    self._cond.wait(remaining)
                finally:
                    self._waiters -= 1
                got = self._try_lease_locked(nbytes)
                if got is not None:
                    return got

    def try_lease(self, nbytes: int) -> Lease | None:
        with self._lock:
            return self._try_lease_locked(nbytes)

    def release(self, lease: Lease) -> None:
        self.release_many((lease,))

    def release_many(self, leases: Iterable[Lease]) -> None:
        """Give leases back (under one lock); LeaseError for one not held, after the others."""
        bad = None
        with self._lock:
            for lease in leases:
                held = self._leases.get(lease.offset)
                if held is None or held.gen != lease.gen:
                    bad = lease
                    continue
                del self._leases[lease.offset]
                size = align_up(lease.nbytes or 1)
                if size <= KEEP_MAX and len(kept := self._kept.setdefault(size, [])) < KEEP_EACH:
                    kept.append(lease.offset)
                    self._kept_bytes += size
                else:
                    self._alloc.free(lease.offset)
            if self._waiters:
                self._unkeep()
                self._cond.notify_all()
        if bad is not None:
            raise LeaseError(f"{bad} is not held (released twice?)")

    def _try_lease_locked(self, nbytes: int) -> Lease | None:
        size = align_up(nbytes or 1)
        kept = self._kept.get(size)
        if kept:
            offset = kept.pop()  # (committed already: it was leased before)
            self._kept_bytes -= size
        else:
            got = self._alloc.allocate(size)
            if got is None and self._kept_bytes:
                self._unkeep()
                got = self._alloc.allocate(size)
            if got is None:
                return None
            offset = got
            if offset + size > self.committed:
                try:
                    self._commit(min(self.capacity, align_up(offset + size, self._step)))
                except BaseException:
                    self._alloc.free(offset)
                    raise
        lease = Lease(self.label, offset, nbytes, next(_generation))
        self._leases[offset] = lease
        return lease

    def _unkeep(self) -> None:
        """Every kept range back to the allocator (coalesced with its neighbours)."""
        for offsets in self._kept.values():
            for offset in offsets:
                self._alloc.free(offset)
        self._kept.clear()
        self._kept_bytes = 0

    # -- memory -------------------------------------------------------------------------------

    def array(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A writeable numpy view of `[offset, offset + nbytes)`; the caller holds the lease."""
        count = math.prod(shape) * dtype.itemsize
        return self._bytes[offset : offset + count].view(dtype).reshape(shape)

    def _commit(self, upto: int) -> None:
        """Reserve backing store for [committed, upto) and fault its pages in, once."""
        if upto <= self.committed:
            return
        start, length = self.committed, upto - self.committed
        try:
            os.posix_fallocate(self.fd, start, length)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                room = _headroom(self.backend)
                raise CapacityError(
                    f"could not reserve {length} bytes of shared memory for the {self.label} "
                    f"arena ({exc.strerror}); {room.available} bytes free by {room.source}. "
                    + _FIX,
                    needed=length,
                    available=room.available,
                ) from exc
            raise
        assert self._map is not None
        try:
            self._map.madvise(_MADV_POPULATE_WRITE, start, length)
        except OSError:
            self._bytes[start:upto:PAGE] = 0  # older kernels: touch one byte a page
        self.committed = upto

    # -- status and end -----------------------------------------------------------------------

    @property
    def used(self) -> int:
        with self._lock:
            return self._alloc.used - self._kept_bytes

    @property
    def leases(self) -> int:
        with self._lock:
            return len(self._leases)

    def close(self) -> None:
        """Unmap and close. Leases still held are dropped: the owner is going away."""
        if self._map is None:
            return
        del self._bytes
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive somewhere: the mapping goes when it does
        self._map = None
        os.close(self.fd)

    def __repr__(self) -> str:
        return (
            f"<Arena {self.label} {self.backend} used={self._alloc.used - self._kept_bytes} "
            f"committed={self.committed} capacity={self.capacity}>"
        )


_FIX = (
    "Lower shm_capacity, or give the container more shared memory: Docker --shm-size, "
    "Kubernetes an emptyDir {medium: Memory, sizeLimit} on /dev/shm, or a higher memory limit."
)


def _headroom(backend: Backend) -> Headroom:
    return dev_shm_available() if backend == "posix" else mem_available()


def check_capacity(needed: int, backend: Backend) -> None:
    """Raise CapacityError at start if `needed` bytes cannot be had: never a SIGBUS later."""
    room = _headroom(backend)
    if needed > room.available:
        raise CapacityError(
            f"slabpool needs {needed} bytes of shared memory ({backend}) but only "
            f"{room.available} bytes are available ({room.source}). " + _FIX,
            needed=needed,
            available=room.available,
        )


def _create_fd(backend: Backend, label: str, instance: str, capacity: int) -> int:
    if backend == "memfd":
        fd = os.memfd_create(f"{PREFIX}{instance}-{label}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, capacity)
        # workers map this fd; seals make it impossible for any of them to resize it (SIGBUS)
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        return fd
    import _posixshmem  # type: ignore[import-not-found]  # CPython's own; no SharedMemory, no tracker

    name = f"/{PREFIX}{instance}-{label}-{secrets.token_hex(8)}"
    fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        os.ftruncate(fd, capacity)
    finally:
        _posixshmem.shm_unlink(name)  # nameless from here on, like memfd
    return int(fd)
