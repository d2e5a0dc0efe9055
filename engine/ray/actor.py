"""Inside the actor process (steps 5-7 of the diagram in `engine.ray.backend`): `SlotActor`
owns one slot's session; what a call returns is `ActorReady` or `ActorBatch`, plain data.

A call runs one batch, as a local worker does: its tasks one after another (a group), or
stacked into one session call on axis 0 (a stacked batch, max_batch_size > 1), each task's
preprocess and postprocess on its own and its error its own; a stacked run that fails runs
its tasks one by one, so that only the guilty one fails.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil
import ray

from slabpool.workers import context as task_context
from slabpool.workers import faults, packing
from slabpool.workers.errors import ErrorKind, TaskDataError
from slabpool.workers.pipeline import TaskPipeline, error_kind, remote_error, run_stacked, seed_task
from slabpool.workers.protocol import FaultSpec, FlatSkeleton, RemoteError, Sealed, SessionInfo, seal, unseal
from slabpool.workers.session import ModelSession, SessionSpec, load_session

log = logging.getLogger("slabpool.engine.ray")


@dataclass(frozen=True)
class ActorReady:
    pid: int
    node_id: str
    info: SessionInfo | None
    error: RemoteError | None  # the session could not be built
    rss: int = 0  # resident memory once the session is built (stats() before any call)


@dataclass(frozen=True)
class CallTask:
    """One task of a call, besides its inputs (which Ray passes as the call's arguments)."""

    task_id: int
    attempt: int
    seed: int
    context: Sealed | None  # pickled at submit: what the caller's dict held then
    fault: FaultSpec | None
    step: int = 0


@dataclass(frozen=True)
class ActorBatch:
    """What one call returns: per task (in order), its outputs (arrays go back through the
    object store) or its error."""

    outputs: tuple[Any, ...]
    errors: tuple[RemoteError | None, ...]
    run_s: float
    pid: int
    rss: int = 0  # resident memory after the call: stats(), the rss gauge, worker_memory_limit


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
        task_timeout: float | None = None,
    ) -> None:
        self.slot = slot
        self.session: ModelSession | None = None
        self.error: RemoteError | None = None
        self.task_timeout = task_timeout
        self.process = psutil.Process()  # its rss, read after each call (a few microseconds)
        try:  # every failure goes back as data (a raising constructor would be retried for ever)
            if initializer is not None:
                initializer(*initargs)
            self.session = load_session(spec) if spec is not None else None
        except BaseException as exc:  # noqa: BLE001 - SystemExit from an initializer too, as the local worker's
            self.error = remote_error(exc, ErrorKind.RUN)
        self.pipeline = TaskPipeline(self.session, preprocess, postprocess)

    def ready(self) -> ActorReady:
        return ActorReady(os.getpid(), ray.get_runtime_context().get_node_id(),
                          self.session.info if self.session else None, self.error, self.process.memory_info().rss)

    def run_batch(self, tasks: list[CallTask], stack: bool, refs: list[Any]) -> ActorBatch:
        """Steps 5-7 for one batch. `refs`: each task's inputs, an ObjectRef read here (not
        resolved by Ray as arguments), so that inputs that do not unpickle fail their own task."""
        t0 = time.perf_counter()
        items, errs = _fetch(refs)
        outs: list[Any] = [None] * len(tasks)
        whole = not any(errs)
        done = self._stacked(tasks, tuple(items), outs, errs) if stack and whole and len(tasks) > 1 else set()
        for i, (t, item) in enumerate(zip(tasks, items, strict=True)):
            if i not in done and errs[i] is None:
                outs[i], errs[i] = self._one(t, functools.partial(
                    self.pipeline, item, timeout=self.task_timeout, fault=t.fault, step=t.step))
        return ActorBatch(tuple(outs), tuple(errs), time.perf_counter() - t0, os.getpid(),
                          self.process.memory_info().rss)

    def _one(self, t: CallTask, thunk: Callable[[], Any]) -> tuple[Any, RemoteError | None]:
        """One task's stage(s) with its context bound and its seed drawn; an error is its own."""
        try:
            ctx = None if t.context is None else unseal(t.context, "the context")
        except TaskDataError as exc:
            return None, remote_error(exc, ErrorKind.DATA)
        with task_context.bind(ctx):
            try:
                seed_task(t.seed)  # before preprocess, as in the local worker
                return _crossing(thunk()), None
            except BaseException as exc:  # noqa: BLE001 - the user's code or the runtime raised (SystemExit
                # and KeyboardInterrupt from a hook too: the task's, as in the local worker)
                log.info("task %d failed in %s: %s", t.task_id, self.pipeline.stage, type(exc).__name__)
                return None, remote_error(exc, error_kind(exc))

    def _stacked(self, tasks: list[CallTask], items: tuple[Any, ...], outs: list[Any],
                 errs: list[RemoteError | None]) -> set[int]:
        """One session call for the batch's feeds on axis 0; the tasks it ran (none if it failed:
        they run one by one, each error its own)."""
        if self.session is None:
            return set()
        feeds = [self._one(t, functools.partial(_prepared, self.pipeline, x, t.fault))
                 for t, x in zip(tasks, items, strict=True)]
        ok = [i for i, (_, err) in enumerate(feeds) if err is None]
        try:
            for i in ok:
                faults.inject(tasks[i].fault, "run")
            stacked = [feeds[i][0] for i in ok]
            parts = run_stacked(lambda x: self.pipeline.run(x, self.task_timeout), list(stacked[0]), stacked)
        except Exception:  # noqa: BLE001 - find the guilty one: run each on its own
            log.debug("stacked run failed; running the batch's %d tasks one by one", len(tasks))
            return set()
        for i, err in enumerate(f[1] for f in feeds):
            if err is not None:
                errs[i] = err
        for i, part in zip(ok, parts, strict=True):
            outs[i], errs[i] = self._one(tasks[i], functools.partial(self.pipeline.finish, part, items[i]))
        return set(range(len(tasks)))


