"""The asyncio front end's threads (engine.caller.aio): each engine's admission lane (one
thread, so callers that had to wait are admitted in arrival order) and cancel lane, started on
first use and stopped by close(); and a one-off thread for `async with`'s close().

A lane holds no reference to the engine while idle, so an engine dropped without close() is
still collected (and stops its lanes). A closed engine gets no lane (EngineClosed).
"""

from __future__ import annotations

import functools
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

from slabpool.engine.core.states import EngineState
from slabpool.workers.errors import EngineClosed

T = TypeVar("T")


class _Host(Protocol):
    @property
    def state(self) -> EngineState: ...


class Lane:
    """One daemon thread that runs jobs in order. It holds no reference to the engine while
    idle, so an engine dropped without close() is still collected (and stops the lane)."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._backlog = 0
        self.jobs = 0  # jobs ever handed to it
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    @property
    def backlog(self) -> int:
        """Jobs queued or running: new admissions queue behind them, in arrival order."""
        return self._backlog

    def run(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        job: Future[T] = Future()
        with self._lock:
            self._backlog += 1
            self.jobs += 1
        self._jobs.put((job, functools.partial(fn, *args)))
        return job

    def stop(self) -> None:
        self._jobs.put(None)

    def _loop(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, call = item
            try:
                if job.set_running_or_notify_cancel():
                    try:
                        job.set_result(call())
                    except BaseException as exc:  # noqa: BLE001 - it belongs to the caller
                        job.set_exception(exc)
            finally:
                del item, job, call
                with self._lock:
                    self._backlog -= 1


class Lanes:
    def __init__(self) -> None:
        self.admit = Lane("slabpool-aio-admit")
        self.cancel = Lane("slabpool-aio-cancel")

    def stop(self) -> None:
        self.admit.stop()
        self.cancel.stop()


all_lanes: weakref.WeakKeyDictionary[Any, Lanes] = weakref.WeakKeyDictionary()
_lanes_lock = threading.Lock()


def lanes(eng: _Host) -> Lanes:
    """The engine's lanes, started at the first call that needs them; a closed engine gets
    none (EngineClosed): close() stopped them, and nothing may start them again."""
    with _lanes_lock:
        lanes = all_lanes.get(eng)
        if lanes is None:
            if eng.state is not EngineState.ACCEPTING:
                raise EngineClosed(f"the engine is {eng.state.name}: submit() after close()")
            lanes = all_lanes[eng] = Lanes()
            weakref.finalize(eng, lanes.stop)
        return lanes


def stop_lanes(eng: _Host) -> None:
    """close()'s, once the engine accepts no more: the lanes stop after the jobs already given
    to them (each queued admission then meets the closed engine: EngineClosed, to its caller),
    and no call starts them again (`lanes`). Was: two idle threads for as long as the engine
    object lived, started again by a call on the closed engine."""
    with _lanes_lock:
        lanes = all_lanes.pop(eng, None)
    if lanes is not None:
        lanes.stop()


def spawn(fn: Callable[[], T]) -> Future[T]:
    """Run `fn` on a new daemon thread; its Future."""
    fut: Future[T] = Future()

    def run() -> None:
        try:
            fut.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - it belongs to the caller
            fut.set_exception(exc)

    fut.set_running_or_notify_cancel()
    threading.Thread(target=run, name="slabpool-aio-close", daemon=True).start()
    return fut
