"""Batched hooks for the batch job: a task is a list of items (`slabpool run --batched`).

A batched `preprocess(items)` gets a list of items and returns the stacked feeds (axis 0 holds
one row per item); a batched `postprocess(outputs, items)` gets the block's outputs and returns
one result per item. A hook opts in with `fn.batched = True`, or every hook with --batched.

When only one of the two hooks is batched, the other is wrapped here so that the task is still
a list: `each_pre`/`each_item` call a per-item preprocess on every item (and stack the feeds),
`each_post` calls a per-item postprocess on every item's rows, `stack_feeds` stands for a
missing preprocess. `decoded*` give hooks the item decoded where it travels encoded (a JSONL
line, parsed in the worker). Workers import these by reference (functools.partial pickles them).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from slabpool.engine.core.config import importable


def hook_batched(name: str | None) -> bool:
    """Whether the hook `module:function` says `batched = True` (False if it cannot be found:
    the engine then reports that with its own message)."""
    if not name or ":" not in name:
        return False
    mod, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError):
        return False
    return bool(getattr(fn, "batched", False))


def resolve(option: str, name: str) -> Callable[..., Any]:
    """The hook `module:function` (from the current folder too), as the engine resolves it."""
    fn = importable(option, name)
    assert fn is not None
    return fn


def json_line(line: str) -> Any:
    """A JSONL item as the hook gets it (a `decode`: runs in the workers)."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the line is not JSON: {exc}") from None


def decoded(decode: Callable[[Any], Any], fn: Callable[[Any], Any], item: Any) -> Any:
    """A preprocess that gets the item decoded (a JSONL line parsed) in the worker."""
    return fn(decode(item))


def decoded_each(decode: Callable[[Any], Any], fn: Callable[[Any], Any], items: Sequence[Any]) -> Any:
    """A batched preprocess that gets its list of items decoded."""
    return fn([decode(it) for it in items])


def decoded_post(decode: Callable[[Any], Any], fn: Callable[[Any, Any], Any], outputs: Any, item: Any) -> Any:
    """A postprocess that gets the item decoded, as the preprocess did (decoded again: the
    worker keeps the item as it travelled)."""
    return fn(outputs, decode(item))


def decoded_post_each(
    decode: Callable[[Any], Any], fn: Callable[[Any, Any], Any], outputs: Any, items: Sequence[Any],
) -> Any:
    """A batched postprocess that gets its list of items decoded."""
    return fn(outputs, [decode(it) for it in items])


def stack_feeds(items: Sequence[Any]) -> Any:
    """Per-item feeds (each with its batch axis of 1) as one block, concatenated on axis 0."""
    if not items:
        raise ValueError("an empty list of items")
    if isinstance(items[0], Mapping):
        return {k: np.concatenate([np.asarray(f[k]) for f in items]) for k in items[0]}
    return np.concatenate([np.asarray(f) for f in items])


def each_pre(fn: Callable[[Any], Any], items: Sequence[Any]) -> Any:
    """A per-item preprocess over a list of items, its feeds stacked (a model follows)."""
    return stack_feeds([fn(it) for it in items])


def each_item(fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    """A per-item preprocess over a list of items, without a model: one result per item."""
    return [fn(it) for it in items]


def each_post(fn: Callable[[Any, Any], Any], outputs: Any, items: Sequence[Any]) -> list[Any]:
    """A per-item postprocess over a block: item j gets its rows (`v[j:j+1]`) and itself."""
    return [fn(rows_of(outputs, j, keep_axis=True), it) for j, it in enumerate(items)]


def rows_of(outputs: Any, j: int, *, keep_axis: bool) -> Any:
    """Row j of every array of a block (a dict of arrays, or one array)."""
    if isinstance(outputs, Mapping):
        return {k: (v[j : j + 1] if keep_axis else v[j]) for k, v in outputs.items()}
    return outputs[j : j + 1] if keep_axis else outputs[j]


def split(outputs: Any, n: int, *, post: bool, model: bool) -> list[Any]:
    """A batched task's result as `n` per-item results (ValueError when it does not split).

    With a postprocess: its list of n results. Else the model's outputs, each with n rows on
    axis 0 (item j gets `v[j:j+1]`, the batch axis kept as for a one-item task). Without a
    model: the preprocess's list of n results, or arrays of n rows (item j gets `v[j]`)."""
    if post or (not model and isinstance(outputs, list | tuple)):
        if not isinstance(outputs, list | tuple) or len(outputs) != n:
            got = f"{len(outputs)} results" if isinstance(outputs, list | tuple) else type(outputs).__name__
            hook = "postprocess" if post else "preprocess"
            raise ValueError(f"a batched {hook} must return a list of one result per item: {n} items, got {got}")
        return list(outputs)
    arrays = outputs.values() if isinstance(outputs, Mapping) else [outputs]
    for a in arrays:
        if not isinstance(a, np.ndarray) or a.ndim == 0 or a.shape[0] != n:
            shape = getattr(a, "shape", type(a).__name__)
            raise ValueError(f"a batched task's outputs need {n} rows on axis 0 (one per item), got {shape}")
    return [rows_of(outputs, j, keep_axis=model) for j in range(n)]
