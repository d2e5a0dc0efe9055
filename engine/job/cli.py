"""The `slabpool` command: `run` (the batch job), `inspect`, `doctor`, `bench`.

    slabpool run MODEL INPUT -o OUTPUT    map a model over items, resumable (engine.job)
    slabpool run                          the bundled demo, end to end
    slabpool inspect MODEL                inputs/outputs, dynamic axes, runtimes available
    slabpool doctor                       shared memory, memory, CPUs, runtimes on this host
    slabpool bench MODEL                  throughput over worker counts
    slabpool serve MODEL [MODEL ...]      Open Inference Protocol over HTTP and gRPC (engine.serve)

Exit status: 0 all done; 2 done, some items failed (listed); 1 the job could not run (one line
on stderr; a traceback with --verbose); 130/143 interrupted by SIGINT/SIGTERM (resumable).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shlex
import signal
import sys
import tempfile
import time
import traceback
import warnings
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

# Light imports only up here: the signal handlers go in before numpy and the job's modules
# are imported (main), so that a Ctrl-C during those imports is the job's, not a traceback.
import slabpool
from slabpool.engine.job import signals
from slabpool.engine.job.options import batch_size as _batch_size
from slabpool.engine.job.options import columns as _columns
from slabpool.engine.job.options import columns_of
from slabpool.engine.job.options import gather as _gather
from slabpool.engine.job.options import positive_float as _positive_float
from slabpool.engine.job.options import positive_int as _positive_int
from slabpool.engine.job.options import positive_ints as _positive_ints

if TYPE_CHECKING:
    from slabpool.engine.job.spec import JobSpec

DEMO_ITEMS = 512
RUN_EXAMPLES = """\
examples:
  slabpool run                                   the bundled demo (512 random images)
  slabpool run model.onnx in.npy -o out.npy      row i of out.npy = the output for in.npy[i]
  slabpool run model.onnx in.npz -o results/     named inputs; shards + manifest in results/
  slabpool run model.tflite images/ -o out.npz --workers 8 --batch-size 4
  slabpool run model.onnx paths.txt -o out.npz --preprocess mypkg.io:load_image
  slabpool run paths.jsonl -o out.npz --preprocess mypkg.cpu:features   (no model)
  slabpool run model.onnx photos/ -o out.parquet --preprocess mypkg.io:load_image --keep path
  slabpool run model.onnx table.parquet -o scores.parquet --keep id   (columns named after inputs)
  cat items.jsonl | slabpool run model.onnx - -o out.parquet --preprocess mypkg.io:features

Rerunning the same command resumes: items already durable are skipped. Exit status: 0 all
done, 2 some items failed (OUTPUT.parts/failures.jsonl), 1 the job could not run, 130/143
interrupted (rerun to resume).
"""


class Parser(argparse.ArgumentParser):
    """Bad arguments: one line on stderr and exit status 1 (the job could not run)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(1)


