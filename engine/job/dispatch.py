"""Steps 2-4 of the job, the two ways items go to the Engine: `by_blocks` (rows of arrays or of
a table, one task per block of rows, cut down to its failing rows) and `by_items` (Engine.map:
tiny items many to a task, each with its own outcome; with batched hooks a map item is a list
of items). Both hand outcomes to the run's Collector and call `JobRun.tick` between them.

The engine is a `JobEngine` (engine.caller.request): its public API and the caller's internals
that infer(batch_size=) and map() are built on (`_submit` of a Request, `_admit`, `_tally`,
`_map_parts`), typed, so that mypy checks every call made here."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from slabpool.engine.caller.blocks import BlockSizer, run_blocks
from slabpool.engine.caller.request import JobEngine, Request
from slabpool.engine.core.task import Result
from slabpool.engine.job import hooks as job_hooks
from slabpool.engine.job.collector import ITEM_ERRORS
from slabpool.engine.job.signals import Interrupts
from slabpool.engine.job.sources import Block, RowReader, Source
from slabpool.engine.job.sources.base import READ_ROWS
from slabpool.engine.job.store.rows import RowError

if TYPE_CHECKING:
    from slabpool.engine.job.run import JobRun

Todo = Iterator[tuple[int, Callable[[], Any], dict[str, Any]]]  # (index, read the item, kept values)


def pending_blocks(source: Source, todo: list[tuple[int, int]]) -> Iterator[tuple[Block, int, int]]:
    """Each block of the source holding items of `todo` (sorted, disjoint runs), with the span
    [j0, j1) of its items that lie in one run; in order."""
    runs = iter(todo)
    run = next(runs, None)
    for b in source.blocks(READ_ROWS):
        lo, hi = b.start, b.start + b.size
        while run is not None and run[0] < hi:
            if run[1] > lo:
                yield b, max(run[0], lo) - lo, min(run[1], hi) - lo
            if run[1] > hi:
                break  # the run goes on in the next block
            run = next(runs, None)
        if run is None:
            return


def pending_items(source: Source, todo: list[tuple[int, int]]) -> Todo:
    """The source's items whose index lies in `todo` (sorted, disjoint runs), in order."""
    for b, j0, j1 in pending_blocks(source, todo):
        for j in range(j0, j1):
            yield b.start + j, functools.partial(b.item, j), b.kept(j)


def by_blocks(run: JobRun, eng: JobEngine, reader: RowReader, todo: list[tuple[int, int]], intr: Interrupts) -> None:
    """Steps 2-4 by blocks of rows: one task per block, straight from the (mapped) file, or
    from a table's spans read front to back (engine.job.sources.RowReader)."""
    window = 2 * run.workers
    sizer = BlockSizer(run.spec.batch_size or "auto", reader.row_bytes(), eng.config.shm_capacity, window,
                       eng.config.task_timeout)

    def submit(lo: int, hi: int, step: int) -> Future[Result]:
        # a block counts no items itself (its rows are tallied here), `step` rows a session call
        return eng._submit(Request(reader.read(lo, hi), units=0, step=step))

    started = time.monotonic()
    pieces = run_blocks(submit, reader.runs(), sizer, window, stop=lambda: intr.count > 0)
    total = sum(b - a for a, b in todo)
    eng._tally(accepted=total)  # the rows handed in; their blocks are tasks of no items
    settled = 0
    try:
        while (piece := intr.wait(pieces)) is not None:
            now = time.monotonic()
            run.collector.add_block(piece, now - started, reader.kept(piece.lo, piece.hi))
            reader.release(piece.hi)
            started = now
            rows = piece.hi - piece.lo
            settled += rows
            eng._tally(completed=rows) if piece.error is None else eng._tally(failed=rows)
            run.tick(eng, intr)
    finally:
        pieces.close()
        eng._tally(cancelled=total - settled)


