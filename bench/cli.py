"""`python -m bench`: every contender on every workload for workers = 1..cores, in one run."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil

from bench.contenders import lineup, serial
from bench.contenders.ray_pool import shutdown as ray_shutdown
from bench.contenders.remote import make_session
from bench.crash import crash_figures
from bench.measure import Measurement, measure
from bench.memory import memory_figures
from bench.report import Report, machine_info
from bench.workloads import Feeds, Outputs, Workload, all_workloads

DEFAULT_OUT = Path(__file__).parent / "results"
_MP_INFRA = ("multiprocessing.forkserver", "multiprocessing.resource_tracker", "loky.backend.resource_tracker")


def parse(argv: list[str] | None) -> argparse.Namespace:
    cores = len(os.sched_getaffinity(0))
    names = list(all_workloads(quick=True))
    p = argparse.ArgumentParser(prog="python -m bench", description=(
        "slabpool vs serial, one session with N threads, ProcessPoolExecutor, loky, pebble, "
        "multiprocessing.Pool and Ray (when importable), side by side in one run; plus crash-recovery "
        "and memory figures. Writes latest.json, latest.md and latest.png under --out."))
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes, 0.3 s per measurement, workers = cores only (a smoke run: < 60 s)")
    p.add_argument("--workers", type=_ints, default=None,
                   help=f"comma-separated worker counts (default 1..cores = 1..{cores})")
    p.add_argument("--workloads", type=lambda s: s.split(","), default=names,
                   help=f"comma-separated, from {','.join(names)} (default: all)")
    p.add_argument("--seconds", type=float, default=None,
                   help="timed seconds per measurement (default 3, 0.3 with --quick)")
    p.add_argument("--no-crash", action="store_true", help="skip the crash and recovery figures")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    unknown = set(args.workloads) - set(names)
    if unknown:
        p.error(f"unknown workload(s) {sorted(unknown)}; choose from {names}")
    args.workers = args.workers or ([cores] if args.quick else list(range(1, cores + 1)))
    args.seconds = args.seconds or (0.3 if args.quick else 3.0)
    return args


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("worker counts are positive integers")
    return values


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    t0 = time.monotonic()
    report = Report(machine_info(), {
        "argv": " ".join(argv if argv is not None else sys.argv[1:]), "quick": args.quick,
        "workers": args.workers, "workloads": args.workloads, "seconds": args.seconds,
    })
    report.machine["loadavg_at_start"] = os.getloadavg()
    warm_s = 0.05 if args.quick else 0.3
    workloads = all_workloads(args.quick)
    with tempfile.TemporaryDirectory(prefix="slabpool-bench-") as tmp, _ray_stopped():
        for name in args.workloads:
            run_workload(report, workloads[name], Path(tmp), args.workers, args.seconds, warm_s)
        if not args.no_crash:
            w = workloads["cnn"]
            model, distinct, refs = prepare(w, Path(tmp))
            print(f"[crash] {w.name}: cold start, recovery, one kill per second ...", flush=True)
            report.crash.append(crash_figures(w, model, max(args.workers), distinct, refs,
                                              max(2 * args.seconds, 1.5), 1 if args.quick else 3))
    report.evaluate_targets()
    report.leftovers = leftover_children()
    report.wall_s = time.monotonic() - t0
    report.machine["loadavg_at_end"] = os.getloadavg()
    written = report.write(args.out)
    print()
    print(report.text())
    print("wrote " + ", ".join(str(p) for p in written))
    failed = [m for m in report.measurements if m.status == "failed"]
    return 1 if failed or report.leftovers or any(c.error for c in report.crash) else 0


@contextlib.contextmanager
def _ray_stopped() -> Iterator[None]:
    try:
        yield
    finally:
        ray_shutdown()


def prepare(w: Workload, tmp: Path) -> tuple[str, list[Feeds], list[Outputs]]:
    """The model file, the distinct items, and the serial reference outputs of each."""
    model = str(w.build(tmp))
    distinct = w.items(np.random.default_rng(0))
    sess = make_session(model, 1)
    names = [o.name for o in sess.get_outputs()]
    refs = [dict(zip(names, sess.run(names, item), strict=True)) for item in distinct]
    return model, distinct, refs


def run_workload(report: Report, w: Workload, tmp: Path, workers: list[int], seconds: float, warm_s: float) -> None:
    model, distinct, refs = prepare(w, tmp)
    report.measurements.append(_one(serial(), w, model, 1, distinct, refs, seconds, warm_s))
    for n in workers:
        for make in lineup(w.window_per_worker, w.tiny):
            report.measurements.append(_one(make(), w, model, n, distinct, refs, seconds, warm_s))
    top = report.get(w.name, "slabpool", max(workers))
    report.memory.append(memory_figures(w.name, model, distinct[0], top.extras if top else {}, max(workers)))


def _one(c: object, w: Workload, model: str, n: int, distinct: list[Feeds], refs: list[Outputs],
         seconds: float, warm_s: float) -> Measurement:
    m = measure(c, w, model, n, distinct, refs, seconds, warm_s)  # type: ignore[arg-type]
    what = (f"{m.items_per_s:>12,.0f} items/s  p50 {m.p50_ms:8.3f} ms  p99 {m.p99_ms:8.3f} ms  "
            f"start-up {m.startup_s:.2f} s" if m.status == "ok" else f"{m.status}: {m.error}")
    print(f"[{w.name} w={n}] {m.contender:<20} {what}", flush=True)
    return m


def leftover_children() -> list[str]:
    """Our descendants still alive (beyond multiprocessing's own helpers): a pool not closed."""
    deadline = time.monotonic() + 10
    while True:
        left = []
        for p in psutil.Process().children(recursive=True):
            try:
                cmd = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if not any(name in cmd for name in _MP_INFRA):
                left.append(f"{p.pid}: {cmd[:120]}")
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)
