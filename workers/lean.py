"""The worker's lean path (issue 21): the common task in the fewest interpreted opcodes.

An idle `Engine.infer` of plain inputs sends its worker a RunBatch of ONE task: a flat dict
of arrays (a FlatSkeleton), no context, no FaultSpec, no deadline, one session call (step 0),
on a worker with a session and no preprocess or postprocess. The general path
(workers.main.Worker.run_batch) walks it through every stage of every kind of batch; this
path runs the same steps once, in one method, and keeps what cannot change between calls:

    the inputs' views        per ArrayRef tuple (the input arena is mapped once, for good),
                             made only once their signature passed the input contract
                             (pipeline's `Checked`: a signature that passed passes again)
    the outputs' layout      per outputs' signature (names, types, dtypes, shapes)
    their views and refs     per (region offset, that layout): the write is one copy each

    views -> status word 0 = the task -> region -> planner.place -> fields(run) -> run
          -> run_s -> outputs into the region (or the general _write: a region to ask for,
             outputs not plain) -> BatchDone; the loop then writes IDLE and sends it

What it does not take it declines before any step has an effect (`run` returns None: the
general path runs the batch): more than one task, any of the task's options, inputs whose
signature the contract has not passed yet (the general path checks them, and says why they
fail). An error of the run becomes that task's RemoteError exactly as `_guarded` makes it
(pipeline.failure, logged with the task's fields); the in-place run and its fallback are the
general path's own code (Worker._run_into).
"""

from __future__ import annotations

import logging
import operator
import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from slabpool.workers import contract, packing
from slabpool.workers.inplace import Placed, signature
from slabpool.workers.pipeline import failure
from slabpool.workers.protocol import (
    ArrayRef,
    BatchDone,
    FlatSkeleton,
    Outcome,
    Packed,
    RemoteError,
    RunBatch,
)
from slabpool.workers.session import RunTimeout
from slabpool.workers.worklog import task_fields

if TYPE_CHECKING:
    from slabpool.workers.main import Worker

log = logging.getLogger("slabpool.workers")

LIMIT = 256  # entries each cache keeps (then starts over: many offsets or shapes)

_PAGE = os.sysconf("SC_PAGE_SIZE")
_DTYPE_SHAPE = operator.attrgetter("dtype", "shape")
_new = tuple.__new__  # a NamedTuple of all its fields, made in C (its own __new__ is a Python call)


def rss() -> int:
    """The process's resident set, in bytes."""
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * _PAGE


