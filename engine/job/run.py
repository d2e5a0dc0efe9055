"""The batch job behind `slabpool run`: read items, map them through an Engine, keep results.

    INPUT --sources--> todo (runs of items not yet durable) --blocks | chunks--> Engine
                                                                                      |
    OUTPUT <--publish-- Store (direct rows | shards, journal) <--commit, every ~1 s-- Collector

1 open INPUT (engine.job.sources) and the Store (engine.job.store); the journal says which items
  are settled (a row or a failure)
2 start the Engine; without a preprocess the first item is checked against the model (one
  error up front, not one per item); send the other items, a bounded window in flight:
  - rows of .npy/.npz or of a Parquet/CSV/Arrow table (no hooks, a batchable model): blocks
    of rows, one task each, read straight from the memory-mapped file, or from the table's
    record batches gathered into contiguous arrays (engine/caller/blocks.py; a failing block is cut
    down to its failing rows; a null or ragged cell fails its row alone);
  - any other source: Engine.map (tiny items many to a task, each item its own outcome);
    with batched hooks (engine.job.hooks) an item of the map is a list of --batch-size items
3 take results in input order; a failed item (row) is recorded, not fatal, unless failures
  look systematic (--max-failures; by default the first 100 all failed): the job stops, exit 1
4 commit the buffered blocks and items, at least every `durable_every` s, and journal them:
  .npy/.npz OUTPUT: written in place into the preallocated direct/ files (fdatasync); a
  directory or .parquet OUTPUT: as a shard (atomic)
5 at the end: failures.jsonl, the single-file OUTPUT (.npy hard-linked from its direct/ file,
  .npz streamed from them, .parquet assembled from Parquet shards by engine.job.parquet),
  report.json, a summary

Ctrl-C or SIGTERM (engine.job.signals: what a signal does at each stage): during the run, stop
submitting, finish what is in flight, commit, exit 130/143; a second one stops now
(close(cancel_pending=True)); what was committed stays committed. At start-up no item is sent;
at the final write OUTPUT is not written (the rerun writes it).

Here: the run and its engine (steps 1, 2, 5). Elsewhere in engine.job: `spec` (JobSpec, the
checks before any work), `dispatch` (steps 2-4 by blocks or by items), `collector` (step 3-4:
outcomes buffered and committed), `progress` (the display), `signals` (Ctrl-C), `report` (report.json and
the summary), `sources`, `store`.
"""

from __future__ import annotations

import errno
import functools
import json
import multiprocessing
import resource
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from slabpool.engine.caller.request import JobEngine
from slabpool.engine.job import hooks as job_hooks
from slabpool.engine.job import parquet as job_parquet
from slabpool.engine.job.collector import Collector
from slabpool.engine.job.dispatch import by_blocks, by_items, pending_items
from slabpool.engine.job.progress import Progress, rate
from slabpool.engine.job.report import JobOutcome, Latency, PeakRss, Report, SlotReport
from slabpool.engine.job.signals import Interrupted, Interrupts, StopNow, hold, interrupts
from slabpool.engine.job.sources import JobError, RowReader, Source, open_source
from slabpool.engine.job.sources.base import input_changed
from slabpool.engine.job.spec import (
    FailureLimit,
    JobSpec,
    StopFailures,
    check_paths,
    fingerprint,
    hook_batch,
    is_batched,
    refusal,
)
from slabpool.engine.job.store import DifferentJob, Store, publish, write_atomic
from slabpool.workers import contract
from slabpool.workers import errors as E

TICK_S = 0.005  # between outcomes, commits and progress are looked at this often at most


def run_job(spec: JobSpec, *, stream: TextIO | None = None) -> JobOutcome:
    """Run (or resume) a job. Raises JobError when it cannot run at all, Interrupted when a
    signal stops it before it runs (engine.job.signals: the stages and what a signal does)."""
    with interrupts() as intr:  # until the last file is written: a signal is counted, never raised
        t0 = time.monotonic()
        check_paths(spec)
        limit = FailureLimit.parse(spec.max_failures)
        if spec.keep and not spec.parquet:
            raise JobError(f"--keep needs a .parquet OUTPUT (got {spec.output.name}): .npy/.npz hold numbers only")
        source = open_source(spec.input, hook=spec.preprocess is not None, text=spec.text)  # step 1
        source.choose_keep(spec.keep)
        source.choose_columns(dict(spec.columns))
        direct = spec.file_format if spec.file_format in ("npy", "npz") else None
        job = fingerprint(spec, source)
        intr.check()  # before anything is written: stdin read, lines counted, the model digested
        made = not spec.parts.exists()  # this run makes the job's folder (a refusal takes it away)
        try:
            try:
                store = Store.open(spec.parts, job, resume=spec.resume, overwrite=spec.overwrite,
                                   parquet=spec.parquet, keep_types={k: source.keep_types.get(k) for k in spec.keep},
                                   direct=direct, count=source.count)
            except DifferentJob as exc:
                raise JobError(refusal(spec.parts, exc.manifest, job)) from None
            refused = False
            try:
                hold("open")
                intr.check()
                return _run_on(spec, source, store, t0, limit, intr, stream)
            except JobError:
                refused = made and _untouched(spec.parts)
                raise
            finally:
                store.close()
                if refused:  # the job could not run at all: the rerun that fixes it is a new job
                    shutil.rmtree(spec.parts, ignore_errors=True)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise JobError(_no_space(spec, exc)) from exc


