"""The batch job behind `slabpool run`: read items, map them through an Engine, keep results.

    INPUT --job_sources--> todo (runs of items not yet durable) --blocks | chunks--> Engine
                                                                                      |
    OUTPUT <--publish-- Store (direct rows | shards, journal) <--commit, every ~1 s-- Collector

1 open INPUT (engine.job_sources) and the Store (engine.job_io); the journal says which items
  are settled (a row or a failure)
2 start the Engine; without a preprocess the first item is checked against the model (one
  error up front, not one per item); send the other items, a bounded window in flight:
  - rows of .npy/.npz or of a Parquet/CSV/Arrow table (no hooks, a batchable model): blocks
    of rows, one task each, read straight from the memory-mapped file, or from the table's
    record batches gathered into contiguous arrays (engine/blocks.py; a failing block is cut
    down to its failing rows; a null or ragged cell fails its row alone);
  - any other source: Engine.map (tiny items many to a task, each item its own outcome);
    with batched hooks (engine.job_hooks) an item of the map is a list of --batch-size items
3 take results in input order; a failed item (row) is recorded, not fatal, unless failures
  look systematic (--max-failures; by default the first 100 all failed): the job stops, exit 1
4 commit the buffered blocks and items, at least every `durable_every` s, and journal them:
  .npy/.npz OUTPUT: written in place into the preallocated direct/ files (fdatasync); a
  directory or .parquet OUTPUT: as a shard (atomic)
5 at the end: failures.jsonl, the single-file OUTPUT (.npy hard-linked from its direct/ file,
  .npz streamed from them, .parquet assembled from Parquet shards by engine.job_parquet),
  report.json, a summary

Ctrl-C or SIGTERM: stop submitting, finish what is in flight, commit, exit 130/143. A second
one stops now (close(cancel_pending=True)); what was committed stays committed. The handlers
stay in place until the run's last file is written, so a late Ctrl-C is never a traceback.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import resource
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Literal, TextIO

import numpy as np

from slabpool.engine.caller.blocks import BlockSizer, Piece, run_blocks
from slabpool.engine.core.task import Result
from slabpool.engine.job import hooks as job_hooks
from slabpool.engine.job import parquet as job_parquet
from slabpool.engine.job.sources import RowReader, Source, open_source
from slabpool.engine.job.store import (
    Failure,
    JobError,
    RowError,
    Schema,
    Store,
    publish,
    write_atomic,
    write_json,
)
from slabpool.engine.job.store.files import Array
from slabpool.engine.job.store.rows import check_rows, schema_of, to_rows
from slabpool.workers import contract
from slabpool.workers import errors as E

MAX_SHARD_ITEMS = 10_000  # parts (items, blocks) a shard holds at most: it also closes then
BATCHED_DEFAULT = 64  # items per hook call with batched hooks when --batch-size is not given
SYSTEMATIC = 100  # by default the job stops when this many first settled items all failed
TICK_S = 0.005  # between outcomes, commits and progress are looked at this often at most


@dataclass(frozen=True)
class FailureLimit:
    """--max-failures: N failed items, or P% of the settled ones (judged from 100 settled on).
    Neither: stop when the first 100 settled items (all of them, if fewer) have all failed."""

    count: int | None = None
    percent: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> FailureLimit:
        if text is None:
            return cls()
        try:
            if text.endswith("%"):
                pct = float(text[:-1])
                if not 0 <= pct <= 100:
                    raise ValueError
                return cls(percent=pct)
            n = int(text)
            if n < 0:
                raise ValueError
            return cls(count=n)
        except ValueError:
            raise JobError(f"--max-failures must be a count (N >= 0) or a percentage (P%), got {text!r}") from None

    def exceeded(self, failed: int, settled: int, todo: int) -> str | None:
        """Why the job must stop, or None."""
        if self.count is not None:
            return f"more than --max-failures {self.count} items failed" if failed > self.count else None
        judged = settled >= min(SYSTEMATIC, todo)
        if self.percent is not None:
            over = judged and 100.0 * failed / max(settled, 1) > self.percent
            return f"{failed} of {settled} settled items failed, over --max-failures {self.percent:g}%" if over else None
        if judged and settled and failed == settled:
            return f"the first {settled} items all failed (a systematic error; see --max-failures)"
        return None


class StopFailures(Exception):
    """Failures crossed the limit: the job stops (exit 1)."""


@dataclass(frozen=True)
class JobSpec:
    model: Path | None
    input: Path
    output: Path
    workers: int | None = None
    batch_size: int | None = None  # rows a block (None: from the measured time per row); items a model call
    preprocess: str | None = None
    postprocess: str | None = None
    resume: bool = False
    overwrite: bool = False
    start_method: Literal["forkserver", "spawn"] = "forkserver"
    max_attempts: int = 3
    task_timeout: float | None = None
    durable_every: float = 1.0  # seconds between commits (at most)
    log_every: float = 2.0  # seconds between log lines when stderr is not a terminal
    command: str = "slabpool run ..."  # shown in the "how to resume" line
    keep: tuple[str, ...] = ()  # input columns copied to a .parquet OUTPUT
    batched: bool = False  # hooks take a list of items (see engine.job_hooks)
    max_failures: str | None = None  # "N" or "P%" (FailureLimit)
    text: bool = False  # INPUT lines are raw strings, not JSON

    @property
    def single_file(self) -> bool:
        return self.output.suffix in (".npy", ".npz", ".parquet")

    @property
    def parquet(self) -> bool:
        return self.output.suffix == ".parquet"

    @property
    def stdin(self) -> bool:
        return str(self.input) == "-"

    @property
    def parts(self) -> Path:
        return self.output.with_name(self.output.name + ".parts") if self.single_file else self.output


@dataclass
class JobOutcome:
    status: int  # 0 all done, 2 some failed, 1 stopped on systematic failures, 130/143 interrupted
    report: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    error: str | None = None  # status 1: the one line to show


# -- step 3: results, as blocks of rows or one item at a time -------------------------------------

ITEM_ERRORS = (E.InputContractError, E.SessionRunError, E.PoisonTask, E.TaskTimeout, E.ShmCapacityError,
               RowError, OSError, ValueError)
MAX_SHARD_BYTES = 64 * 1024 * 1024  # output bytes a shard holds at most (bounds memory)


class Collector:
    """Buffers settled items (in any order: every row keeps its index); commits them to the
    Store as one shard. A block of rows is kept as the block's arrays, not row by row."""

    def __init__(self, store: Store, strip_batch: bool, schema: Schema | None) -> None:
        self.store, self.strip_batch, self.schema = store, strip_batch, schema
        self.keep_names = tuple(store.keep_types)
        # (item indices, outputs with rows on axis 0, --keep values of those items)
        self.parts: list[tuple[Array, dict[str, Any], dict[str, list[Any]]]] = []
        self.failures: list[Failure] = []
        self.failed_kept: dict[str, list[Any]] = {k: [] for k in self.keep_names}  # --keep of the failures
        self.first_failure: Failure | None = None
        self.latencies: list[float] = []
        self.done = self.failed = 0
        self.pending_rows = self.pending_bytes = 0
        self.last_commit = time.monotonic()
        # items settled one by one, gathered as columns until the next block or commit (a part)
        self.item_indices: list[int] = []
        self.item_cols: dict[str, list[Any]] = {}
        self.item_keep: dict[str, list[Any]] = {k: [] for k in self.keep_names}
        self.item_bytes = 0  # bytes of one item's rows (from the schema)
        self._expect: tuple[Schema, list[tuple[str, np.dtype[Any], tuple[int, ...]]]] | None = None

    def add(self, index: int, outcome: Result | BaseException, kept: dict[str, Any] | None = None) -> None:
        """One item's outcome (a task of one item, or an item of a chunk)."""
        if isinstance(outcome, Result):
            rows = self._fast_rows(outcome.outputs)
            if rows is None:
                try:
                    rows = to_rows(outcome.outputs, strip_batch=self.strip_batch, parquet=self.store.parquet,
                                   reserved=self.keep_names)  # numeric unless Parquet: checked there
                    if self.schema is None:
                        self.schema = schema_of(rows)
                    check_rows(rows, self.schema)
                except RowError as exc:
                    return self._fail(index, exc, outcome.attempts, self._kept_one(kept))
            if not self.item_indices:
                self.item_cols = {k: [] for k in rows}
                self.item_bytes = sum(getattr(v, "nbytes", 64) for v in rows.values())
            self.item_indices.append(index)
            for k, v in rows.items():
                self.item_cols[k].append(v)
            for k, values in self.item_keep.items():
                values.append(kept.get(k) if kept else None)
            self.done += 1
            self.pending_rows += 1
            self.pending_bytes += self.item_bytes
            self.latencies.append(outcome.timings.total)
        elif isinstance(outcome, ITEM_ERRORS):
            self._fail(index, outcome, len(getattr(outcome, "crashes", ())) or 1, self._kept_one(kept))
        else:  # the pool itself broke (or a bug): not an item's fault
            raise outcome

    def _fast_rows(self, outputs: Any) -> dict[str, Array] | None:
        """What to_rows + check_rows give, for the common case only (a dict of the first item's
        names, numeric arrays of its dtypes and shapes); None: take the general path."""
        schema = self.schema
        if schema is None or type(outputs) is not dict or len(outputs) != len(schema):
            return None
        if self._expect is None or self._expect[0] is not schema:
            lead = (1,) if self.strip_batch else ()
            self._expect = (schema, [(k, np.dtype(d), (*lead, *sh)) for k, (d, sh) in schema.items()
                                     if d != job_parquet.PY])
        expect = self._expect[1]
        if len(expect) != len(schema):
            return None
        rows = {}
        for name, dtype, shape in expect:
            a = outputs.get(name)
            if type(a) is not np.ndarray or a.shape != shape or a.dtype != dtype:
                return None
            rows[name] = a[0] if self.strip_batch else a
        return rows

    def _kept_one(self, kept: dict[str, Any] | None) -> dict[str, list[Any]]:
        return {k: [kept.get(k) if kept else None] for k in self.keep_names}

    def _flush_items(self) -> None:
        """The items gathered one by one become one part: each output's rows stacked (a
        Parquet OUTPUT's non-numeric values stay a list)."""
        if not self.item_indices:
            return
        schema = self.schema or {}
        cols = {k: v if schema.get(k, ("py",))[0] == job_parquet.PY else np.stack(v)
                for k, v in self.item_cols.items()}
        self.parts.append((np.asarray(self.item_indices, dtype=np.int64), cols, self.item_keep))
        self.item_indices, self.item_cols = [], {}
        self.item_keep = {k: [] for k in self.keep_names}

    def add_block(self, piece: Piece, latency: float, kept: dict[str, list[Any]] | None = None) -> None:
        """Rows [lo, hi) of a block: its outputs, or one failure per row (a row cut alone).
        `kept`: the rows' --keep values, one list per column."""
        keep = {k: (kept or {}).get(k) or [None] * (piece.hi - piece.lo) for k in self.keep_names}
        error: BaseException | None = piece.error
        if error is None:
            assert piece.outputs is not None
            cols = {str(k): np.asarray(v) for k, v in piece.outputs.items()}
            try:
                self._check({k: v[0] for k, v in cols.items()} if piece.hi > piece.lo else {})
            except RowError as exc:
                error = exc
            else:
                self._keep(np.arange(piece.lo, piece.hi, dtype=np.int64), cols, keep)
                self.latencies.append(latency)
                return
        if not isinstance(error, ITEM_ERRORS):
            raise error
        attempts = len(getattr(error, "crashes", ())) or 1
        for j, i in enumerate(range(piece.lo, piece.hi)):
            self._fail(i, error, attempts, {k: v[j : j + 1] for k, v in keep.items()})

    def _check(self, rows: dict[str, Array]) -> None:
        for name, a in rows.items():
            if a.dtype.hasobject or a.dtype.kind in "USV":
                raise RowError(f"output {name!r} is not a numeric array (dtype {a.dtype})")
        if self.schema is None:
            self.schema = schema_of(rows)
        check_rows(rows, self.schema)

    def _keep(self, indices: Array, cols: dict[str, Any], keep: dict[str, list[Any]]) -> None:
        self._flush_items()  # parts stay in the order they settled
        self.parts.append((indices, cols, keep))
        self.done += len(indices)
        self.pending_rows += len(indices)
        self.pending_bytes += sum(getattr(v, "nbytes", 64 * len(v)) for v in cols.values())

    def _fail(self, index: int, exc: BaseException, attempts: int, keep: dict[str, list[Any]]) -> None:
        message = (str(exc).strip().splitlines() or [""])[0]
        failure = Failure(index, type(exc).__name__, message, attempts)
        self.failures.append(failure)
        for k, v in keep.items():
            self.failed_kept[k].extend(v)
        self.first_failure = self.first_failure or failure
        self.failed += 1

    def due(self, every: float) -> bool:
        pending = self.pending_rows + len(self.failures)
        if not pending:
            return False
        full = (len(self.parts) + len(self.item_indices) + len(self.failures) >= MAX_SHARD_ITEMS
                or self.pending_bytes >= MAX_SHARD_BYTES)
        return full or time.monotonic() - self.last_commit >= every

    def commit(self) -> None:  # step 4
        self._flush_items()
        if self.store.direct and (self.parts or self.failures):
            self.store.commit_direct([(i, c) for i, c, _ in self.parts], self.failures, self.schema)
        elif self.parts or self.failures:
            parts = self.parts
            indices = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64)
            cols = ({k: _join([p[1][k] for p in parts]) for k in parts[0][1]}
                    if len(parts) > 1 else parts[0][1] if parts else {})
            kept = {k: [*(v for p in parts for v in p[2][k]), *self.failed_kept[k]] for k in self.keep_names}
            self.store.commit(indices, cols, self.failures, kept=kept, schema=self.schema)
        self.parts, self.failures = [], []
        self.failed_kept = {k: [] for k in self.keep_names}
        self.pending_rows = self.pending_bytes = 0
        self.last_commit = time.monotonic()


