"""Per-task context, visible inside the worker while (and only while) the task runs.

    submit(item, context={"tenant": "a", "request_id": "r-1"})
    ...
    def preprocess(item):            # runs in the worker
        tenant = slabpool.workers.context.current().get("tenant")

`bind()` is the one wrapper that sets it on entry and clears it on every exit path.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

_EMPTY: Mapping[str, Any] = MappingProxyType({})
_current: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "slabpool_context", default=_EMPTY
)


def current() -> Mapping[str, Any]:
    """The running task's context, read-only; empty outside a task."""
    return _current.get()


@contextlib.contextmanager
def bind(context: Mapping[str, Any] | None) -> Iterator[Mapping[str, Any]]:
    token = _current.set(MappingProxyType(dict(context)) if context else _EMPTY)
    try:
        yield _current.get()
    finally:
        _current.reset(token)
