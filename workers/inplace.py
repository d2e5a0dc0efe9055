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

from dataclasses import dataclass
from typing import Any

import numpy as np

from slabpool.shm.mapping import Mapping
from slabpool.workers import packing
from slabpool.workers.protocol import ArrayRef, Packed, TaskSpec, flat_skeleton

Signature = tuple[tuple[str, str, tuple[int, ...]], ...]  # (name, dtype, shape) per array
MAX_SIGNATURES = 256


@dataclass(frozen=True)
class Placed:
    """One task's outputs, laid out in the output region before its run."""

    key: Signature  # its inputs' signature
    dests: dict[str, np.ndarray]  # writeable views in the output arena, by output name
    packed: Packed  # the same, as the Outcome reports them


def signature(arrays: dict[str, np.ndarray]) -> Signature:
    return tuple((name, a.dtype.str, a.shape) for name, a in arrays.items())


class OutputPlanner:
    def __init__(self, outputs: Mapping, min_bytes: int = 0) -> None:
        self._outputs = outputs
        self._min_bytes = min_bytes  # smaller outputs are copied: binding costs ~50 us a run
        self._shapes: dict[Signature, Signature | None] = {}  # None: output shapes vary

    def plan(self, region: tuple[int, int], tasks: list[TaskSpec], feeds: dict[int, Any]) -> dict[int, Placed] | None:
        """A place for every task's outputs inside `region` (offset, bytes), in task order; None
        unless every task's output shapes are known and all of them fit."""
        start, nbytes = region
        if start < 0:
            return None
        plan, cursor = {}, start
        for t in tasks:
            key = signature(feeds[t.task_id])
            outs = self._shapes.get(key)
            if outs is None:
                return None
            dtypes = [np.dtype(dt) for _, dt, _ in outs]
            offsets, size = packing.layout_sizes(
                [dt.itemsize * int(np.prod(shape)) for dt, (_, _, shape) in zip(dtypes, outs, strict=True)])
            if size < self._min_bytes or cursor + size > start + nbytes:
                return None
            dests = {name: self._outputs.array(cursor + off, dt, shape)
                     for (name, _, shape), dt, off in zip(outs, dtypes, offsets, strict=True)}
            refs = tuple(ArrayRef(cursor + off, dt, shape) for (_, dt, shape), off in zip(outs, offsets, strict=True))
            plan[t.task_id] = Placed(key, dests, Packed(flat_skeleton(tuple(n for n, _, _ in outs)), refs))
            cursor += size
        return plan

    def learn(self, feeds: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> None:
        if len(self._shapes) >= MAX_SIGNATURES:
            self._shapes.clear()  # many distinct shapes (a dynamic axis): start over
        self._shapes.setdefault(signature(feeds), signature(outputs))

    def forget(self, key: Signature) -> None:
        self._shapes[key] = None
