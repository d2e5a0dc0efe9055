"""`python -m bench.latency`: one call's round trip, side by side in one run (issue 21).

Every contender serves the same 64->128->10 MLP, one row per call, on `--workers` workers, at
each concurrency in `--concurrency` (threads for a sync call, asyncio tasks for
`infer_async`). Each caller calls, waits, and calls again for `--seconds`; every call's latency
is kept. Printed: p50, p99, p99.9 and calls/s, the CPU a call (this process, and its workers),
the cyclic collector's time a call in this process, and each row against ProcessPoolExecutor's
at the same concurrency (latency: lower is better; calls/s: higher is better).

    floor        two Python processes, one byte each way on a pipe (os.write / os.read)
    in-process   the same session in this process (threads share it: ORT's run is thread-safe)
    ppe          ProcessPoolExecutor(forkserver), the session built by its initializer
    loky         loky's reusable executor, the same initializer
    infer        Engine.infer(x)                       (forkserver, default settings)
    async        await Engine.infer_async(x)           (the same engine)
    ray          RayEngine.infer(x), with --ray        (a private local Ray instance)

`--ab` adds, interleaved with each infer and async cell on the same engine, the same cell with
callers not combined (engine.caller.combine: every queued call its own task, "... [no
combining]"), with no spinning (`spin_us=0`: a lent call's caller and worker sleep at once,
"... [no spin]"), with the express lane off (engine.local.express: the fast path's general
steps, "... [no express]") and with the fast path off too (engine.core.fastpath: every call
through the owner thread, the path before issue 21, "... [owner thread]"): the A/B for a
shared machine, where only cells measured side by side compare. The switches are the
benchmark's, not the product's.

The default run takes about a minute; `--long` measures 10 s a cell.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.contenders.remote import init_session, make_session, run_item

Call = Callable[[Any], Any]
ACall = Callable[[Any], Any]  # async: returns an awaitable


@dataclass(frozen=True)
class Row:
    contender: str
    concurrency: int
    calls: int
    seconds: float
    p50_us: float
    p99_us: float
    p999_us: float
    cpu_us: float = 0.0  # CPU a call: this process (every thread) and its live child processes
    children_us: float = 0.0  # ... of which its child processes (the workers)
    gc_us: float = 0.0  # the cyclic collector's time a call in this process (gc.callbacks), all generations

    @property
    def rate(self) -> float:
        return self.calls / self.seconds if self.seconds else 0.0


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.latency", description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2, help="worker processes per pool (default 2)")
    p.add_argument("--concurrency", type=lambda s: [int(v) for v in s.split(",")], default=[1, 8, 64],
                   help="comma-separated callers at once (default 1,8,64)")
    p.add_argument("--seconds", type=float, default=None, help="timed seconds per cell (default 1.5)")
    p.add_argument("--long", action="store_true", help="10 s per cell")
    p.add_argument("--only", type=lambda s: s.split(","), default=None,
                   help="comma-separated contenders (floor,in-process,ppe,combine,loky,infer,async,ray)")
    p.add_argument("--ray", action="store_true", help="add RayEngine.infer (slow to start)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    p.add_argument("--ab", action="store_true", help="each engine cell again with the fast path off, interleaved")
    p.add_argument("--rounds", type=int, default=1, help="repeat the engine cells (interleaved A/B) this many times")
    args = p.parse_args(argv)
    args.seconds = args.seconds or (10.0 if args.long else 1.5)
    return args


# -- the callers ----------------------------------------------------------------------------------


def drive(call: Call, item: Any, threads: int, seconds: float) -> tuple[list[int], float]:
    """`threads` threads each call(item) in a loop for `seconds` (after a short warm-up);
    every call's latency in ns, and the timed wall seconds."""
    for _ in range(20):
        call(item)
    lat: list[list[int]] = [[] for _ in range(threads)]
    start = threading.Barrier(threads + 1)
    stop_at = [0.0]

    def loop(mine: list[int]) -> None:
        clock, until = time.perf_counter_ns, None
        start.wait()
        until = stop_at[0]
        while True:
            t0 = clock()
            call(item)
            t1 = clock()
            mine.append(t1 - t0)
            if t1 >= until:
                return

    workers = [threading.Thread(target=loop, args=(mine,), daemon=True) for mine in lat]
    for w in workers:
        w.start()
    t0 = time.perf_counter_ns()
    stop_at[0] = t0 + int(seconds * 1e9)
    start.wait()
    for w in workers:
        w.join()
    return [x for mine in lat for x in mine], (time.perf_counter_ns() - t0) / 1e9


