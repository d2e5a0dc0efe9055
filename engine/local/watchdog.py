"""When a slot's work is overdue, as pure decisions over a slot's state and its status words,
and the one action that moves work away from a stalled slot (`revoke`).

    time_limit  when the task in hand passes task_timeout: its own time, whatever the size of
                its group (the worker writes when it took the task into its status word 1)
    stall_at    when the running batch counts as stalled: no progress for stall_after
    revoke      a batch sent ahead to a stalled slot goes back to the queue, on copies of its
                inputs (the stalled worker may still read the originals; they stay pinned
                until it answers)
"""

from __future__ import annotations

import time

import numpy as np
import numpy.typing as npt

from slabpool.engine.core.config import EngineConfig
from slabpool.engine.core.states import TaskState
from slabpool.engine.core.task import Batch, Task
from slabpool.engine.local.slot import Slot
from slabpool.shm import Arena
from slabpool.workers.pipeline import IDLE


def time_limit(cfg: EngineConfig, slot: Slot, words: npt.NDArray[np.int64]) -> float | None:
    """When the task in hand passes task_timeout (monotonic seconds); None: no limit runs.
    With no task in hand yet, one taken from now on cannot pass it before now + task_timeout:
    that is when to look again."""
    if cfg.task_timeout is None or not slot.batches or slot.kill_reason:
        return None
    head = slot.batches[0]
    if head.started_at is None or head.out_wanted:
        return None  # not started, or waiting for output memory: no task's time runs
    grace = min(2.0, cfg.task_timeout) if slot.info and slot.info.runtime == "onnxruntime" else 0.0
    task_id, began = int(words[0]), int(words[1])
    if task_id == IDLE or int(words[0]) != task_id:  # (word 1 is written first: a pair read
        return time.monotonic() + cfg.task_timeout + grace  # across a change waits)
    return began / 1e9 + cfg.task_timeout + grace


def stall_at(cfg: EngineConfig, slot: Slot) -> float | None:
    """When the slot's running batch counts as stalled (None: not running, or warned already)."""
    if slot.stalled_since is not None or not slot.batches or slot.kill_reason:
        return None
    head = slot.batches[0]
    return None if head.started_at is None or head.out_wanted else head.started_at + cfg.stall_after


def revoke(batch: Batch, inputs: Arena) -> list[Task] | None:
    """Take back a batch sent ahead: its live tasks get copies of their inputs and go back to
    QUEUED; the originals stay pinned to the batch. None: no room for the copies now."""
    live = [t for t in batch.tasks if t.state is TaskState.RUNNING]
    fresh = [inputs.try_lease(t.lease.nbytes) if t.lease is not None else None for t in live]
    if any(n is None and t.lease is not None for n, t in zip(fresh, live, strict=True)):
        inputs.release_many([n for n in fresh if n is not None])
        return None
    for t, new in zip(live, fresh, strict=True):
        old = t.lease
        if old is not None and new is not None:
            src = inputs.array(old.offset, np.dtype(np.uint8), (old.nbytes,))
            inputs.array(new.offset, np.dtype(np.uint8), (old.nbytes,))[:] = src
            refs = tuple(r._replace(offset=r.offset - old.offset + new.offset) for r in t.packed.arrays)
            t.packed, t.lease = t.packed._replace(arrays=refs), new
            batch.pinned.append(old)
        t.move(TaskState.QUEUED)
        t.in_batch = None
    for t in batch.tasks:  # tasks that ended meanwhile keep their inputs till the answer
        if t.state.is_terminal and t.lease is not None:
            batch.pinned.append(t.lease)
            t.lease = None
    batch.revoked, batch.tasks = True, []
    return live
