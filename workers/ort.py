"""The ONNX Runtime adapter: one InferenceSession, one thread, no spinning, honest providers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import onnxruntime as ort

from slabpool.workers.protocol import SessionInfo, TensorSpec
from slabpool.workers.session import AcceleratorUnavailable, RunTimeout, SessionSpec
from slabpool.workers.weights import Pinned, cpu_features, named_as_given, pin

_CPU = "CPUExecutionProvider"
_FATAL = 4  # ORT log severity: only fatal errors are logged
_DTYPES = {
    "tensor(float)": "float32", "tensor(double)": "float64", "tensor(float16)": "float16",
    "tensor(int8)": "int8", "tensor(int16)": "int16", "tensor(int32)": "int32",
    "tensor(int64)": "int64", "tensor(uint8)": "uint8", "tensor(uint16)": "uint16",
    "tensor(uint32)": "uint32", "tensor(uint64)": "uint64", "tensor(bool)": "bool",
}  # fmt: skip


class OrtSession:
    writes_in_place = True  # IO binding: outputs go straight into buffers in the output arena

    def __init__(self, spec: SessionSpec) -> None:
        t0 = time.perf_counter()
        so = ort.SessionOptions()
        so.intra_op_num_threads = spec.threads  # explicit: the default pins threads to cores
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.log_severity_level = 3
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
        requested = _provider_names(spec.providers)
        providers, degraded = _usable_providers(spec)
        self.pinned = _pinned(spec, providers)
        if self.pinned.form == "prepacked":  # optimized once, when it was written: re-optimizing it
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # cost 32 MiB of heap
        with named_as_given(self.pinned, spec.path):
            self._sess = ort.InferenceSession(self.pinned.path, sess_options=so, providers=providers)
        applied = tuple(self._sess.get_providers())
        accel = [p for p in requested if p != _CPU]
        if accel and not _runs_nodes_on(self._sess, accel):
            if not spec.allow_fallback:
                raise AcceleratorUnavailable(
                    f"requested {accel} but no node of the model runs on it (applied: {list(applied)}); "
                    "pass allow_fallback=True to run on the CPU"
                )
            degraded = True
        self._outputs = [o.name for o in self._sess.get_outputs()]
        self._bound = list(dict.fromkeys(self._outputs))  # a name listed twice is bound (and returned) once
        # reused by every run without a time limit (never terminated). No run logs: a run's error
        # is raised with ORT's message (a SessionRunError naming it); its log line on the worker's
        # stderr said it again, once for each call a failing block is cut into (was: a job with 3
        # bad rows printed 22 coloured ORT lines beside its own)
        self._untimed = ort.RunOptions()
        self._untimed.log_severity_level = _FATAL
        self._terminator = _Terminator()
        self.info = SessionInfo(
            runtime="onnxruntime",
            runtime_version=ort.__version__,
            requested=tuple(requested),
            applied=applied,
            degraded=degraded,
            model_digest=self.pinned.digest,
            load_s=time.perf_counter() - t0,
            inputs=tuple(_spec(a, "input") for a in self._sess.get_inputs()),
            outputs=tuple(_spec(a, "output") for a in self._sess.get_outputs()),
            weights=self.pinned.note,
        )

    def run(self, feeds: dict[str, np.ndarray], timeout: float | None = None) -> dict[str, np.ndarray]:
        if timeout is None:  # the common case, without a closure: tiny models run in ~8 us
            values = self._sess.run(self._outputs, feeds, self._untimed)
        else:
            values = self._timed(lambda opts: self._sess.run(self._outputs, feeds, opts), timeout)
        return dict(zip(self._outputs, values, strict=True))

    def run_into(self, feeds: dict[str, np.ndarray], dests: dict[str, np.ndarray],
                 timeout: float | None = None) -> None:
        """IO binding to our buffers: no output allocation (page faults) and no copy after.
        Inputs are bound by address: read-only shared-memory views need no copy either.

        A bound buffer is not proof that ORT wrote it: an output that is a graph input (a
        pass-through) comes back as the input's own OrtValue, and our buffer keeps what an
        earlier task left there. So every output ORT hands back is checked: one that is not
        the buffer we bound is copied into it (_settle)."""
        binding = self._sess.io_binding()
        for name, arr in feeds.items():
            arr = np.ascontiguousarray(arr)
            binding.bind_input(name, "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)
        for name in self._bound:
            dst = dests[name]
            binding.bind_output(name, "cpu", 0, dst.dtype, dst.shape, dst.ctypes.data)
        # a bound run that fails (an output shape that depends on the data) is run
        # again plainly, which tells a real error; ORT's log lines of it are noise on stderr
        self._timed(lambda opts: self._sess.run_with_iobinding(binding, opts), timeout)
        _settle(self._bound, binding.get_outputs(), dests)

    def _timed(self, call: Callable[[Any], Any], timeout: float | None) -> Any:
        """call(run_options); past `timeout` ORT is told to terminate: RunTimeout. No run logs
        (its error still raises)."""
        if timeout is None:
            return call(self._untimed)
        opts = ort.RunOptions()
        opts.log_severity_level = _FATAL
        with self._terminator.armed(opts, timeout):
            try:
                return call(opts)
            except Exception as exc:
                if opts.terminate:
                    raise RunTimeout(f"terminated after {timeout} s") from exc
                raise

    def close(self) -> None:
        self._terminator.stop()
        del self._sess


def _settle(names: list[str], values: list[Any], dests: dict[str, np.ndarray]) -> None:
    """Make each bound destination hold its output: the OrtValue ORT returned is either our
    buffer (written in place) or another tensor (a graph input passed through, a tensor two
    outputs share, ...), copied in here. Shape or dtype other than the buffer's: ValueError
    (the caller runs the task plainly)."""
    if len(values) != len(names):
        raise ValueError(f"ORT returned {len(values)} outputs for {len(names)} bound")
    for name, value in zip(names, values, strict=True):
        dst = dests[name]
        if dst.nbytes == 0 or value.data_ptr() == dst.ctypes.data:
            continue
        got = value.numpy()
        if got.shape != dst.shape or got.dtype != dst.dtype:
            raise ValueError(f"output {name!r} came back as {got.dtype}{list(got.shape)}, "
                             f"not into its buffer {dst.dtype}{list(dst.shape)}")
        np.copyto(dst, got)


def _pinned(spec: SessionSpec, providers: list[Any]) -> Pinned:
    """The pinned model (workers.weights): ONNX Runtime's prepacked CPU form where it is exact
    (the CPU provider alone), else a copy of the model as given."""
    if not spec.share_weights:
        return pin(spec, "copy", why="share_weights=False")
    accel = [p for p in _provider_names(tuple(providers)) if p != _CPU]
    if accel:
        return pin(spec, "copy", why=f"{accel[0]} copies the weights to its device")
    runtime = f"onnxruntime {ort.__version__} cpu {cpu_features()} opt=all"
    return pin(spec, "prepacked", runtime, _prepack_apart)


_CHILD = """import sys
from slabpool.workers.ort import _prepack
try:
    ok = _prepack(*sys.argv[1:])
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
    sys.exit(1)
