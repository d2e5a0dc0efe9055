"""Engine settings: one frozen, validated record. A bad setting fails here, by name."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import pickle
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

from slabpool.workers.session import Backend, SessionSpec, detect_backend, model_digest
from slabpool.workers.weights import default_cache_dir

MiB = 1 << 20
Admission = Literal["block", "reject", "drop_oldest"]  # what a caller writes: admission="reject"


class AdmissionPolicy(StrEnum):
    """What a full queue does to a new task (engine.core.admission.TaskQueue.reserve)."""

    BLOCK = "block"  # the caller waits for room (up to its block_timeout)
    REJECT = "reject"  # QueueFull at once; nothing accepted
    DROP_OLDEST = "drop_oldest"  # the oldest queued task is cancelled to make room

    @classmethod
    def of(cls, value: Any) -> AdmissionPolicy:
        """The policy a setting names; ValueError naming every choice for anything else."""
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(p.value) for p in cls)
            raise ValueError(f"admission must be one of {choices}, got {value!r}") from None


def usable_cpus() -> int:
    """CPUs this process may run on: affinity, then the cgroup v2 quota."""
    n = len(os.sched_getaffinity(0))
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()
        if quota != "max":
            n = min(n, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return n


@dataclass(frozen=True)
class EngineConfig:
    model: str | None
    workers: int
    start_method: str = "forkserver"
    backend: Backend | None = None
    providers: tuple[Any, ...] | None = None
    delegate: str | None = None
    delegate_options: dict[str, str] = field(default_factory=dict)
    allow_fallback: bool = False
    threads_per_worker: int = 1
    preprocess: Callable[..., Any] | None = None
    postprocess: Callable[..., Any] | None = None
    initializer: Callable[..., Any] | None = None
    initargs: tuple[Any, ...] = ()
    queue_capacity: int = 0
    admission: AdmissionPolicy = AdmissionPolicy.BLOCK
    max_attempts: int = 3
    task_timeout: float | None = None
    max_tasks_per_worker: int | None = None
    worker_memory_limit: int | None = None
    seed: int = 0
    max_batch_size: int = 1
    max_batch_wait_ms: float = 2.0
    inflight_per_slot: int = 2
    # ONNX Runtime writes a task's outputs straight into shared memory (IO binding) when they
    # take at least this many bytes; None: never. Binding costs ~50 us per run (measured), a
    # copy of 1 MiB about as much: below that the plain run and one copy are faster.
    in_place_min_bytes: int | None = MiB
    shm_capacity: int = 0  # bytes per arena (inputs, outputs); 0: the default
    queue_bytes: int = 64 * MiB  # input bytes that may wait in the queue (one task always fits)
    shm_backend: Literal["memfd", "posix"] = "memfd"
    startup_timeout: float = 120.0
    # a slot whose running batch has made no progress this long (a stopped process, a native
    # deadlock) gets a warning, no more work, and what was sent ahead to it runs elsewhere
    stall_after: float = 10.0
    # a call that finds the engine idle (its slot lent to its caller): the caller polls for the
    # answer, and the worker after answering for the next call, this long before sleeping
    # (two process wake-ups a call saved, ~35 us each on a 2-core VM; 0: always sleep)
    spin_us: float = 250.0
    fault_injection: bool = False
    # every worker loads one shared, memory-mapped copy of the weights where that is exact
    # (ONNX Runtime, CPU provider: its prepacked form), made once into `cache_dir`
    share_weights: bool = True
    cache_dir: str | None = None  # None: the user cache dir (workers.weights.default_cache_dir)
    model_digest: str = ""  # the version pinned at start: every slot loads exactly it
    pool_shape: str = ""  # workers="auto": the shape chosen and why (engine.core.shape)

    def session_spec(self) -> SessionSpec | None:
        if self.model is None:
            return None
        return SessionSpec(
            path=self.model,
            backend=self.backend or detect_backend(self.model),
            providers=self.providers,
            delegate=self.delegate,
            delegate_options=dict(self.delegate_options),
            allow_fallback=self.allow_fallback,
            threads=self.threads_per_worker,
            digest=self.model_digest,
            cache_dir=self.cache_dir or default_cache_dir(),
            share_weights=self.share_weights,
        )


def runtime_settings(backend: str, providers: Any, delegate: Any, delegate_options: Any,
                     reload: str | None = None) -> None:
    """The runtime's own settings apply to its models alone: `providers` to ONNX Runtime,
    `delegate` and `delegate_options` to LiteRT. Given for the other runtime's model, a
    ValueError (was: ignored, and the model ran on the CPU path without a word); at a
    `reload` of that model (its path), the engine's settings are what was given."""
    if backend == "onnxruntime" and (delegate is not None or delegate_options):
        setting, whose, model = f"delegate={delegate!r} / delegate_options", "LiteRT settings", "an ONNX model"
        fix = "give ONNX Runtime's execution providers with providers=[...]"
    elif backend == "litert" and providers is not None:
        setting, whose = f"providers={list(providers)!r}", "ONNX Runtime's execution providers"
        model, fix = "a LiteRT (.tflite) model", "give a LiteRT delegate with delegate=..."
    else:
        return
    if reload is not None:
        raise ValueError(f"cannot reload {reload}: it is {model}, and this engine was built with {setting} ({whose}), "
                         "which a reload keeps: build a new engine for this model (nothing was swapped)")
    raise ValueError(f"{setting} are {whose}, and the model is {model}: {fix}")