def build_parser() -> Parser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = Parser(prog="slabpool", formatter_class=fmt,
               description="Run models on every core: one session per worker process, tensors "
                           "through shared memory, crashes replayed.",
               epilog="example:\n  slabpool run model.onnx in.npy -o out.npy    (slabpool run alone: the demo)")
    p.add_argument("--verbose", "-v", action="store_true", help="tracebacks and engine logs")
    p.add_argument("--version", action="version", version=f"slabpool {slabpool.__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)

    run = sub.add_parser("run", help="map a model over items (resumable); no arguments: the demo",
                         formatter_class=fmt, epilog=RUN_EXAMPLES,
                         description="Map MODEL over the items of INPUT and write OUTPUT; row i is item i.")
    run.add_argument("paths", nargs="*", metavar="MODEL INPUT",
                     help="MODEL (.onnx/.tflite; omit with --preprocess alone) and INPUT: .npy, .npz, "
                          ".parquet, .csv, .arrow/.feather, a folder (of .npy/.npz; of any files with "
                          "--preprocess), .jsonl/.txt lines for --preprocess, or - for stdin")
    run.add_argument("-o", "--output", type=Path, help="a folder, or a single .npy/.npz/.parquet file")
    run.add_argument("--workers", type=_positive_int, help="worker processes (default: usable CPUs)")
    run.add_argument("--batch-size", type=_batch_size, default=None, metavar="B|auto",
                     help="rows of .npy/.npz/tables per model call (default: calls of ~2 ms, from the measured "
                          "time per row; a task holds ~30 ms of calls); for other inputs, items stacked into one "
                          "model call (default 1); with --batched, items per hook call (default 64); auto: the default")
    run.add_argument("--preprocess", metavar="MOD:FN", help="runs in the workers: item -> model feeds")
    run.add_argument("--postprocess", metavar="MOD:FN", help="runs in the workers: (outputs, item) -> row(s)")
    run.add_argument("--batched", action="store_true",
                     help="hooks take a list of items: preprocess(items) -> stacked feeds, "
                          "postprocess(outputs, items) -> one result per item (or set fn.batched = True)")
    run.add_argument("--keep", metavar="COL[,COL...]", type=_columns, default=(),
                     help="copy input columns to a .parquet OUTPUT (a table's columns; path for a folder; "
                          "line for text/JSONL)")
    run.add_argument("--columns", metavar="INPUT=COL,COL,...", type=_gather, action="append", default=[],
                     help="a table's columns, in this order, side by side as the model input INPUT (rows "
                          "[N, columns]; repeat for several inputs); without a hook")
    run.add_argument("--max-failures", metavar="N|P%",
                     help="stop (exit 1) after N failed items or P%% of those settled (default: stop when "
                          "the first 100 all fail)")
    run.add_argument("--text", action="store_true", help="INPUT lines are raw strings, not JSON (stdin, .jsonl)")
    again = run.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="require a previous run to continue")
    again.add_argument("--overwrite", action="store_true", help="forget previous results in OUTPUT")
    run.add_argument("--start-method", choices=("forkserver", "spawn"), default="forkserver")
    run.add_argument("--max-attempts", type=_positive_int, default=3,
                     help="worker deaths an item may cause before it is listed as failed (default 3)")
    run.add_argument("--task-timeout", type=_positive_float, help="seconds an item may run")
    run.add_argument("--durable-every", type=_positive_float, default=1.0,
                     help="seconds between commits of results (default 1)")
    run.add_argument("--log-every", type=_positive_float, default=2.0,
                     help="seconds between progress lines when stderr is not a terminal (default 2)")
    run.add_argument("--verbose", "-v", action="store_true", default=argparse.SUPPRESS)
    run.set_defaults(func=cmd_run)

    ins = sub.add_parser("inspect", help="a model's inputs, outputs and runtime", formatter_class=fmt,
                         epilog="example:\n  slabpool inspect model.onnx")
    ins.add_argument("model", type=Path, metavar="MODEL")
    ins.add_argument("--verbose", "-v", action="store_true", default=argparse.SUPPRESS)
    ins.set_defaults(func=cmd_inspect)

    doc = sub.add_parser("doctor", help="what this host offers: shared memory, CPUs, runtimes",
                         formatter_class=fmt, epilog="example:\n  slabpool doctor\n  slabpool doctor model.onnx --workers 4")
    doc.add_argument("model", type=Path, metavar="MODEL", nargs="?",
                     help="also start WORKERS workers on MODEL and show each one's RSS, PSS and shared bytes")
    doc.add_argument("--workers", type=_positive_int, default=2, help="workers started on MODEL (default 2)")
    doc.add_argument("--verbose", "-v", action="store_true", default=argparse.SUPPRESS)
    doc.set_defaults(func=cmd_doctor)

    bench = sub.add_parser("bench", help="throughput over worker counts, on random inputs",
                           formatter_class=fmt, epilog="example:\n  slabpool bench model.onnx --items 512 --workers 1,2,4")
    bench.add_argument("model", type=Path, metavar="MODEL")
    bench.add_argument("--items", type=_positive_int, default=256, help="items per worker count (default 256)")
    bench.add_argument("--workers", type=_positive_ints,
                       help="comma-separated worker counts (default 1,2,4,... up to usable CPUs)")
    bench.add_argument("--verbose", "-v", action="store_true", default=argparse.SUPPRESS)
    bench.set_defaults(func=cmd_bench)

    from slabpool.engine.serve.cli import add_parser as add_serve_parser  # argparse only: stays light

    add_serve_parser(sub, formatter_class=fmt)
    return p


def main(argv: list[str] | None = None) -> int:
    """The `slabpool` command; `argv=None` means this process is the command (sys.argv): its
    signal handlers then stay until it exits (engine.job.signals says what a signal does when)."""
    as_command = argv is None
    argv = sys.argv[1:] if argv is None else list(argv)
    with signals.interrupts(exit_now=as_command) as intr:
        try:
            return _command(build_parser(), argv, intr)
        except signals.Interrupted as exc:  # by a signal during the imports
            print(f"slabpool: interrupted ({exc}) before the job started; nothing was written", file=sys.stderr)
            return exc.status


