"""What is measured: a model, the items fed to it one by one, and how outputs are checked."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

Feeds = dict[str, np.ndarray]
Outputs = dict[str, np.ndarray]

RTOL, ATOL = 1e-4, 1e-5  # ORT's bits may depend on batch composition (measured: magika rows differ at 1e-7 between batch 8 and 1)


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    build: Callable[[Path], Path]  # writes the model under a directory, returns its path
    items: Callable[[np.random.Generator], list[Feeds]]  # distinct items, cycled in a run
    window_per_worker: int  # tasks in flight per worker, the same for every contender
    tiny: bool = False  # a tiny model: slabpool also runs with dynamic batching

    def cycle(self, distinct: list[Feeds], n: int) -> list[Feeds]:
        return [distinct[i % len(distinct)] for i in range(n)]


def check(got: Any, want: Outputs, where: str) -> None:
    """Raise AssertionError unless `got` holds every output of `want`, allclose."""
    if not isinstance(got, dict) or set(got) != set(want):
        raise AssertionError(f"{where}: outputs {sorted(got) if isinstance(got, dict) else type(got)} "
                             f"!= {sorted(want)}")
    for name, ref in want.items():
        arr = np.asarray(got[name])
        if arr.shape != ref.shape or not np.allclose(arr, ref, rtol=RTOL, atol=ATOL):
            raise AssertionError(f"{where}: output {name!r} differs from the serial reference")


def magika_model() -> Path:
    """The ONNX model inside the installed `magika` wheel (a file-type classifier)."""
    import magika

    found = sorted(glob.glob(os.path.join(os.path.dirname(magika.__file__), "models", "*", "model.onnx")))
    if not found:
        raise FileNotFoundError("no model.onnx inside the installed magika package")
    return Path(found[-1])


def _random(shape: tuple[int, ...], dtype: Any = np.float32) -> Callable[[np.random.Generator], np.ndarray]:
    def make(rng: np.random.Generator) -> np.ndarray:
        return rng.standard_normal(shape).astype(dtype)

    return make


def _items(name: str, make: Callable[[np.random.Generator], np.ndarray], count: int) -> Callable[..., list[Feeds]]:
    def items(rng: np.random.Generator) -> list[Feeds]:
        return [{name: make(rng)} for _ in range(count)]

    return items


def _magika_bytes(rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, 257, size=(1, 2048), dtype=np.int32)  # 256 = padding token


def all_workloads(quick: bool) -> dict[str, Workload]:
    from tests.models import onnx_models as om

    size = 64 if quick else 128  # the CNN: ~4.4 ms/item at 128 px on the 2-core VM
    elements = 256 * 1024 if quick else 2 * 1024 * 1024  # payload: 8 MiB in + 8 MiB out per item
    return {w.name: w for w in (
        Workload("mlp", "tiny MLP, items one by one", lambda d: om.mlp(d / "mlp.onnx"),
                 _items("x", _random((1, 16)), 256), window_per_worker=64, tiny=True),
        Workload("cnn", f"CNN {size}x{size} (CPU-bound)", lambda d: om.cnn(d / "cnn.onnx", size=size),
                 _items("image", _random((1, 3, size, size)), 16), window_per_worker=4),
        Workload("magika", "magika (real model from PyPI)", lambda d: magika_model(),
                 _items("bytes", _magika_bytes, 32), window_per_worker=4),
        Workload("payload", f"payload {elements * 4 >> 20} MiB in + out",
                 lambda d: om.payload(d / "payload.onnx", elements=elements),
                 _items("x", _random((1, elements)), 4), window_per_worker=2),
        Workload("noop", "no-op model (dispatch overhead)", lambda d: om.identity(d / "noop.onnx", dim=1),
                 _items("x", _random((1, 1)), 256), window_per_worker=64, tiny=True),
    )}