def resolve(model: str | os.PathLike[str] | None, **kw: Any) -> EngineConfig:
    """Validate and fill defaults; raise ValueError/TypeError naming the setting."""
    if kw.get("workers") == "auto":
        return _auto_shape(model, kw)
    path = os.fspath(model) if model is not None else None
    if path is not None and not os.path.isfile(path):
        raise FileNotFoundError(f"model file not found: {path}")
    if path is not None:  # a worker or a Ray actor may run in another folder: it opens this file
        path = os.path.abspath(path)
    if path is None and kw.get("preprocess") is None:
        raise ValueError("model=None needs a preprocess function: it is then the whole task")
    workers = kw.pop("workers", None)
    workers = usable_cpus() if workers is None else workers
    _positive("workers", workers)
    if workers > usable_cpus():
        warnings.warn(
            f"workers={workers} but this process may use {usable_cpus()} CPUs (affinity and cgroup "
            "quota): the extra workers share cores, which adds memory and rarely throughput",
            stacklevel=3,
        )
    sm = kw.get("start_method", "forkserver")
    if sm == "fork":
        raise ValueError(
            "start_method='fork' is refused: forking a process that has threads (the supervisor, "
            "onnxruntime's pools) can deadlock or crash the child; use 'forkserver' or 'spawn'"
        )
    if sm not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {sm!r}")
    backend = kw.pop("backend", "auto")
    if backend not in ("auto", "onnxruntime", "litert"):
        raise ValueError(f"backend must be 'auto', 'onnxruntime' or 'litert', got {backend!r}")
    kw["backend"] = None if backend == "auto" else backend
    if kw.get("providers") is not None:
        kw["providers"] = tuple(kw["providers"])
    kw["admission"] = AdmissionPolicy.of(kw.get("admission", "block"))
    if kw.get("shm_backend", "memfd") not in ("memfd", "posix"):
        raise ValueError(f"shm_backend must be 'memfd' or 'posix', got {kw['shm_backend']!r}")
    for name in ("preprocess", "postprocess", "initializer"):
        kw[name] = importable(name, kw.get(name))
    # deep enough that a busy engine can send tasks to a worker in groups (engine.admission)
    kw["queue_capacity"] = kw.get("queue_capacity") or 16 * workers
    for name in ("queue_capacity", "max_attempts", "threads_per_worker", "max_batch_size", "inflight_per_slot"):
        if name in kw:
            _positive(name, kw[name])
    ipm = kw.get("in_place_min_bytes", MiB)
    if ipm is not None and (not isinstance(ipm, int) or ipm < 0):
        raise ValueError(f"in_place_min_bytes must be a number of bytes >= 0 or None, got {ipm!r}")
    _check_limits(kw)
    cap = kw.get("shm_capacity") or max(256 * MiB, 32 * MiB * workers)
    kw["shm_capacity"] = cap
    kw["initargs"] = tuple(kw.get("initargs", ()))
    kw["delegate_options"] = dict(kw.get("delegate_options") or {})
    if path is not None:
        runtime_settings(kw["backend"] or detect_backend(path), kw.get("providers"), kw.get("delegate"),
                         kw["delegate_options"])
    _check_weights(kw)
    kw["model_digest"] = model_digest(path) if path is not None else ""
    return EngineConfig(model=path, workers=workers, **kw)


def _auto_shape(model: str | os.PathLike[str] | None, kw: dict[str, Any]) -> EngineConfig:
    """workers="auto": settings checked (and the model pinned) first, then a probe of the model
    on this host chooses workers x threads (engine.core.shape); `pool_shape` says why."""
    from slabpool.engine.core.shape import choose

    given = kw.get("threads_per_worker")
    first = resolve(model, **{**kw, "workers": 1})
    shape = choose(first.session_spec(), usable_cpus(), given if given not in (None, 1) else None)
    cfg = resolve(model, **{**kw, "workers": shape.workers, "threads_per_worker": shape.threads})
    return dataclasses.replace(cfg, pool_shape=shape.why)