def _join(pieces: list[Any]) -> Any:
    """One column from the pieces of a shard: arrays concatenated; lists (Parquet) joined."""
    if all(isinstance(p, np.ndarray) for p in pieces):
        return np.concatenate(pieces)
    return [row for p in pieces for row in p]


# -- progress --------------------------------------------------------------------------------------


class Progress:
    """A tqdm bar on a terminal; plain lines every `log_every` seconds otherwise (CI, nohup)."""

    def __init__(self, total: int, initial: int, log_every: float, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.total, self.initial, self.log_every = total, initial, log_every
        self.start = self.last_line = time.monotonic()
        self.tty = self.stream.isatty()
        self.bar: Any = None

    def begin(self) -> None:
        """The engine is ready: rates count from now."""
        self.start = self.last_line = time.monotonic()
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=self.initial, unit="item", file=self.stream,
                            dynamic_ncols=True, desc="slabpool")

    def update(self, settled: int, failed: int, restarts: int) -> None:
        if self.tty:
            if self.bar is None:
                return
            self.bar.update(settled - self.bar.n)
            self.bar.set_postfix(restarts=restarts, failed=failed, refresh=False)
        elif time.monotonic() - self.last_line >= self.log_every:
            self.line(settled, failed, restarts)

    def line(self, settled: int, failed: int, restarts: int) -> None:
        self.last_line = now = time.monotonic()
        rate = (settled - self.initial) / max(now - self.start, 1e-9)
        left = self.total - settled
        eta = "0 s" if left <= 0 else f"{left / rate:.0f} s" if rate > 0 else "unknown"
        pct = 100.0 * settled / max(self.total, 1)
        self.note(f"progress: {settled}/{self.total} items ({pct:.0f}%), {rate:.1f} items/s, "
                  f"eta {eta}, restarts {restarts}, failed {failed}")

    def note(self, message: str) -> None:
        if self.bar is not None:
            self.bar.write(f"slabpool: {message}", file=self.stream)
        else:
            print(f"slabpool: {message}", file=self.stream, flush=True)

    def close(self, settled: int, failed: int, restarts: int) -> None:
        if self.bar is not None:
            self.update(settled, failed, restarts)
            self.bar.close()
        else:
            self.line(settled, failed, restarts)