def _command(parser: Parser, argv: list[str], intr: signals.Interrupts) -> int:
    args = parser.parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    warnings.formatwarning = lambda message, *_, **__: f"slabpool: warning: {message}\n"
    if os.getcwd() not in sys.path:  # hook modules resolve from the current folder, as `python -m` does
        sys.path.insert(0, os.getcwd())
    if args.command is None:
        parser.print_help()
        return 0
    signals.hold("imports")
    import slabpool.engine.job.run  # noqa: F401 - numpy and the job's modules, a signal counted meanwhile
    from slabpool.engine.job.sources import JobError
    from slabpool.workers.errors import EngineError

    intr.check()
    if args.command != "run":  # no job to stop cleanly: Ctrl-C is KeyboardInterrupt, SIGTERM ends it
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        return int(args.func(args, argv))
    except KeyboardInterrupt:  # outside the job's own handlers: no traceback
        print(f"slabpool {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `slabpool inspect m.onnx | head -1`: the reader left; say nothing
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader left
    except (JobError, EngineError, OSError, ValueError, TypeError, ImportError) as exc:
        if args.verbose:
            traceback.print_exc()
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        print(f"slabpool {args.command}: error: {first}", file=sys.stderr)
        return 1


# -- run -------------------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace, argv: list[str]) -> int:
    from slabpool.engine.job.sources import JobError
    from slabpool.engine.job.spec import JobSpec

    paths = [Path(p) for p in args.paths]
    if not paths and args.output is None and args.preprocess is None:
        return run_demo(args)
    if len(paths) > 2:
        raise JobError(f"expected MODEL INPUT, got {len(paths)} paths")
    if len(paths) == 1 and args.preprocess is None:
        raise JobError("missing INPUT (only --preprocess may stand in for MODEL)")
    if not paths:
        raise JobError("missing INPUT")
    model, data = (None, paths[0]) if len(paths) == 1 else (paths[0], paths[1])
    if args.output is None:
        raise JobError("missing -o OUTPUT (a folder, or a .npy/.npz/.parquet file)")
    if model is not None and not model.is_file():
        raise JobError(f"model not found: {model}")
    spec = JobSpec(
        model=model, input=data, output=args.output, workers=args.workers, batch_size=args.batch_size,
        preprocess=args.preprocess, postprocess=args.postprocess, resume=args.resume,
        overwrite=args.overwrite, start_method=args.start_method, max_attempts=args.max_attempts,
        task_timeout=args.task_timeout, durable_every=args.durable_every, log_every=args.log_every,
        command=resume_command(argv), keep=args.keep, batched=args.batched, max_failures=args.max_failures,
        text=args.text, columns=columns_of(args.columns),
    )
    return _report_run(spec)


def resume_command(argv: list[str]) -> str:
    """The command that resumes this run: as typed, less --overwrite (which would wipe the work)."""
    return shlex.join(["slabpool", *(a for a in argv if a != "--overwrite")])


def _report_run(spec: JobSpec) -> int:
    from slabpool.engine.job.report import summary
    from slabpool.engine.job.run import run_job

    try:
        outcome = run_job(spec)
    except signals.Interrupted as exc:  # at start-up, before any item was sent
        _interrupted(spec, exc.status)
        return exc.status
    for line in summary(outcome):
        print(line)
    if outcome.error is not None:
        print(f"slabpool run: error: {outcome.error}", file=sys.stderr)
    if outcome.status in (130, 143):
        _interrupted(spec, outcome.status)
    return outcome.status


def _interrupted(spec: JobSpec, status: int) -> None:
    if not (spec.parts / "manifest.json").exists():
        print("slabpool: interrupted before the job started; nothing was written", file=sys.stderr)
        return
    same = " (with the same input on stdin)" if spec.stdin else ""
    print(f"slabpool: interrupted; results so far are durable in {spec.parts}. "
          f"Resume with: {spec.command}{same}", file=sys.stderr)


def demo_model() -> Path:
    return Path(__file__).parent.parent / "data" / "demo.onnx"


def demo_folder() -> Path:
    """./slabpool-demo when the working folder is writable, else a fresh temporary folder."""
    folder = Path.cwd() / "slabpool-demo"
    try:
        folder.mkdir(exist_ok=True)
        if os.access(folder, os.W_OK):
            return folder
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="slabpool-demo-"))


