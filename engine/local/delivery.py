"""Step 8 of the task flow on a local Engine: a worker's BatchDone becomes per-task outcomes,
each task's outputs copied out of shared memory into arrays the caller owns (inside the
local transport, before the owner sees the Done). What fails here (a result that does not
unpickle, no memory left in this process for the copy) fails that task alone.
"""

from __future__ import annotations

import time
from typing import Any

from slabpool.engine.core.task import Batch, Task
from slabpool.engine.core.transport import Outcome
from slabpool.engine.local.regions import OutputRegions
from slabpool.shm import Arena
from slabpool.workers import errors as E
from slabpool.workers import packing
from slabpool.workers.protocol import SPLIT, BatchDone, FlatSkeleton, open_result


def batch_outcomes(batch: Batch, msg: BatchDone, regions: OutputRegions, outputs: Arena) -> tuple[Outcome, ...]:
    """One Outcome per task of the batch that had not ended (a task cancelled while it ran
    gets none: its result is dropped); the sizes seen are learnt for the next batch."""
    used = 0
    split = False
    got = []
    tasks = {t.id: t for t in batch.tasks}
    for outcome in msg.outcomes:
        task = tasks[outcome.task_id]
        if task.state.is_terminal:
            continue  # cancelled while it ran: its result is dropped, its inputs go back
        if outcome.error is not None:
            if outcome.error.kind == SPLIT:  # its outputs did not fit beside the others': again, apart
                split = True
                got.append(Outcome(task, split=True))
            else:
                got.append(Outcome(task, error=E.from_remote(outcome.error, task.id)))
            continue
        packed = outcome.outputs
        assert packed is not None
        used += packing.region_size(packed)
        got.append(copy_out(task, packed, outputs))
    if not split:  # (a split batch's sizes were learnt from its NeedOutput)
        regions.observed(batch, used)
    return tuple(got)


def copy_out(task: Task, packed: Any, outputs: Arena) -> Outcome:
    """Step 8 for one task: open its result, copy its outputs out."""
    t0 = time.perf_counter()
    try:
        if type(packed.skeleton) is not FlatSkeleton:
            packed = open_result(packed)  # made by user code: it may not unpickle here
        arrays = packing.unpack(packed, outputs.array, copy=True, items=False)  # step 8
    except E.TaskDataError as exc:
        return Outcome(task, error=E.TaskDataError(f"task {task.id}: {exc}", task_id=task.id))
    except MemoryError:
        return Outcome(task, error=E.TaskDataError(
            f"task {task.id}: this process ran out of memory copying its outputs "
            f"({packing.region_size(packed)} bytes) out of shared memory", task_id=task.id))
    return Outcome(task, outputs=arrays, copy_s=time.perf_counter() - t0)
