"""What a run did: the `Report` (written as report.json, a documented format: docs/cli.md),
the `JobOutcome` that `run_job` returns, and the `summary` lines printed at the end."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slabpool.engine.core.stats import SlotStats
from slabpool.engine.job.store import write_json


@dataclass(frozen=True)
class Latency:
    """Seconds per task (`Result.timings.total`; a block's time for a block), percentiles."""

    p50: float | None  # (None: no task ended well, no latency to tell: every item failed)
    p95: float | None
    p99: float | None


@dataclass(frozen=True)
class SlotReport:
    """One worker slot at the end of the run."""

    slot: int
    pid: int
    tasks_done: int
    restarts: int
    runtime: str  # runtime and its version
    applied: tuple[str, ...]  # provider/delegate really in use
    requested: tuple[str, ...]  # provider/delegate asked for
    degraded: bool
    peak_rss_bytes: int = 0  # the worker's memory, sampled every 0.5 s: the peaks of RSS,
    peak_pss_bytes: int = 0  # of PSS (shared pages divided among their sharers),
    peak_shared_bytes: int = 0  # and of the pages it shares (mapped weights, arenas)
    weights: str = ""  # how the weights were loaded: shared, or as given and why

    @classmethod
    def of(cls, s: SlotStats, peak: tuple[int, int, int] | None = None) -> SlotReport:
        rss, pss, shared = peak or (s.rss_bytes, s.pss_bytes, s.shared_bytes)
        return cls(slot=s.slot, pid=s.pid, tasks_done=s.tasks_done, restarts=s.restarts,
                   runtime=f"{s.runtime} {s.runtime_version}".strip(), applied=tuple(s.applied),
                   requested=tuple(s.requested), degraded=s.degraded, peak_rss_bytes=rss,
                   peak_pss_bytes=pss, peak_shared_bytes=shared, weights=s.weights)


@dataclass(frozen=True)
class PeakRss:
    """Peak resident memory in bytes: this process, and the workers together (sampled every 0.5 s)."""

    supervisor: int
    workers_total: int


@dataclass(frozen=True)
class Report:
    """The summary of one run; its fields are report.json's keys (docs/cli.md), nested ones as
    objects, tuples as lists."""

    command: str  # the command that resumes this run
    model: str | None
    input: str
    output: str
    parts: str  # the folder of shards, journal, failures.jsonl and report.json
    items: int
    done: int | None  # items with a result; None until the job is complete
    failed: int
    skipped_durable: int  # settled by earlier runs
    computed_this_run: int
    complete: bool
    exit_status: int
    interrupted: str | None  # the signal's name (SIGINT, SIGTERM)
    workers: int
    batch_size: int | str  # B, or "auto"
    dispatch: str | None  # "blocks" or "chunks"; None when nothing ran
    elapsed_s: float
    startup_s: float  # from the command's start to the engine ready (before the running phase)
    running_s: float  # the running phase: items sent and settled (the last progress line's, too)
    throughput_items_per_s: float | None  # items this run / running_s; None when under 0.1 s (noise)
    latency_s: Latency
    slots: tuple[SlotReport, ...]
    restarts: int
    replays: int
    quarantines: int
    timeouts: int
    runtime: str | None
    providers: tuple[str, ...]  # every provider/delegate applied in some slot
    peak_rss_bytes: PeakRss

    def as_json(self) -> dict[str, Any]:
        """report.json's object."""
        return dataclasses.asdict(self)

    def write(self, path: Path) -> None:
        """report.json, atomically."""
        write_json(path, self.as_json())


@dataclass
class JobOutcome:
    status: int  # 0 all done, 2 some failed, 1 stopped on systematic failures, 130/143 interrupted
    report: Report
    notes: list[str] = field(default_factory=list)
    error: str | None = None  # status 1: the one line to show
    written: bool = True  # False: a complete run's single-file OUTPUT was not written (no item succeeded)


def _throughput(r: Report) -> str:
    if r.throughput_items_per_s is None:
        return f"throughput - ({r.computed_this_run} items in {r.running_s * 1e3:.0f} ms: too short for a rate)"
    return f"throughput {r.throughput_items_per_s:,.1f} items/s"


def summary(outcome: JobOutcome) -> list[str]:
    """The lines printed at the end of a run."""
    r = outcome.report
    if r.complete and not r.items:
        where = f"the folder {r.output} holds none" if Path(r.output).is_dir() else f"{r.output} was not written"
        return [f"items 0: {r.input} holds no items; nothing was computed, {where}"]
    if r.complete and not r.computed_this_run and not r.workers:  # all durable already
        return [f"items {r.items}: all already durable, nothing to compute "
                f"({r.failed} failed, listed in {Path(r.parts) / 'failures.jsonl'})" if r.failed else
                f"items {r.items}: all already durable, nothing to compute",
                *outcome.notes, f"output: {r.output}"]
    lat, rss = r.latency_s, r.peak_rss_bytes
    lines = [
        f"items {r.items}: computed {r.computed_this_run} this run, {r.skipped_durable} already durable, "
        f"failed {r.failed}",
        f"elapsed {r.elapsed_s:.2f} s (start-up {r.startup_s:.2f} s, running {r.running_s:.2f} s), "
        f"{_throughput(r)} on {r.workers} workers (batch size {r.batch_size})",
        "latency - (no task ended well)" if lat.p50 is None or lat.p95 is None or lat.p99 is None else
        f"latency p50 {lat.p50 * 1e3:.1f} ms, p95 {lat.p95 * 1e3:.1f} ms, p99 {lat.p99 * 1e3:.1f} ms",
        f"restarts {r.restarts}, replays {r.replays}, quarantines {r.quarantines}, "
        f"runtime {r.runtime or '-'} ({', '.join(r.providers) or 'no model'})",
        "per slot: " + (", ".join(f"#{s.slot} {s.tasks_done} tasks/{s.restarts} restarts"
                                  for s in r.slots) or "-"),
        f"peak RSS: supervisor {rss.supervisor / 2**20:.0f} MiB, workers "
        f"{rss.workers_total / 2**20:.0f} MiB in total",
        *_memory_lines(r.slots),
    ]
    if r.failed:
        lines.append(f"failed items are listed in {Path(r.parts) / 'failures.jsonl'}")
    lines.extend(outcome.notes)
    if r.complete and outcome.written and r.exit_status not in (130, 143):  # (interrupted at the final write)
        lines.append(f"output: {r.output}" + (f" (its journal and report in {r.parts})"
                                               if r.output != r.parts else ""))
    return lines


def _memory_lines(slots: tuple[SlotReport, ...]) -> list[str]:
    """Each worker's peak RSS, PSS and shared bytes, and how its weights were loaded."""
    if not any(s.peak_rss_bytes for s in slots):
        return []
    per = ", ".join(f"#{s.slot} RSS {s.peak_rss_bytes >> 20} / PSS {s.peak_pss_bytes >> 20} / shared "
                    f"{s.peak_shared_bytes >> 20}" for s in slots)
    notes = sorted({s.weights for s in slots if s.weights})
    return [f"worker memory (peak MiB): {per}", *(f"weights: {n}" for n in notes)]
