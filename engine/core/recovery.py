"""After a worker death: who is charged, what replays, in which composition. A pure decision
over the dead slot's batches; the supervisor applies it (step d of the crash path).

    running task (named by the slot's status word)  -> charged one crash; quarantined at
                                                       max_attempts; replayed alone otherwise
    a stacked batch that was running                -> charged as a whole; replayed with the
                                                       same composition (byte-identical), and
                                                       bisected if it kills a worker again
    everything else the slot held                   -> replayed uncharged, in acceptance order
    killed for task_timeout                         -> the running task fails with TaskTimeout
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slabpool.engine.core.states import KillReason, TaskState
from slabpool.engine.core.task import Batch, Task
from slabpool.workers.errors import Crash
from slabpool.workers.pipeline import STACKED  # a slot's status word besides a task id


@dataclass
class Settlement:
    replays: list[Batch] = field(default_factory=list)
    timed_out: list[Task] = field(default_factory=list)
    poisoned: list[Task] = field(default_factory=list)


def settle(
    held: list[Batch], expected: KillReason | None, crash: Crash, running_id: int, max_attempts: int,
) -> Settlement:
    """`expected` is why we killed it (None: it died on its own). Records crashes on the
    charged tasks and batches; returns what to replay, time out and quarantine."""
    out = Settlement()
    for i, batch in enumerate(held):
        live = [t for t in batch.tasks if t.state is TaskState.RUNNING]
        culprits = _running(batch, live, running_id) if i == 0 and batch.started_at is not None else []
        if culprits and expected is KillReason.TIMEOUT:
            out.timed_out += culprits
            live = [t for t in live if t not in culprits]
        elif culprits and expected is None:
            batch.crashes += 1
            for t in culprits:
                t.crashes.append(crash)
            if len(culprits) == 1 and len(culprits[0].crashes) >= max_attempts:
                out.poisoned.append(culprits[0])
                live = [t for t in live if t is not culprits[0]]
        elif i == 0 and batch.started_at is not None and expected is None and len(live) > 1:
            batch.crashes += 1  # died between the tasks of a group: nobody to charge
        out.replays += _regroup(batch, live, culprits)
    return out


def _running(batch: Batch, live: list[Task], running_id: int) -> list[Task]:
    if batch.stack and running_id == STACKED:
        return live
    return [t for t in live if t.id == running_id] or (live if len(live) == 1 else [])


def _regroup(batch: Batch, live: list[Task], culprits: list[Task]) -> list[Batch]:
    if not live:
        return []
    if batch.stack:
        if batch.crashes >= 2 and len(live) > 1:  # the same batch killed twice: bisect
            half = len(live) // 2
            return [Batch(live[:half], stack=half > 1), Batch(live[half:], stack=len(live) - half > 1)]
        same = len(live) == len(batch.tasks)
        return [Batch(live, stack=len(live) > 1, crashes=batch.crashes if same else 0)]
    if culprits:  # a group: the culprit alone (a second death then isolates it)
        c = culprits[0]
        parts = ([t for t in live if t.id < c.id], [c] if c in live else [], [t for t in live if t.id > c.id])
        return [Batch(p, stack=False) for p in parts if p]
    if batch.crashes >= 2 and len(live) > 1:  # died between tasks twice: bisect
        half = len(live) // 2
        return [Batch(live[:half], stack=False), Batch(live[half:], stack=False)]
    return [Batch(live, stack=False, crashes=batch.crashes)]
