"""Outputs written by the runtime straight into the output region (ONNX Runtime IO binding).

Without it an output of 8 MiB is allocated by the runtime (fresh pages: faults), then copied
into shared memory; with it the runtime writes into the batch's output region and nothing is
copied in the worker (0.75 vs 1.3 ms per 8 MiB run on the 2-core VM, measured). A bound run
costs ~50 us more than a plain one, so small outputs are still copied (in_place_min_bytes,
1 MiB by default: plain + copy 174 us vs bound 149 us there; 64 KiB: 10 vs 56 us).

IO binding needs each output's shape before the run. The planner learns it: after a plain
run, inputs of this exact signature (names, dtypes, shapes) gave outputs of those shapes. A
model whose output shapes depend on the data (NonZero, NMS) fails the bound run once for a
signature; the worker then runs it plainly and the planner never binds that signature again.

A bound buffer is not proof of a written one: ORT returns some outputs as tensors of its own
(a graph input passed through as an output, a tensor two outputs share). The adapter checks
every output it gets back against the buffer it bound, and copies those into place
(workers/ort.py, _settle); the region never reports an earlier task's bytes.

    plan = planner.plan(region, tasks, feeds)    # task id -> Placed, or None: run plainly
    session.run_into(feeds, placed.dests)        # outputs land at placed.packed's refs
    planner.learn(feeds, outputs)                # after a plain run
    planner.forget(placed.key)                   # the bound run failed, the plain one did not
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from slabpool.shm.mapping import Mapping
from slabpool.workers import packing
from slabpool.workers.protocol import ArrayRef, FlatSkeleton, Packed, TaskSpec, flat_skeleton

Signature = tuple[tuple[str, np.dtype[Any], tuple[int, ...]], ...]  # (name, dtype, shape) per array
MAX_SIGNATURES = 256


@dataclass(frozen=True)
class Placed:
    """One task's outputs, laid out in the output region before its run."""

    key: Signature  # its inputs' signature
    dests: dict[str, np.ndarray]  # writeable views in the output arena, by output name
    packed: Packed  # the same, as the Outcome reports them


@dataclass(frozen=True)
class Layout:
    """The outputs that inputs of one signature give, laid out once (relative offsets): a
    plan of them only adds the region's base."""

    outputs: Signature
    offsets: tuple[int, ...]
    size: int  # bytes in the region, 64-byte aligned (packing.layout)
    skeleton: FlatSkeleton


def signature(arrays: dict[str, np.ndarray]) -> Signature:
    return tuple([(name, a.dtype, a.shape) for name, a in arrays.items()])


def layout_of(outputs: Signature) -> Layout:
    offsets, size = packing.layout_sizes([dt.itemsize * math.prod(shape) for _, dt, shape in outputs])
    return Layout(outputs, tuple(offsets), size, flat_skeleton(tuple(n for n, _, _ in outputs)))


class OutputPlanner:
    def __init__(self, outputs: Mapping, min_bytes: int = 0) -> None:
        self._outputs = outputs
        self.min_bytes = min_bytes  # smaller outputs are copied: binding costs ~50 us a run
        self._layouts: dict[Signature, Layout | None] = {}  # None: output shapes vary

    def plan(self, region: tuple[int, int], tasks: list[TaskSpec], feeds: dict[int, Any]) -> dict[int, Placed] | None:
        """A place for every task's outputs inside `region` (offset, bytes), in task order; None
        unless every task's output shapes are known and all of them fit. Nothing is made (no
        view of the arena) before every task is known to be placed."""
        start, nbytes = region
        if start < 0:
            return None
        keys, layouts, cursor = [], [], start
        for t in tasks:
            key = signature(feeds[t.task_id])
            lay = self._layouts.get(key)
            if lay is None or lay.size < self.min_bytes or cursor + lay.size > start + nbytes:
                return None
            keys.append(key)
            layouts.append(lay)
            cursor += lay.size
        plan, cursor = {}, start
        for t, key, lay in zip(tasks, keys, layouts, strict=True):
            plan[t.task_id] = self._placed(cursor, key, lay)
            cursor += lay.size
        return plan

    def place(self, region: tuple[int, int], key: Signature) -> Placed | None:
        """`plan` of one task whose inputs have the signature `key` (the worker's lean path,
        workers.lean): the same answer, without the lists."""
        start, nbytes = region
        if start < 0:
            return None
        lay = self._layouts.get(key)
        if lay is None or lay.size < self.min_bytes or lay.size > nbytes:
            return None
        return self._placed(start, key, lay)

    def _placed(self, cursor: int, key: Signature, lay: Layout) -> Placed:
        dests = {name: self._outputs.array(cursor + off, dt, shape)
                 for (name, dt, shape), off in zip(lay.outputs, lay.offsets, strict=True)}
        refs = tuple(ArrayRef(cursor + off, dt.str, shape)
                     for (_, dt, shape), off in zip(lay.outputs, lay.offsets, strict=True))
        return Placed(key, dests, Packed(lay.skeleton, refs))

    def learn(self, feeds: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> None:
        self.learn_key(signature(feeds), outputs)

    def learn_key(self, key: Signature, outputs: dict[str, np.ndarray]) -> None:
        """`learn`, the inputs' signature known already."""
        if key in self._layouts:
            return  # known (or known to vary: forget's word stays)
        if len(self._layouts) >= MAX_SIGNATURES:
            self._layouts.clear()  # many distinct shapes (a dynamic axis): start over
        self._layouts[key] = layout_of(signature(outputs))

    def forget(self, key: Signature) -> None:
        self._layouts[key] = None
