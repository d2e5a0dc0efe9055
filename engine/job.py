"""The batch job behind `slabpool run`: read items, map them through an Engine, keep results.

    INPUT --open_source--> todo (items not yet durable) --submit, window--> Engine
                                                                              |
    OUTPUT <--assemble-- Store (shards + journal) <--commit, every ~1 s-- Collector (in order)

1 open INPUT and the Store; the journal says which items are settled (a row or a failure)
2 start the Engine; submit the other items one per task (shape (1, ...)), a bounded window
3 take results in input order; a failed item is recorded, not fatal
4 commit the buffered rows as a shard (atomic) and journal it, at least every `durable_every` s
5 at the end: failures.jsonl, the single-file OUTPUT (if asked for), report.json, a summary

Ctrl-C or SIGTERM: stop submitting, finish what is in flight, commit, exit 130/143. A second
one stops now (close(cancel_pending=True)); what was committed stays committed.
"""

from __future__ import annotations

import json
import resource
import signal
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Literal, TextIO

import numpy as np

from slabpool.engine.job_io import (
    Failure,
    JobError,
    RowError,
    Schema,
    Source,
    Store,
    assemble,
    check_rows,
    open_source,
    save_output,
    schema_of,
    to_rows,
    write_atomic,
    write_json,
)
from slabpool.engine.task import Result
from slabpool.workers import errors as E

MAX_SHARD_ITEMS = 10_000  # a shard also closes at this size, to bound memory


@dataclass(frozen=True)
class JobSpec:
    model: Path | None
    input: Path
    output: Path
    workers: int | None = None
    batch_size: int = 1
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

    @property
    def single_file(self) -> bool:
        return self.output.suffix in (".npy", ".npz")

    @property
    def parts(self) -> Path:
        return self.output.with_name(self.output.name + ".parts") if self.single_file else self.output


@dataclass
class JobOutcome:
    status: int  # 0 all done, 2 some failed, 130/143 interrupted
    report: dict[str, Any]
    notes: list[str] = field(default_factory=list)


# -- step 3: results in input order -----------------------------------------------------------------

ITEM_ERRORS = (E.InputContractError, E.SessionRunError, E.PoisonTask, E.TaskTimeout, E.ShmCapacityError,
               RowError, OSError, ValueError)


class Collector:
    """Buffers settled items in input order; commits them to the Store as one shard."""

    def __init__(self, store: Store, strip_batch: bool, schema: Schema | None) -> None:
        self.store, self.strip_batch, self.schema = store, strip_batch, schema
        self.indices: list[int] = []
        self.rows: list[dict[str, Any]] = []
        self.failures: list[Failure] = []
        self.latencies: list[float] = []
        self.done = self.failed = 0
        self.last_commit = time.monotonic()

    def add(self, index: int, outcome: Result | BaseException) -> None:
        if isinstance(outcome, Result):
            try:
                rows = to_rows(outcome.outputs, strip_batch=self.strip_batch)
                if self.schema is None:
                    self.schema = schema_of(rows)
                check_rows(rows, self.schema)
            except RowError as exc:
                return self._fail(index, exc, outcome.attempts)
            self.indices.append(index)
            self.rows.append(rows)
            self.latencies.append(outcome.timings.total)
            self.done += 1
        elif isinstance(outcome, ITEM_ERRORS):
            self._fail(index, outcome, len(getattr(outcome, "crashes", ())) or 1)
        else:  # the pool itself broke (or a bug): not an item's fault
            raise outcome

    def _fail(self, index: int, exc: BaseException, attempts: int) -> None:
        message = (str(exc).strip().splitlines() or [""])[0]
        self.failures.append(Failure(index, type(exc).__name__, message, attempts))
        self.failed += 1

    def due(self, every: float) -> bool:
        pending = len(self.indices) + len(self.failures)
        return pending > 0 and (time.monotonic() - self.last_commit >= every or pending >= MAX_SHARD_ITEMS)

    def commit(self) -> None:  # step 4
        if self.indices or self.failures:
            self.store.commit(self.indices, self.rows, self.failures)
        self.indices, self.rows, self.failures = [], [], []
        self.last_commit = time.monotonic()


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
        eta = (self.total - settled) / rate if rate > 0 else float("inf")
        pct = 100.0 * settled / max(self.total, 1)
        self.note(f"progress: {settled}/{self.total} items ({pct:.0f}%), {rate:.1f} items/s, "
                  f"eta {eta:.0f} s, restarts {restarts}, failed {failed}")

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


class Interrupts:
    """SIGINT/SIGTERM set flags only (no I/O in a handler); the loop reads them."""

    def __init__(self) -> None:
        self.count = 0
        self.signum = 0
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        self.signum = self.signum or signum

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
    ranks: dict[str, int] = {}
    source = open_source(spec.input, preprocess=spec.preprocess is not None, ranks=ranks)  # step 1
    store = Store.open(spec.parts, fingerprint(spec, source), resume=spec.resume, overwrite=spec.overwrite)
    try:
        return _run_on(spec, source, store, t0, ranks, stream)
    finally:
        store.close()


def _run_on(spec: JobSpec, source: Source, store: Store, t0: float, ranks: dict[str, int],
            stream: TextIO | None) -> JobOutcome:
    settled_before = store.settled()
    todo = [i for i in range(source.count) if i not in settled_before]
    progress = Progress(source.count, len(settled_before), spec.log_every, stream)
    if store.invalid:
        progress.note(f"{store.invalid} journal line(s) failed validation (torn or missing shard); their items run again")
    if settled_before:
        progress.note(f"resuming: {len(settled_before)} of {source.count} items already durable in {spec.parts}")
    collector = Collector(store, spec.model is not None and spec.postprocess is None, store.schema())
    run = _Run(spec, progress, collector, t0)
    if todo:
        run.execute(source, todo, ranks)
    settled = len(store.settled())
    progress.close(settled, len(store.failures()), run.stats.restarts if run.stats else 0)
    return run.finish(store, source.count, len(settled_before))


