"""Move the arrays of a structure into shared memory and back, leaving the rest to pickle.

    pack:   {"x": arr, "meta": {"id": 7}}  ->  Packed({"x": Hole(0), "meta": {"id": 7}}, [ref0])
    unpack: Packed + arena views           ->  {"x": view0, "meta": {"id": 7}}

Only dicts, lists and tuples are walked (their subclasses too: an OrderedDict, a namedtuple,
a defaultdict come back as what they were); every other leaf is left as it is (and pickled).
Arrays of numpy's own subclasses cross whole: a masked array with its mask and fill value
(`Masked`), a matrix or a record array with its class, a structured dtype with its field names
(`Viewed`: the bytes go through shared memory, the dtype and class beside them). Object arrays
hold pointers, not data, and are refused, and so is an ndarray subclass of another library,
whose extra state a view would drop.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from slabpool.shm.alloc import align_up
from slabpool.shm.pages import private_copy
from slabpool.workers.errors import ErrorKind, TaskDataError
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
_VIEWED = (np.matrix, np.recarray)  # numpy's subclasses that a view of the bytes rebuilds whole
_AS_ARRAY = (np.memmap,)  # a memory-mapped file's rows cross as a plain array (its data)


@dataclass(frozen=True, slots=True)
class Viewed:
    """An array whose bytes are the Hole `raw` (uint8, flat), rebuilt as `dtype` (its field
    names kept), `shape` and class `cls` (np.ndarray, np.matrix, np.recarray)."""

    raw: Hole
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    cls: type

    def rebuild(self, arrays: list[np.ndarray]) -> np.ndarray:
        out = arrays[self.raw.at].view(self.dtype).reshape(self.shape)
        return out if self.cls is np.ndarray else out.view(self.cls)


@dataclass(frozen=True, slots=True)
class Masked:
    """A numpy masked array: its data and its mask (each a Hole or a Viewed), its fill value."""

    data: Any
    mask: Any
    fill_value: Any

    def rebuild(self, arrays: list[np.ndarray]) -> np.ndarray:
        data, mask = _fill(self.data, arrays), _fill(self.mask, arrays)
        return np.ma.MaskedArray(data, mask=mask, fill_value=self.fill_value)


def _plain(a: Any) -> bool:
    """An array that crosses as its bytes, dtype string and shape alone."""
    return type(a) is np.ndarray and not a.dtype.hasobject and a.dtype.names is None


def split(obj: Any) -> tuple[Any, list[np.ndarray]]:
    """The skeleton of `obj` and its arrays, in skeleton order."""
    if type(obj) is dict:  # the common case, a flat dict of arrays: one shared skeleton per names
        flat = list(obj.values())
        if all(_plain(a) for a in flat):
            return flat_skeleton(tuple(obj)), flat
    if type(obj) is Chunk and all(type(d) is dict for d in obj):  # map()'s chunk of flat dicts
        stacked = _stack(obj)
        if stacked is not None:
            return stacked
        arrays: list[np.ndarray] = [a for d in obj for a in d.values()]
        if all(_plain(a) for a in arrays):
            holes = iter(range(len(arrays)))
            return Chunk({k: Hole(next(holes)) for k in d} for d in obj), arrays
    arrays = []

    def hole(a: np.ndarray) -> Hole:
        arrays.append(a)
        return Hole(len(arrays) - 1)

    def array(node: np.ndarray) -> Any:
        if node.dtype.hasobject:
            raise TypeError("arrays of dtype object cannot go through shared memory")
        if _plain(node) or isinstance(node, _AS_ARRAY):
            return hole(node.view(np.ndarray) if type(node) is not np.ndarray else node)
        if isinstance(node, np.ma.MaskedArray):
            return Masked(array(np.ma.getdata(node)), array(np.ma.getmaskarray(node)), node.fill_value)
        cls = type(node)
        if cls is not np.ndarray and not issubclass(cls, _VIEWED):
            raise TypeError(f"an array of class {cls.__module__}.{cls.__qualname__} cannot cross between "
                            "processes intact (a view of its data would drop what the subclass adds); "
                            "pass np.asarray(...) of it, or a dict of its parts")
        flat = np.ascontiguousarray(node.view(np.ndarray)).reshape(-1)  # its bytes, its dtype beside them
        return Viewed(hole(flat.view(np.uint8)), node.dtype, node.shape, cls)

    def walk(node: Any) -> Any:
        if isinstance(node, np.ndarray):
            return array(node)
        if type(node) is dict:
            return {k: walk(v) for k, v in node.items()}
        if type(node) is Chunk:
            return Chunk(walk(v) for v in node)
        if type(node) is list or type(node) is tuple:
            if _SCALARS.issuperset(map(type, node)):  # a JSON list of numbers: nothing to move
                return node
            out = [walk(v) for v in node]
            return out if type(node) is list else tuple(out)
        if isinstance(node, (dict, list, tuple)):  # a subclass: the same class comes back
            return like(node, [walk(v) for v in _values(node)])
        return node

    return walk(obj), arrays


def _values(node: dict[Any, Any] | list[Any] | tuple[Any, ...]) -> list[Any]:
    return list(node.values()) if isinstance(node, dict) else list(node)


def like(node: Any, values: list[Any]) -> Any:
    """A container of the class of `node` (a dict, list or tuple subclass: OrderedDict,
    defaultdict, Counter, a namedtuple, ...) holding `values` in its places; what the class
    keeps beside its items (a defaultdict's factory) is kept too. TypeError for a tuple class
    that cannot be rebuilt from its items."""
    if isinstance(node, dict):
        out = copy.copy(node)
        for k, v in zip(list(node), values, strict=True):
            out[k] = v
        return out
    if isinstance(node, list):
        seq = copy.copy(node)
        seq[:] = values
        return seq
    cls = type(node)
    if hasattr(cls, "_make"):  # a namedtuple
        return cls._make(values)
    try:
        return cls(values)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"a {cls.__qualname__} (a tuple subclass) cannot be rebuilt from its items: {exc}; "
                        "pass a plain tuple, a namedtuple or a dict") from None


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
    sig = [(a.dtype, a.shape[1:]) if _plain(a) and a.ndim else None
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
    if type(sk) is dict and all(type(v) is Hole for v in sk.values()):
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
        return RemoteError(ErrorKind.DATA, "TypeError", str(exc), "")


def _fill(node: Any, arrays: list[np.ndarray]) -> Any:
    if type(node) is Hole:
        return arrays[node.at]
    if type(node) is Sealed:  # user data pickled on its own (see protocol.Sealed)
        return _fill(unseal(node, "the inputs"), arrays)
    if type(node) is dict or type(node) is FlatSkeleton:
        return {k: _fill(v, arrays) for k, v in node.items()}
    if type(node) is Chunk:
        return Chunk(_fill_item(v, arrays) for v in node)
    if type(node) is list:
        return [_fill(v, arrays) for v in node]
    if type(node) is tuple:
        return tuple(_fill(v, arrays) for v in node)
    if type(node) is Viewed or type(node) is Masked:
        return node.rebuild(arrays)
    if isinstance(node, (dict, list, tuple)):  # a subclass (see split): the same class
        return like(node, [_fill(v, arrays) for v in _values(node)])
    return node
