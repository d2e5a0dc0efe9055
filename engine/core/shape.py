"""`workers="auto"`: how many workers, and how many intra-op threads each, for this host and model.

    probe (a process of its own, workers.probe)  ->  Probe(private, shared, time a row per threads)
    budget: usable CPUs (affinity, cgroup quota); memory (MemAvailable, cgroup memory.max)
    decide(cpus, memory, probe)                  ->  Shape(workers, threads, why)

One worker of one thread per usable CPU is the most throughput a CPU gives (runtimes.md: N
processes x 1 thread beat intra-op threads by 35-65 % in CPU per item), so that is the shape
whenever the memory holds that many workers. The weights a worker maps from the shared form are
counted once for the pool; what it holds alone is counted per worker. When memory holds fewer
workers than CPUs, each gets the spare CPUs as threads, if the probe shows threads make a call
faster (at least 1.2x); otherwise the CPUs stay idle rather than slow every call down.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import psutil

from slabpool.workers.probe import Probe, probe, time_at
from slabpool.workers.session import SessionSpec

log = logging.getLogger("slabpool.engine")
MiB = 1 << 20
RESERVE = 512 * MiB  # left for the supervisor, the arenas and the page cache
WORKER_EXTRA = 20 * MiB  # a slabpool worker's own modules and buffers beyond the bare session
THREADS_PAY = 1.2  # threads are given only if a call gets at least this much faster


@dataclass(frozen=True)
class Shape:
    workers: int
    threads: int
    why: str


def memory_budget() -> int:
    """Bytes the pool may take: what the host has available, within the cgroup's limit."""
    avail = psutil.virtual_memory().available
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        used = int(open("/sys/fs/cgroup/memory.current").read())
        if limit != "max":
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(int(avail * 0.9) - RESERVE, 0)


def choose(spec: SessionSpec | None, cpus: int, threads: int | None = None) -> Shape:
    """Probe `spec` (in a spawned process) and decide; `threads` given: only workers are chosen."""
    budget = memory_budget()
    if spec is None:
        return Shape(cpus, threads or 1, f"workers={cpus}: no model to probe, one worker per usable CPU ({cpus})")
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        found = ex.submit(probe, spec).result()
        spare = cpus // max(1, min(_fit(budget, found), cpus))
        if threads is None and spare > 1 and found.row_s:  # memory holds fewer workers than CPUs
            at = ex.submit(time_at, spec, spare).result()
            if at is not None:
                found = dataclasses.replace(found, row_s={**found.row_s, spare: at})
    shape = decide(cpus, budget, found, threads)
    log.info("slabpool: workers='auto' chose %s", shape.why)
    return shape


def _fit(budget: int, found: Probe) -> int:
    """Workers the memory holds: the shared weights once, then each worker's own bytes."""
    return max((budget - found.shared_bytes) // (found.private_bytes + WORKER_EXTRA), 0)


def decide(cpus: int, budget: int, found: Probe, threads: int | None = None) -> Shape:
    """The shape, and why, from the CPUs, the memory budget and the probe (a pure function)."""
    fit = _fit(budget, found)
    mem = (f"memory {budget / MiB:.0f} MiB for workers of {(found.private_bytes + WORKER_EXTRA) / MiB:.0f} MiB "
           f"each + {found.shared_bytes / MiB:.0f} MiB of shared weights once: {fit} fit")
    if threads:
        workers = max(1, min(cpus // threads, fit))
        return Shape(workers, threads, f"workers={workers} x threads={threads} (threads given): "
                                       f"{cpus} usable CPUs; {mem}")
    if fit >= cpus:
        return Shape(cpus, 1, f"workers={cpus} x threads=1: one worker per usable CPU ({cpus}); {mem}")
    workers = max(1, fit)
    spare = cpus // workers
    timed = found.row_s.get(1), found.row_s.get(spare)
    if spare > 1 and timed[0] and timed[1] and timed[0] / timed[1] >= THREADS_PAY:
        return Shape(workers, spare, f"workers={workers} x threads={spare}: {mem}, fewer than the {cpus} "
                                     f"usable CPUs; {spare} threads make a call {timed[0] / timed[1]:.2f}x faster")
    if spare <= 1:
        reason = "no spare CPU for threads"
    elif timed[0] and timed[1]:
        reason = f"{spare} threads make a call {timed[0] / timed[1]:.2f}x faster, under {THREADS_PAY}x"
    else:
        reason = found.note or f"{spare} threads not timed"
    warn = " (not even one: the pool starts one worker anyway)" if fit == 0 else ""
    return Shape(workers, 1, f"workers={workers} x threads=1: {mem}{warn}, fewer than the {cpus} usable CPUs; "
                             f"{reason}")