class StopNow(Exception):
    """A second Ctrl-C/SIGTERM while the loop waits for work: stop at once."""


class Interrupts:
    """SIGINT/SIGTERM set flags (no I/O in a handler); the loop reads them. A second one
    raises StopNow out of a wait, but only while `armed` (waiting for the engine, never in
    the middle of a commit)."""

    def __init__(self) -> None:
        self.count = 0
        self.signum = 0
        self.armed = False
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        self.signum = self.signum or signum
        if self.count >= 2 and self.armed:
            self.armed = False
            raise StopNow

    def wait(self, it: Iterator[Any]) -> Any:
        """next(it), interruptible by a second signal; None at its end."""
        if self.count >= 2:
            raise StopNow
        self.armed = True
        try:
            return next(it, None)
        finally:
            self.armed = False

    def __enter__(self) -> Interrupts:
        for s in (signal.SIGINT, signal.SIGTERM):
            self._old[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *_: Any) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)


# -- steps 1-5 -------------------------------------------------------------------------------------


def run_job(spec: JobSpec, *, stream: TextIO | None = None) -> JobOutcome:
    """Run (or resume) a job. Raises JobError when it cannot run at all."""
    t0 = time.monotonic()
    check_paths(spec)
    limit = FailureLimit.parse(spec.max_failures)
    if spec.keep and not spec.parquet:
        raise JobError(f"--keep needs a .parquet OUTPUT (got {spec.output.name}): .npy/.npz hold numbers only")
    source = open_source(spec.input, hook=spec.preprocess is not None, text=spec.text)  # step 1
    source.choose_keep(spec.keep)
    direct = spec.output.suffix[1:] if spec.output.suffix in (".npy", ".npz") else None
    store = Store.open(spec.parts, fingerprint(spec, source), resume=spec.resume, overwrite=spec.overwrite,
                       parquet=spec.parquet, keep_types={k: source.keep_types.get(k) for k in spec.keep},
                       direct=direct, count=source.count)
    try:
        with Interrupts() as intr:  # until the last file is written: a late Ctrl-C is counted, not raised
            return _run_on(spec, source, store, t0, limit, intr, stream)
    finally:
        store.close()