_FRESH = {".lock", "manifest.json", "journal.jsonl", "shards"}


def _untouched(parts: Path) -> bool:
    """The job's folder holds nothing but what opening it wrote: no journal line, no shard, no
    failure, no report (a job refused before its first item: its input or model does not fit).
    Was: left behind, so the corrected rerun was refused as "a different job"."""
    shards, journal = parts / "shards", parts / "journal.jsonl"
    try:
        if not {p.name for p in parts.iterdir()} <= _FRESH:
            return False
        return (not shards.exists() or not any(shards.iterdir())) and \
            (not journal.exists() or journal.stat().st_size == 0)
    except OSError:
        return False


def _no_space(spec: JobSpec, exc: OSError) -> str:
    """A full disk stops the job, but what was journaled stays durable (a half-written row or
    shard never counts): the message names the file and says how to go on once space is freed."""
    what = exc.strerror or "no space left on device"
    if exc.filename is not None:  # straight from the kernel, not from store.files.write_error
        what = f"could not write {exc.filename}: no space left on device ({exc.strerror})"
    command = spec.command if "--resume" in spec.command.split() else f"{spec.command} --resume"
    again = f"resume with: {command}"
    if spec.stdin or not (spec.parts / "manifest.json").exists():  # --resume would be refused
        again = "rerun the same command" + (" with the same input on stdin" if spec.stdin else "")
    return f"{what}. What is durable stays: free space there, then {again}"


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
    run = JobRun(spec, progress, collector, t0, limit, intr)
    todo = _gaps(durable, source.count)
    if todo:
        run.execute(source, todo)
    progress.close(store.settled_count(), len(store.failures()), run.stats.restarts if run.stats else 0)
    return run.finish(store, source, settled_before)


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


