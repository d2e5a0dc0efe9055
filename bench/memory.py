"""Memory: what a slabpool worker holds beyond the session itself, and one copy of the weights.

The session's own cost is measured in a fresh process (spawn): RSS after importing numpy and
onnxruntime, then after building the session and running a few items. A slabpool worker's RSS
(sampled during the timed run) minus that process's RSS is slabpool's per-worker overhead.

`python -m bench.memory` (issue 23's workload) builds a large MLP with its weights as external
data, starts 1, 2 and 4 workers on it with shared weights and without (share_weights=False), and
prints the workers' total PSS against one copy of the weights plus a per-worker overhead, and
the throughput ratio shared / unshared (timed alternately, one engine at a time). It also times
the first start on a new model (the one-time conversion into the cache) against a cold start of
one worker that loads the model as given. Defaults fit a 2-core, 24 GB machine in about a minute;
`--mib 480` is the issue's model.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any


@dataclass
class MemoryFigures:
    workload: str
    bare_process_bytes: int = 0  # python + numpy + onnxruntime imported, no session
    session_bytes: int = 0  # RSS growth from building the session and running 3 items
    slabpool_worker_bytes: int = 0  # peak RSS of one slabpool worker, arena pages excluded
    slabpool_worker_shm_bytes: int = 0  # peak of the arena pages counted in that worker's RSS
    overhead_bytes: int = 0  # slabpool worker (arena pages excluded) - (bare process + session)
    shm_in_use_peak_bytes: int = 0  # both arenas, peak during the timed run
    shm_capacity_bytes: int = 0  # both arenas: the configured bound
    workers: int = 0
    error: str = ""


def session_cost(model: str, item: Any) -> tuple[int, int]:
    """(bare process RSS, session RSS growth), measured in a fresh spawned process."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        return ex.submit(_session_cost, model, item).result()  # type: ignore[no-any-return]


def _session_cost(model: str, item: Any) -> tuple[int, int]:
    import onnxruntime  # noqa: F401  (part of the bare process)
    import psutil

    from bench.contenders.remote import init_session, run_item

    me = psutil.Process()
    bare = me.memory_info().rss
    init_session(model)
    for _ in range(3):
        run_item(item)
    return bare, me.memory_info().rss - bare


def memory_figures(workload: str, model: str, item: Any, slabpool_extras: dict[str, float],
                   workers: int) -> MemoryFigures:
    fig = MemoryFigures(workload, workers=workers)
    try:
        fig.bare_process_bytes, fig.session_bytes = session_cost(model, item)
    except Exception as exc:
        fig.error = f"{type(exc).__name__}: {exc}"
        return fig
    fig.slabpool_worker_shm_bytes = int(slabpool_extras.get("worker_rss_shmem_bytes", 0))
    fig.slabpool_worker_bytes = int(slabpool_extras.get("worker_private_rss_bytes", 0))
    if fig.slabpool_worker_bytes:
        fig.overhead_bytes = fig.slabpool_worker_bytes - fig.bare_process_bytes - fig.session_bytes
    fig.shm_in_use_peak_bytes = int(slabpool_extras.get("shm_in_use_bytes", 0))
    fig.shm_capacity_bytes = int(slabpool_extras.get("shm_capacity_bytes", 0))
    return fig


# -- issue 23: one copy of the weights ------------------------------------------------------------

MiB = 1 << 20


