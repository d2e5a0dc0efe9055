"""One model session per worker, behind one small interface, for every runtime.

    spec = SessionSpec(path, backend="onnxruntime", ...)   # picklable; built by the supervisor
    session = load_session(spec)                           # in the worker, once
    session.info                                           # what is REALLY in use
    outputs = session.run({"x": arr})                      # dict name -> array
    session.run_into({"x": arr}, {"y": view_in_shm})       # ORT: outputs written in place

Each adapter imports its runtime here, lazily: `import engine` never imports onnxruntime or
LiteRT. Runtime errors are translated at this boundary (a worker reports them as data).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from slabpool.workers.protocol import SessionInfo

Backend = Literal["onnxruntime", "litert"]


@dataclass(frozen=True)
class SessionSpec:
    """How to build a session: everything picklable, nothing live."""

    path: str
    backend: Backend
    providers: tuple[Any, ...] | None = None  # ONNX Runtime: names or (name, options)
    delegate: str | None = None  # LiteRT: None (XNNPACK), "none", or an external delegate path
    delegate_options: dict[str, str] = field(default_factory=dict)
    allow_fallback: bool = False  # may a missing provider/delegate degrade to the CPU path?
    threads: int = 1
    # the model version the engine pinned (model_digest, taken by the caller): every worker,
    # and every slot rebuilt after a crash, loads exactly these bytes or refuses to start
    digest: str = ""
    cache_dir: str | None = None  # where pinned and converted forms live (workers.weights); None: none
    share_weights: bool = True  # load the shared (prepacked, memory-mapped) form where it is exact


class ModelSession(Protocol):
    info: SessionInfo
    writes_in_place: bool  # run_into is supported: the runtime writes into buffers we give it

    def run(self, feeds: dict[str, np.ndarray], timeout: float | None = None) -> dict[str, np.ndarray]:
        """Run once; raise RunTimeout if `timeout` (s) passes and the runtime can stop cleanly."""
        ...

    def run_into(self, feeds: dict[str, np.ndarray], dests: dict[str, np.ndarray],
                 timeout: float | None = None) -> None:
        """Run once, the runtime writing each output straight into `dests[name]` (shapes known
        in advance); raise if an output's shape is not that of its destination."""
        ...

    def close(self) -> None: ...


class RunTimeout(Exception):
    """The runtime stopped a run cleanly at the task's time limit (ONNX Runtime terminate)."""


class AcceleratorUnavailable(RuntimeError):
    """A provider or delegate was requested, could not be applied, and fallback is not allowed."""


def detect_backend(path: str) -> Backend:
    """By content: a FlatBuffer with identifier TFL3 is LiteRT; else by suffix; else ONNX."""
    with open(path, "rb") as f:
        head = f.read(8)
    if head[4:8] == b"TFL3" or path.endswith(".tflite"):
        return "litert"
    return "onnxruntime"


def model_files(path: str) -> list[str]:
    """The files the model is made of, relative to its folder: the model file first, then the
    external data files an ONNX model names (`workers.onnxfiles`)."""
    if detect_backend(path) != "onnxruntime":
        return [os.path.basename(path)]
    from slabpool.workers.onnxfiles import BadModelFile, external_files

    try:
        extra = external_files(path)
    except BadModelFile:
        extra = []  # not readable as ONNX: the runtime says why when it loads it
    return [os.path.basename(path), *extra]


def model_digest(path: str, copy_to: str | None = None) -> str:
    """The model version: the first 16 hex digits of the SHA-256 of the model file, followed by
    each external data file's name and bytes (a model without external data: of the file alone).
    `copy_to`: each file is also copied there as it is read, so the copy is what was hashed."""
    folder = os.path.dirname(os.path.abspath(path))
    h = hashlib.sha256()
    for i, name in enumerate(model_files(path)):
        if i:
            h.update(b"\0" + name.encode() + b"\0")
        with open(os.path.join(folder, name), "rb") as f:
            if copy_to is None:
                hashlib.file_digest(f, lambda: h)  # one running hash over every file
            else:
                _copy_hashed(f, os.path.join(copy_to, name), h)
    return h.hexdigest()[:16]


def _copy_hashed(src: Any, target: str, h: Any) -> None:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target, "wb") as out:
        for chunk in iter(lambda: src.read(1 << 20), b""):
            h.update(chunk)
            out.write(chunk)


def load_session(spec: SessionSpec) -> ModelSession:
    if spec.backend == "onnxruntime":
        from slabpool.workers.ort import OrtSession

        return OrtSession(spec)
    if spec.backend == "litert":
        from slabpool.workers.litert import LiteRtSession

        return LiteRtSession(spec)
    raise ValueError(f"unknown backend {spec.backend!r}: expected 'onnxruntime' or 'litert'")