class JobRun:
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
        self.peak_slots: dict[int, tuple[int, int, int]] = {}
        self.workers = 0
        self.mode = ""
        self.unwritten = False  # the single-file OUTPUT was not written: no item succeeded
        self.draining = False
        self.last_stats = self.next_tick = 0.0
        self.restarts = 0
        self.todo = 0
        self.batched = is_batched(spec)
        self.chunk = hook_batch(spec) or 1

    def execute(self, source: Source, todo: list[tuple[int, int]]) -> None:
        intr = self.intr
        self.todo = sum(b - a for a, b in todo)
        eng = self._start(blocks_possible=source.blockable and not self.batched, decode=source.decode)
        reader: RowReader | None = None
        try:
            self.describe = eng.describe()
            if self.spec.model is not None:
                source.bind(self.describe.inputs)
                self._check_outputs()
                self._dynamic_outputs()
            reader = source.row_reader(todo) if self._by_blocks(source) else None
            if self.spec.model is not None:
                self._check_first(source, todo, reader)
        except BaseException:
            eng.close(cancel_pending=True, timeout=10)
            raise
        self.startup_s = time.monotonic() - self.t0
        hold("engine")
        self.collector.last_commit = time.monotonic()
        self.progress.begin()
        self.mode = "blocks" if reader is not None else "chunks"
        try:
            try:
                if intr.count:  # during start-up: nothing is sent
                    pass
                elif reader is not None:
                    by_blocks(self, eng, reader, todo, intr)
                else:
                    by_items(self, eng, source, todo, intr)
            except StopNow:
                pass
            except StopFailures as exc:
                self.stopped = str(exc)
                self.progress.note(f"stopping: {self.stopped}")
            if intr.count >= 2:
                self.progress.note("stopping now: cancelling what is in flight")
            self.interrupted = intr.signum if intr.count else 0
        finally:
            self.processing_s = self.progress.end()  # the running phase: the report's rate and the last line's
            try:
                self.collector.commit()
            finally:  # a commit that fails (a full disk) still stops the workers
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

    def _dynamic_outputs(self) -> None:
        """Model outputs stored as they come (no postprocess) whose shape may vary (a dynamic
        axis past the batch axis): Parquet keeps each row's shape; others stop at a change."""
        if self.spec.postprocess is not None:
            return
        dynamic = frozenset(o.name for o in self.describe.outputs if any(d is None for d in o.shape[1:]))
        self.collector.dynamic = dynamic
        schema = self.collector.schema  # a resumed job keeps the layout it began with
        if self.spec.parquet and (schema is None or any(d.startswith(job_parquet.VAR) for d, _ in schema.values())):
            self.collector.var = dynamic

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
            first = next(pending_items(source, todo), None)
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
        numbers with the rows on axis 0, nothing per item: blocks. An output whose axis 0 is
        fixed (a total[1]) or names another dim than the inputs' batch (NonZero's idx[2, nz])
        holds no rows: item by item (was: the job failed at its first block)."""
        s, d = self.spec, self.describe
        if d is None or not d.batchable:
            return False
        batch = {i.dim0 for i in d.inputs if i.dim0}
        rows_out = all(o.shape and o.shape[0] is None and (not o.dim0 or not batch or o.dim0 in batch)
                       for o in d.outputs)
        numeric = all(np.dtype(o.dtype).kind not in "OUS" for o in d.outputs)
        return (source.blockable and s.model is not None and s.preprocess is None and s.postprocess is None
                and not self.batched and rows_out and numeric)

    def _start(self, *, blocks_possible: bool, decode: Callable[[Any], Any] | None) -> JobEngine:
        from slabpool.engine.core.config import usable_cpus
        from slabpool.engine.local.pool import Engine

        s = self.spec
        self.workers = s.workers or usable_cpus()
        # a block is one model call of --batch-size rows; items (chunks) stack up to --batch-size;
        # a batched hook's list is one model call already
        stack = 1 if blocks_possible or self.batched or s.batch_size is None else s.batch_size
        pre, post = self._hooks(decode)
        if s.start_method == "forkserver":
            # the job owns its process: its workers fork from a server that has imported what
            # each of them imports (numpy, slabpool.workers), ~0.1 s of CPU a worker it no longer
            # pays. Not a runtime: a session is built only in the worker that owns it.
            multiprocessing.set_forkserver_preload(["slabpool.workers.main", "slabpool.engine.job.hooks"])
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

    def _hooks(self, decode: Callable[[Any], Any] | None) -> tuple[Any, Any]:
        """The engine's hooks: the names as given, or adapters so that a task's item is a list,
        or that the hooks get items decoded in the worker (`decode`: a JSONL line parsed)."""
        s = self.spec
        pre: Any = s.preprocess
        post: Any = s.postprocess
        if not self.batched:
            if decode is not None:
                pre = pre and functools.partial(job_hooks.decoded, decode, job_hooks.resolve("preprocess", pre))
                post = post and functools.partial(job_hooks.decoded_post, decode,
                                                  job_hooks.resolve("postprocess", post))
            return pre, post
        if s.preprocess is None:
            pre = job_hooks.stack_feeds
        else:
            fn = job_hooks.resolve("preprocess", s.preprocess)
            if s.batched or getattr(fn, "batched", False):
                pre = fn
            else:
                pre = functools.partial(job_hooks.each_pre if s.model else job_hooks.each_item, fn)
        if s.postprocess is not None:
            fn = job_hooks.resolve("postprocess", s.postprocess)
            post = fn if s.batched or getattr(fn, "batched", False) else functools.partial(job_hooks.each_post, fn)
        if decode is not None:
            pre = functools.partial(job_hooks.decoded_each, decode, pre)
            post = post and functools.partial(job_hooks.decoded_post_each, decode, post)
        return pre, post

    def tick(self, eng: JobEngine, intr: Interrupts) -> None:
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
            self.progress.note("interrupted: finishing the items in flight, then committing them")
        if col.due(self.spec.durable_every):
            col.commit()
        if now - self.last_stats >= 0.5:
            self.last_stats = now
            self.restarts = self._sample(eng)
        self.progress.update(self.progress.initial + col.done + col.failed, col.failed, self.restarts)

    def _sample(self, eng: JobEngine) -> int:
        st = eng.stats()
        self.peak_workers_rss = max(self.peak_workers_rss, sum(s.rss_bytes for s in st.slots))
        for s in st.slots:  # each worker's peak RSS, PSS and shared bytes, for the report
            was = self.peak_slots.get(s.slot, (0, 0, 0))
            self.peak_slots[s.slot] = (max(was[0], s.rss_bytes), max(was[1], s.pss_bytes), max(was[2], s.shared_bytes))
        return int(st.restarts)

    def finish(self, store: Store, source: Source, skipped: int) -> JobOutcome:  # step 5
        spec, col, count = self.spec, self.collector, source.count
        notes: list[str] = []
        failures = store.failures()
        text = "".join(json.dumps(f.as_json()) + "\n" for f in failures)
        write_atomic(spec.parts / "failures.jsonl", lambda f: f.write(text.encode()))
        complete = store.settled_count() >= count
        changed = source.changed()  # (OUTPUT from an input changed midway would mix old and new)
        hold("final")
        try:
            if complete and count and not self.intr.count and changed is None:
                notes.extend(self._write_output(store, count))
        except Interrupted:
            pass  # OUTPUT stays as it was (a write is atomic); a rerun writes it from what is durable
        signalled = self.intr.count  # from here on the job is over: a signal changes nothing
        error = None
        if self.stopped:
            status, first = 1, col.first_failure
            error = f"stopped: {self.stopped}; first error: " + (f"{first.error}: {first.message}" if first else "-")
        elif changed is not None or (not complete and not signalled):
            status, error = 1, self._input_changed(changed, store.settled_count(), count)
        elif signalled:
            self.interrupted = self.intr.signum
            status = 128 + self.intr.signum if self.intr.signum else 130
        else:
            status = 2 if failures else 0
        report = self._report(count, skipped, len(failures), complete, status)
        report.write(spec.parts / "report.json")
        return JobOutcome(status, report, notes, error, written=not self.unwritten)

    def _input_changed(self, changed: str | None, settled: int, count: int) -> str:
        """The one line of a job whose INPUT changed while it ran (rewritten, truncated, replaced):
        OUTPUT is not written, and a resume would be refused (its fingerprint is not the job's)."""
        return input_changed(changed if changed is not None else (
            f"it ended after {settled:,} of the {count:,} items it held when the job began"))

    def _write_output(self, store: Store, count: int) -> list[str]:
        """The single-file OUTPUT, from what is durable (a folder OUTPUT is its parts); notes."""
        spec = self.spec
        if spec.parquet:
            keep = tuple(store.keep_types)
            write_atomic(spec.output, lambda f: job_parquet.assemble(store.shard_paths(), count, keep, f,
                                                                     check=self.intr.check),
                         ready=self.intr.check)  # (a signal during the last row group: not written)
        elif spec.single_file:
            written, note = publish(store, spec.output)
            if not written:
                self.unwritten = True
                return [f"no item succeeded: {spec.output} was not written"]
            return [note] if note else []
        return []

    def _report(self, count: int, skipped: int, failed: int, complete: bool, status: int) -> Report:
        spec, col, st = self.spec, self.collector, self.stats
        lat = np.asarray(col.latencies)
        computed = col.done + col.failed
        slots = () if st is None else tuple(SlotReport.of(s, self.peak_slots.get(s.slot)) for s in st.slots)
        return Report(
            command=spec.command, model=str(spec.model) if spec.model else None,
            input=str(spec.input), output=str(spec.output), parts=str(spec.parts),
            items=count, done=count - failed if complete else None, failed=failed,
            skipped_durable=skipped, computed_this_run=computed, complete=complete,
            exit_status=status, interrupted=signal.Signals(self.interrupted).name if self.interrupted else None,
            workers=self.workers, batch_size=spec.batch_size or "auto", dispatch=self.mode or None,
            elapsed_s=round(time.monotonic() - self.t0, 3), startup_s=round(self.startup_s, 3),
            running_s=round(self.processing_s, 3),
            throughput_items_per_s=None if (r := rate(computed, self.processing_s)) is None else round(r, 2),
            latency_s=Latency(*(float(np.percentile(lat, q)) if lat.size else None for q in (50, 95, 99))),
            slots=slots,
            restarts=st.restarts if st else 0, replays=st.replayed if st else 0,
            quarantines=col.quarantined, timeouts=st.timeouts if st else 0,  # (items: a chunk's task may be
            # quarantined, then its items run alone, and only the poison ones are; was: the tasks)
            runtime=(f"{self.describe.runtime} {self.describe.runtime_version}".strip()
                     if self.describe else None),
            providers=tuple(sorted({p for s in slots for p in s.applied})),
            peak_rss_bytes=PeakRss(supervisor=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                                   workers_total=self.peak_workers_rss),
        )
