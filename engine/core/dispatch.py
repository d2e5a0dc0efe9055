"""Dispatch policy as pure functions: how much work the next batch for a slot may take.

The owner thread asks `take_limits` once per batch it sends and does the I/O after; nothing
here touches a slot, a queue or a process, so the policy is tested on its own
(tests/test_core_policy.py).

    group_limit   tiny tasks go to a slot in groups that run ~GROUP_TARGET_S (one message each
                  way per group; measured: ~100 us of messages saved per task)
    task_budget   max_tasks_per_worker caps an incarnation's tasks; worker_memory_limit is
                  checked after every task, so one at a time
    take_limits   the queue.take() arguments for one slot: items per stacked batch, tasks per
                  group, and the fewest tasks worth sending ahead to a busy slot
"""

from __future__ import annotations

from typing import NamedTuple

from slabpool.engine.core.admission import MAX_GROUP, MIN_GROUP
from slabpool.engine.core.config import EngineConfig

GROUP_TARGET_S = 0.002  # a group of tiny tasks runs about this long


class TakeLimits(NamedTuple):
    max_items: int  # items per stacked batch (dynamic batching)
    max_tasks: int  # tasks per group
    min_tasks: int  # fewer than this waiting: send nothing ahead to a busy slot


def group_limit(task_s: float | None) -> int:
    """Tasks per group: as many as run in about GROUP_TARGET_S at the measured mean run time
    per task (None: nothing measured yet, one by one). Pointless, and unfair to the other
    slots, for tasks of milliseconds."""
    if task_s is None:
        return 1
    return max(1, min(MAX_GROUP, int(GROUP_TARGET_S / max(task_s, 1e-6))))


def task_budget(cfg: EngineConfig, incarnation_done: int, held: int, retiring: bool) -> int:
    """How many tasks the next batch of this worker incarnation may hold (0: recycle it)."""
    if cfg.worker_memory_limit is not None:
        return 0 if retiring else 1
    if cfg.max_tasks_per_worker is None:
        return MAX_GROUP
    return max(0, min(MAX_GROUP, cfg.max_tasks_per_worker - incarnation_done - held))


def fit_tasks(capacity: int, out_per_task: int) -> int:
    """Tasks of the largest outputs seen (per task) that one group's region holds: half the
    output arena, the other half being kept for the running batches."""
    return max(1, capacity // 2 // out_per_task) if out_per_task else MAX_GROUP


def take_limits(
    cfg: EngineConfig, *, budget: int, task_s: float | None, out_per_task: int, out_per_item: int,
    capacity: int, busy: bool, live_slots: int,
) -> TakeLimits:
    """The limits of the next batch for one slot: `budget` from task_budget, `busy` if the
    slot already holds a batch, `live_slots` the slots that share the queue."""
    budget = min(budget, fit_tasks(capacity, out_per_task))
    max_items = cfg.max_batch_size
    if out_per_item and max_items > 1:  # a stacked batch's outputs share one region
        max_items = max(1, min(max_items, capacity // 2 // out_per_item))
    min_tasks = 1
    if cfg.max_batch_size <= 1:  # unstacked groups; a stacked batch is sized in items
        limit = group_limit(task_s)
        budget = min(budget, limit)
        if busy and limit >= MIN_GROUP:  # tiny tasks, a busy slot: send ahead only a group
            min_tasks = MIN_GROUP * live_slots  # worth its message (measured: half the groups
            # had been of one task, at 1.6x the messages per task)
    return TakeLimits(max_items, budget, min_tasks)
