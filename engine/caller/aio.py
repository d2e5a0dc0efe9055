"""asyncio front end of the Engine: `await eng.infer_async(x)`, `map_async`, `async with`.

    event-loop thread                      admission lane (1 thread)     supervisor thread
    submit_async(inputs)
     A  submit(block_timeout=0)    -- QueueFull, or large inputs, or a backlog in the lane -->
        (admitted at once: locks           submit(inputs, block_timeout=left)
         and a small copy only)             waits for room like a sync caller
     B  Future --add_done_callback--> loop.call_soon_threadsafe --> asyncio future  <== step 9
        (an idle local engine lends the slot to the loop, engine.core.fastpath: a reader on its
         pipe; steps 8-9 on the loop thread, which never waits for the owner lock: held, the
         lend goes back to the owner thread; the asyncio future is then set at once)
     C  the awaiting coroutine is cancelled (timeout scope, client gone, task.cancel()):
          Future.cancel()    queued: it never runs (the engine drops it from its queue)
          else eng.cancel()  running: it ends at once with TaskCancelled, its result is never
                             delivered; run on the cancel lane, the loop does not wait for it

Nothing here waits on the loop thread. The only engine call made on it is an admission that
cannot wait (`block_timeout=0`); whatever could wait (a full queue, full shared memory, the
copy of large inputs, the supervisor's reply to a cancel, `close()`) runs on another thread.
Each engine gets two daemon threads, started on first use: the admission lane (one, so
callers that had to wait are admitted in arrival order) and the cancel lane.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from slabpool.engine.caller import lanes
from slabpool.engine.caller.mapping import DOOR_ERRORS
from slabpool.engine.core import interrupts
from slabpool.engine.core.config import waits
from slabpool.engine.core.fastpath import Lender
from slabpool.engine.core.states import EngineState
from slabpool.workers.errors import EngineClosed, QueueFull, TaskCancelled

if TYPE_CHECKING:
    from slabpool.engine.core.config import EngineConfig
    from slabpool.engine.core.task import Result

T = TypeVar("T")
INLINE_COPY_BYTES = 1 << 20  # larger inputs are copied into shared memory off the loop thread


class _Host(Protocol):
    """What the async front end needs of an engine (`slabpool.engine.local.pool.Engine` provides it)."""

    @property
    def config(self) -> EngineConfig: ...

    @property
    def state(self) -> EngineState: ...

    def submit(
        self,
        inputs: Any,
        *,
        context: dict[str, Any] | None = ...,
        deadline: float | None = ...,
        block_timeout: float | None = ...,
    ) -> Future[Result]: ...

    def cancel(self, future: Future[Result], *, kill: bool = ...) -> bool: ...

    def close(self, *, cancel_pending: bool = ..., timeout: float | None = ...) -> None: ...


async def infer_async(eng: _Host, inputs: Any, kw: dict[str, Any]) -> Any:
    """`BaseEngine.infer_async()`: the outputs. A local engine's express lane takes an idle
    engine's call of plain inputs on the loop thread (engine.local.express), unless earlier
    calls still wait on the admission lane (they were accepted first); else `submit_async`."""
    if kw:
        return (await submit_async(eng, inputs, **kw)).outputs
    got = _express(eng, inputs, result=False)
    if got is not None:
        return await _express_done(eng, *got)
    return (await _submit_async(eng, inputs, None, None, None)).outputs


async def submit_async(
    eng: _Host,
    inputs: Any,
    *,
    context: dict[str, Any] | None = None,
    deadline: float | None = None,
    block_timeout: float | None = None,
) -> Result:
    """`BaseEngine.submit_async()`: admit without blocking the loop, then await the task
    (cancelling the awaiting coroutine cancels it). Plain inputs alone take the express lane
    as `infer_async`'s do, with the Result the owner's path makes (the version and the slot
    that computed it: what `slabpool serve` answers with)."""
    if context is None and deadline is None and block_timeout is None:
        got = _express(eng, inputs, result=True)
        if got is not None:
            return cast("Result", await _express_done(eng, *got))
    return await _submit_async(eng, inputs, context, deadline, block_timeout)


async def _submit_async(eng: _Host, inputs: Any, context: dict[str, Any] | None, deadline: float | None,
                        block_timeout: float | None) -> Result:
    """`submit_async` past the express lane: admitted by the admission lane, then awaited."""
    loop = asyncio.get_running_loop()
    fut = await _admit(eng, loop, inputs, context, deadline, block_timeout, lend=True)
    return await _await_task(eng, loop, fut)


def _express(eng: _Host, inputs: Any, result: bool) -> tuple[Future[Result], asyncio.Future[Any]] | None:
    """The express lane's take of this call (engine.local.express: its task's Future and the
    future of its outputs, or of its Result), or None: it is not there (another backend), the
    call is not one it takes, or earlier calls still wait on the admission lane (they were
    accepted first)."""
    express = getattr(eng, "_express", None)
    if express is None:
        return None
    if _backlog(eng):
        return None
    return cast("tuple[Future[Result], asyncio.Future[Any]] | None",
                express.call_async(eng, inputs, asyncio.get_running_loop(), result))


async def _express_done(eng: _Host, fut: Future[Result], waiter: asyncio.Future[Any]) -> Any:
    """What an express call gives (its outputs, or its Result); cancelling the awaiting
    coroutine cancels its task."""
    try:
        return await waiter
    except asyncio.CancelledError:
        _cancel_task(eng, fut)
        raise


async def map_async(
    eng: _Host,
    items: AsyncIterable[Any] | Iterable[Any],
    window: int | None,
    return_exceptions: bool,
    context: dict[str, Any] | None,
) -> AsyncIterator[Result | BaseException]:
    """`BaseEngine.map_async()`: at most `window` tasks accepted and not yet yielded; what is
    still in flight when the consumer stops is cancelled. An iterable that raises: the outcomes
    of every item it gave, then its error (as map())."""
    cfg = eng.config
    window = window or cfg.queue_capacity + cfg.workers * cfg.inflight_per_slot
    loop = asyncio.get_running_loop()
    held: deque[tuple[Future[Result], asyncio.Future[Result], int]] = deque()
    numbered = _enumerate(_aiter(items))
    broke: Exception | None = None
    try:
        while True:
            try:
                index, item = await anext(numbered)
            except StopAsyncIteration:
                break
            except Exception as exc:  # noqa: BLE001 - the caller's iterable: raised after what it gave
                broke = exc
                break
            try:
                fut = await _admit(eng, loop, item, context, None, None)
            except DOOR_ERRORS as exc:  # (as map(): at its position, after the outcomes before it)
                fut = Future()
                fut.set_exception(exc)
            except EngineClosed as exc:  # closed meanwhile: the accepted items' outcomes first (a
                broke = exc  # drain runs them), then this error, as map()
                break
            held.append((fut, bridge(loop, fut), index))
            if len(held) >= window:
                yield await _head(held, return_exceptions)
        while held:
            yield await _head(held, return_exceptions)
        if broke is not None:
            raise broke
    finally:
        for fut, waiter, _ in held:
            if waiter.done() and not waiter.cancelled():
                waiter.exception()  # retrieved: an error nobody will see is not logged
            waiter.cancel()
            _cancel_task(eng, fut)


async def close_async(eng: _Host, cancel_pending: bool) -> None:
    """`async with`'s exit: close() on a thread of its own (it waits for the drain), the lanes
    stopped after it. Cancelled while closing: the close goes on, the caller moves on."""
    closing = lanes.spawn(functools.partial(eng.close, cancel_pending=cancel_pending))
    closing.add_done_callback(lambda _: lanes.stop_lanes(eng))
    await asyncio.wrap_future(closing)


# -- admission (A) ------------------------------------------------------------------------------


async def _admit(
    eng: _Host,
    loop: asyncio.AbstractEventLoop,
    inputs: Any,
    context: dict[str, Any] | None,
    deadline: float | None,
    block_timeout: float | None,
    lend: bool = False,
) -> Future[Result]:
    """The engine's Future for `inputs`: accepted on the loop thread when that cannot wait,
    else on the admission lane (as a sync caller would be), without blocking the loop.
    `lend`: the caller awaits it at once, and its slot may be lent to this loop (`watch_lend`)."""
    if deadline is not None or block_timeout is not None:
        waits(deadline, block_timeout)  # (the loop's own submit below is given block_timeout=0)
    if not _backlog(eng) and _nbytes(inputs) <= INLINE_COPY_BYTES:
        submit = functools.partial(eng.submit, inputs, context=context, deadline=deadline, block_timeout=0)
        lending = getattr(eng, "_lending_submit", None) if lend else None
        try:
            return lending(submit, Lender.LOOP) if lending is not None else submit()
        except QueueFull:
            if block_timeout == 0:
                raise
    lane = lanes.lanes(eng).admit  # (started here, at the first call that needs it)
    started = time.monotonic()
    # the lane's count and its put are one step for a Ctrl-C (a hand-run loop on the main
    # thread): one between them left the count up for good, and every later call took the
    # lane, the express lane never again. Deferred, it is raised once the job is queued.
    interrupts.enter()
    try:
        job = lane.run(_submit_late, eng, inputs, context, deadline, block_timeout, started)
    except BaseException:
        interrupts.leave_quietly()
        raise
    try:
        interrupts.leave()
        return await asyncio.wrap_future(job, loop=loop)
    except (asyncio.CancelledError, KeyboardInterrupt):
        if not job.cancel():  # already being admitted: cancel what it admits, at once
            job.add_done_callback(functools.partial(_cancel_admitted, eng))
        raise


def _backlog(eng: _Host) -> int:
    """Calls waiting on the engine's admission lane (0 if it has none): a new call queues
    behind them, in arrival order, neither admitted on the loop nor taken by the express lane."""
    got = lanes.all_lanes.get(eng)
    return got.admit.backlog if got is not None else 0


def _cancel_admitted(eng: _Host, job: Future[Future[Result]]) -> None:
    if not job.cancelled() and job.exception() is None:
        _cancel_task(eng, job.result())


def _submit_late(
    eng: _Host,
    inputs: Any,
    context: dict[str, Any] | None,
    deadline: float | None,
    block_timeout: float | None,
    started: float,
) -> Future[Result]:
    """On the admission lane: `submit`, with the time already spent waiting for the lane
    taken off the caller's deadline and block_timeout."""
    spent = time.monotonic() - started
    return eng.submit(
        inputs,
        context=context,
        deadline=None if deadline is None else max(deadline - spent, 0.0),
        block_timeout=None if block_timeout is None else max(block_timeout - spent, 0.0),
    )


