"""The worker's lean path (issue 21): the common task in the fewest interpreted opcodes.

An idle `Engine.infer` of plain inputs sends its worker a RunBatch of ONE task: a flat dict
of arrays (a FlatSkeleton), no context, no FaultSpec, no deadline, one session call (or, a
group of callers' rows under load, engine.caller.combine, and a block of infer(batch_size=):
session calls of `step` rows, pipeline.run_in_steps, as the general path makes them), on a
worker with a session and no preprocess or postprocess. The general path
(workers.main.Worker.run_batch) walks it through every stage of every kind of batch; this
path runs the same steps once, in one method, and keeps what cannot change between calls:

    the inputs' views        per ArrayRef tuple (the input arena is mapped once, for good),
                             made only once their signature passed the input contract
                             (pipeline's `Checked`: a signature that passed passes again)
    the outputs' layout      per outputs' signature (names, types, dtypes, shapes)
    their views and refs     per (region offset, that layout): the write is one copy each

    views -> status word 0 = the task -> region -> planner.place (a region of at least
          in_place_min_bytes) -> fields(run) -> run (in steps) -> run_s -> outputs into the region (or
          the general _write: a region to ask for, outputs not plain) -> the BatchDone,
          encoded (protocol.encode_done: encode's bytes); the loop then writes IDLE, sends it

What it does not take it declines before any step has an effect (`run` returns None: the
general path runs the batch): more than one task, any of the task's options, inputs whose
signature the contract has not passed yet (the general path checks them, and says why they
fail). An error of the run becomes that task's RemoteError as `_guarded` makes it
(pipeline.failure, logged with the task's fields: the same kind, type and message; only its
traceback's frames are this path's); the in-place run is the general path's own
(Worker._run_into), and so is its fallback to a plain run.
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
    FlatSkeleton,
    Packed,
    RemoteError,
    RunBatch,
    encode_done,
    outcome_wire,
    packed_wire,
)
from slabpool.workers.session import RunTimeout
from slabpool.workers.worklog import task_fields

if TYPE_CHECKING:
    from slabpool.workers.main import Worker

log = logging.getLogger("slabpool.workers")

LIMIT = 256  # entries each cache keeps (then starts over: many offsets or shapes)

_PAGE = os.sysconf("SC_PAGE_SIZE")
_CLASS_DTYPE_SHAPE = operator.attrgetter("__class__", "dtype", "shape")
_clock = time.perf_counter
_Made = tuple[list[np.ndarray], int, tuple[Any, ...]]


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
        self.place_from = self.planner.min_bytes if self.planner is not None else 1 << 62
        self.array_in, self.array_out = worker.inputs.array, worker.outputs.array
        # ArrayRef tuple -> (skeleton, views by name, the planner's key of them)
        self._inputs: dict[tuple[ArrayRef, ...], tuple[Any, dict[str, np.ndarray], Any]] = {}
        # outputs' (name, type, dtype, shape) per output -> (skeleton, offsets, size), or None
        # when they are not a flat dict of plain arrays (the general _write walks them)
        self._layouts: dict[tuple[Any, ...], tuple[FlatSkeleton, list[int], int] | None] = {}
        # (region offset, outputs' key) -> (views to copy into, bytes, the Packed of them as on the wire)
        self._dests: dict[tuple[int, tuple[Any, ...]], _Made] = {}

    def run(self, msg: RunBatch) -> bytes | None:
        """The BatchDone of `msg`, encoded (protocol.encode_done), or None (nothing done): not
        the common case."""
        tasks = msg.tasks
        if len(tasks) != 1:
            return None
        t = tasks[0]
        if t.context is not None or t.fault is not None or t.deadline is not None:
            return None
        item = t.item
        t0 = _clock()
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
        planner = self.planner  # (a region smaller than in_place_min_bytes places nothing)
        placed = planner.place(region, key) if region[1] >= self.place_from and planner is not None else None
        token = task_fields.set({"task_id": tid, "attempt": t.attempt, "stage": "run"})
        try:  # Worker._run_one of a task without a fault: one session call, or one a step
            if placed is None:
                out: Any = self.pipeline.run(feeds, self.timeout, t.step)
                if planner is not None:
                    planner.learn_key(key, out)
            else:
                assert planner is not None
                out = self._in_place(feeds, placed, tid, t.step)
        except Exception as exc:  # noqa: BLE001 - the runtime raised: the task's outcome
            out = failure("run", exc)
        finally:
            task_fields.reset(token)
        run_s = _clock() - t0
        kind = type(out)
        if kind is Placed:
            wire, in_place = (tid, *packed_wire(out.packed), None), 1
        elif kind is RemoteError:
            wire, in_place = (tid, None, None, None, out), 0
        else:
            wire, in_place = self._write(msg, region, tid, out), 0
        return encode_done(msg.batch_id, wire, run_s, rss() if self.report_rss else 0, in_place)

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

    def _in_place(self, feeds: dict[str, np.ndarray], placed: Placed, tid: int, step: int = 0) -> Any:
        """The in-place run, or a plain one if it failed (then never in place for these inputs)."""
        self.pipeline.stage = "preprocess"  # (as the general path leaves it: no pipeline.run)
        try:
            self.w._run_into(feeds, placed.dests, step)
            return placed
        except RunTimeout:
            raise
        except Exception:  # noqa: BLE001 - a plain run tells a shape change from a real error
            log.debug("in-place run of task %d failed; running it plainly", tid)
        out = self.pipeline.run(feeds, self.timeout, step)
        assert self.planner is not None
        self.planner.forget(placed.key)  # the shapes vary with the data: never bind them
        return out

    def _write(self, msg: RunBatch, region: tuple[int, int], tid: int, out: Any) -> tuple[Any, ...]:
        """Step 7 for a plain run's outputs, its Outcome as on the wire: into the region it
        came with, through views made once per place and layout; else by the general _write."""
        base, room = region
        made = None
        if type(out) is dict:
            values = out.values()
            try:  # (names, (class, dtype, shape)s): made in C
                okey = (tuple(out), tuple(map(_CLASS_DTYPE_SHAPE, values)))
                made = self._dests.get((base, okey)) or self._made(base, okey, out)
            except Exception:  # noqa: BLE001 - not plain arrays: the general _write says what they are
                made = None
        if made is None or made[1] > room:  # (the region is too small: ask for one)
            return outcome_wire(self.w._write(msg, region, {tid: out})[0])
        for dst, a in zip(made[0], values, strict=True):
            dst[...] = a  # (dtype and shape: those of the key; np.copyto is a Python call)
        return (tid, *made[2], None)

    def _made(self, base: int, okey: tuple[Any, ...], out: dict[str, Any]) -> _Made | None:
        """The views and the refs packing.write makes for outputs of this key at `base`; None
        when the general _write must write them: not a flat dict of plain arrays, or a region
        to ask for (none came with the batch)."""
        lay = self._layouts[okey] if okey in self._layouts else self._layout(okey, out)
        if lay is None:
            return None
        skeleton, offsets, size = lay
        if size > 0 and base < 0:
            return None
        arrays = list(out.values())
        dests = [self.array_out(base + off, a.dtype, a.shape) for a, off in zip(arrays, offsets, strict=True)]
        refs = tuple([ArrayRef(base + off, a.dtype.str, a.shape) for a, off in zip(arrays, offsets, strict=True)])
        made = (dests, size, packed_wire(Packed(skeleton, refs)))
        if len(self._dests) >= LIMIT:
            self._dests.clear()
        self._dests[(base, okey)] = made
        return made

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