def check_paths(spec: JobSpec) -> None:
    """OUTPUT must never be (or lie inside) INPUT or MODEL; stdin cannot be resumed."""
    if spec.stdin:
        if spec.resume:
            raise JobError("--resume cannot replay stdin: rerun the same command with the same input on "
                           "stdin (what is durable is skipped), or save the input to a file")
        return
    targets = {spec.output.resolve(), spec.parts.resolve()}
    for what, path in (("INPUT", spec.input.resolve()), ("MODEL", spec.model.resolve() if spec.model else None)):
        if path is None:
            continue
        if path in targets:
            raise JobError(f"OUTPUT {spec.output} is the {what}: it would be overwritten; choose another OUTPUT")
        if path.is_dir() and any(t.is_relative_to(path) for t in targets):
            raise JobError(f"OUTPUT {spec.output} lies inside the {what} folder {spec.input}: its files would "
                           "become items; choose an OUTPUT outside it")


def _run_on(spec: JobSpec, source: Source, store: Store, t0: float, limit: FailureLimit, intr: Interrupts,
            stream: TextIO | None) -> JobOutcome:
    durable = store.settled_ranges()
    settled_before = sum(b - a for a, b in durable)
    progress = Progress(source.count, settled_before, spec.log_every, stream)
    if store.invalid:
        progress.note(f"{store.invalid} journal line(s) failed validation (torn or missing shard); their items run again")
    if settled_before:
        progress.note(f"resuming: {settled_before} of {source.count} items already durable in {spec.parts}")
    collector = Collector(store, spec.model is not None and spec.postprocess is None, store.schema())
    run = _Run(spec, progress, collector, t0, limit, intr)
    todo = _gaps(durable, source.count)
    if todo:
        run.execute(source, todo)
    progress.close(store.settled_count(), len(store.failures()), run.stats.restarts if run.stats else 0)
    return run.finish(store, source.count, settled_before)


