"""A hot model swap, what both backends share: the plan a caller waits on, and its rules.

    eng.reload("v2.onnx")            # returns the new model version

One slot at a time (the others keep serving), in `order`. A slot's new session is built from
`spec`; once it is up, its signature is checked against the engine's (unless `allow_change`)
and the next slot follows. If the new model fails on a slot, the swap stops, that slot keeps
(or gets back) the old model, and the slots already swapped are swapped back (a `rollback`
plan); reload() raises once the old model serves on every slot again. Every Result carries
the version of the slot that computed it.

How a slot is swapped is the backend's: `engine.local.reload` (the worker process exits and is
rebuilt), `engine.ray.reload` (a new actor is started next to the old one, which keeps serving
until the new one is ready). The owner thread drives the plan; the caller only waits on `done`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Self

from slabpool.workers.errors import EngineError
from slabpool.workers.protocol import SessionInfo
from slabpool.workers.session import SessionSpec


class SignatureChanged(EngineError, ValueError):
    """The new model's inputs/outputs differ from the old one's (allow_signature_change=False)."""


@dataclass(eq=False)
class ReloadPlan:
    """One swap in progress: `done` is set once it ends, with `error` or the new `info`."""

    spec: SessionSpec  # the model to swap in
    old: SessionSpec  # the model it replaces (and the one a failed swap goes back to)
    drain: bool  # a slot finishes what it holds first (True), or hands it back to the queue
    allow_change: bool  # inputs/outputs may differ from the old model's
    order: list[int] = field(default_factory=list)  # slot indexes, swapped in this order
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    info: SessionInfo | None = None  # the new model's, once a slot runs it
    then: ReloadPlan | None = None  # the failed swap this one rolls back: its caller waits for us
    apply: Callable[[SessionInfo], None] | None = None  # the caller's side takes the new model
    _at: int = 0  # the position in `order` of the slot being swapped

    @property
    def at(self) -> int:
        """The index of the slot being swapped."""
        return self.order[self._at]

    def refused(self, old: SessionInfo | None, new: SessionInfo) -> SignatureChanged | None:
        """Why the new session may not replace the old one (its signature), or None."""
        if old is None or self.allow_change or _signature(old) == _signature(new):
            return None
        return SignatureChanged(
            f"the new model's signature differs: inputs {_fmt(new.inputs)} outputs {_fmt(new.outputs)}, "
            f"was inputs {_fmt(old.inputs)} outputs {_fmt(old.outputs)}; pass allow_signature_change=True "
            "to swap anyway")

    def advance(self, info: SessionInfo) -> bool:
        """The slot being swapped runs the new model: True if it was the last one."""
        self.info = info
        self._at += 1
        return self._at == len(self.order)

    def swapped(self) -> list[int]:
        """The slots that run the new model already (to swap back after a failure)."""
        return self.order[: self._at]

    def rollback(self, order: list[int]) -> Self:
        """The swap that puts the old model back on these slots; the caller of this one waits
        for it, so that when reload() raises, the old model serves on every slot."""
        return type(self)(self.old, self.spec, drain=True, allow_change=True, order=order, then=self)

    def settle(self) -> None:
        """The swap has ended (and the swap it rolled back, if any): on success the caller's
        side takes the new model (its inputs, its version) even if reload() stopped waiting;
        then the caller wakes."""
        if self.error is None and self.info is not None and self.apply is not None:
            self.apply(self.info)
        self.done.set()
        if self.then is not None:
            self.then.settle()

    def abort(self, error: BaseException) -> None:
        """The swap cannot go on (the engine closes, another swap runs): the caller learns why."""
        if not self.done.is_set():
            self.error = self.error or error
            self.settle()


def _signature(info: SessionInfo) -> tuple[object, ...]:
    return (info.inputs, info.outputs)


def _fmt(specs: tuple[object, ...]) -> str:
    return ", ".join(f"{s.name}:{s.dtype}{s.shape}" for s in specs)  # type: ignore[attr-defined]