def _nbytes(inputs: Any, depth: int = 2) -> int:
    """Bytes of the arrays (or bytes) in `inputs`, looking two containers deep: a cheap bound
    on the copy that admission makes on the calling thread."""
    size = getattr(inputs, "nbytes", None)
    if isinstance(size, int):
        return size
    if isinstance(inputs, bytes | bytearray | memoryview):
        return len(inputs)
    if depth and isinstance(inputs, dict):
        return sum(_nbytes(v, depth - 1) for v in inputs.values())
    if depth and isinstance(inputs, list | tuple):
        return sum(_nbytes(v, depth - 1) for v in inputs)
    return 0


# -- waiting and cancelling (B, C) --------------------------------------------------------------


def bridge(loop: asyncio.AbstractEventLoop, fut: Future[Result], outputs: bool = False) -> asyncio.Future[Any]:
    """An asyncio future that the engine's Future completes, through call_soon_threadsafe:
    with its Result, or (`outputs`) with the Result's outputs.

    A Future cancelled by someone else (`eng.cancel`, `close`) ends it with TaskCancelled,
    never with asyncio.CancelledError: that one means "this coroutine was cancelled"."""
    waiter: asyncio.Future[Any] = loop.create_future()
    loop_thread = threading.get_ident()  # (made on the loop's thread)

    def relay(done: Future[Result]) -> None:
        if threading.get_ident() == loop_thread:  # completed on the loop itself (a lent slot)
            _settle(waiter, done, outputs)
            return
        try:
            loop.call_soon_threadsafe(_settle, waiter, done, outputs)
        except RuntimeError:
            pass  # the loop is closed: nobody is waiting any more

    fut.add_done_callback(relay)
    return waiter