def _check_weights(kw: dict[str, Any]) -> None:
    for name in ("model_digest", "pool_shape"):
        if name in kw:
            raise TypeError(f"{name} is not a setting: the engine finds it out")
    if not isinstance(kw.get("share_weights", True), bool):
        raise ValueError(f"share_weights must be True or False, got {kw['share_weights']!r}")
    cache = kw.get("cache_dir")
    if cache is not None:
        if not isinstance(cache, (str, os.PathLike)):
            raise ValueError(f"cache_dir must be None (the user cache dir) or a folder path, got {cache!r}")
        kw["cache_dir"] = os.path.abspath(os.fspath(cache))


MAX_SPIN_US = 10_000.0  # more is a core held, not a wake-up saved
MIN_SHM = 1 * MiB  # an arena smaller than this holds nothing useful (and the status words)


def _check_limits(kw: dict[str, Any]) -> None:
    """Times and sizes: a ValueError that names the setting and its range (NaN, 0 or a
    negative time would make every task time out, or kill the supervisor's timer)."""
    timeout = kw.get("task_timeout")
    if timeout is not None and not _number(timeout, lo=0.0, lo_open=True):
        raise ValueError(f"task_timeout must be None (no limit) or a finite number of seconds > 0, got {timeout!r}")
    for name in ("worker_memory_limit", "max_tasks_per_worker"):
        value = kw.get(name)
        if value is not None and not _number(value, lo=0.0, lo_open=True, integral=True):
            raise ValueError(f"{name} must be None (no limit) or a positive integer, got {value!r}")
    if "stall_after" in kw and not _number(kw["stall_after"], lo=0.0, lo_open=True):
        raise ValueError(f"stall_after must be a finite number of seconds > 0, got {kw['stall_after']!r}")
    if "spin_us" in kw and not _number(kw["spin_us"], lo=0.0, hi=MAX_SPIN_US):
        raise ValueError(f"spin_us must be a number of microseconds in [0, {MAX_SPIN_US:g}], got {kw['spin_us']!r}")
    if "startup_timeout" in kw and not _number(kw["startup_timeout"], lo=0.0, lo_open=True):
        raise ValueError(f"startup_timeout must be a finite number of seconds > 0, got {kw['startup_timeout']!r}")
    if "max_batch_wait_ms" in kw and not _number(kw["max_batch_wait_ms"], lo=0.0):
        raise ValueError(f"max_batch_wait_ms must be a finite number of milliseconds >= 0, got {kw['max_batch_wait_ms']!r}")
    if "queue_bytes" in kw and not _number(kw["queue_bytes"], lo=0.0, integral=True):
        raise ValueError(f"queue_bytes must be a number of bytes >= 0 (0: no limit), got {kw['queue_bytes']!r}")
    cap = kw.get("shm_capacity", 0)
    if not _number(cap, lo=0.0, integral=True) or 0 < cap < MIN_SHM:
        raise ValueError(f"shm_capacity must be 0 (the default) or a number of bytes >= {MIN_SHM} (1 MiB), got {cap!r}")
    seed = kw.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")


def _number(value: Any, *, lo: float, lo_open: bool = False, integral: bool = False, hi: float = math.inf) -> bool:
    """A real, finite number (not a bool) above `lo` and at most `hi`; an int when `integral`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if integral and not isinstance(value, int):
        return False
    if not math.isfinite(value):
        return False
    return (value > lo if lo_open else value >= lo) and value <= hi


def seconds(name: str, value: Any, at_least: float = -math.inf) -> None:
    """A time argument: None, or a real number of seconds (infinity allowed, NaN not: it reached
    the owner thread's wait and stopped the engine, every caller's task failing with it; a bool
    read as 1 s). Raises naming the argument and what was got."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds or None, got {value!r}")
    if math.isnan(value) or value < at_least:
        raise ValueError(f"{name} must be a number of seconds" + (f" >= {at_least:g}" if at_least > -math.inf else "")
                         + f" or None, got {value!r}")


def context_of(value: Any) -> None:
    """A task's `context`: None or a mapping (its worker binds a read-only copy). Raised at the
    call: a string or a list was accepted, and its task failed in the worker with a
    SessionRunError about a 'dictionary update sequence'."""
    if value is not None and not isinstance(value, Mapping):
        raise TypeError(f"context must be a dict or None, got {type(value).__name__} {value!r:.80}")


