"""Fault injection, for slabpool's own tests: an internal interface, not the caller's API.

A task may carry a `FaultSpec` (workers.faults: a stage and what strikes there, e.g. SIGKILL
while its session runs), but only on an engine built inside `injecting()`; any other engine
ignores faults. None of this shows in a public signature.

    eng = faults.build(Engine, model, workers=1)          # an engine that accepts faults
    fut = faults.submit(eng, x, FaultSpec("run", "sigkill"))   # this task kills its worker
    faults.set_init_fault(eng, FaultSpec("init", "exit3"))     # the next workers' initializer

    faults.build(Engine, model, workers=2, init=FaultSpec("init", "sigsegv"))  # every worker's initializer

`build(cls, ...)` is `cls(...)` inside `injecting()`, the context manager that arms every
engine built in its block (this thread or task).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from slabpool.engine.caller.request import Request

if TYPE_CHECKING:
    from slabpool.engine.caller.base import BaseEngine
    from slabpool.engine.core.task import Result
    from slabpool.workers.protocol import FaultSpec


@dataclass(frozen=True)
class Injection:
    """What an engine built inside `injecting()` takes: tasks' faults are honoured, and
    `init` strikes in every worker's initializer."""

    init: FaultSpec | None = None


_armed: contextvars.ContextVar[Injection | None] = contextvars.ContextVar("slabpool_fault_injection", default=None)


def armed() -> Injection | None:
    """The injection an engine being built now takes (None: faults are ignored)."""
    return _armed.get()


@contextlib.contextmanager
def injecting(*, init: FaultSpec | None = None) -> Iterator[None]:
    """Engines built inside this block (this thread or task) honour the faults tasks carry;
    `init`: a fault in the initializer of each of their workers."""
    token = _armed.set(Injection(init))
    try:
        yield
    finally:
        _armed.reset(token)


E = TypeVar("E", bound="BaseEngine")


def build(cls: type[E], model: Any = None, *, init: FaultSpec | None = None, **settings: Any) -> E:
    """`cls(model, **settings)` (Engine, RayEngine), honouring the faults its tasks carry."""
    with injecting(init=init):
        return cls(model, **settings)


def submit(eng: BaseEngine, inputs: Any, fault: FaultSpec | None, *, context: dict[str, Any] | None = None,
           deadline: float | None = None, block_timeout: float | None = None) -> Future[Result]:
    """`eng.submit(inputs, ...)`, the task carrying `fault` (None: a plain task)."""
    return eng._submit(Request(inputs, context, deadline, block_timeout, fault=fault))


def infer(eng: BaseEngine, inputs: Any, fault: FaultSpec | None) -> Any:
    """`eng.infer(inputs)`, the task carrying `fault`: the same call path (a local engine's
    slot may be lent to this caller, engine.core.fastpath)."""
    submit = functools.partial(eng._submit, Request(inputs, fault=fault))
    lent_call = getattr(eng, "_lent_call", None)
    return lent_call(submit) if lent_call is not None else submit().result().outputs


def set_init_fault(eng: BaseEngine, fault: FaultSpec | None) -> None:
    """A fault in the initializer of every worker `eng` starts from now on (a local engine)."""
    eng._init_fault = fault