def run_demo(args: argparse.Namespace) -> int:
    import numpy as np

    from slabpool.engine.job.spec import JobSpec
    from slabpool.engine.job.store import write_atomic

    folder = demo_folder()
    inputs = folder / "inputs.npy"
    shape = (DEMO_ITEMS, 3, 112, 112)
    try:
        ok = np.load(inputs, mmap_mode="r").shape == shape
    except (OSError, ValueError):
        ok = False
    if not ok:
        x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
        write_atomic(inputs, lambda f: np.save(f, x))
    print(f"demo: {DEMO_ITEMS} random 3x112x112 images in {inputs}, model {demo_model()}")
    spec = JobSpec(model=demo_model(), input=inputs, output=folder / "outputs.npy", workers=args.workers,
                   batch_size=args.batch_size, overwrite=True, command="slabpool run")
    status = _report_run(spec)
    if status == 0:
        probs = np.load(spec.output, mmap_mode="r")
        print(f"demo: {spec.output} holds {probs.shape[0]} rows of class probabilities {probs.shape[1:]}; "
              f"item 0 is class {int(np.argmax(probs[0]))}")
    return status


# -- inspect ---------------------------------------------------------------------------------------


def _dims(shape: tuple[int | None, ...]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def cmd_inspect(args: argparse.Namespace, argv: list[str]) -> int:
    import numpy as np

    from slabpool.engine.job.sources import JobError
    from slabpool.engine.local.pool import Engine

    if not args.model.is_file():
        raise JobError(f"model not found: {args.model}")
    with Engine(str(args.model), workers=1) as eng:
        d, st = eng.describe(), eng.stats()
    print(f"model    {args.model}  (version {d.model_version})")
    print(f"runtime  {d.runtime} {d.runtime_version}; in use: {', '.join(st.slots[0].applied) or '-'}")
    for title, specs in (("inputs", d.inputs), ("outputs", d.outputs)):
        print(f"{title}:")
        for s in specs:
            dyn = [i for i, n in enumerate(s.shape) if n is None]
            print(f"  {s.name:<20} {np.dtype(s.dtype).name:<8} {_dims(s.shape):<20} "
                  f"dynamic axes: {dyn or 'none'}")
    print(f"batchable (one dynamic axis 0, the batch, on every input): {'yes' if d.batchable else 'no'}")
    for line in _runtimes():
        print(line)
    return 0


def _runtimes() -> list[str]:
    lines = []
    try:
        import onnxruntime

        lines.append(f"onnxruntime {onnxruntime.__version__}: providers {', '.join(onnxruntime.get_available_providers())}")
    except ImportError:
        lines.append("onnxruntime: not installed")
    for mod, dist in (("ai_edge_litert", "ai-edge-litert"), ("tflite_runtime", "tflite-runtime")):
        found = importlib.util.find_spec(mod) is not None
        lines.append(f"{dist}: {_version(dist) if found else 'not installed'}"
                     + ("; delegates: XNNPACK (default), external by path" if found else ""))
    return lines


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "installed (version unknown)"


# -- doctor ----------------------------------------------------------------------------------------


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def cmd_doctor(args: argparse.Namespace, argv: list[str]) -> int:
    import numpy as np

    from slabpool.engine.core.config import usable_cpus

    try:
        vfs = os.statvfs("/dev/shm")
        print(f"/dev/shm        size {_mib(vfs.f_blocks * vfs.f_frsize)}, free {_mib(vfs.f_bavail * vfs.f_frsize)} "
              "(used only with shm_backend='posix'; the default memfd arenas count against memory)")
    except OSError as exc:
        print(f"/dev/shm        unavailable ({exc})")
    meminfo = dict(ln.split(":", 1) for ln in (_read("/proc/meminfo") or "").splitlines() if ":" in ln)
    avail = meminfo.get("MemAvailable", "").split()
    print(f"MemAvailable    {_mib(int(avail[0]) * 1024) if avail else 'unknown'}")
    mem_max = _read("/sys/fs/cgroup/memory.max")
    if mem_max is None:
        print("cgroup memory   n/a (no cgroup v2 memory controller here)")
    else:
        print(f"cgroup memory   {'no limit' if mem_max == 'max' else _mib(int(mem_max))} (memory.max)")
    affinity = len(os.sched_getaffinity(0))
    print(f"CPUs            {affinity} in affinity, cgroup cpu.max {_read('/sys/fs/cgroup/cpu.max') or 'n/a'}; "
          f"usable: {usable_cpus()} (the default --workers)")
    print(f"numpy           {np.__version__}")
    for line in _runtimes():
        print(line)
    if importlib.util.find_spec("tflite_runtime") and int(np.__version__.split(".")[0]) >= 2:
        print("note            tflite-runtime needs numpy<2; with numpy 2 use ai-edge-litert (pip install ai-edge-litert)")
    else:
        print("note            ai-edge-litert works with numpy 1 and 2; tflite-runtime needs numpy<2")
    print(_weight_cache_line())
    if args.model is not None:
        _doctor_model(args.model, args.workers)
    return 0


def _weight_cache_line() -> str:
    from slabpool.workers.weights import default_cache_dir

    root = Path(default_cache_dir())
    entries = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")] if root.is_dir() else []
    size = sum(f.stat().st_size for e in entries for f in e.rglob("*") if f.is_file())
    return (f"weight cache    {root}: {len(entries)} entries, {_mib(size)} (set SLABPOOL_CACHE_DIR or "
            "cache_dir= to move it)")


def _doctor_model(model: Path, workers: int) -> None:
    """Start `workers` workers on `model`, run each once, print each one's memory."""
    import numpy as np

    from slabpool.engine.job.sources import JobError
    from slabpool.engine.local.pool import Engine

    if not model.is_file():
        raise JobError(f"model not found: {model}")
    with Engine(str(model), workers=workers) as eng:
        item = random_item(eng.describe().inputs, np.random.default_rng(0))
        for _ in range(100):  # until every worker has run (its weights are then resident)
            for _ in eng.map([item] * (2 * workers)):
                pass
            if all(s.tasks_done for s in eng.stats().slots):
                break
        st = eng.stats()
        print(f"model           {model}: version {eng.model_version}; weights: {eng.describe().weights}")
        for s in st.slots:
            print(f"  worker #{s.slot}     pid {s.pid}: RSS {_mib(s.rss_bytes)}, PSS {_mib(s.pss_bytes)}, "
                  f"shared {_mib(s.shared_bytes)}")
        print(f"  all workers   PSS {_mib(sum(s.pss_bytes for s in st.slots))} in total")


# -- bench -----------------------------------------------------------------------------------------


def random_item(specs: Any, rng: Any) -> dict[str, Any]:
    """One item matching `describe()`: batch axis 1, other dynamic axes 8 (rng: numpy's Generator)."""
    import numpy as np

    feeds = {}
    for s in specs:
        shape = tuple((1 if i == 0 else 8) if d is None else d for i, d in enumerate(s.shape))
        dt = np.dtype(s.dtype)
        if dt.kind == "f":
            feeds[s.name] = rng.standard_normal(shape).astype(dt)
        elif dt.kind == "b":
            feeds[s.name] = rng.integers(0, 2, shape).astype(dt)
        else:
            feeds[s.name] = rng.integers(0, 10, shape).astype(dt)
    return feeds


def cmd_bench(args: argparse.Namespace, argv: list[str]) -> int:
    import numpy as np

    from slabpool.engine.core.config import usable_cpus
    from slabpool.engine.job.sources import JobError
    from slabpool.engine.local.pool import Engine

    if not args.model.is_file():
        raise JobError(f"model not found: {args.model}")
    cpus = usable_cpus()
    counts = args.workers or sorted({*(2**k for k in range(8) if 2**k <= cpus), cpus})
    rng = np.random.default_rng(0)
    pool: list[dict[str, Any]] = []
    base = 0.0
    print(f"{'workers':>8} {'items/s':>10} {'speedup':>8}   ({args.items} items, {cpus} usable CPUs)")
    for w in counts:
        with Engine(str(args.model), workers=w, queue_capacity=4 * w) as eng:
            if not pool:
                pool = [random_item(eng.describe().inputs, rng) for _ in range(16)]
            for _ in eng.map(pool[: 2 * w]):  # warm-up: every worker has run once
                pass
            t0 = time.perf_counter()
            for _ in eng.map(pool[i % len(pool)] for i in range(args.items)):
                pass
            rate = args.items / (time.perf_counter() - t0)
        base = base or rate
        print(f"{w:>8} {rate:>10.1f} {rate / base:>7.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
