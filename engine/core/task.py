"""A task in the engine (`Task`), the unit sent to a slot (`Batch`), and what a caller gets
back (`Result`)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from slabpool.engine.core.states import TaskState
from slabpool.workers.errors import Crash
from slabpool.workers.protocol import FaultSpec


@dataclass(frozen=True)
class Timings:
    """Seconds: waiting in the queue, copying through shared memory, in the worker, end to end."""

    queued: float
    transfer: float
    run: float
    total: float


@dataclass(frozen=True)
class Result:
    """What one task (or one item of `map()`) computed, and where.

    `task_id` names the task: the items of one `map()` chunk share it. `index` names the item:
    its 0-based position in the iterable given to `map()` (ordered or not, whatever chunk,
    replay or item-by-item rerun computed it), None for `submit()`. `context` is the one the
    task was given (`submit(context=)`, `map(context=)`)."""

    task_id: int  # the acceptance sequence number
    outputs: Any  # dict name -> array (caller-owned), or what postprocess/preprocess returned
    model_version: str  # digest of the model file that computed it ('' without a model)
    slot: int
    pid: int
    attempts: int  # 1 on the first try
    timings: Timings
    context: dict[str, Any] | None = None
    index: int | None = None  # map(): the item's position in its iterable


@dataclass(eq=False)
class Task:
    """One accepted task. Mutable, owned by the owner thread once dispatched.

    `inputs` is opaque here: what the backend staged at step 2 (a local Engine: the layout
    of the inputs in the input arena and their lease; Ray: an ObjectRef). The backend's
    transport reads it and releases it once, when the task has ended and no slot reads it."""

    id: int
    # None once the ledger has its outcome (finish): the Future's `slabpool_task` points back
    # here, and the cycle left every call's Task, Future, Lend and Batch to the collector
    future: Future[Result] | None
    inputs: Any
    shape_key: tuple[Any, ...]  # batches group tasks with equal keys
    rows: int  # rows on axis 0, what a stacked batch counts (1 when not batchable)
    context: dict[str, Any] | None
    seed: int
    deadline: float | None  # monotonic; still queued then -> TaskTimeout
    fault: FaultSpec | None
    accepted_at: float = field(default_factory=time.monotonic)
    copy_in_s: float = 0.0
    nbytes: int = 0  # its inputs' bytes in shared memory
    state: TaskState = TaskState.QUEUED
    attempts: int = 0
    crashes: list[Crash] = field(default_factory=list)
    dispatched_at: float = 0.0
    in_batch: Batch | None = None  # the batch that holds it in a slot (its inputs stay till then)
    units: int = 1  # caller's items it counts for in stats() (0: a chunk or block, counted by the caller's side)
    step: int = 0  # a block of rows: at most this many rows a session call (0: one call)

    def move(self, new: TaskState) -> None:
        self.state.check(new)
        self.state = new

    def result(self, outputs: Any, version: str, slot: int, pid: int, timings: Timings) -> Result:
        """Its Result (step 9): what computed it, and where its time went (`timings`)."""
        return Result(self.id, outputs, version, slot, pid, self.attempts, timings, self.context)

    def timings(self, run_s: float, copy_s: float, now: float) -> Timings:
        return Timings(queued=max(self.dispatched_at - self.accepted_at, 0.0), transfer=self.copy_in_s + copy_s,
                       run=run_s, total=now - self.accepted_at)

    def __repr__(self) -> str:
        return f"<Task {self.id} {self.state.name} attempts={self.attempts}>"


_batch_ids = iter(range(1, 1 << 62))


@dataclass(eq=False)
class Batch:
    """Tasks sent together to one slot. A replay keeps the composition (byte-identical)."""

    tasks: list[Task]
    stack: bool
    id: int = field(default_factory=lambda: next(_batch_ids))
    crashes: int = 0  # deaths of workers while running exactly this composition
    # taken back from a stalled slot (its tasks run elsewhere): it holds no task any more, and
    # only its answer (or its slot's death) ends it
    revoked: bool = False
    started_at: float | None = None  # when it became the head of its slot
