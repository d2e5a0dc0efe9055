"""Inside the actor process (steps 5-7 of the diagram in `engine.ray.backend`): `SlotActor`
owns one slot's session; what a call returns is `ActorReady` or `ActorDone`, plain data."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from slabpool.workers import context as task_context
from slabpool.workers.errors import ErrorKind
from slabpool.workers.pipeline import TaskPipeline, error_kind, remote_error, seed_task
from slabpool.workers.protocol import FaultSpec, RemoteError, SessionInfo
from slabpool.workers.session import ModelSession, SessionSpec, load_session

log = logging.getLogger("slabpool.engine.ray")


@dataclass(frozen=True)
class ActorReady:
    pid: int
    node_id: str
    info: SessionInfo | None
    error: RemoteError | None  # the session could not be built


@dataclass(frozen=True)
class ActorDone:
    """What one call returns: outputs (arrays go back through the object store) or an error."""

    task_id: int
    attempt: int
    outputs: Any
    error: RemoteError | None
    run_s: float
    pid: int


class SlotActor:
    """One slot: owns exactly one session, built once per actor incarnation."""

    def __init__(
        self,
        slot: int,
        spec: SessionSpec | None,
        preprocess: Callable[..., Any] | None,
        postprocess: Callable[..., Any] | None,
        initializer: Callable[..., Any] | None,
        initargs: tuple[Any, ...],
    ) -> None:
        self.slot = slot
        self.session: ModelSession | None = None
        self.error: RemoteError | None = None
        try:  # every failure goes back as data (a raising constructor would be retried for ever)
            if initializer is not None:
                initializer(*initargs)
            self.session = load_session(spec) if spec is not None else None
        except Exception as exc:  # noqa: BLE001
            self.error = remote_error(exc, ErrorKind.RUN)
        self.pipeline = TaskPipeline(self.session, preprocess, postprocess)

    def ready(self) -> ActorReady:
        return ActorReady(os.getpid(), ray.get_runtime_context().get_node_id(),
                          self.session.info if self.session else None, self.error)

    def run(self, item: Any, task_id: int, attempt: int, seed: int,
            ctx: dict[str, Any] | None, fault: FaultSpec | None, step: int = 0) -> ActorDone:
        t0 = time.perf_counter()
        with task_context.bind(ctx):
            try:
                seed_task(seed)  # before preprocess, as in the local worker
                out = self.pipeline(item, fault=fault, step=step)
            except Exception as exc:  # noqa: BLE001 - the user's code or the runtime raised
                log.info("task %d failed in %s: %s", task_id, self.pipeline.stage, type(exc).__name__)
                return self._failed(task_id, attempt, remote_error(exc, error_kind(exc)), t0)
        return ActorDone(task_id, attempt, out, None, time.perf_counter() - t0, os.getpid())

    @staticmethod
    def _failed(task_id: int, attempt: int, err: RemoteError, t0: float) -> ActorDone:
        return ActorDone(task_id, attempt, None, err, time.perf_counter() - t0, os.getpid())