def _settle(waiter: asyncio.Future[Any], done: Future[Result], outputs: bool = False) -> None:
    if waiter.done():
        return
    if done.cancelled():
        task = getattr(done, "slabpool_task", None)
        task_id = getattr(task, "id", None)
        waiter.set_exception(TaskCancelled(f"task {task_id}: cancelled while queued", task_id=task_id))
    elif (exc := done.exception()) is not None:
        waiter.set_exception(exc)
    else:
        waiter.set_result(done.result().outputs if outputs else done.result())


async def _await_task(eng: _Host, loop: asyncio.AbstractEventLoop, fut: Future[Result]) -> Result:
    waiter = bridge(loop, fut)
    lend = getattr(fut, "lend", None)
    if lend is not None:
        watch_lend(loop, lend)
    try:
        return cast("Result", await waiter)
    except asyncio.CancelledError:
        _cancel_task(eng, fut)
        raise


def watch_lend(loop: asyncio.AbstractEventLoop, lend: Any, step: Any = None,
               deliver: Callable[[Any], None] | None = None) -> None:
    """The loop is the lender of a slot (engine.core.fastpath.Lend): the worker's answer
    wakes the loop itself (a reader on the dup of the slot's pipe) and the loop runs steps 8-9
    (`Lend.look`, which never waits for the owner lock; `step`: the lender's own step, whose
    value, when it has one, goes to `deliver`). The Future then completes on the loop
    thread and `bridge` settles the waiter at once. The owner ends a lend through `wake`
    (call_soon_threadsafe): the reader goes, and the Future completes as any other. It does
    not depend on the awaiting coroutine: cancelled, the task ends here all the same.

    First the loop polls the pipe for up to `spin_us` (a lend is made to a calm loop only: see
    FastPath._idle), and an answer that lands within it is looked at here, with no reader,
    no wake-up and no turn of the loop (workers.wire.Spin: while that pays)."""
    fd, watched = lend.fd, [True]

    def look() -> None:
        if not watched[0]:
            return
        # one stretch for a Ctrl-C (engine.core.interrupts): on a hand-run loop on the main
        # thread it landed in the owner's step and stopped the engine for good. Deferred, it is
        # raised once the step is done, its outputs delivered and the reader gone.
        interrupts.enter()
        try:
            got = lend.look(step)
            if got is not None and deliver is not None:
                deliver(got)
            if lend.over or lend.abandoned:
                watched[0] = False
                loop.remove_reader(fd)
                os.close(fd)
                lend.wake = _told  # (this wake held look, which holds the lend: a cycle per call)
        except BaseException:
            interrupts.leave_quietly()
            raise
        interrupts.leave()

    def wake() -> None:
        try:
            loop.call_soon_threadsafe(look)
        except RuntimeError:  # the loop is closed: it will never look; its dup of the pipe goes here
            if watched[0]:  # (the owner has given the slot back: this is its end of the lend)
                watched[0] = False
                os.close(fd)
            lend.wake = _told

    lend.loop_lend(time.monotonic())
    lend.wake = wake
    fast = lend.fast
    if fast is not None and fast.spin_s and fast.spin.wait(fd, fast.spin_s):
        look()
        if not watched[0]:
            return
    loop.add_reader(fd, look)
    if lend.over:
        look()