def _gaps(durable: list[tuple[int, int]], count: int) -> list[tuple[int, int]]:
    """The runs of [0, count) not in `durable` (sorted, disjoint)."""
    out, at = [], 0
    for a, b in durable:
        if a > at:
            out.append((at, min(a, count)))
        at = max(at, b)
    if at < count:
        out.append((at, count))
    return [(a, b) for a, b in out if b > a]


def fingerprint(spec: JobSpec, source: Source) -> dict[str, Any]:
    """What makes two runs the same job (workers and batch size do not change results' rows)."""
    model = None
    if spec.model is not None:
        st = spec.model.stat()
        model = {"path": str(spec.model.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return {"model": model, "input": source.fingerprint, "count": source.count,
            "preprocess": spec.preprocess, "postprocess": spec.postprocess}


Todo = Iterator[tuple[int, Callable[[], Any], dict[str, Any]]]  # (index, read the item, kept values)


def _pending(source: Source, todo: list[tuple[int, int]]) -> Todo:
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


class _Run:
    """One run's engine, loop and numbers."""

    def __init__(self, spec: JobSpec, progress: Progress, collector: Collector, t0: float,
                 limit: FailureLimit, intr: Interrupts) -> None:
        self.spec, self.progress, self.collector, self.t0 = spec, progress, collector, t0
        self.limit, self.intr = limit, intr
        self.interrupted = 0
        self.stopped: str | None = None  # why failures stopped the job
        self.startup_s = 0.0
        self.processing_s = 0.0
        self.stats: Any = None
        self.describe: Any = None
        self.peak_workers_rss = 0
        self.workers = 0
        self.mode = ""
        self.draining = False
        self.last_stats = self.next_tick = 0.0
        self.restarts = 0
        self.todo = 0
        pre, post = spec.preprocess, spec.postprocess
        self.batched = spec.batched or job_hooks.hook_batched(pre) or job_hooks.hook_batched(post)
        self.chunk = (spec.batch_size or BATCHED_DEFAULT) if self.batched else 1

    def execute(self, source: Source, todo: list[tuple[int, int]]) -> None:
        intr = self.intr
        self.todo = sum(b - a for a, b in todo)
        eng = self._start(blocks_possible=source.blockable and not self.batched)
        reader: RowReader | None = None
        try:
            self.describe = eng.describe()
            if self.spec.model is not None:
                source.bind(self.describe.inputs)
                self._check_outputs()
            reader = source.row_reader(todo) if self._by_blocks(source) else None
            if self.spec.model is not None:
                self._check_first(source, todo, reader)
        except BaseException:
            eng.close(cancel_pending=True, timeout=10)
            raise
        self.startup_s = time.monotonic() - self.t0
        t1 = self.collector.last_commit = time.monotonic()
        self.progress.begin()
        self.mode = "blocks" if reader is not None else "chunks"
        try:
            try:
                if reader is not None:
                    self._loop_blocks(eng, reader, todo, intr)
                else:
                    self._loop_items(eng, source, todo, intr)
            except StopNow:
                pass
            except StopFailures as exc:
                self.stopped = str(exc)
                self.progress.note(f"stopping: {self.stopped}")
            if intr.count >= 2:
                self.progress.note("stopping now: cancelling what is in flight")
            self.interrupted = intr.signum if intr.count else 0
        finally:
            self.processing_s = time.monotonic() - t1
            self.collector.commit()
            self.stats = eng.stats()
            eng.close(cancel_pending=True, timeout=10)

    def _check_outputs(self) -> None:
        """A model output of strings cannot go to .npy/.npz: refused before any work."""
        if self.spec.parquet or self.spec.postprocess is not None:
            return
        for s in self.describe.outputs:
            if np.dtype(s.dtype).kind in "OUS":
                raise JobError(f"model output {s.name!r} holds {np.dtype(s.dtype)} values; .npy/.npz/folder "
                               "OUTPUTs keep numbers only: use -o OUT.parquet")

    def _check_first(self, source: Source, todo: list[tuple[int, int]], reader: RowReader | None) -> None:
        """Without a preprocess every item has the first one's dtype: one error up front (not
        one per item) when it does not fit the model. By blocks: the first readable row."""
        if self.spec.preprocess is not None:
            return
        if reader is not None:
            item = reader.first()
            if item is None:
                return
        else:
            first = next(_pending(source, todo), None)
            if first is None:
                return
            try:
                item = first[1]()
            except (OSError, ValueError):
                return  # an unreadable first item fails alone
        specs = self.describe.inputs
        try:
            contract.check(contract.normalize(item, specs), specs)
        except E.InputContractError as exc:
            raise JobError(f"{self.spec.input} does not fit the model: {exc}") from exc

    def _by_blocks(self, source: Source) -> bool:
        """Rows of arrays or of a table, a model that takes any number of rows and gives
        numbers, nothing per item: blocks."""
        s, d = self.spec, self.describe
        numeric = d is not None and all(np.dtype(o.dtype).kind not in "OUS" for o in d.outputs)
        return (source.blockable and s.model is not None and s.preprocess is None and s.postprocess is None
                and not self.batched and bool(d and d.batchable) and numeric)

    def _start(self, *, blocks_possible: bool) -> Any:
        from slabpool.engine.core.config import usable_cpus
        from slabpool.engine.local.pool import Engine

        s = self.spec
        self.workers = s.workers or usable_cpus()
        # a block is one model call of --batch-size rows; items (chunks) stack up to --batch-size;
        # a batched hook's list is one model call already
        stack = 1 if blocks_possible or self.batched or s.batch_size is None else s.batch_size
        pre, post = self._hooks()
        try:
            return Engine(
                str(s.model) if s.model else None, workers=self.workers, start_method=s.start_method,
                preprocess=pre, postprocess=post, max_attempts=s.max_attempts,
                task_timeout=s.task_timeout, max_batch_size=stack,
            )
        except (E.EngineError, OSError, ValueError, TypeError, ImportError, AttributeError) as exc:
            what = "the model failed to load" if isinstance(exc, E.SessionInitError) else "cannot start"
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise JobError(f"{what}: {first}") from exc

    def _hooks(self) -> tuple[Any, Any]:
        """The engine's hooks: the names as given, or adapters so that a task's item is a list."""
        s = self.spec
        if not self.batched:
            return s.preprocess, s.postprocess
        pre: Any = job_hooks.stack_feeds
        if s.preprocess is not None:
            fn = job_hooks.resolve(s.preprocess)
            if s.batched or getattr(fn, "batched", False):
                pre = fn
            else:
                pre = functools.partial(job_hooks.each_pre if s.model else job_hooks.each_item, fn)
        post: Any = None
        if s.postprocess is not None:
            fn = job_hooks.resolve(s.postprocess)
            post = fn if s.batched or getattr(fn, "batched", False) else functools.partial(job_hooks.each_post, fn)
        return pre, post

    def _loop_blocks(self, eng: Any, reader: RowReader, todo: list[tuple[int, int]], intr: Interrupts) -> None:
        """Steps 2-4 by blocks of rows: one task per block, straight from the (mapped) file, or
        from a table's spans read front to back (engine.job_sources.RowReader)."""
        window = 2 * self.workers
        sizer = BlockSizer(self.spec.batch_size or "auto", reader.row_bytes(), eng.config.shm_capacity, window)

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
                self.collector.add_block(piece, now - started, reader.kept(piece.lo, piece.hi))
                reader.release(piece.hi)
                started = now
                rows = piece.hi - piece.lo
                settled += rows
                eng._tally(completed=rows) if piece.error is None else eng._tally(failed=rows)
                self._tick(eng, intr)
        finally:
            pieces.close()
            eng._tally(cancelled=total - settled)

    def _loop_items(self, eng: Any, source: Source, todo: list[tuple[int, int]], intr: Interrupts) -> None:
        """Steps 2-4 item by item, as Engine.map sends them: tiny items many to a task (a
        chunk), each item with its own outcome. With batched hooks a map item is a list of
        items (one hook call); a list that fails is retried item by item, so a bad one fails alone."""
        order: deque[list[tuple[int, Callable[[], Any], dict[str, Any]]]] = deque()
        col = self.collector
        pending = _pending(source, todo)

        def each() -> Iterator[Any]:  # one item per map item: no groups to build
            admit = self.spec.preprocess is None
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
            while not intr.count and (group := list(itertools.islice(pending, self.chunk))):
                got = []
                for entry in group:
                    try:
                        item = entry[1]()
                        if self.spec.preprocess is None and not self.batched:
                            eng._admit(item)  # refused at the door: this item alone fails
                    except ITEM_ERRORS as exc:
                        col.add(entry[0], exc, entry[2])
                        continue
                    got.append((entry, item))
                if got:
                    order.append([e for e, _ in got])
                    yield [it for _, it in got] if self.batched else got[0][1]

        outcomes = eng.map(items() if self.batched else each(), return_exceptions=True)
        try:
            while (outcome := intr.wait(outcomes)) is not None:
                self._settle(eng, order.popleft(), outcome)
                self._tick(eng, intr)
        finally:
            outcomes.close()

    def _settle(self, eng: Any, group: list[tuple[int, Callable[[], Any], dict[str, Any]]],
                outcome: Result | BaseException) -> None:
        """One map outcome: an item's, or a batched list's (split per item)."""
        if len(group) > 1 and isinstance(outcome, ITEM_ERRORS):
            for entry in group:  # find the bad item: each on its own, as a list of one
                try:
                    alone: Result | BaseException = eng.submit([entry[1]()]).result()
                except ITEM_ERRORS as exc:
                    alone = exc
                self._settle(eng, [entry], alone)
            return
        for j, (index, _, kept) in enumerate(group):
            self.collector.add(index, self._one(outcome, j, len(group)), kept)

    def _one(self, outcome: Result | BaseException, j: int, n: int) -> Result | BaseException:
        """Item j's share of a task's outcome (a batched list's result splits per item)."""
        if not self.batched or not isinstance(outcome, Result):
            return outcome
        try:
            parts = job_hooks.split(outcome.outputs, n, post=self.spec.postprocess is not None,
                                    model=self.spec.model is not None)
        except ValueError as exc:
            return RowError(str(exc))
        return dataclasses.replace(outcome, outputs=parts[j])

    def _tick(self, eng: Any, intr: Interrupts) -> None:
        """Between outcomes: commit when due (step 4), the progress display, the first signal's note."""
        col = self.collector
        if col.failed and (why := self.limit.exceeded(col.failed, col.done + col.failed, self.todo)):
            raise StopFailures(why)  # (no failure: no limit can be crossed)
        now = time.monotonic()
        if now < self.next_tick and not intr.count:
            return  # tiny items settle thousands a second: the rest is looked at every TICK_S
        self.next_tick = now + TICK_S
        if intr.count and not self.draining:
            self.draining = True
            self.progress.note("interrupted: finishing the items in flight (press Ctrl-C again to stop now)")
        if col.due(self.spec.durable_every):
            col.commit()
        if now - self.last_stats >= 0.5:
            self.last_stats = now
            self.restarts = self._sample(eng)
        self.progress.update(self.progress.initial + col.done + col.failed, col.failed, self.restarts)

    def _sample(self, eng: Any) -> int:
        st = eng.stats()
        self.peak_workers_rss = max(self.peak_workers_rss, sum(s.rss_bytes for s in st.slots))
        return int(st.restarts)

    def finish(self, store: Store, count: int, skipped: int) -> JobOutcome:  # step 5
        spec, col = self.spec, self.collector
        notes: list[str] = []
        failures = store.failures()
        text = "".join(json.dumps(f.as_json()) + "\n" for f in failures)
        write_atomic(spec.parts / "failures.jsonl", lambda f: f.write(text.encode()))
        complete = store.settled_count() >= count
        if complete and spec.parquet:
            if count:
                keep = tuple(store.keep_types)
                write_atomic(spec.output, lambda f: job_parquet.assemble(store.shard_paths(), count, keep, f))
            else:
                notes.append(f"the input holds no items: {spec.output} was not written")
        elif complete and spec.single_file:
            written, note = publish(store, spec.output)
            if not written:
                notes.append(f"no item succeeded: {spec.output} was not written")
            notes.extend([note] if note else [])
        error = None
        if self.stopped:
            status, first = 1, col.first_failure
            error = f"stopped: {self.stopped}; first error: " + (f"{first.error}: {first.message}" if first else "-")
        elif not complete:
            status = 143 if self.interrupted == signal.SIGTERM else 130
        else:
            status = 2 if failures else 0
        report = self._report(count, skipped, len(failures), complete, status)
        write_json(spec.parts / "report.json", report)
        return JobOutcome(status, report, notes, error)

    def _report(self, count: int, skipped: int, failed: int, complete: bool, status: int) -> dict[str, Any]:
        spec, col, st = self.spec, self.collector, self.stats
        lat = np.asarray(col.latencies or [0.0])
        computed = col.done + col.failed
        slots = [] if st is None else [
            {"slot": s.slot, "pid": s.pid, "tasks_done": s.tasks_done, "restarts": s.restarts,
             "runtime": f"{s.runtime} {s.runtime_version}".strip(), "applied": list(s.applied),
             "requested": list(s.requested), "degraded": s.degraded} for s in st.slots]
        return {
            "command": spec.command, "model": str(spec.model) if spec.model else None,
            "input": str(spec.input), "output": str(spec.output), "parts": str(spec.parts),
            "items": count, "done": count - failed if complete else None, "failed": failed,
            "skipped_durable": skipped, "computed_this_run": computed, "complete": complete,
            "exit_status": status, "interrupted": signal.Signals(self.interrupted).name if self.interrupted else None,
            "workers": self.workers, "batch_size": spec.batch_size or "auto", "dispatch": self.mode or None,
            "elapsed_s": round(time.monotonic() - self.t0, 3), "startup_s": round(self.startup_s, 3),
            "throughput_items_per_s": round(computed / self.processing_s, 2) if self.processing_s else 0.0,
            "latency_s": {f"p{q}": float(np.percentile(lat, q)) for q in (50, 95, 99)},
            "slots": slots,
            "restarts": st.restarts if st else 0, "replays": st.replayed if st else 0,
            "quarantines": st.quarantined if st else 0, "timeouts": st.timeouts if st else 0,
            "runtime": (f"{self.describe.runtime} {self.describe.runtime_version}".strip()
                        if self.describe else None),
            "providers": sorted({p for s in slots for p in s["applied"]}),
            "peak_rss_bytes": {"supervisor": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                               "workers_total": self.peak_workers_rss},
        }


def summary(outcome: JobOutcome) -> list[str]:
    """The lines printed at the end of a run."""
    r = outcome.report
    if r["complete"] and not r["computed_this_run"] and not r["workers"]:  # all durable already
        return [f"items {r['items']}: all already durable, nothing to compute "
                f"({r['failed']} failed, listed in {Path(r['parts']) / 'failures.jsonl'})" if r["failed"] else
                f"items {r['items']}: all already durable, nothing to compute",
                *outcome.notes, f"output: {r['output']}"]
    lat = r["latency_s"]
    lines = [
        f"items {r['items']}: computed {r['computed_this_run']} this run, {r['skipped_durable']} already durable, "
        f"failed {r['failed']}",
        f"elapsed {r['elapsed_s']:.2f} s (start-up {r['startup_s']:.2f} s), throughput "
        f"{r['throughput_items_per_s']:.1f} items/s on {r['workers']} workers (batch size {r['batch_size']})",
        f"latency p50 {lat['p50'] * 1e3:.1f} ms, p95 {lat['p95'] * 1e3:.1f} ms, p99 {lat['p99'] * 1e3:.1f} ms",
        f"restarts {r['restarts']}, replays {r['replays']}, quarantines {r['quarantines']}, "
        f"runtime {r['runtime'] or '-'} ({', '.join(r['providers']) or 'no model'})",
        "per slot: " + (", ".join(f"#{s['slot']} {s['tasks_done']} tasks/{s['restarts']} restarts"
                                  for s in r["slots"]) or "-"),
        f"peak RSS: supervisor {r['peak_rss_bytes']['supervisor'] / 2**20:.0f} MiB, workers "
        f"{r['peak_rss_bytes']['workers_total'] / 2**20:.0f} MiB in total",
    ]
    if r["failed"]:
        lines.append(f"failed items are listed in {Path(r['parts']) / 'failures.jsonl'}")
    lines.extend(outcome.notes)
    if r["complete"]:
        lines.append(f"output: {r['output']}" + (f" (shards, journal, report in {r['parts']})"
                                                 if r["output"] != r["parts"] else ""))
    return lines