def big_mlp(path: str, mib: int, dim: int) -> int:
    """An MLP of (MatMul dim x dim + Add + Relu) layers, about `mib` MiB of float32 weights, all
    in one external data file next to `path`; returns the weights' bytes."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    layers = max(1, mib * MiB // (dim * dim * 4))
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        w = (rng.standard_normal((dim, dim)) / np.sqrt(dim)).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(np.zeros(dim, np.float32), f"b{i}")]
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]), helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
                  helper.make_node("Relu", [f"a{i}"], [f"h{i}"])]
        x = f"h{i}"
    graph = helper.make_graph(nodes, "big_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", dim])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", dim])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save_model(model, path, save_as_external_data=True, location=os.path.basename(path) + ".data",
                    size_threshold=1024)
    return layers * (dim * dim + dim) * 4


@dataclass
class PoolMemory:
    workers: int
    shared: bool
    pss_total: int
    rss_total: int
    items_per_s: float


def pool_memory(model: str, workers: int, shared: bool, cache: str, items: int, dim: int) -> PoolMemory:
    import numpy as np

    from slabpool import Engine

    x = {"x": np.ones((1, dim), np.float32)}
    with Engine(model, workers=workers, share_weights=shared, cache_dir=cache) as eng:
        for _ in range(100):  # every worker has run (its weights are resident), then the timed run
            for f in [eng.submit(x) for _ in range(2 * workers)]:
                f.result()
            if all(s.tasks_done for s in eng.stats().slots):
                break
        t0 = time.perf_counter()
        for _ in eng.map(x for _ in range(items)):
            pass
        rate = items / (time.perf_counter() - t0)
        st = eng.stats()
    return PoolMemory(workers, shared, sum(s.pss_bytes for s in st.slots), sum(s.rss_bytes for s in st.slots), rate)


def start_times(model: str, cache: str) -> tuple[float, float, float]:
    """(first start with the conversion, a start from the cache, a cold start as given) of one worker, s."""
    from slabpool import Engine

    def timed(**kw: object) -> float:
        t0 = time.perf_counter()
        with Engine(model, workers=1, cache_dir=cache, **kw):  # type: ignore[arg-type]
            return time.perf_counter() - t0

    first = timed()
    return first, timed(), timed(share_weights=False)


def demo_batch_sizes(sizes: list[str], repeats: int) -> None:
    """The demo job (`slabpool run`, 512 images) at each --batch-size: items/s and each worker's
    peak RSS, from its report.json; sizes alternate, `repeats` rounds."""
    import json
    import subprocess
    import sys

    rows: dict[str, list[tuple[float, int]]] = {s: [] for s in sizes}
    for _ in range(repeats):
        for size in sizes:
            with tempfile.TemporaryDirectory(prefix="slabpool-demo-") as d:
                flag = [] if size == "auto" else ["--batch-size", size]  # auto: the job's default
                subprocess.run([sys.executable, "-m", "slabpool", "run", *flag], cwd=d, check=True, capture_output=True)
                (report,) = [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs if f == "report.json"]
                rep = json.load(open(report))
            rows[size].append((rep["throughput_items_per_s"], max(s["peak_rss_bytes"] for s in rep["slots"])))
    print(f"{'--batch-size':>12} | {'items/s':>17} | {'worker peak RSS':>17}")
    for size, got in rows.items():
        rates, rss = [g[0] for g in got], [g[1] for g in got]
        print(f"{size:>12} | {min(rates):>7.0f} - {max(rates):<7.0f} | {min(rss) / MiB:>6.0f} - {max(rss) / MiB:<6.0f} MiB")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.split("\n\n")[2])
    ap.add_argument("--mib", type=int, default=128, help="MiB of weights (the issue's model: 480)")
    ap.add_argument("--dim", type=int, default=2048, help="width of each layer")
    ap.add_argument("--workers", default="1,2,4", help="worker counts, comma-separated")
    ap.add_argument("--items", type=int, default=200, help="items timed per engine (one row each)")
    ap.add_argument("--batch-sizes", metavar="S,S,...", help="instead: the demo job at each --batch-size "
                    "(e.g. auto,8,32,256), items/s and worker peak RSS")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of --batch-sizes, alternating")
    args = ap.parse_args(argv)
    if args.batch_sizes:
        demo_batch_sizes(args.batch_sizes.split(","), args.repeats)
        return 0
    with tempfile.TemporaryDirectory(prefix="slabpool-bench-memory-") as d:
        model = os.path.join(d, "big.onnx")
        weights = big_mlp(model, args.mib, args.dim)
        cache = os.path.join(d, "cache")
        first, cached, cold = start_times(model, cache)
        print(f"model: {weights / MiB:.0f} MiB of weights (external data), {args.dim} wide")
        print(f"start of one worker: first (converts into the cache) {first:.2f} s, from the cache {cached:.2f} s, "
              f"as given {cold:.2f} s: the conversion costs {first / cold:.2f}x a cold start")
        print(f"{'workers':>7} | {'shared: PSS total':>17} {'1 copy + N x over':>18} | {'unshared: PSS total':>19} | "
              f"{'items/s shared/unshared':>24}")
        for n in (int(w) for w in args.workers.split(",")):
            a = pool_memory(model, n, True, cache, args.items, args.dim)
            b = pool_memory(model, n, False, cache, args.items, args.dim)
            over = (a.pss_total - weights) / n
            print(f"{n:>7} | {a.pss_total / MiB:>13.0f} MiB {weights / MiB:>6.0f} + {n} x {over / MiB:>4.0f} MiB | "
                  f"{b.pss_total / MiB:>15.0f} MiB | {a.items_per_s:>8.0f} / {b.items_per_s:<8.0f} = "
                  f"{a.items_per_s / b.items_per_s:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