def drive_async(acall: ACall, item: Any, tasks: int, seconds: float) -> tuple[list[int], float]:
    """The same with `tasks` asyncio tasks on one event loop."""

    async def main() -> tuple[list[int], float]:
        for _ in range(20):
            await acall(item)
        clock = time.perf_counter_ns
        until = clock() + int(seconds * 1e9)
        lat: list[int] = []

        async def loop() -> None:
            while True:
                t0 = clock()
                await acall(item)
                t1 = clock()
                lat.append(t1 - t0)
                if t1 >= until:
                    return

        t0 = clock()
        await asyncio.gather(*(loop() for _ in range(tasks)))
        return lat, (clock() - t0) / 1e9

    return asyncio.run(main())


def summarize(name: str, conc: int, lat: list[int], seconds: float, cpu: tuple[float, float] = (0.0, 0.0),
              gc_s: float = 0.0) -> Row:
    a = np.sort(np.asarray(lat, dtype=np.int64)) / 1000.0
    q = np.quantile(a, [0.5, 0.99, 0.999]) if len(a) else [np.nan] * 3
    n = max(len(a), 1)
    return Row(name, conc, len(a), seconds, float(q[0]), float(q[1]), float(q[2]),
               (cpu[0] + cpu[1]) / n * 1e6, cpu[1] / n * 1e6, gc_s / n * 1e6)


def cpu_now() -> tuple[float, float]:
    """CPU seconds so far: this process, and its live children (what a shared machine's load
    moves least: the wall-clock figures are the scheduler's as much as ours)."""
    import psutil

    kids = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
            kids += t.user + t.system
        except psutil.Error:
            pass
    return time.process_time(), kids


def measured(run: Callable[[], tuple[list[int], float]]) -> tuple[list[int], float, tuple[float, float], float]:
    """`run()`'s latencies and seconds, the CPU it took (see cpu_now; includes warm-up), and
    the seconds this process spent in the cyclic collector meanwhile (a pass holds the GIL:
    every thread waits; what a call path's reference cycles cost, docs/latency.md). The
    garbage left by what came before (an engine's start-up, the last cell) is collected first,
    so that no cell is charged for it."""
    spent, began = [0.0], [0.0]
    gc.collect()

    def collector(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            spent[0] += time.perf_counter() - began[0]

    own0, kids0 = cpu_now()
    gc.callbacks.append(collector)
    try:
        lat, seconds = run()
    finally:
        gc.callbacks.remove(collector)
    own1, kids1 = cpu_now()
    return lat, seconds, (own1 - own0, kids1 - kids0), spent[0]


# -- the contenders ----------------------------------------------------------------------------


def _pong(r: Any, w: Any) -> None:
    rfd, wfd = r.fileno(), w.fileno()
    while os.read(rfd, 1):
        os.write(wfd, b"x")


@contextmanager
def pipe_floor() -> Iterator[Call]:
    """Another Python process that answers each byte with a byte: the least a call can cost."""
    ctx = multiprocessing.get_context("forkserver")
    a_r, a_w = ctx.Pipe(duplex=False)
    b_r, b_w = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_pong, args=(a_r, b_w), daemon=True)
    proc.start()
    a_r.close()
    b_w.close()
    lock = threading.Lock()  # one ping in the pipe at a time
    wfd, rfd = a_w.fileno(), b_r.fileno()

    def call(_: Any) -> bytes:
        with lock:
            os.write(wfd, b"x")
            return os.read(rfd, 1)

    try:
        yield call
    finally:
        a_w.close()
        proc.join(5)
        b_r.close()