class LeanPath:
    """The lean path of one worker (it exists only with a session and neither hook)."""

    def __init__(self, worker: Worker) -> None:
        assert worker.session is not None
        self.w = worker
        self.session, self.planner, self.pipeline = worker.session, worker.planner, worker.pipeline
        self.status, self.timeout, self.timed = worker.status, worker.boot.task_timeout, worker._timed
        self.report_rss = worker.boot.report_rss
        self.array_in, self.array_out = worker.inputs.array, worker.outputs.array
        # ArrayRef tuple -> (skeleton, views by name, the planner's key of them)
        self._inputs: dict[tuple[ArrayRef, ...], tuple[Any, dict[str, np.ndarray], Any]] = {}
        # outputs' (name, type, dtype, shape) per output -> (skeleton, offsets, size), or None
        # when they are not a flat dict of plain arrays (the general _write walks them)
        self._layouts: dict[tuple[Any, ...], tuple[FlatSkeleton, list[int], int] | None] = {}
        # (region offset, outputs' key) -> (views to copy into, the Packed that names them)
        self._dests: dict[tuple[int, tuple[Any, ...]], tuple[list[np.ndarray], Packed]] = {}

    def run(self, msg: RunBatch) -> BatchDone | None:
        """The BatchDone of `msg`, or None (nothing done): not the common case."""
        tasks = msg.tasks
        if len(tasks) != 1:
            return None
        t = tasks[0]
        if t.context is not None or t.fault is not None or t.deadline is not None or t.step:
            return None
        item = t.item
        t0 = time.perf_counter()
        known = self._inputs.get(item.arrays)
        if known is None or known[0] is not item.skeleton:
            known = self._view(item)
            if known is None:
                return None
        _, feeds, key = known
        w, tid = self.w, t.task_id
        if self.timed:
            w._hand(tid)
        else:  # (the loop left it IDLE)
            w._in_hand = tid
            self.status[0] = tid
        region = (msg.out_offset, msg.out_nbytes) if msg.out_offset >= 0 else w._granted(msg.batch_id)
        planner = self.planner
        placed = planner.place(region, key) if planner is not None else None
        token = task_fields.set({"task_id": tid, "attempt": t.attempt, "stage": "run"})
        try:  # Worker._run_one of a task without a fault, one session call
            if placed is None:
                self.pipeline.stage = "run"
                out: Any = self.session.run(feeds, self.timeout)
                if planner is not None:
                    planner.learn_key(key, out)
            else:
                out = self._in_place(feeds, placed, tid)
        except Exception as exc:  # noqa: BLE001 - the runtime raised: the task's outcome
            out = failure("run", exc)
        finally:
            task_fields.reset(token)
        run_s = time.perf_counter() - t0
        kind = type(out)
        outcomes: tuple[Outcome, ...]
        if kind is Placed:
            outcomes, in_place = (_new(Outcome, (tid, out.packed, None)),), 1
        elif kind is RemoteError:
            outcomes, in_place = (_new(Outcome, (tid, None, out)),), 0
        else:
            outcomes, in_place = self._write(msg, region, tid, out), 0
        return _new(BatchDone, (msg.batch_id, outcomes, run_s, rss() if self.report_rss else 0, in_place))

    def _view(self, item: Packed) -> tuple[Any, dict[str, np.ndarray], Any] | None:
        """The inputs' views, kept, once their signature has passed the contract; else None."""
        if type(item.skeleton) is not FlatSkeleton:  # a chunk, rows, a structure: the general path
            return None
        try:
            feeds = packing.unpack(item, self.array_in)
        except Exception:  # noqa: BLE001 - the general path says why (the task's error)
            return None
        if not self.pipeline.passed(contract.signature(feeds)):
            return None
        if len(self._inputs) >= LIMIT:
            self._inputs.clear()
        known = (item.skeleton, feeds, signature(feeds))
        self._inputs[item.arrays] = known
        return known

    def _in_place(self, feeds: dict[str, np.ndarray], placed: Placed, tid: int) -> Any:
        """The in-place run, or a plain one if it failed (then never in place for these inputs)."""
        self.pipeline.stage = "preprocess"  # (as the general path leaves it: no pipeline.run)
        try:
            self.w._run_into(feeds, placed.dests, 0)
            return placed
        except RunTimeout:
            raise
        except Exception:  # noqa: BLE001 - a plain run tells a shape change from a real error
            log.debug("in-place run of task %d failed; running it plainly", tid)
        self.pipeline.stage = "run"
        out = self.session.run(feeds, self.timeout)
        assert self.planner is not None
        self.planner.forget(placed.key)  # the shapes vary with the data: never bind them
        return out

    def _write(self, msg: RunBatch, region: tuple[int, int], tid: int, out: Any) -> tuple[Outcome, ...]:
        """Step 7 for a plain run's outputs: into the region it came with, through views
        made once per place and layout; else by the general _write."""
        lay: tuple[FlatSkeleton, list[int], int] | None = None
        okey: tuple[Any, ...] = ()
        if type(out) is dict:
            values = out.values()
            try:  # (names, classes, (dtype, shape)s): made in C
                okey = (tuple(out), tuple(map(type, values)), tuple(map(_DTYPE_SHAPE, values)))
                lay = self._layouts[okey] if okey in self._layouts else self._layout(okey, out)
            except Exception:  # noqa: BLE001 - not plain arrays: the general _write says what they are
                lay = None
        base, room = region
        if lay is None or (lay[2] > 0 and (base < 0 or lay[2] > room)):
            return self.w._write(msg, region, {tid: out})
        dests, packed = self._dests.get((base, okey)) or self._made(base, okey, lay, list(values))
        for dst, a in zip(dests, values, strict=True):
            dst[...] = a  # (dtype and shape: those of the key; np.copyto is a Python call)
        return (_new(Outcome, (tid, packed, None)),)

    def _layout(self, okey: tuple[Any, ...], out: dict[str, Any]) -> tuple[FlatSkeleton, list[int], int] | None:
        skeleton, arrays = packing.split(out)
        lay = None
        if type(skeleton) is FlatSkeleton:
            offsets, size = packing.layout(arrays)
            lay = (skeleton, offsets, size)
        if len(self._layouts) >= LIMIT:
            self._layouts.clear()
        self._layouts[okey] = lay
        return lay

    def _made(self, base: int, okey: tuple[Any, ...], lay: tuple[FlatSkeleton, list[int], int],
              arrays: list[np.ndarray]) -> tuple[list[np.ndarray], Packed]:
        """The views and refs packing.write makes for arrays of this layout at `base`."""
        skeleton, offsets, _ = lay
        dests = [self.array_out(base + off, a.dtype, a.shape) for a, off in zip(arrays, offsets, strict=True)]
        refs = tuple([ArrayRef(base + off, a.dtype.str, a.shape) for a, off in zip(arrays, offsets, strict=True)])
        made = (dests, Packed(skeleton, refs))
        if len(self._dests) >= LIMIT:
            self._dests.clear()
        self._dests[(base, okey)] = made
        return made
