"""The LiteRT (TFLite) adapter: one Interpreter per process, XNNPACK by default.

Prefers `ai_edge_litert` (maintained, numpy 2); falls back to `tflite_runtime`, which only
works with numpy < 2 (its import succeeds under numpy 2, then `Interpreter()` fails).
`Interpreter`, `OpResolverType` and `load_delegate` always come from the same module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numpy as np

from slabpool.workers.protocol import SessionInfo, TensorSpec
from slabpool.workers.session import AcceleratorUnavailable, SessionSpec
from slabpool.workers.weights import Pinned, named_as_given, pin

log = logging.getLogger("slabpool.workers")

# XNNPACK packs weights privately in every process. ai-edge-litert 2.3 shares them through a
# weight cache file only in CompiledModel (CpuOptions.xnnpack_weight_cache_path); its Interpreter,
# which this adapter uses (runtimes.md 2.6: CompiledModel copies and fails on rank-2 inputs),
# offers no such option. So the model is pinned (a copy) and its packed weights stay private.
_NO_WEIGHT_CACHE = "XNNPACK packs weights per process (LiteRT's Interpreter offers no shared weight cache)"


def import_interpreter() -> tuple[ModuleType, str, str]:
    """(interpreter module, distribution name, version) or ImportError saying what to install."""
    try:
        mod = importlib.import_module("ai_edge_litert.interpreter")
        from importlib.metadata import version

        return mod, "ai-edge-litert", version("ai-edge-litert")
    except ImportError:
        pass
    try:
        mod = importlib.import_module("tflite_runtime.interpreter")
    except ImportError as exc:
        raise ImportError(
            "LiteRT is not installed: pip install 'slabpool[litert]' (ai-edge-litert)"
        ) from exc
    if int(np.__version__.split(".")[0]) >= 2:
        raise ImportError(
            f"tflite_runtime is installed but needs numpy < 2 (numpy {np.__version__} is "
            "installed); install ai-edge-litert instead, or numpy<2"
        )
    from importlib.metadata import version

    return mod, "tflite-runtime", version("tflite-runtime")


@contextlib.contextmanager
def native_stderr_to_log() -> Iterator[None]:
    """What LiteRT's native code prints on fd 2 while the interpreter is built ("INFO: Created
    TensorFlow Lite XNNPACK delegate for CPU.") goes to the log instead: "INFO:" lines at INFO
    (shown with --verbose), anything else at WARNING. The worker's faulthandler writes to its
    own copy of fd 2 (workers.main), so a crash in here still prints its traceback."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            for line in captured.read().decode(errors="replace").splitlines():
                if line.strip():
                    log.log(logging.INFO if line.startswith("INFO:") else logging.WARNING, "litert: %s", line)


class LiteRtSession:
    def __init__(self, spec: SessionSpec) -> None:
        t0 = time.perf_counter()
        mod, dist, ver = import_interpreter()
        self._mod = mod
        self.pinned = _pinned(spec)
        delegates, requested, applied, degraded = self._delegates(spec)
        kwargs: dict[str, Any] = {"model_path": self.pinned.path, "num_threads": spec.threads}
        if spec.delegate == "none":
            kwargs["experimental_op_resolver_type"] = mod.OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES
        if delegates:
            kwargs["experimental_delegates"] = delegates
        with native_stderr_to_log(), named_as_given(self.pinned, spec.path):
            self._interp = mod.Interpreter(**kwargs)
            self._interp.allocate_tensors()  # applies XNNPACK now, in the initializer
        self._in = {d["name"]: d for d in self._interp.get_input_details()}
        self._out = [(d["name"], d["index"]) for d in self._interp.get_output_details()]
        self.info = SessionInfo(
            runtime=dist,
            runtime_version=ver,
            requested=tuple(requested),
            applied=tuple(applied),
            degraded=degraded,
            model_digest=self.pinned.digest,
            load_s=time.perf_counter() - t0,
            inputs=tuple(_spec(d) for d in self._interp.get_input_details()),
            outputs=tuple(_spec(d) for d in self._interp.get_output_details()),
            weights=self.pinned.note,
        )

    def _delegates(self, spec: SessionSpec) -> tuple[list[Any], list[str], list[str], bool]:
        if spec.delegate in (None, "xnnpack"):
            return [], ["xnnpack"], ["xnnpack"], False
        if spec.delegate == "none":
            return [], ["none"], ["builtin"], False
        path = spec.delegate
        try:
            delegate = self._mod.load_delegate(path, dict(spec.delegate_options))
            claims = self._claims(spec, path)
        except (OSError, AttributeError, ValueError, RuntimeError) as exc:
            if not spec.allow_fallback:
                raise AcceleratorUnavailable(f"delegate {path} failed to load: {exc}") from exc
            return [], [path], ["xnnpack"], True
        if claims == 0:
            if not spec.allow_fallback:
                raise AcceleratorUnavailable(
                    f"delegate {path} loaded but claimed no node of the model; "
                    "pass allow_fallback=True to run on the CPU"
                )
            return [delegate], [path], ["xnnpack"], True
        return [delegate], [path], [path], False

    def _claims(self, spec: SessionSpec, path: str) -> int:
        """How many partitions the delegate alone takes, on a probe interpreter."""
        probe = self._mod.Interpreter(
            model_path=self.pinned.path,
            experimental_delegates=[self._mod.load_delegate(path, dict(spec.delegate_options))],
            experimental_op_resolver_type=self._mod.OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
        )
        return sum(op["op_name"] == "DELEGATE" for op in probe._get_ops_details())

    def run(self, feeds: dict[str, np.ndarray], timeout: float | None = None) -> dict[str, np.ndarray]:
        interp = self._interp
        resized = False
        for name, arr in feeds.items():
            detail = self._in[name]
            if tuple(detail["shape"]) != arr.shape:
                interp.resize_tensor_input(detail["index"], arr.shape, strict=True)
                detail["shape"] = np.array(arr.shape, dtype=np.int32)
                resized = True
        if resized:
            interp.allocate_tensors()
        for name, arr in feeds.items():
            interp.set_tensor(self._in[name]["index"], arr)
        interp.invoke()  # no clean stop in LiteRT: task_timeout kills the slot instead
        return {name: interp.get_tensor(index) for name, index in self._out}

    writes_in_place = False  # its output tensors live in the interpreter's own arena

    def run_into(self, feeds: dict[str, np.ndarray], dests: dict[str, np.ndarray],
                 timeout: float | None = None) -> None:
        raise NotImplementedError("LiteRT writes outputs into its own tensor arena")

    def close(self) -> None:
        del self._interp  # before its delegates


def _pinned(spec: SessionSpec) -> Pinned:
    """The pinned copy (workers.weights). The built-in kernels read weights from the mapped
    file, shared; XNNPACK (the default) and external delegates make their own copy."""
    if spec.delegate == "none":
        p = pin(spec, "copy")
        return dataclasses.replace(p, shared=True, note="built-in kernels read the weights from the mapped file")
    return pin(spec, "copy", why=_NO_WEIGHT_CACHE if spec.delegate in (None, "xnnpack") else
               f"the delegate {spec.delegate} holds its own copy")


def _spec(detail: dict[str, Any]) -> TensorSpec:
    sig = detail.get("shape_signature")
    dims = sig if sig is not None and len(sig) == len(detail["shape"]) else detail["shape"]
    return TensorSpec(
        detail["name"], np.dtype(detail["dtype"]).str, tuple(None if d < 0 else int(d) for d in dims)
    )