sys.exit(0 if ok else 3)
"""


def _prepack_apart(src: str, dst: str) -> bool:
    """_prepack in a process of its own: the memory of the session that writes the form (the
    weights loaded, then packed) is not kept by the worker's heap after it is freed (glibc
    keeps it: the converting worker held one more copy of the weights than the others)."""
    done = subprocess.run([sys.executable, "-c", _CHILD, src, dst], capture_output=True, text=True, check=False)
    if done.returncode not in (0, 3):
        why = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        raise RuntimeError(f"onnxruntime could not load the model: {why}")
    return done.returncode == 0


def _prepack(src: str, dst: str) -> bool:
    """Save `src` as ONNX Runtime's CPU form: optimized, every initializer of 1 KiB or more in
    one external data file next to `dst`, prepacked blobs included; True if that file exists."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    so.optimized_model_filepath = dst
    data = os.path.splitext(os.path.basename(dst))[0] + ".data"
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", data)
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    so.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    ort.InferenceSession(src, sess_options=so, providers=[_CPU])
    return os.path.exists(os.path.join(os.path.dirname(dst), data))


def _spec(arg: Any, kind: str) -> TensorSpec:
    dtype = _DTYPES.get(arg.type)
    if dtype is None:
        raise TypeError(_unsupported(arg, kind))
    shape = tuple(d if isinstance(d, int) and d >= 0 else None for d in arg.shape)
    first = arg.shape[0] if arg.shape else None
    dim0 = first if isinstance(first, str) and not _MADE_UP.fullmatch(first) else ""
    return TensorSpec(arg.name, np.dtype(dtype).str, shape, dim0)


