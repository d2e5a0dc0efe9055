"""Steps 2-4 of the job, the two ways items go to the Engine: `by_blocks` (rows of arrays or of
a table, one task per block of rows, cut down to its failing rows) and `by_items` (Engine.map:
tiny items many to a task, each with its own outcome; with batched hooks a map item is a list
of items). Both hand outcomes to the run's Collector and call `JobRun.tick` between them."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from slabpool.engine.caller.blocks import BlockSizer, run_blocks
from slabpool.engine.core.task import Result
from slabpool.engine.job import hooks as job_hooks
from slabpool.engine.job.collector import ITEM_ERRORS
from slabpool.engine.job.progress import Interrupts
from slabpool.engine.job.sources import RowReader, Source
from slabpool.engine.job.store.rows import RowError

if TYPE_CHECKING:
    from slabpool.engine.job.run import JobRun

Todo = Iterator[tuple[int, Callable[[], Any], dict[str, Any]]]  # (index, read the item, kept values)


def pending_items(source: Source, todo: list[tuple[int, int]]) -> Todo:
    """The source's items whose index lies in `todo` (sorted, disjoint runs), in order."""
    runs = iter(todo)
    run = next(runs, None)
    for entry in source.items():
        while run is not None and entry[0] >= run[1]:
            run = next(runs, None)
        if run is None:
            return
        if entry[0] >= run[0]:
            yield entry


def by_blocks(run: JobRun, eng: Any, reader: RowReader, todo: list[tuple[int, int]], intr: Interrupts) -> None:
    """Steps 2-4 by blocks of rows: one task per block, straight from the (mapped) file, or
    from a table's spans read front to back (engine.job.sources.RowReader)."""
    window = 2 * run.workers
    sizer = BlockSizer(run.spec.batch_size or "auto", reader.row_bytes(), eng.config.shm_capacity, window)

    def submit(lo: int, hi: int) -> Future[Result]:
        return eng._submit_rows(reader.read(lo, hi), None, None)  # type: ignore[no-any-return]

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


def by_items(run: JobRun, eng: Any, source: Source, todo: list[tuple[int, int]], intr: Interrupts) -> None:
    """Steps 2-4 item by item, as Engine.map sends them: tiny items many to a task (a
    chunk), each item with its own outcome. With batched hooks a map item is a list of
    items (one hook call); a list that fails is retried item by item, so a bad one fails alone."""
    order: deque[list[tuple[int, Callable[[], Any], dict[str, Any]]]] = deque()
    col = run.collector
    pending = pending_items(source, todo)

    def each() -> Iterator[Any]:  # one item per map item: no groups to build
        admit = run.spec.preprocess is None
        for entry in pending:
            if intr.count:
                return
            try:
                item = entry[1]()
                if admit:
                    eng._admit(item)  # refused at the door: this item alone fails
            except ITEM_ERRORS as exc:
                col.add(entry[0], exc, entry[2])
                continue
            order.append([entry])
            yield item

    def items() -> Iterator[Any]:
        while not intr.count and (group := list(itertools.islice(pending, run.chunk))):
            got = []
            for entry in group:
                try:
                    item = entry[1]()
                    if run.spec.preprocess is None and not run.batched:
                        eng._admit(item)  # refused at the door: this item alone fails
                except ITEM_ERRORS as exc:
                    col.add(entry[0], exc, entry[2])
                    continue
                got.append((entry, item))
            if got:
                order.append([e for e, _ in got])
                yield [it for _, it in got] if run.batched else got[0][1]

    outcomes = eng.map(items() if run.batched else each(), return_exceptions=True)
    try:
        while (outcome := intr.wait(outcomes)) is not None:
            settle(run, eng, order.popleft(), outcome)
            run.tick(eng, intr)
    finally:
        outcomes.close()


def settle(run: JobRun, eng: Any, group: list[tuple[int, Callable[[], Any], dict[str, Any]]],
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
    for j, (index, _, kept) in enumerate(group):
        run.collector.add(index, share(run, outcome, j, len(group)), kept)


def share(run: JobRun, outcome: Result | BaseException, j: int, n: int) -> Result | BaseException:
    """Item j's share of a task's outcome (a batched list's result splits per item)."""
    if not run.batched or not isinstance(outcome, Result):
        return outcome
    try:
        parts = job_hooks.split(outcome.outputs, n, post=run.spec.postprocess is not None,
                                model=run.spec.model is not None)
    except ValueError as exc:
        return RowError(str(exc))
    return dataclasses.replace(outcome, outputs=parts[j])
