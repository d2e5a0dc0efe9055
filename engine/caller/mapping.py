"""`map()`: items in, outcomes out, in order (or as they finish), with bounded memory.

Tiny items go many to a task (a chunk: one outcome per item), the chunk size following the
measured run time per item and the bytes an item takes in and out (`_Pace`); an item refused at
the door or failing in the worker is that item's outcome alone; a chunk that kills workers, or
whose outputs cannot fit the output arena together, runs again item by item. An iterable that
raises ends map() as the builtin map() ends: the outcomes of every item it gave, then its error.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
from collections import deque
from collections.abc import Generator, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from slabpool.engine.caller.handles import refuse_wait_here
from slabpool.engine.caller.request import Request
from slabpool.engine.core.config import EngineConfig
from slabpool.engine.core.task import Result
from slabpool.workers import errors as E
from slabpool.workers import packing
from slabpool.workers.protocol import Chunk, RemoteError

_Pending = tuple[Future[Result], list[Any], int]  # a task of map(): its Future, its items, the first's index


class MapHost(Protocol):
    """What map() needs of an engine (`BaseEngine` provides it): its submit(), its one internal
    way in, chunk tasks (a local Engine's) and the caller's item counts."""

    chunked_map: bool

    @property
    def config(self) -> EngineConfig: ...

    def submit(self, inputs: Any, *, context: dict[str, Any] | None = ...) -> Future[Result]: ...

    def _submit(self, request: Request) -> Future[Result]: ...

    def _submit_chunk(self, inputs: list[Any], context: dict[str, Any] | None) -> Future[Result]: ...

    def _tally(self, *, accepted: int = ..., completed: int = ..., failed: int = ...,
               cancelled: int = ...) -> None: ...


# an item refused at the door (its input contract, data that cannot be pickled, too large):
# map() and map_async() give it at its position, with its .index, after the outcomes before it
DOOR_ERRORS = (E.TaskError, E.ShmCapacityError, TypeError, ValueError)


def results(
    eng: MapHost, items: Iterable[Any], *, window: int | None, return_exceptions: bool,
    context: dict[str, Any] | None, chunk: int | None, ordered: bool,
) -> Generator[Result | BaseException, None, None]:
    """`BaseEngine.map()` once its call is checked: item by item, each task's outcomes."""
    refuse_wait_here(eng, "map()")
    # an item refused at the door is contained either way: it then raises at its position,
    # with its .index, after the results before it (was: at once, before them, with no index)
    tasks = parts(eng, items, window=window, contain=True, context=context, chunk=chunk, ordered=ordered)
    try:
        for part in tasks:
            yield from part.each(return_exceptions)
    finally:
        tasks.close()  # at once, not when a traceback lets go of it: what is queued is cancelled


def parts(
    eng: MapHost,
    items: Iterable[Any],
    *,
    window: int | None = None,
    contain: bool = False,
    context: dict[str, Any] | None = None,
    chunk: int | None = None,
    ordered: bool = True,
) -> Generator[MapPart, None, None]:
    """map() one task at a time: a MapPart per task, holding the outcomes of its items in
    their order (map() yields them one by one; the batch job takes a chunk's outputs whole,
    with no Result per item). `contain`: map()'s return_exceptions at the door."""
    if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk must be a positive integer or None, got {chunk!r}")
    auto = chunk is None and _chunks_ok(eng)
    size = 1 if chunk is None or not _chunks_ok(eng) else chunk
    base = window or eng.config.queue_capacity + eng.config.workers * eng.config.inflight_per_slot
    pace = _Pace(min(MAX_CHUNK_BYTES, eng.config.shm_capacity // (4 * eng.config.workers)))
    pending: deque[_Pending] = deque()
    in_flight = 0
    start = 0  # the index of the next item taken from `items`
    it = iter(items)
    broke: Exception | None = None  # what `items` raised: after the outcomes of the items before it
    try:
        while broke is None:
            if auto:
                size = pace.chunk(window, eng.config.workers)
            limit = window or max(base, 4 * eng.config.workers * size)
            group: list[Any] = []
            try:  # (extend keeps what it took before the iterable raised: those items still run)
                group.extend(itertools.islice(it, size))
            except Exception as exc:  # noqa: BLE001 - the caller's iterable: raised after what it gave
                broke = exc
            if not group:
                break
            pace.weigh(group[0])
            try:
                pending.extend(_submit_items(eng, group, context, contain, start))
            except E.EngineClosed as exc:  # closed meanwhile (another thread's close()): what was
                broke = exc  # accepted still ends (a drain runs it), so its outcomes come first, then
                break  # this error (was: raised at once, the outcomes of the accepted items dropped)
            start += len(group)
            in_flight += len(group)
            while pending and in_flight >= limit:
                fut, group, first = _next_done(pending, ordered)
                in_flight -= len(group)
                yield from _task_parts(eng, fut, group, context, pace, len(group) > 1, first)
        while pending:
            fut, group, first = _next_done(pending, ordered)
            yield from _task_parts(eng, fut, group, context, pace, len(group) > 1, first)
        if broke is not None:  # (as the builtin map(): every outcome before it, then its error)
            raise broke
    finally:
        for f, group, _ in pending:
            f.cancel()
            if len(group) > 1:  # a chunk's items are the caller's side to count
                eng._tally(cancelled=len(group))


def _submit_items(
    eng: MapHost, group: list[Any], context: dict[str, Any] | None, contain: bool, start: int,
) -> list[_Pending]:
    """Submit one task of map(), its items from index `start` of the caller's iterable. With
    `contain` (return_exceptions), an item refused at the door (its input contract, data
    that cannot be pickled, too large) becomes a failed Future at its position: the items
    of its chunk go one by one, the rest still runs."""
    try:
        if len(group) == 1:
            return [(eng.submit(group[0], context=context), group, start)]
        fut = eng._submit_chunk(group, context)
        eng._tally(accepted=len(group))
        return [(fut, group, start)]
    except DOOR_ERRORS as exc:
        if not contain:
            raise
        if len(group) > 1:
            return [part for i, x in enumerate(group)
                    for part in _submit_items(eng, [x], context, contain, start + i)]
        failed: Future[Result] = Future()
        failed.set_exception(exc)
        return [(failed, group, start)]


def _task_parts(
    eng: MapHost, fut: Future[Result], group: list[Any], context: dict[str, Any] | None, pace: _Pace, tally: bool,
    start: int,
) -> Iterator[MapPart]:
    """The outcome of one task of map() as MapParts (one; or one per item when a chunk that
    killed workers runs again item by item), its first item at index `start`. `tally`: the
    task counts no items itself (a chunk, or an item of one run again alone)."""
    try:
        res = fut.result()
    except (E.PoisonTask, E.WorkerCrashed, E.ShmCapacityError) as exc:
        # which item kills workers, or needs more shared memory than the arena holds for
        # one task? Each alone now: it fails alone (an item that fits alone never fails
        # for sharing a chunk)
        if len(group) > 1:
            futs: list[Future[Result]] = []
            seen = 0
            try:
                futs = [eng._submit(Request(x, context, units=0)) for x in group]
                for i, f in enumerate(futs):
                    seen += 1  # its outcome is counted by the call below
                    yield from _task_parts(eng, f, [group[i]], context, pace, True, start + i)
            finally:
                for f in futs[seen:]:
                    f.cancel()
                eng._tally(cancelled=len(group) - seen)
            return
        if tally:
            eng._tally(failed=1)
        yield MapPart(1, None, exc, start)
        return
    except Exception as exc:  # noqa: BLE001 - every item of the task ends with it (raised there)
        if tally:
            eng._tally(failed=len(group))
        yield MapPart(len(group), None, exc, start)
        return
    except BaseException:  # a Ctrl-C while it waits: taken off `pending` already, so cancelled
        fut.cancel()  # here (was: run on, and a chunk's items never counted: accepted ran ahead of
        if tally:  # completed + failed + cancelled for good, a hostile run)
            eng._tally(cancelled=len(group))
        raise
    pace.observe(res.timings.run, len(group), res.outputs)
    if type(res.outputs) is not Chunk:
        if tally:
            eng._tally(completed=1)
        yield MapPart(1, res, None, start)
        return
    count = packing.chunk_count(res.outputs)  # (stacked: every item done)
    bad = 0 if res.outputs.stacked is not None else sum(type(out) is RemoteError for out in res.outputs)
    eng._tally(completed=count - bad, failed=bad)
    yield MapPart(count, res, None, start)


def _chunks_ok(eng: MapHost) -> bool:
    """Chunk tasks need a local engine; task_timeout is per task, not per item: off then."""
    return eng.chunked_map and eng.config.task_timeout is None


@dataclass(frozen=True, slots=True)
class MapPart:
    """The outcomes of `count` consecutive items of map(), the first at index `start` of the
    caller's iterable: one task's Result (its outputs a Chunk of one outcome per item, or one
    item's outputs), or one error for all of them."""

    count: int
    result: Result | None
    error: BaseException | None
    start: int = 0

    def each(self, return_exceptions: bool) -> Iterator[Result | BaseException]:
        """Item by item, as map() yields them: a Result with its item's `index`, or the item's
        error with `.index` set (raised unless `return_exceptions`)."""
        if self.error is not None:
            if not return_exceptions:
                raise _indexed(self.error, self.start)
            for i in range(self.count):
                yield _indexed(self.error if i == 0 else _copy_error(self.error), self.start + i)
            return
        res = self.result
        assert res is not None
        if type(res.outputs) is not Chunk:
            yield dataclasses.replace(res, index=self.start)
            return
        for i, out in enumerate(packing.chunk_items(res.outputs)):
            if type(out) is RemoteError:
                err = _indexed(E.from_remote(out, res.task_id), self.start + i)
                if not return_exceptions:
                    raise err
                yield err
            else:
                yield Result(res.task_id, out, res.model_version, res.slot, res.pid, res.attempts, res.timings,
                             res.context, self.start + i)


def _indexed(error: BaseException, index: int) -> BaseException:
    """The error of map()'s item `index`, saying so (`.index`), as a Result does."""
    with contextlib.suppress(AttributeError, TypeError):  # an exception class with __slots__
        error.index = index  # type: ignore[attr-defined]
    return error


def _copy_error(error: BaseException) -> BaseException:
    """One error object per item of a failed chunk, so that each carries its own `.index`."""
    try:
        return copy.copy(error)
    except Exception:  # noqa: BLE001 - an exception class copy cannot rebuild: share the one
        return error


CHUNK_TARGET_S = 0.02  # run time per chunk task that map() aims at: its overhead (~0.3 ms) stays ~1%
MAX_CHUNK = 1024  # items per chunk task at most
MAX_CHUNK_BYTES = 16 * 1024 * 1024  # input bytes per chunk task at most (shared memory, queue_bytes)


def _next_done(pending: deque[_Pending], ordered: bool) -> _Pending:
    """The task whose outcomes map() yields next: the oldest, or (unordered) the first finished."""
    if not ordered:
        wait([f for f, _, _ in pending], return_when=FIRST_COMPLETED)
        for i, entry in enumerate(pending):
            if entry[0].done():
                del pending[i]
                return entry
    return pending.popleft()


class _Pace:
    """map()'s measure of the run time per item (an EWMA over finished tasks), and the chunk
    size it implies: ~CHUNK_TARGET_S of work, within `max_bytes` of inputs and outputs (a
    chunk's outputs share one region of the output arena)."""

    def __init__(self, max_bytes: int = MAX_CHUNK_BYTES) -> None:
        self.per_item: float | None = None
        self.item_bytes = 0  # array bytes of the latest item looked at
        self.out_bytes = 0  # array bytes of the outputs of one item (the latest measured)
        self.max_bytes = max(max_bytes, 1)

    def observe(self, run_s: float, items: int, outputs: Any = None) -> None:
        per = run_s / max(items, 1)
        self.per_item = per if self.per_item is None else 0.8 * self.per_item + 0.2 * per
        if isinstance(outputs, dict):  # one item's outputs (a chunk's are not looked into)
            self.out_bytes = sum(v.nbytes for v in outputs.values() if isinstance(v, np.ndarray))

    def weigh(self, item: Any) -> None:
        if isinstance(item, dict):
            self.item_bytes = sum(v.nbytes for v in item.values() if isinstance(v, np.ndarray))

    def chunk(self, window: int | None, workers: int) -> int:
        if self.per_item is None:
            return 1  # nothing measured yet: a task per item
        size = max(1, min(MAX_CHUNK, int(CHUNK_TARGET_S / max(self.per_item, 1e-7)),
                          self.max_bytes // max(self.item_bytes + self.out_bytes, 1)))
        if window:  # keep two tasks per worker in flight within the caller's window
            size = max(1, min(size, window // (2 * workers)))
        return size