def fingerprint(spec: JobSpec, source: Source) -> dict[str, Any]:
    """What makes two runs the same job (workers and batch size do not change results' rows)."""
    model = None
    if spec.model is not None:
        st = spec.model.stat()
        model = {"path": str(spec.model.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return {"model": model, "input": source.fingerprint, "count": source.count,
            "preprocess": spec.preprocess, "postprocess": spec.postprocess}


class _Run:
    """One run's engine, loop and numbers."""

    def __init__(self, spec: JobSpec, progress: Progress, collector: Collector, t0: float) -> None:
        self.spec, self.progress, self.collector, self.t0 = spec, progress, collector, t0
        self.interrupted = 0
        self.startup_s = 0.0
        self.processing_s = 0.0
        self.stats: Any = None
        self.describe: Any = None
        self.peak_workers_rss = 0
        self.workers = 0

    def execute(self, source: Source, todo: list[int], ranks: dict[str, int]) -> None:
        eng = self._start()
        self.describe = eng.describe()
        ranks.update({s.name: len(s.shape) for s in self.describe.inputs})
        if len(self.describe.inputs) == 1:
            ranks[""] = len(self.describe.inputs[0].shape)
        self.startup_s = time.monotonic() - self.t0
        t1 = self.collector.last_commit = time.monotonic()
        self.progress.begin()
        try:
            with Interrupts() as intr:
                self._loop(eng, source, iter(todo), intr)
                self.interrupted = intr.signum if intr.count else 0
        finally:
            self.processing_s = time.monotonic() - t1
            self.collector.commit()
            self.stats = eng.stats()
            eng.close(cancel_pending=True, timeout=10)

    def _start(self) -> Any:
        from slabpool.engine.api import Engine
        from slabpool.engine.config import usable_cpus

        s = self.spec
        self.workers = s.workers or usable_cpus()
        window = self.workers * max(2 * s.batch_size, 4)
        try:
            return Engine(
                str(s.model) if s.model else None, workers=self.workers, start_method=s.start_method,
                preprocess=s.preprocess, postprocess=s.postprocess, max_attempts=s.max_attempts,
                task_timeout=s.task_timeout, max_batch_size=s.batch_size, queue_capacity=window,
            )
        except (E.EngineError, OSError, ValueError, TypeError, ImportError, AttributeError) as exc:
            what = "the model failed to load" if isinstance(exc, E.SessionInitError) else "cannot start"
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise JobError(f"{what}: {first}") from exc

    def _loop(self, eng: Any, source: Source, todo: Iterator[int], intr: Interrupts) -> None:
        window = eng.config.queue_capacity
        inflight: deque[tuple[int, Future[Result]]] = deque()
        col, spec = self.collector, self.spec
        draining = False
        last_stats = 0.0
        restarts = 0
        while True:
            if intr.count and not draining:
                draining = True
                self.progress.note("interrupted: finishing the items in flight (press Ctrl-C again to stop now)")
            if intr.count >= 2:
                self._take_done(inflight)
                self.progress.note("stopping now: cancelling what is in flight")
                return
            while not draining and len(inflight) < window and (i := next(todo, None)) is not None:
                inflight.append((i, _submit(eng, source, i)))  # step 2
            if not inflight:
                break
            wait([inflight[0][1]], timeout=0.25)
            self._take_done(inflight)  # step 3
            if col.due(spec.durable_every):
                col.commit()  # step 4
            if time.monotonic() - last_stats >= 0.5:
                last_stats = time.monotonic()
                restarts = self._sample(eng)
            settled = self.progress.initial + col.done + col.failed
            self.progress.update(settled, col.failed, restarts)

    def _take_done(self, inflight: deque[tuple[int, Future[Result]]]) -> None:
        while inflight and inflight[0][1].done():
            index, fut = inflight.popleft()
            try:
                outcome: Result | BaseException = fut.result()
            except BaseException as exc:  # noqa: BLE001 - an outcome, sorted by Collector.add
                outcome = exc
            self.collector.add(index, outcome)

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
        complete = len(store.settled()) >= count
        if complete and spec.single_file:
            arrays = assemble(store, count, col.schema)
            if arrays is None:
                notes.append(f"no item succeeded: {spec.output} was not written")
            else:
                note = save_output(spec.output, arrays)
                notes.extend([note] if note else [])
        if not complete:
            status = 143 if self.interrupted == signal.SIGTERM else 130
        else:
            status = 2 if failures else 0
        report = self._report(count, skipped, len(failures), complete, status)
        write_json(spec.parts / "report.json", report)
        return JobOutcome(status, report, notes)

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
            "workers": self.workers, "batch_size": spec.batch_size,
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


def _submit(eng: Any, source: Source, index: int) -> Future[Result]:
    """Submit item `index` as one task; an item that cannot be read or admitted fails alone."""
    try:
        return eng.submit(source.item(index))  # type: ignore[no-any-return]
    except ITEM_ERRORS as exc:
        fut: Future[Result] = Future()
        fut.set_exception(exc)
        return fut


def summary(outcome: JobOutcome) -> list[str]:
    """The lines printed at the end of a run."""
    r = outcome.report
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
