"""Move the arrays of a structure into shared memory and back, leaving the rest to pickle.

    pack:   {"x": arr, "meta": {"id": 7}}  ->  Packed({"x": Hole(0), "meta": {"id": 7}}, [ref0])
    unpack: Packed + arena views           ->  {"x": view0, "meta": {"id": 7}}

Only dicts, lists and tuples are walked; every other leaf is left as it is (and pickled).
Object arrays hold pointers, not data, and are refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from slabpool.shm.alloc import align_up
from slabpool.shm.pages import private_copy
from slabpool.workers.errors import TaskDataError
from slabpool.workers.protocol import (
    ArrayRef,
    Chunk,
    FlatSkeleton,
    Hole,
    Packed,
    RemoteError,
    Rows,
    Sealed,
    flat_skeleton,
    unseal,
)

_SCALARS = frozenset((int, float, str, bool, type(None), bytes))


def split(obj: Any) -> tuple[Any, list[np.ndarray]]:
    """The skeleton of `obj` and its arrays, in skeleton order."""
    if type(obj) is dict:  # the common case, a flat dict of arrays: one shared skeleton per names
        flat = list(obj.values())
        if all(type(a) is np.ndarray and not a.dtype.hasobject for a in flat):
            return flat_skeleton(tuple(obj)), flat
    if type(obj) is Chunk and all(type(d) is dict for d in obj):  # map()'s chunk of flat dicts
        stacked = _stack(obj)
        if stacked is not None:
            return stacked
        arrays: list[np.ndarray] = [a for d in obj for a in d.values()]
        if all(type(a) is np.ndarray and not a.dtype.hasobject for a in arrays):
            holes = iter(range(len(arrays)))
            return Chunk({k: Hole(next(holes)) for k in d} for d in obj), arrays
    arrays = []

    def walk(node: Any) -> Any:
        if isinstance(node, np.ndarray):
            if node.dtype.hasobject:
                raise TypeError("arrays of dtype object cannot go through shared memory")
            arrays.append(node)
            return Hole(len(arrays) - 1)
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if type(node) is Chunk:
            return Chunk(walk(v) for v in node)
        if isinstance(node, (list, tuple)):
            if _SCALARS.issuperset(map(type, node)):  # a JSON list of numbers: nothing to move
                return node
            out = [walk(v) for v in node]
            return out if isinstance(node, list) else tuple(out)
        return node

    return walk(obj), arrays


class Stack:
    """Arrays to be concatenated on axis 0 straight into their region (one copy, no
    intermediate array): what `write` and `layout` read of an array, and the parts."""

    __slots__ = ("dtype", "nbytes", "parts", "shape")

    def __init__(self, parts: list[np.ndarray]) -> None:
        self.parts = parts
        self.dtype = parts[0].dtype
        self.shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
        self.nbytes = self.dtype.itemsize * math.prod(self.shape)


def _stack(chunk: Chunk) -> tuple[Rows, list[Any]] | None:
    """A chunk of flat dicts of equal names, dtypes and trailing shapes, each item's arrays of
    equal rows, as one Stack per name; None when they differ (each item keeps its arrays)."""
    first = chunk[0]
    names = tuple(first)
    sig = [(a.dtype, a.shape[1:]) if type(a) is np.ndarray and a.ndim and not a.dtype.hasobject else None
           for a in first.values()]
    if not names or None in sig:
        return None
    counts = []
    for d in chunk:
        if tuple(d) != names:
            return None
        rows = -1
        for a, want in zip(d.values(), sig, strict=True):
            if type(a) is not np.ndarray or (a.dtype, a.shape[1:]) != want or rows not in (-1, a.shape[0]):
                return None
            rows = a.shape[0]
        counts.append(rows)
    return Rows(names, tuple(counts)), [Stack([d[n] for d in chunk]) for n in names]


def layout(arrays: list[np.ndarray]) -> tuple[list[int], int]:
    """Offsets (relative, 64-byte aligned) of each array in one region, and its total size."""
    return layout_sizes([a.nbytes for a in arrays])


def layout_sizes(sizes: list[int]) -> tuple[list[int], int]:
    """`layout` for arrays of these byte sizes (arrays not made yet)."""
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total = align_up(total + n)
    return offsets, total


def region_size(packed: Packed) -> int:
    """Bytes a Packed structure occupies in its region (as laid out by `layout`)."""
    total = 0
    for ref in packed.arrays:
        total = align_up(total + np.dtype(ref.dtype).itemsize * math.prod(ref.shape))
    return total


def write(
    skeleton: Any,
    arrays: list[Any],  # arrays, or Stacks of arrays (concatenated into place)
    base: int,
    array_at: Callable[[int, np.dtype, tuple[int, ...]], np.ndarray],
    offsets: list[int] | None = None,
) -> Packed:
    """Copy `arrays` into the region at `base` (laid out by `layout`, whose offsets the caller
    may pass); return the Packed form."""
    if offsets is None:
        offsets, _ = layout(arrays)
    refs = []
    for a, off in zip(arrays, offsets, strict=True):
        dst = array_at(base + off, a.dtype, a.shape)
        if type(a) is Stack:
            np.concatenate(a.parts, out=dst, casting="no")
        else:
            np.copyto(dst, a, casting="no")
        refs.append(ArrayRef(base + off, a.dtype.str, a.shape))
    return Packed(skeleton, tuple(refs))


def unpack(
    packed: Packed,
    array_at: Callable[[int, np.dtype, tuple[int, ...]], np.ndarray],
    *,
    copy: bool = False,
    readonly: bool = False,
    items: bool = True,
) -> Any:
    """Rebuild the structure: views into the arena (or private copies when `copy`; for a
    Chunk, one copy of the region its arrays span and views into it: one allocation, not one
    per array). `items=False`: a chunk of stacked rows is left as its rows (Chunk.stacked),
    its items made only if asked for (`chunk_items`)."""
    if copy and type(packed.skeleton) in (Chunk, Rows) and packed.arrays:
        block = _copy_block(packed.arrays, array_at)
        if type(packed.skeleton) is Rows:
            return _rows(packed.skeleton, block, items)
        return _fill(packed.skeleton, block)
    arrays = []
    for ref in packed.arrays:
        a = array_at(ref.offset, np.dtype(ref.dtype), ref.shape)
        if copy:
            a = private_copy(a)
        elif readonly:
            a = a.view()
            a.flags.writeable = False
        arrays.append(a)
    sk = packed.skeleton
    if type(sk) is Rows:
        return _rows(sk, arrays, items)
    if type(sk) is FlatSkeleton:  # the common case: its holes are in order
        return dict(zip(sk, arrays, strict=True))
    if isinstance(sk, dict) and all(type(v) is Hole for v in sk.values()):
        return {k: arrays[v.at] for k, v in sk.items()}
    return _fill(sk, arrays)


def _copy_block(
    refs: tuple[ArrayRef, ...], array_at: Callable[[int, np.dtype, tuple[int, ...]], np.ndarray]
) -> list[np.ndarray]:
    dtypes = [np.dtype(r.dtype) for r in refs]
    ends = [r.offset + dt.itemsize * math.prod(r.shape) for r, dt in zip(refs, dtypes, strict=True)]
    low = min(r.offset for r in refs)
    block = private_copy(array_at(low, np.dtype(np.uint8), (max(ends) - low,)))
    return [block[r.offset - low : end - low].view(dt).reshape(r.shape)
            for r, dt, end in zip(refs, dtypes, ends, strict=True)]


def _rows(sk: Rows, arrays: list[np.ndarray], items: bool = True) -> Chunk:
    """A stacked chunk (its rows kept in `stacked`), with its items again unless not `items`:
    item k a dict of views of its rows of every array."""
    out = Chunk()
    out.stacked = (sk, arrays)
    return chunk_items(out) if items else out


def chunk_items(chunk: Chunk) -> Chunk:
    """The chunk's items (outcomes), one per item: a stacked chunk's made from its rows, once."""
    if chunk.stacked is None or len(chunk) == len(chunk.stacked[0].counts):
        return chunk
    sk, arrays = chunk.stacked
    lo, names = 0, sk.names
    for n in sk.counts:
        hi = lo + n
        chunk.append({name: a[lo:hi] for name, a in zip(names, arrays, strict=True)})
        lo = hi
    return chunk


def chunk_count(chunk: Chunk) -> int:
    """How many items the chunk holds (made or not)."""
    return len(chunk.stacked[0].counts) if chunk.stacked is not None else len(chunk)


def _fill_item(node: Any, arrays: list[np.ndarray]) -> Any:
    """One item of a chunk; one that cannot be unpickled becomes its RemoteError (it fails alone)."""
    try:
        return _fill(node, arrays)
    except TaskDataError as exc:
        return RemoteError("data", "TypeError", str(exc), "")


def _fill(node: Any, arrays: list[np.ndarray]) -> Any:
    if type(node) is Hole:
        return arrays[node.at]
    if type(node) is Sealed:  # user data pickled on its own (see protocol.Sealed)
        return _fill(unseal(node, "the inputs"), arrays)
    if isinstance(node, dict):
        return {k: _fill(v, arrays) for k, v in node.items()}
    if type(node) is Chunk:
        return Chunk(_fill_item(v, arrays) for v in node)
    if isinstance(node, list):
        return [_fill(v, arrays) for v in node]
    if isinstance(node, tuple):
        return tuple(_fill(v, arrays) for v in node)
    return node
