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
        sizes = self._sizes
        for i, free in enumerate(sizes):
            if free >= need:
                starts = self._starts
                start = starts[i]
                if free == need:
                    del starts[i], sizes[i]
                else:
                    starts[i] = start + need
                    sizes[i] = free - need
                self._used[start] = need
                return start
        return None

    def free(self, offset: int) -> None:
        size = self._used.pop(offset, None)
        if size is None:
            raise KeyError(f"range at offset {offset} is not allocated (double free?)")
        starts, sizes = self._starts, self._sizes
        i = bisect.bisect_left(starts, offset)
        end = offset + size
        # coalesce with the previous range and the next one, in place where it can
        after = i < len(starts) and starts[i] == end
        if i > 0 and starts[i - 1] + sizes[i - 1] == offset:
            sizes[i - 1] += size
            if after:
                sizes[i - 1] += sizes.pop(i)
                del starts[i]
        elif after:
            starts[i] = offset
            sizes[i] += size
        else:
            starts.insert(i, offset)
            sizes.insert(i, size)
