"""A hot model swap, what both backends share: the plan a caller waits on, and its rules.

    eng.reload("v2.onnx")            # returns the new model version

One slot at a time (the others keep serving), in `order`. A slot's new session is built from
`spec`; once it is up, its signature is checked against the engine's (unless `allow_change`)
and the next slot follows. If the new model fails on a slot, the swap stops, that slot keeps
(or gets back) the old model, and the slots already swapped are swapped back (a `rollback`
plan); reload() raises once the old model serves on every slot again. A rollback goes through
every slot in its order: one whose start on the old model fails (a transient start-up error)
is left to the owner's start-up retries on the old model, and the next is swapped back all the
same (was: the rollback stopped there, and a slot already swapped served the new model for good
while reload() said the old one serves). Every Result carries
the version of the slot that computed it.

The plan is driven by the owner thread (engine.core.coordinator), the same on every backend:
a slot stops taking work, finishes what it holds (drain=True) or hands it back to the queue
uncharged (False), exits, and is rebuilt on the new spec by its transport; when its Ready
arrives the next slot follows, so at least workers - 1 keep serving. Three hooks: `start`,
`on_ready`, `on_start_failed`. If the new model fails to load, that slot is rebuilt on the old
one, and so are those already swapped (rolled back: `[slot, *swapped]`). The caller only
waits on `done`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, Self

from slabpool.engine.core.slots import SlotRecord
from slabpool.workers.errors import EngineError, SessionInitError
from slabpool.workers.protocol import SessionInfo
from slabpool.workers.session import SessionSpec

RELOAD_RETRIES = 2  # start-up deaths of a swapped slot, not reported by its session, retried


class Swapper(Protocol):
    """What a plan asks of the owner that drives it (engine.core.coordinator.Coordinator)."""

    slots: list[SlotRecord]
    info: SessionInfo | None

    def replace(self, slot: SlotRecord, *, drain: bool) -> None: ...

    def start_reload(self, plan: ReloadPlan) -> None: ...

    def end_reload(self, plan: ReloadPlan, info: SessionInfo | None) -> None: ...


class SignatureChanged(EngineError, ValueError):
    """The new model's inputs/outputs differ from the old one's (allow_signature_change=False).
    `change` says how, without the advice to the Python caller (a server words its own)."""

    def __init__(self, change: str) -> None:
        super().__init__(f"{change}; pass allow_signature_change=True to swap anyway")
        self.change = change

    def __reduce__(self) -> tuple[type[SignatureChanged], tuple[str]]:
        return type(self), (self.change,)


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
    retries: int = 0  # start-up deaths retried (for the slot being swapped)
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
            f"was inputs {_fmt(old.inputs)} outputs {_fmt(old.outputs)}")

    def advance(self, info: SessionInfo | None) -> bool:
        """The slot being swapped runs the new model (`info`; None: not yet, a rollback's slot
        left to the owner's start-up retries): True if it was the last one."""
        self.info = info or self.info
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


    # -- driven by the owner thread ------------------------------------------------------------

    def start(self, owner: Swapper) -> None:
        self.order = self.order or [s.index for s in owner.slots]
        self._swap(owner, owner.slots[self.at])

    def _swap(self, owner: Swapper, slot: SlotRecord) -> None:
        slot.spec = self.spec  # what its next incarnation is built on
        owner.replace(slot, drain=self.drain)

    def _current(self, slot: SlotRecord) -> bool:
        """The slot being swapped, in an incarnation started on our spec (not one that was
        already starting on the old model when the swap reached it)."""
        return not self.done.is_set() and slot.index == self.at and slot.started_spec is self.spec

    def on_ready(self, owner: Swapper, slot: SlotRecord) -> None:
        """The slot's new incarnation is up: check its signature, then swap the next slot."""
        if not self._current(slot) or slot.info is None:
            return
        refused = self.refused(owner.info, slot.info)
        if refused is not None:
            self._fail(owner, slot, refused)
        else:
            self._next(owner, slot.info)

    def _next(self, owner: Swapper, info: SessionInfo | None) -> None:
        """The slot being swapped is done (`info`: it runs the new model; None: a rollback's slot
        left to start on the old one): the next slot, or the end of the swap."""
        if self.advance(info):
            owner.end_reload(self, self.info)
            self.settle()
        else:
            self.retries = 0
            self._swap(owner, owner.slots[self.at])

    def on_start_failed(self, owner: Swapper, slot: SlotRecord, why: BaseException, reported: bool) -> bool:
        """The new model did not load: put the old one back and stop. True if it was ours to
        handle. A death that the session did not report (`reported` False: a signal, a kill
        from outside, a crash in native code) is retried RELOAD_RETRIES times first, as a
        start-up death is; a rollback whose model no longer loads leaves the slot to the
        owner's start-up retries (and their limit)."""
        if not self._current(slot):
            return False
        if self.then is not None:  # a rollback: the slot keeps the old spec, left to the owner's
            self._next(owner, None)  # start-up retries (and their limit), and the rollback goes on:
            return False  # every other slot swapped already must get the old model back too
        if not reported and self.retries < RELOAD_RETRIES:
            self.retries += 1
            return False  # the owner starts it again, on the new model, after a back-off
        self._fail(owner, slot, SessionInitError(
            f"the new model failed to load on slot {slot.index}; the old model keeps serving: {why}"))
        return True

    def _fail(self, owner: Swapper, slot: SlotRecord, error: BaseException) -> None:
        """The swap stops: this slot, then the ones already swapped, back to the old model (a
        rollback never fails: it allows any signature, and goes on past a slot that fails)."""
        self.error = error
        owner.end_reload(self, None)
        owner.start_reload(self.rollback([slot.index, *self.swapped()]))


def _signature(info: SessionInfo) -> tuple[object, ...]:
    return (info.inputs, info.outputs)


def _fmt(specs: tuple[object, ...]) -> str:
    return ", ".join(f"{s.name}:{s.dtype}{s.shape}" for s in specs)  # type: ignore[attr-defined]
