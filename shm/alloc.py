"""A first-fit allocator of byte ranges, with coalescing: pure bookkeeping, no memory.

`RangeAllocator` hands out `[offset, offset + size)` ranges of one address space, every
offset aligned to `ALIGN` (64 bytes: a cache line, and aligned for every numpy dtype).
The arena (`slabpool.shm.arena`) wraps it with the memory, the lock and the lease objects.
"""

from __future__ import annotations

import bisect

ALIGN = 64


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class RangeAllocator:
    """First-fit over a sorted list of free ranges; neighbours coalesce on free."""

    def __init__(self, size: int) -> None:
        if size <= 0 or size % ALIGN:
            raise ValueError(f"allocator size must be a positive multiple of {ALIGN}, got {size}")
        self.size = size
        self._starts: list[int] = [0]  # free ranges, sorted by start
        self._sizes: list[int] = [size]
        self._used: dict[int, int] = {}  # offset -> size of each allocated range

    @property
    def used(self) -> int:
        return self.size - sum(self._sizes)

    @property
    def largest_free(self) -> int:
        return max(self._sizes, default=0)

    def allocate(self, nbytes: int) -> int | None:
        """Return the offset of a free range of at least `nbytes`, or None if none fits."""
        need = align_up(max(nbytes, 1))
        for i, free in enumerate(self._sizes):
            if free >= need:
                start = self._starts[i]
                if free == need:
                    del self._starts[i], self._sizes[i]
                else:
                    self._starts[i] += need
                    self._sizes[i] -= need
                self._used[start] = need
                return start
        return None

    def free(self, offset: int) -> None:
        size = self._used.pop(offset, None)
        if size is None:
            raise KeyError(f"range at offset {offset} is not allocated (double free?)")
        i = bisect.bisect_left(self._starts, offset)
        self._starts.insert(i, offset)
        self._sizes.insert(i, size)
        # coalesce with the next range, then with the previous one
        if i + 1 < len(self._starts) and offset + size == self._starts[i + 1]:
            self._sizes[i] += self._sizes.pop(i + 1)
            del self._starts[i + 1]
        if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == offset:
            self._sizes[i - 1] += self._sizes.pop(i)
            del self._starts[i]