@contextmanager
def in_process(model: str) -> Iterator[Call]:
    sess = make_session(model, 1)
    names = [o.name for o in sess.get_outputs()]
    yield lambda x: sess.run(names, x)


def in_process_outputs(model: str, item: Any) -> dict[str, Any]:
    sess = make_session(model, 1)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, item), strict=True))


@contextmanager
def executor(model: str, workers: int) -> Iterator[Call]:
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("forkserver"),
                               initializer=init_session, initargs=(model,))
    try:
        yield lambda x: pool.submit(run_item, x).result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@contextmanager
def loky_pool(model: str, workers: int) -> Iterator[Call]:
    import loky

    pool = loky.get_reusable_executor(max_workers=workers, initializer=init_session, initargs=(model,), reuse=False)
    try:
        yield lambda x: pool.submit(run_item, x).result()
    finally:
        pool.shutdown(wait=True, kill_workers=True)


@contextmanager
def engine(model: str, workers: int, ray: bool = False) -> Iterator[Any]:
    if ray:
        from slabpool import RayEngine

        eng: Any = RayEngine(model, workers=workers, address="local")
    else:
        from slabpool import Engine

        eng = Engine(model, workers=workers, start_method="forkserver")
    try:
        yield eng
    finally:
        eng.close()


# -- the run -------------------------------------------------------------------------------------


def run(args: argparse.Namespace, model: str, item: Any) -> list[Row]:
    rows: list[Row] = []
    want = set(args.only or ["floor", "in-process", "ppe", "combine", "loky", "infer", "async"]
               + (["ray"] if args.ray else []))

    def cells(name: str, call: Call, concs: list[int]) -> None:
        for c in concs:
            rows.append(summarize(name, c, *measured(functools.partial(drive, call, item, c, args.seconds))))
            _print_row(rows[-1], None)

    if "floor" in want:
        with pipe_floor() as call:
            cells("pipe floor", call, [1])
    if "in-process" in want:
        with in_process(model) as call:
            cells("in-process", call, args.concurrency)
    if "ppe" in want:
        with executor(model, args.workers) as call:
            cells("ProcessPoolExecutor", call, args.concurrency)
    if "combine" in want:
        from bench.contenders.combining import combining

        with combining(model, args.workers) as pool:
            want_out = in_process_outputs(model, item)
            got = pool.call(item)
            assert all(np.array_equal(got[k], want_out[k]) for k in want_out), "the batching floor's outputs differ"
            cells("batching floor (no engine)", pool.call, args.concurrency)
            print(f"  (batching floor: {pool.rows / max(pool.batches, 1):.1f} calls a batch)", flush=True)
    if "loky" in want:
        try:
            with loky_pool(model, args.workers) as call:
                cells("loky", call, args.concurrency)
        except ImportError as exc:
            print(f"loky skipped: {exc}", file=sys.stderr)
    if want & {"infer", "async"}:
        with engine(model, args.workers) as eng:
            for _ in range(args.rounds):
                _engine_cells(args, eng, item, want, rows)
    if "ray" in want:
        try:
            with engine(model, args.workers, ray=True) as eng:
                cells("RayEngine.infer", eng.infer, args.concurrency)
        except ImportError as exc:
            print(f"ray skipped: {exc}", file=sys.stderr)
    return rows