def _told() -> None:
    """A lend's wake once its loop has stopped looking: nothing left to tell."""


def _cancel_task(eng: _Host, fut: Future[Result]) -> None:
    """The receipts of `eng.cancel()`, without waiting on the calling thread: a queued task is
    cancelled here (it never runs); a running one by the cancel lane (never delivered)."""
    if fut.cancel() or fut.done():
        return
    try:
        lane = lanes.lanes(eng).cancel
    except EngineClosed:  # (closed: its lanes are stopped; the owner answers at once, or is gone)
        eng.cancel(fut)
        return
    lane.run(eng.cancel, fut)


async def _head(held: deque[tuple[Future[Result], asyncio.Future[Result], int]],
                return_exceptions: bool) -> Result | BaseException:
    """The oldest task's outcome, with its item's index; it leaves `held` only once it has one
    (a cancelled wait leaves it there, for the caller to cancel)."""
    index = held[0][2]
    try:
        result = await held[0][1]
    except Exception as exc:
        held.popleft()
        with contextlib.suppress(AttributeError, TypeError):  # an exception class with __slots__
            exc.index = index  # type: ignore[attr-defined]
        if return_exceptions:
            return exc
        raise
    held.popleft()
    return dataclasses.replace(result, index=index)


async def _enumerate(items: AsyncIterator[T]) -> AsyncIterator[tuple[int, T]]:
    index = 0
    async for item in items:
        yield index, item
        index += 1


async def _aiter(items: AsyncIterable[T] | Iterable[T]) -> AsyncIterator[T]:
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item
