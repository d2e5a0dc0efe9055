"""One task as the caller's side asks for it: the one internal request that every way in builds.

    submit(x)                     Request(x, context, deadline, block_timeout)  --+
    map(): an item run alone      Request(x, context, units=0)                    |
    infer(batch_size=), the job   Request(rows, context, ..., units=0, step)      +--> _submit(request)
    tests (engine.caller.faults)  Request(x, fault=FaultSpec(...))              --+    1 _admit: the contract
                                                                                       2 _enqueue(request, admitted)

`BaseEngine._submit(request)` is the one documented internal entry point: step 1 (the input
contract, `BaseEngine._admit`, which gives an `Admitted`), then the backend's
`_enqueue(request, admitted)` (step 2). A map() chunk is the one other way in: a local
engine's `_submit_chunk` admits each of its items and hands `_enqueue` a request of its own.

A request is a NamedTuple: immutable, typed, and cheap to build (~0.3 us; the one object
submit() allocates on top of what it did before; `Admitted` is the plain tuple it was).
`JobEngine` is what the batch job (engine/job) asks of an engine, internals included, so that
mypy checks the job's calls.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy.typing as npt

if TYPE_CHECKING:
    from slabpool.engine.caller.mapping import MapPart
    from slabpool.engine.core.config import EngineConfig
    from slabpool.engine.core.stats import EngineStats, ModelDescription
    from slabpool.engine.core.task import Result
    from slabpool.workers.protocol import FaultSpec


Outputs = dict[str, npt.NDArray[Any]]  # a task's outputs by name: what infer() returns


class Request(NamedTuple):
    """What a caller asks the engine to run as one task, before it is checked.

    `units`: the caller's items this task counts (1: a submit(), a map() item; 0: a block of
    rows or an item rerun alone, which the caller counts itself; such a task is never stacked
    with other work by dynamic batching). `step`: a block's rows per session call (0: one call).
    `fault`: tests only, a fault the task triggers in its worker (`engine.caller.faults`)."""

    inputs: Any
    context: dict[str, Any] | None = None
    deadline: float | None = None  # seconds it may wait in the queue
    block_timeout: float | None = None  # how long a full queue may block the caller
    units: int = 1
    step: int = 0
    fault: FaultSpec | None = None


def as_block(shape_key: tuple[Any, ...], items: int) -> tuple[tuple[Any, ...], int]:
    """The batch key and items of a task that counts no items (a block of rows, an item run
    alone, a group of callers: Request(units=0)): a key no plain task shares, so dynamic
    batching never stacks it with others, and no items for it to count."""
    return ("block", items, shape_key), 0


# Step 1's answer, (item, shape key, items): the inputs as they go (normalized feeds), the key
# that tasks batched together share, and the rows dynamic batching counts (0: never stacked).
# A plain tuple, as before the Request existed: submit() allocates nothing more for it.
Admitted = tuple[Any, tuple[Any, ...], int]


class JobEngine(Protocol):
    """What the batch job (engine/job) uses of an engine: the public API, and the caller's
    internals it shares with infer(batch_size=) and map() (`BaseEngine` provides them)."""

    @property
    def config(self) -> EngineConfig: ...

    @property
    def model_version(self) -> str | None: ...

    def submit(self, inputs: Any, *, context: dict[str, Any] | None = ..., deadline: float | None = ...,
               block_timeout: float | None = ...) -> Future[Result]: ...

    def map(self, items: Iterable[Any], *, window: int | None = ..., return_exceptions: bool,
            context: dict[str, Any] | None = ..., chunk: int | None = ...,
            ordered: bool = ...) -> Generator[Result | BaseException, None, None]: ...

    def stats(self) -> EngineStats: ...

    def describe(self) -> ModelDescription: ...

    def close(self, *, cancel_pending: bool = ..., timeout: float | None = ...) -> None: ...

    def _submit(self, request: Request) -> Future[Result]:
        """Steps 1-2 for one request (`BaseEngine._submit`)."""
        ...

    def _admit(self, inputs: Any) -> Admitted:
        """Step 1 alone: the input contract, raised at the door (InputContractError)."""
        ...

    def _tally(self, *, accepted: int = ..., completed: int = ..., failed: int = ...,
               cancelled: int = ...) -> None:
        """Count the caller's items of blocks and chunks (their tasks count none themselves)."""
        ...

    def _map_parts(self, items: Iterable[Any], *, window: int | None = ..., contain: bool = ...,
                   context: dict[str, Any] | None = ..., chunk: int | None = ...,
                   ordered: bool = ...) -> Generator[MapPart, None, None]:
        """map() one task at a time (`mapping.parts`)."""
        ...