def _fetch(refs: list[Any]) -> tuple[list[Any], list[RemoteError | None]]:
    """The tasks' inputs from the object store (zero-copy, read-only views), and for each one
    that does not unpickle here its TaskDataError. A lost object fails the call (the owner
    replays its tasks)."""
    try:
        return list(ray.get(refs)), [None] * len(refs)
    except ray.exceptions.ObjectLostError:
        raise
    except Exception:  # noqa: BLE001 - find which: one by one
        pass
    items: list[Any] = []
    errs: list[RemoteError | None] = []
    for ref in refs:
        try:
            items.append(ray.get(ref))
            errs.append(None)
        except ray.exceptions.ObjectLostError:
            raise
        except Exception as exc:  # noqa: BLE001 - the caller's object: its task's error
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            err = TaskDataError(f"the inputs: pickled, but cannot be unpickled in this process: {why}")
            items.append(None)
            errs.append(remote_error(err, ErrorKind.DATA))
    return items, errs


def _crossing(out: Any) -> Any:
    """A task's result, once it is known to cross to the caller: what is not an array is
    pickled and unpickled here (a flat dict of arrays has nothing else), so that a result that
    does not cross fails its own task (TaskDataError, as from a local worker) rather than the
    whole call's answer; a result nested past the recursion limit fails with RecursionError."""
    skeleton, _ = packing.split(out)
    if type(skeleton) is not FlatSkeleton:
        what = "the result (what postprocess, or preprocess without a model, returned)"
        unseal(seal(skeleton, what), what)
    return out


def _prepared(pipeline: TaskPipeline, item: Any, fault: FaultSpec | None) -> Any:
    faults.inject(fault, "preprocess")
    return pipeline.prepare(item)


