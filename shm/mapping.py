"""The worker's side of an arena: map it from a passed fd, read and write leased ranges.

There is deliberately no `multiprocessing.shared_memory` here. On Python 3.11 an *attach*
registers the segment with the resource tracker, which can unlink it under the owner
(gh-82300); memfd fds passed by `DupFd` need no name and no tracker at all.
"""

from __future__ import annotations

import math
import mmap
import os
from multiprocessing import reduction
from typing import Any

import numpy as np


class PassFd:
    """An fd that travels to a spawn/forkserver child as the child's own fd.

    `DupFd` must be called while the child is being started (as CPython's heap.Arena does in
    its reducer): called earlier, it parks a dup in the resource-sharer thread, which leaks
    the memfd if the child dies before collecting it.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        return (_received_fd, (reduction.DupFd(self.fd),))


def _received_fd(dup: Any) -> int:
    return int(dup.detach())


class Mapping:
    """A whole arena mapped into this process. Inputs are mapped read-only."""

    def __init__(self, fd: int, size: int, *, writable: bool) -> None:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        os.close(fd)  # the mapping keeps the memory alive
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        self.writable = writable

    def array(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        count = math.prod(shape) * dtype.itemsize
        return self._bytes[offset : offset + count].view(dtype).reshape(shape)
