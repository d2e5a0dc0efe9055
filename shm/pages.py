"""Private copies of large arrays, without transparent huge pages.

numpy asks for transparent huge pages (madvise MADV_HUGEPAGE) on every allocation of 4 MiB or
more. Where the kernel's THP defrag setting is "madvise" (a common default), the first touch of
such memory may compact memory synchronously: a copy-out of 8 MiB outputs took from 1.3 to
3.8 ms of the supervisor thread's CPU depending on how fragmented memory was, and the payload
rate swung 2x from run to run (measured, 8 MiB payload, 2 workers, three rounds of 400 items
in a fresh process, twice each: 209/330/476 and 248/353/318 items/s with the hint, 392/434/444
and 336/432/437 with this). The copies slabpool makes for the caller are written once, right
away: it asks for ordinary pages instead.
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

import numpy as np

HUGE = 4 << 20  # numpy's own threshold for the huge-page hint
_MADV_NOHUGEPAGE = 15  # linux/mman.h

def _libc_madvise() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # not Linux/glibc: the hint does not exist there
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


_madvise = _libc_madvise()


def private_copy(src: np.ndarray) -> np.ndarray:
    """A C-contiguous copy the caller owns; a large one on ordinary pages."""
    dst = np.empty(src.shape, src.dtype)
    if dst.nbytes >= HUGE and _madvise is not None:
        start = dst.ctypes.data & ~(mmap.PAGESIZE - 1)  # whole pages of dst's own allocation
        end = dst.ctypes.data + dst.nbytes
        _madvise(start, end - start, _MADV_NOHUGEPAGE)  # a hint: its failure changes nothing
    np.copyto(dst, src)
    return dst
