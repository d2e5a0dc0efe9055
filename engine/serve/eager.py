"""A coroutine started eagerly: its first steps run now, in the caller, and only the rest, if it
ever waits, in a Task (what Python 3.12's eager task factory does; this project runs 3.11).

serve's inference route is a coroutine that, on an idle engine, never waits: the express lane
polls the worker's pipe and steps the answer in place (engine.caller.aio.watch_lend), so the
future it awaits is done when awaited. Run as a Task it still cost a turn of the event loop
before its first step, and its task's creation and scheduling (bench.serve_overhead, docs/serve.md).
Started here it runs to its answer inside the protocol's `data_received`:

    run(coro)   coro.send(None) ... StopIteration             done: no Task at all
                coro.send(None) -> a future it waits on       Task(_Rest(coro, that future)): the
                                                              Task waits on the future as if it had
                                                              been the Task's own from the start

During the first steps no Task is current, and nothing can cancel them (no other callback runs
until they return). `current()` stands in for `asyncio.current_task()` there: a handle whose
cancel() and uncancel() go to the Task that the rest runs in (a disconnect, the only canceller,
can come only once the coroutine waits, so that Task exists by then). Code that needs a real
Task (asyncio.timeout) awaits `asyncio.sleep(0)` first when none is current: a bare yield, which
moves the rest into its Task at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any

_running: list[Started] = []  # the coroutine whose first steps run now (innermost last)


class Started:
    """One eager start: the Task its rest runs in, once it waits."""

    __slots__ = ("task",)

    def __init__(self) -> None:
        self.task: asyncio.Task[Any] | None = None

    def cancel(self, msg: Any = None) -> bool:
        return self.task.cancel(msg) if self.task is not None else False

    def uncancel(self) -> int:
        return self.task.uncancel() if self.task is not None else 0


def run(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any] | None:
    """Run `coro` until it first waits; then the Task that runs the rest (None: it finished).
    What it raises in its first steps is raised here."""
    started = Started()
    _running.append(started)
    try:
        yielded = coro.send(None)
    except StopIteration:
        return None
    finally:
        _running.pop()
    started.task = loop.create_task(_rest(coro, yielded))
    return started.task


def current() -> asyncio.Task[Any] | Started | None:
    """The current Task, or, in an eager start's first steps, its handle."""
    task = asyncio.current_task()
    if task is None and _running:
        return _running[-1]
    return task


async def _rest(coro: Coroutine[Any, Any, Any], yielded: Any) -> Any:
    return await _Rest(coro, yielded)


class _Rest:
    """The rest of a coroutine started eagerly, awaited in a Task: each future it yields (what it
    waits on, or None: a bare yield) is handed to the Task as the Task's own, and what the Task
    sends or throws back goes on to it."""

    __slots__ = ("coro", "yielded")

    def __init__(self, coro: Coroutine[Any, Any, Any], yielded: Any) -> None:
        self.coro, self.yielded = coro, yielded

    def __await__(self) -> Generator[Any, None, Any]:
        coro, yielded = self.coro, self.yielded
        while True:
            try:
                yield yielded
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # noqa: BLE001 - a cancel, or the awaited future's error: the coroutine's
                try:
                    yielded = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
                continue
            try:
                yielded = coro.send(None)
            except StopIteration as stop:
                return stop.value