# dim names an exporter makes up per input, not the model's own: tf2onnx's unk__N, and
# torch.onnx.export's for dynamic_axes given as a list ({input}_dynamic_axes_{k})
_MADE_UP = re.compile(r"unk__\d+|.+_dynamic_axes_\d+")


def _unsupported(arg: Any, kind: str) -> str:
    """Why this input or output cannot cross, and how to make it a tensor."""
    what = f"{kind} {arg.name!r} has type {arg.type}"
    if not arg.type.startswith(("seq(", "map(", "optional(")):
        return f"{what}, an element type slabpool does not support (supported: {', '.join(_DTYPES)})"
    hint = ("; a scikit-learn classifier converted by skl2onnx has such an output (ZipMap): convert it with "
            "options={id(model): {'zipmap': False}} (or options={type(model): {'zipmap': False}}) to get the "
            "probabilities as a tensor") if kind == "output" else ""
    return f"{what}, not a tensor: slabpool passes tensors only, through shared memory{hint}"


def _provider_names(providers: tuple[Any, ...] | None) -> list[str]:
    if not providers:
        return [_CPU]
    return [p[0] if isinstance(p, tuple) else str(p) for p in providers]


def _usable_providers(spec: SessionSpec) -> tuple[list[Any], bool]:
    """Drop what this build lacks *before* creating the session, so ORT never prints
    its "EP Error ... Falling back" to stdout; raise unless fallback is allowed."""
    if not spec.providers:
        return [_CPU], False
    available = set(ort.get_available_providers())
    usable = [p for p in spec.providers if (p[0] if isinstance(p, tuple) else p) in available]
    missing = [p for p in _provider_names(spec.providers) if p not in available]
    if missing and not spec.allow_fallback:
        raise AcceleratorUnavailable(
            f"execution provider(s) {missing} are not available in this onnxruntime build "
            f"(available: {sorted(available)}); pass allow_fallback=True to run on the CPU"
        )
    if not any((p[0] if isinstance(p, tuple) else p) == _CPU for p in usable):
        usable.append(_CPU)
    return usable, bool(missing)


def _runs_nodes_on(sess: Any, providers: list[str]) -> bool:
    try:
        info = sess.get_provider_graph_assignment_info()
    except Exception:  # noqa: BLE001 - older runtimes lack it: trust get_providers()
        return any(p in sess.get_providers() for p in providers)
    return any(sub.ep_name in providers and len(sub.get_nodes()) > 0 for sub in info)


class _Terminator:
    """One thread per worker that sets RunOptions.terminate when a run outlives its limit."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._target: tuple[Any, float] | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False

    def armed(self, opts: Any, timeout: float) -> _Armed:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ort-terminator", daemon=True)
            self._thread.start()
        return _Armed(self, opts, time.monotonic() + timeout)

    def _set(self, target: tuple[Any, float] | None) -> None:
        with self._cond:
            self._target = target
            self._cond.notify()

    def _loop(self) -> None:
        with self._cond:
            while not self._stopped:
                if self._target is None:
                    self._cond.wait()
                    continue
                opts, deadline = self._target
                left = deadline - time.monotonic()
                if left <= 0:
                    opts.terminate = True
                    self._target = None
                else:
                    self._cond.wait(left)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()


class _Armed:
    def __init__(self, owner: _Terminator, opts: Any, deadline: float) -> None:
        self._owner, self._opts, self._deadline = owner, opts, deadline

    def __enter__(self) -> None:
        self._owner._set((self._opts, self._deadline))

    def __exit__(self, *exc: object) -> None:
        self._owner._set(None)
