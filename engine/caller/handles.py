"""What the caller's side hands out and holds, beside the engine itself: the Future of one
task (`TaskFuture`), what it asks of a backend's owner thread (`Owner`), and what a reload
plan calls once it has swapped every slot (`applier`)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING, Any, Protocol

from slabpool.engine.core.task import Result, Task
from slabpool.workers.protocol import SessionInfo
from slabpool.workers.session import SessionSpec

if TYPE_CHECKING:
    from slabpool.engine.caller.base import BaseEngine


class Owner(Protocol):
    """What the caller's side asks of a backend's owner (engine.core.coordinator.Coordinator):
    its thread's calls, and the ledger's cancel and close."""

    @property
    def on_thread(self) -> bool: ...

    def call(self, fn: Callable[..., Any], *args: Any) -> Future[Any]: ...

    def join(self, timeout: float | None) -> bool: ...

    def close(self, cancel_pending: bool) -> None: ...

    def cancel(self, task: Task, kill: bool) -> bool: ...

    def abort(self, reason: str) -> None: ...

    def model_spec(self) -> SessionSpec | None: ...

    def start_reload(self, plan: Any) -> None: ...  # the backend's own `_reload_plan`


ABORT_S = 1.0  # close(timeout=) past its time: how long it waits at most for the abort to end every Future


def close_within(owner: Owner, timeout: float) -> bool:
    """close(timeout=)'s wait, once the owner was asked to close: its drain, and past all but the
    last fifth of the time (2 s at most) what still runs is cancelled and its slots stopped. Its
    Futures have ended when this returns (ABORT_S at most: the owner takes the call within
    microseconds; was, with timeout=0, close() returned with tasks of a held worker not yet
    done, a hostile run). False: the workers are still being stopped (in the background)."""
    stop_s = min(timeout / 5, 2.0)
    if owner.join(timeout - stop_s):
        return True
    aborted = owner.call(owner.abort, f"close(timeout={timeout}) expired before the task ended")
    wait([aborted], timeout=max(stop_s, ABORT_S))
    return owner.join(stop_s)


def applier(ref: weakref.ReferenceType[BaseEngine]) -> Callable[[SessionInfo], None]:
    """What a reload plan calls on the owner thread once it has swapped every slot: the
    engine's inputs and version become the new model's (weakly: the plan keeps no engine)."""

    def apply(info: SessionInfo) -> None:
        eng = ref()
        if eng is not None:
            eng._set_specs(info)

    return apply


def refuse_wait_here(eng: Any, what: str) -> None:
    """A call that waits for the engine, made on its owner thread (a Future's done-callback) or
    by a thread acting as the owner (a signal handler that interrupted its call into this
    engine): it would wait for that very thread, for ever. A RuntimeError saying so (was: the
    engine hung, close() too, and the process never exited)."""
    owner = getattr(eng, "_owner", None)
    if owner is not None and owner.on_thread:
        raise RuntimeError(f"{what} on the engine's own thread (in a Future's done-callback, or a signal handler "
                           "that interrupted a call into this engine) would wait for that thread: for ever. Call "
                           "it from another thread, or chain the work with add_done_callback")


class TaskFuture(Future[Result]):
    """The Future of one task. Its cancel() of a queued task also takes the task out of the
    queue (a subclass, not a done-callback: no callback to register and call per task)."""

    slabpool_task: Task
    lend: Any = None  # the slot lent to its caller (engine.core.fastpath.Lend), if it was

    def __init__(self, engine: weakref.ReferenceType[BaseEngine]) -> None:
        super().__init__()
        self._engine = engine

    def result(self, timeout: float | None = None) -> Result:
        if timeout is None and not self.done():
            refuse_wait_here(self._engine(), "result() of a task not done yet")
        return super().result(timeout)

    def cancel(self) -> bool:
        eng = self._engine()
        if eng is not None and eng._inherited:  # a forked child's copy of a parent's task: the
            return False  # parent's to cancel (its queue and memory are the parent's, as are their locks)
        if not super().cancel():
            return False
        if eng is not None:  # else the engine was collected, and its shutdown ended the task
            eng._on_cancelled(self)
        return True
