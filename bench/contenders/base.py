"""The `Contender` protocol and the one submission loop every pool shares."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class Skipped(Exception):
    """The contender cannot run here (e.g. its library is not installed); the report says why."""


@dataclass(frozen=True)
class Done:
    """One item's outputs and its latency (submit -> result ready), in seconds."""

    outputs: Any
    latency: float


class Contender(Protocol):
    name: str
    note: str  # one line for the report: how it is configured

    def setup(self, model: str, workers: int) -> None: ...

    def run(self, items: Sequence[Any]) -> Iterator[Done]:
        """Outputs in item order, one `Done` per item; items go in one by one."""
        ...

    def close(self) -> None: ...

    def sample(self) -> dict[str, float]:
        """Numbers to sample during a run (peaks are kept), e.g. shared memory in use."""
        ...


class Handle(Protocol):
    def get(self) -> Any: ...


Submit = Callable[[Any, Callable[[], None]], Handle]


class _Stamp:
    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = 0.0

    def __call__(self, *_: Any) -> None:
        self.done = time.perf_counter()


def windowed(submit: Submit, items: Sequence[Any], window: int) -> Iterator[Done]:
    """Submit items one by one, at most `window` in flight; yield results in order.

    `submit(item, on_done)` starts a task and returns something with `.get()`; the pool calls
    `on_done` when the result is ready, which timestamps it (latency is not inflated by waiting
    in order)."""
    pending: deque[tuple[Handle, float, _Stamp]] = deque()

    def finish() -> Done:
        handle, t0, stamp = pending.popleft()
        out = handle.get()
        return Done(out, (stamp.done or time.perf_counter()) - t0)

    for item in items:
        stamp = _Stamp()
        t0 = time.perf_counter()
        pending.append((submit(item, stamp), t0, stamp))
        if len(pending) >= window:
            yield finish()
    while pending:
        yield finish()


class FutureHandle:
    """Adapts a concurrent.futures.Future (or a subclass) to `Handle` with a done stamp."""

    __slots__ = ("fut",)

    def __init__(self, fut: Any, on_done: Callable[[], None]) -> None:
        self.fut = fut
        fut.add_done_callback(on_done)

    def get(self) -> Any:
        return self.fut.result()


class NoSample:
    def sample(self) -> dict[str, float]:
        return {}
