"""Frozen snapshots for callers: `describe()` and `stats()`."""

from __future__ import annotations

from dataclasses import dataclass

from slabpool.engine.core.admission import Counter
from slabpool.workers.protocol import TensorSpec


@dataclass(frozen=True)
class ModelDescription:
    inputs: tuple[TensorSpec, ...]  # name, dtype, shape (None = dynamic dim)
    outputs: tuple[TensorSpec, ...]
    runtime: str
    runtime_version: str
    model_version: str
    batchable: bool  # every input's axis 0 is one dynamic dim, the batch (workers.contract.batchable)
    weights: str = ""  # how the weights were loaded (shared, or as given and why)


@dataclass(frozen=True)
class SlotStats:
    slot: int
    pid: int
    state: str
    tasks_done: int
    restarts: int
    runtime: str
    runtime_version: str
    requested: tuple[str, ...]  # provider/delegate asked for
    applied: tuple[str, ...]  # provider/delegate really in use
    degraded: bool
    model_version: str
    rss_bytes: int
    pss_bytes: int = 0  # proportional set size: each shared page divided among its sharers
    shared_bytes: int = 0  # resident pages another process maps too (rss - uss): shared weights, arenas
    weights: str = ""  # how the model's weights were loaded: shared (prepacked, mapped) or as given


@dataclass(frozen=True)
class EngineStats:
    """accepted/completed/failed/cancelled count tasks (what the engine ran: a map() chunk or
    an infer(batch_size=) block is one task); items_* count what the caller handed in (a
    submit() is one item, a map() item one, a row of infer(batch_size=) or of the job one)."""

    state: str
    slots: tuple[SlotStats, ...]
    queued: int
    accepted: int
    completed: int
    failed: int
    cancelled: int
    replayed: int
    quarantined: int
    timeouts: int
    restarts: int
    shm_inputs_used: int
    shm_outputs_used: int
    shm_capacity: int  # per arena
    stacked_batches: int = 0  # session calls that ran several tasks stacked (dynamic batching)
    outputs_in_place: int = 0  # tasks whose outputs ONNX Runtime wrote into shared memory (IO binding)
    items_accepted: int = 0  # the caller's items (rows of infer(batch_size=)) handed in
    items_completed: int = 0  # ... that ended with a result
    items_failed: int = 0  # ... that ended with an error (a failed row of a block, say)
    items_cancelled: int = 0  # ... cancelled, or never run (map() abandoned, close)
    pool_shape: str = ""  # workers="auto": the workers x threads chosen, and why

    def counts(self) -> dict[Counter, int]:
        """Every counter of this snapshot, by `Counter` (the metrics' one way to read them)."""
        return {c: getattr(self, c) for c in Counter}
