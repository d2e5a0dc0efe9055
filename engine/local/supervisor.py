"""The supervisor of a local Engine: the owner every backend shares
(engine.core.coordinator.Coordinator) on the local transport (engine.local.transport: worker
processes, their pipes and one selector, shared memory). Steps 3-4 and 8-9 of the task flow
and the whole crash path (the diagram in `engine/__init__.py`) are the owner's; what is local
(spawn, reap, pipes, output regions, copies out of shared memory) is the transport's.
"""

from __future__ import annotations

from collections.abc import Callable
from multiprocessing.context import BaseContext
from typing import Any

from slabpool.engine.core.admission import TaskQueue
from slabpool.engine.core.config import EngineConfig
from slabpool.engine.core.coordinator import Coordinator
from slabpool.engine.local.transport import LocalTransport
from slabpool.shm import Arena
from slabpool.workers.main import WorkerBoot
from slabpool.workers.session import SessionSpec


def supervisor(
    cfg: EngineConfig, queue: TaskQueue, inputs: Arena, outputs: Arena, ctx: BaseContext,
    boot: Callable[[int, int, SessionSpec | None, int], WorkerBoot], metrics: Any,
) -> tuple[Coordinator, LocalTransport]:
    """The owner of a local Engine's slots, and its transport (not started yet)."""
    transport = LocalTransport(cfg, inputs, outputs, ctx, boot)
    return Coordinator(cfg, queue, metrics, transport, "slabpool-supervisor"), transport