def by_items(run: JobRun, eng: JobEngine, source: Source, todo: list[tuple[int, int]], intr: Interrupts) -> None:
    """Steps 2-4 item by item, as Engine.map sends them: tiny items many to a task (a
    chunk), each item with its own outcome, settled a task at a time (a chunk's outputs
    whole: engine.caller.mapping.MapPart). An item that cannot be read, or that the model's
    contract refuses at the door, fails alone before it is sent."""
    if run.batched:
        return by_groups(run, eng, source, todo, intr)
    order: deque[tuple[int, dict[str, Any]]] = deque()  # (index, kept values) of each item sent
    col = run.collector
    admit = run.spec.preprocess is None

    def each() -> Iterator[Any]:
        for b, j0, j1 in pending_blocks(source, todo):
            values = b.items if b.load is None and not admit else None  # as they are: nothing to read
            for j in range(j0, j1):
                if intr.count:
                    return
                if values is not None:
                    item = values[j]
                else:
                    try:
                        item = b.item(j)
                        if admit:
                            eng._admit(item)  # refused at the door: this item alone fails
                    except ITEM_ERRORS as exc:
                        col.add(b.start + j, exc, b.kept(j))
                        continue
                order.append((b.start + j, b.kept(j)))
                yield item

    parts = eng._map_parts(each(), contain=True)
    try:
        while (part := intr.wait(parts)) is not None:
            col.add_part([order.popleft() for _ in range(part.count)], part)
            run.tick(eng, intr)
    finally:
        parts.close()


def by_groups(run: JobRun, eng: JobEngine, source: Source, todo: list[tuple[int, int]], intr: Interrupts) -> None:
    """by_items with batched hooks: a map item is a list of items (one hook call); a list that
    fails is retried item by item, so a bad one fails alone."""
    order: deque[list[tuple[int, Callable[[], Any], dict[str, Any]]]] = deque()
    col = run.collector
    pending = pending_items(source, todo)

    def groups() -> Iterator[Any]:
        while not intr.count and (group := list(itertools.islice(pending, run.chunk))):
            got = []
            for entry in group:
                try:
                    got.append((entry, entry[1]()))
                except ITEM_ERRORS as exc:
                    col.add(entry[0], exc, entry[2])
            if got:
                order.append([e for e, _ in got])
                yield [it for _, it in got]

    outcomes = eng.map(groups(), return_exceptions=True)
    try:
        while (outcome := intr.wait(outcomes)) is not None:
            settle(run, eng, order.popleft(), outcome)
            run.tick(eng, intr)
    finally:
        outcomes.close()


def settle(run: JobRun, eng: JobEngine, group: list[tuple[int, Callable[[], Any], dict[str, Any]]],
            outcome: Result | BaseException) -> None:
    """One map outcome: an item's, or a batched list's (split per item)."""
    if len(group) > 1 and isinstance(outcome, ITEM_ERRORS):
        for entry in group:  # find the bad item: each on its own, as a list of one
            try:
                alone: Result | BaseException = eng.submit([entry[1]()]).result()
            except ITEM_ERRORS as exc:
                alone = exc
            settle(run, eng, [entry], alone)
        return
    for (index, _, kept), mine in zip(group, shares(run, outcome, len(group)), strict=True):
        run.collector.add(index, mine, kept)


def shares(run: JobRun, outcome: Result | BaseException, n: int) -> list[Result | BaseException]:
    """Each item's share of a task's outcome: a batched list's result split once, into its n
    items' (one split per list, not one per item: the bookkeeping stays linear in the list)."""
    if not run.batched or not isinstance(outcome, Result):
        return [outcome] * n
    try:
        parts = job_hooks.split(outcome.outputs, n, post=run.spec.postprocess is not None,
                                model=run.spec.model is not None)
    except ValueError as exc:
        return [RowError(str(exc))] * n
    return [dataclasses.replace(outcome, outputs=part) for part in parts]