def waits(deadline: Any, block_timeout: Any, context: Any = None) -> None:
    """A task's `deadline` and `block_timeout`, each checked by `seconds`, and its `context`."""
    seconds("deadline", deadline)
    seconds("block_timeout", block_timeout)
    if context is not None and type(context) is not dict:
        context_of(context)


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def importable(name: str, fn: Any) -> Callable[..., Any] | None:
    """Workers import hooks by reference: a module-level callable, or 'module:function'."""
    if fn is None:
        return None
    if isinstance(fn, str):
        import importlib

        mod, _, attr = fn.partition(":")
        if not attr:
            raise ValueError(f"{name} must look like 'module:function', got {fn!r}")
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name != mod.split(".")[0]:
                raise
            raise ModuleNotFoundError(
                f"{name}={fn!r}: no module named {exc.name!r} in the current folder ({os.getcwd()}) "
                "or on sys.path; run from the folder that holds it, or add that folder to PYTHONPATH",
                name=exc.name,
            ) from None
        try:
            fn = getattr(module, attr)
        except AttributeError:
            raise ImportError(f"{name}={fn!r}: cannot import name {attr!r} from {mod!r}") from None
    if not callable(fn):
        raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise TypeError(
            f"{name} must be an importable module-level function (workers import it by name); "
            f"{fn!r} cannot be pickled: {exc}"
        ) from exc
    return fn  # type: ignore[no-any-return]


# Names users bring from other pools and runtimes, and the setting that does that here (or
# where it lives instead): difflib finds typos, this finds synonyms.
ALIASES = {
    "max_workers": "workers", "processes": "workers", "n_jobs": "workers", "num_workers": "workers",
    "n_workers": "workers", "pool_size": "workers", "concurrency": "workers", "num_procs": "workers",
    "batch": "max_batch_size", "batch_size": "max_batch_size", "max_batch": "max_batch_size",
    "timeout": "task_timeout", "time_limit": "task_timeout",
    "maxtasksperchild": "max_tasks_per_worker", "max_tasks_per_child": "max_tasks_per_worker",
    "mp_context": "start_method",
    "num_threads": "threads_per_worker", "intra_op_num_threads": "threads_per_worker",
    "threads": "threads_per_worker", "provider": "providers", "execution_providers": "providers",
    "init_args": "initargs", "initializer_args": "initargs",
    "queue_size": "queue_capacity", "max_queue_size": "queue_capacity", "maxsize": "queue_capacity",
    "retries": "max_attempts", "max_retries": "max_attempts",
    "memory_limit": "worker_memory_limit", "num_cpus": "cpus_per_slot",
}  # fmt: skip
# ... and names that are not settings at all, but arguments of a call
ELSEWHERE = {
    "batch_size": "infer(inputs, batch_size=N) splits rows into blocks",
    "chunksize": "map(items, chunk=N) sets the items per task", "chunk_size": "map(items, chunk=N) sets the items per task",
    "chunk": "map(items, chunk=N) sets the items per task", "window": "map(items, window=N) bounds what is in flight",
    "context": "submit(inputs, context={...}) gives a task its context",
    "model_path": "the model is the first argument: Engine('model.onnx', ...)",
    "path": "the model is the first argument: Engine('model.onnx', ...)",
}  # fmt: skip


def check_settings(owner: str, given: Iterable[str], known: Iterable[str]) -> None:
    """TypeError for a setting `owner` (e.g. "Engine()") does not take, with the one the user
    probably meant: "Engine() got an unexpected setting 'max_workers'; did you mean 'workers'?"."""
    names = sorted(n for n in known if not n.startswith("_"))
    for name in given:
        if name not in known:
            raise TypeError(f"{owner} got an unexpected setting {name!r}{suggest(name, names)}")


def suggest(name: str, known: Sequence[str]) -> str:
    """"; did you mean 'x'?" (an alias, or the closest of `known`), what else `name` may be
    meant for, or the list of what is known."""
    hints = []
    meant = ALIASES.get(name) or ALIASES.get(name.lower())
    if meant not in known:
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        meant = close[0] if close else None
    if meant is not None:
        hints.append(f"did you mean {meant!r}?")
    if name in ELSEWHERE:
        hints.append(f"({ELSEWHERE[name]})" if hints else ELSEWHERE[name])
    if not hints:
        hints.append(f"the settings are: {', '.join(known)}")
    return "; " + " ".join(hints)
