"""The input contract: exact names, exact dtype (byte order included), rank and static dims.

Used twice with the same rules: by `Engine.submit()` before a task is accepted (no
preprocess), and inside the worker after preprocess. Nothing is ever cast or truncated:
ONNX Runtime and LiteRT both compute garbage, silently, on a big-endian array.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from slabpool.workers.errors import InputContractError
from slabpool.workers.protocol import TensorSpec


def normalize(inputs: Any, specs: Sequence[TensorSpec]) -> dict[str, Any]:
    """A bare array is the single input of a single-input model; a mapping is taken as is."""
    if isinstance(inputs, Mapping):
        return dict(inputs)
    if isinstance(inputs, np.ndarray) and len(specs) == 1:
        return {specs[0].name: inputs}
    names = [s.name for s in specs]
    raise InputContractError(
        f"expected a dict of numpy arrays keyed by input name {names}"
        + (" (or a bare array: the model has one input)" if len(specs) == 1 else "")
        + f", got {type(inputs).__name__}"
    )


def one_input(inputs: Any, specs: Sequence[TensorSpec]) -> Any:
    """A bare array as `normalize` reads it (the one input of a one-input model), anything
    else as it is: the door's cache of checked signatures then takes bare arrays too."""
    if type(inputs) is np.ndarray and len(specs) == 1:
        return {specs[0].name: inputs}
    return inputs


def signature(inputs: dict[Any, Any]) -> tuple[Any, ...]:
    """What the contract reads of a dict of inputs: names, exact types, dtypes and shapes. Two
    dicts of one signature pass or fail the check alike, so a checked one need not be again."""
    return tuple([(k, type(v), getattr(v, "dtype", None), getattr(v, "shape", None)) for k, v in inputs.items()])


class Checked:
    """Signatures of dicts of inputs that passed the check (at most `limit`: many distinct
    shapes, a dynamic axis, start it over), each with what the checker kept of it."""

    def __init__(self, limit: int = 256) -> None:
        self.limit = limit
        self._seen: dict[tuple[Any, ...], Any] = {}

    def get(self, sig: tuple[Any, ...]) -> Any:
        return self._seen.get(sig)

    def add(self, sig: tuple[Any, ...], value: Any = True) -> None:
        if len(self._seen) >= self.limit:
            self._seen.clear()
        self._seen[sig] = value


def check(feeds: Mapping[str, Any], specs: Sequence[TensorSpec]) -> dict[str, np.ndarray]:
    """Raise InputContractError naming the input, what was expected and what was got."""
    expected = {s.name for s in specs}
    missing = sorted(expected - feeds.keys())
    extra = sorted(set(feeds) - expected)
    if missing or extra:
        raise InputContractError(
            f"input names do not match the model: expected {sorted(expected)}, got "
            f"{sorted(map(str, feeds))}" + (f"; missing {missing}" if missing else "")
            + (f"; unknown {extra}" if extra else "")
        )
    together = len(_named(specs)) <= 1  # one batch axis: every dynamic axis 0 takes one size
    sizes: dict[str, tuple[str, int]] = {}  # the axis-0 dim -> the first input of it, its size
    for spec in specs:
        arr = feeds[spec.name]
        check_one(spec, arr)
        if spec.shape and spec.shape[0] is None and (together or spec.dim0):
            dim = "" if together else spec.dim0
            first = sizes.setdefault(dim, (spec.name, arr.shape[0]))
            if arr.shape[0] != first[1]:
                raise InputContractError(
                    f"input {spec.name!r}: expected {first[1]} items on axis 0 like the other "
                    f"inputs (input {first[0]!r}{f', both {dim!r}' if dim else ''}), got {arr.shape[0]}"
                )
    return dict(feeds)


def batchable(specs: Sequence[TensorSpec]) -> bool:
    """Every input's axis 0 is one dynamic dim, the batch: items stack on it (and rows split
    on it). Not when two inputs name different dims there (a[N], b[M]: sizes that may
    differ, as ONNX reads different dim_params); then each size is checked only against the
    inputs that name the same dim."""
    return bool(specs) and all(s.shape and s.shape[0] is None for s in specs) and len(_named(specs)) <= 1


def _named(specs: Sequence[TensorSpec]) -> set[str]:
    return {s.dim0 for s in specs if s.dim0 and s.shape and s.shape[0] is None}


def check_one(spec: TensorSpec, arr: Any) -> None:
    where = f"input {spec.name!r}"
    if not isinstance(arr, np.ndarray):
        raise InputContractError(
            f"{where}: expected a numpy.ndarray of {spec.dtype}, got {type(arr).__name__}"
        )
    if type(arr) is not np.ndarray and not isinstance(arr, np.memmap):
        raise InputContractError(f"{where}: expected a plain numpy.ndarray of {spec.dtype}, got {_subclass(arr)}")
    want = np.dtype(spec.dtype)
    if arr.dtype != want:
        hint = " (non-native byte order; convert with .astype(...newbyteorder('='))" if (
            arr.dtype.newbyteorder("=") == want
        ) else ""
        raise InputContractError(
            f"{where}: expected dtype {want.str} ({want}), got {arr.dtype.str} ({arr.dtype}){hint}; "
            "nothing is cast silently"
        )
    if arr.ndim != len(spec.shape):
        raise InputContractError(
            f"{where}: expected rank {len(spec.shape)} with shape {_fmt(spec.shape)}, "
            f"got rank {arr.ndim} with shape {arr.shape}"
        )
    for axis, (want_dim, got_dim) in enumerate(zip(spec.shape, arr.shape, strict=True)):
        if want_dim is not None and want_dim != got_dim:
            raise InputContractError(
                f"{where}: expected shape {_fmt(spec.shape)}, got {arr.shape} "
                f"(axis {axis} must be {want_dim})"
            )


def _subclass(arr: np.ndarray) -> str:
    """What an ndarray subclass is, what a model would lose of it, and what to pass instead."""
    cls = type(arr)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if isinstance(arr, np.ma.MaskedArray):
        return (f"a masked array ({name}): the model would see the values under its mask; pass "
                "arr.filled(value), or the mask as an input of its own")
    if isinstance(arr, np.recarray):
        return f"a record array ({name}, fields {list(arr.dtype.names or ())}); pass one field: arr['name']"
    if isinstance(arr, np.matrix):
        return f"a matrix ({name}); pass np.asarray(m)"
    return f"an ndarray subclass {name}; pass np.asarray(arr)"


def _fmt(shape: Sequence[int | None]) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"
