"""Hooks for tests/test_first_contact.py: what a worker saw of a payload, and the payload back."""

from __future__ import annotations

from typing import Any

import numpy as np


def describe(obj: Any) -> Any:
    """A plain (dict, list, str) account of a payload's classes, dtypes and masks."""
    if isinstance(obj, np.ndarray):
        out: dict[str, Any] = {"class": type(obj).__name__, "dtype": str(obj.dtype), "shape": list(obj.shape),
                               "fields": list(obj.dtype.names or ())}
        if isinstance(obj, np.ma.MaskedArray):
            out["mask"] = np.ma.getmaskarray(obj).tolist()
            out["fill"] = obj.fill_value.item()
        return out
    if isinstance(obj, dict):
        return {"class": type(obj).__name__, "items": [[k, describe(v)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"class": type(obj).__name__, "items": [describe(v) for v in obj]}
    return {"class": type(obj).__name__}


def echo(item: Any) -> Any:
    """The payload as the worker saw it, and the payload itself back to the caller."""
    return {"seen": describe(item["payload"]), "back": item["payload"]}
