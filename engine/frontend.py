"""The caller's side that every backend shares: the local `Engine` and `RayEngine` differ in
where tasks run, not in how a caller talks to them.

A backend provides `submit`, `close`, `_end_queued`, `_info()`, `stats()` and `_control` (the
thread that owns its slots: `command(kind, arg)`); everything here is built on those.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from typing import Any, Protocol

from engine.admission import TaskQueue
from engine.aio import AsyncEngineMixin
from engine.config import EngineConfig
from engine.states import EngineState
from engine.stats import ModelDescription
from engine.task import Result, Task
from workers import contract
from workers.protocol import FaultSpec, SessionInfo, TensorSpec


class Control(Protocol):
    def command(self, kind: str, arg: Any = None, *, wait_reply: bool = True) -> Any: ...


class Frontend(AsyncEngineMixin):
    config: EngineConfig
    _queue: TaskQueue
    _state: EngineState
    _specs: tuple[TensorSpec, ...]
    _batchable: bool
    _control: Control

    # -- what a backend provides ----------------------------------------------------------------

    def submit(
        self,
        inputs: Any,
        *,
        context: dict[str, Any] | None = None,
        deadline: float | None = None,
        block_timeout: float | None = None,
        _fault: FaultSpec | None = None,
    ) -> Future[Result]:
        raise NotImplementedError

    def close(self, *, cancel_pending: bool = False, timeout: float | None = None) -> None:
        raise NotImplementedError

    def _end_queued(self, task: Task, error: BaseException | None) -> None:
        raise NotImplementedError

    def _info(self) -> SessionInfo | None:
        raise NotImplementedError

    # -- step 1 and the task's identity ---------------------------------------------------------

    def _admit(self, inputs: Any) -> tuple[Any, tuple[Any, ...], int]:
        """Check the input contract at the door (no preprocess); return item, batch key, items.

        Inputs of a signature (names, exact array types, dtypes, shapes) already checked are
        not checked again: the contract depends on nothing else."""
        if self.config.preprocess is not None or not self._specs:
            return inputs, ("item",), 1
        if type(inputs) is dict:
            sig = tuple([(k, type(v), getattr(v, "dtype", None), getattr(v, "shape", None)) for k, v in inputs.items()])
            known = self._admitted.get(sig)
            if known is not None:
                return dict(inputs), known[0], known[1]
        feeds = contract.check(contract.normalize(inputs, self._specs), self._specs)
        key = tuple((n, a.dtype.str, a.shape[1:]) for n, a in feeds.items())
        items = next(iter(feeds.values())).shape[0] if self._batchable else 1
        if type(inputs) is dict:
            if len(self._admitted) >= 256:  # many distinct shapes (a dynamic axis): start over
                self._admitted.clear()
            self._admitted[sig] = (key, items)
        return feeds, key, items

    def _set_specs(self, info: SessionInfo | None) -> None:
        self._specs = info.inputs if info else ()
        self._batchable = bool(self._specs) and all(s.shape and s.shape[0] is None for s in self._specs)
        self._admitted: dict[tuple[Any, ...], tuple[tuple[Any, ...], int]] = {}
        self.model_version = info.model_digest if info else ""

    def _seed(self, task_id: int) -> int:
        """The task's seed, from (engine seed, task id): a replay draws the same numbers. Only
        user code draws them (the worker seeds before preprocess/postprocess): 0 without it."""
        if self.config.preprocess is None and self.config.postprocess is None:
            return 0
        digest = hashlib.blake2b(f"{self.config.seed}:{task_id}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little")

    def _on_cancelled(self, fut: TaskFuture) -> None:
        """Future.cancel() on a queued task: take it out of the queue, free its inputs now."""
        task = fut.slabpool_task
        if self._queue.discard(task):
            self._end_queued(task, None)

    # -- the rest of the caller's API -----------------------------------------------------------

    def infer(self, inputs: Any, **kw: Any) -> Any:
        """Submit and wait: the outputs (dict name -> array, or what postprocess returned)."""
        return self.submit(inputs, **kw).result().outputs

    def map(
        self,
        items: Iterable[Any],
        *,
        window: int | None = None,
        return_exceptions: bool = False,
        context: dict[str, Any] | None = None,
    ) -> Iterator[Any]:
        """Results in submission order, at most `window` tasks in flight (memory stays bounded).

        A failed task raises at its position, unless `return_exceptions` yields the error instead.
        Abandoning the iterator cancels what is still queued."""
        window = window or self.config.queue_capacity + self.config.workers * self.config.inflight_per_slot
        futs: deque[Future[Result]] = deque()
        try:
            for item in items:
                futs.append(self.submit(item, context=context))
                if len(futs) >= window:
                    yield _outcome(futs.popleft(), return_exceptions)
            while futs:
                yield _outcome(futs.popleft(), return_exceptions)
        finally:
            for f in futs:
                f.cancel()

    def cancel(self, future: Future[Result], *, kill: bool = False) -> bool:
        """Cancel a task. Queued: it never runs. Running: its result is never delivered (it ends
        with TaskCancelled now; its buffers are freed once the run really ends); with
        `kill=True` its slot is rebuilt to stop the computation, and the slot's other tasks replay."""
        if future.cancel():
            return True
        task: Task | None = getattr(future, "slabpool_task", None)
        if task is None or future.done():
            return False
        return bool(self._control.command("cancel", (task, kill)))

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.close(cancel_pending=exc_type is not None)

    @property
    def state(self) -> EngineState:
        return self._state

    def describe(self) -> ModelDescription:
        info = self._info()
        if info is None:
            return ModelDescription((), (), "", "", "", False)
        return ModelDescription(info.inputs, info.outputs, info.runtime, info.runtime_version,
                                info.model_digest, self._batchable)

    def _counts(self) -> dict[str, int]:
        c = self._queue.counters
        with self._queue.lock:
            return {k: getattr(c, k) for k in ("accepted", "completed", "failed", "cancelled", "replayed",
                                                 "quarantined", "timeouts", "stacked_batches",
                                                 "outputs_in_place")}


class TaskFuture(Future[Result]):
    """The Future of one task. Its cancel() of a queued task also takes the task out of the
    queue (a subclass, not a done-callback: no callback to register and call per task)."""

    slabpool_task: Task

    def __init__(self, frontend: Frontend) -> None:
        super().__init__()
        self._frontend = frontend

    def cancel(self) -> bool:
        if not super().cancel():
            return False
        self._frontend._on_cancelled(self)
        return True


def _outcome(fut: Future[Result], return_exceptions: bool) -> Any:
    if not return_exceptions:
        return fut.result()
    try:
        return fut.result()
    except BaseException as exc:  # noqa: BLE001 - handed to the caller as the item's outcome
        return exc