def _engine_cells(args: argparse.Namespace, eng: Any, item: Any, want: set[str], rows: list[Row]) -> None:
    """Engine.infer and infer_async at each concurrency; with --ab each cell is followed by the
    same cell with each part of the call path off in turn, on the same engine."""
    fast, express, combiner = eng._owner.fast, getattr(eng, "_express", None), getattr(eng, "_combiner", None)
    # (fast path, express lane, spinning, callers combined, tag)
    modes = [(True, True, 1, True, ""), (True, True, 1, False, " [no combining]"), (True, True, 0, True, " [no spin]"),
             (True, False, 1, True, " [no express]"),
             (False, False, 1, False, " [owner thread]")] if args.ab else [(True, True, 1, True, "")]
    if express is None:  # (Ray: one path)
        modes = modes[:1]
    lane_on, combine_on = express is not None and express.on, combiner is not None and combiner.on
    transport, spin_s = getattr(eng, "_transport", None), fast.spin_s
    for c in args.concurrency:
        for on, lane, spin, combine, tag in modes:
            fast.enabled = on and fast.transport is not None
            fast.spin_s = spin * spin_s
            if transport is not None:
                transport.spin_s = spin * spin_s
            if express is not None:
                express.on = lane and lane_on
            if combiner is not None:
                combiner.on = combine and combine_on
            try:
                if "infer" in want:
                    before = (combiner.groups, combiner.combined) if combiner is not None else (0, 0)
                    rows.append(summarize("Engine.infer" + tag, c,
                                          *measured(functools.partial(drive, eng.infer, item, c, args.seconds))))
                    _print_row(rows[-1], None)
                    if combiner is not None and combiner.groups > before[0]:
                        groups, calls = combiner.groups - before[0], combiner.combined - before[1]
                        print(f"  (combined: {calls / rows[-1].calls:.0%} of the calls, {calls / groups:.1f} a task)",
                              flush=True)
                if "async" in want:
                    rows.append(summarize("Engine.infer_async" + tag, c,
                                          *measured(functools.partial(drive_async, eng.infer_async, item, c, args.seconds))))
                    _print_row(rows[-1], None)
            finally:
                fast.enabled = fast.transport is not None
                fast.spin_s = spin_s
                if transport is not None:
                    transport.spin_s = spin_s
                if express is not None:
                    express.on = lane_on
                if combiner is not None:
                    combiner.on = combine_on


def _print_row(row: Row, ref: Row | None) -> None:
    vs = ""
    if ref is not None and ref is not row:
        vs = (f"  {row.p50_us / ref.p50_us:5.2f}x {row.p99_us / ref.p99_us:5.2f}x "
              f"{row.rate / ref.rate:5.2f}x")
    print(f"{row.contender:<34} {row.concurrency:>4} {row.p50_us:>9.1f} {row.p99_us:>9.1f} {row.p999_us:>9.1f} "
          f"{row.rate:>10,.0f} {row.cpu_us:>7.0f} {row.children_us:>7.0f} {row.gc_us:>6.1f}{vs}", flush=True)


def report(rows: list[Row]) -> None:
    print(f"\n{'contender':<34} conc   p50 us    p99 us  p99.9 us    calls/s  cpu us  kids us  gc us   vs "
          "ProcessPoolExecutor (p50, p99, calls/s)")
    refs = {r.concurrency: r for r in rows if r.contender == "ProcessPoolExecutor"}
    for c in sorted({r.concurrency for r in rows}):
        for row in (r for r in rows if r.concurrency == c):
            _print_row(row, refs.get(c))


def main(argv: list[str] | None = None) -> int:
    from tests.models import onnx_models as om

    args = parse(argv)
    item = {"x": np.random.default_rng(0).standard_normal((1, 64)).astype(np.float32)}
    with tempfile.TemporaryDirectory(prefix="slabpool-latency-") as tmp:
        model = str(om.mlp(Path(tmp) / "mlp.onnx", in_dim=64, hidden=128, out_dim=10))
        print(f"{args.workers} workers, 64->128->10 MLP, one row per call, {args.seconds} s a cell; "
              f"{len(os.sched_getaffinity(0))} cores", flush=True)
        rows = run(args, model, item)
    report(rows)
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) | {"calls_per_s": r.rate} for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
