"""Hot model swap: replace the session slot by slot while the engine keeps serving.

    eng.reload("v2.onnx")            # returns the new model version

One slot at a time (at least workers - 1 keep serving): it stops taking work, finishes what
it holds (drain_slot=True) or hands it back to the queue uncharged (False), exits, and is
rebuilt on the new model; when its Ready arrives the next slot follows. The supervisor thread
drives it through three hooks: `start`, `on_ready`, `on_start_failed`.

If the new model fails to load on the first slot, that slot is rebuilt on the old model, the
swap stops and `reload` raises SessionInitError; on a later slot, the slots already swapped
are swapped back. A new model whose inputs or outputs differ is refused (rolled back) unless
`allow_signature_change=True`. Every Result carries the version of the slot that computed it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from slabpool.workers.errors import EngineError, SessionInitError
from slabpool.workers.protocol import SessionInfo
from slabpool.workers.session import SessionSpec

if TYPE_CHECKING:
    from slabpool.engine.local.slot import Slot
    from slabpool.engine.local.supervisor import Supervisor


class SignatureChanged(EngineError, ValueError):
    """The new model's inputs/outputs differ from the old one's (allow_signature_change=False)."""


@dataclass(eq=False)
class Reload:
    spec: SessionSpec
    old: SessionSpec
    drain: bool
    allow_change: bool
    order: list[int] = field(default_factory=list)  # slot indexes, swapped in this order
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    info: SessionInfo | None = None
    _at: int = 0

    def start(self, sup: Supervisor) -> None:
        self.order = self.order or [s.index for s in sup.slots]
        self._swap(sup, sup.slots[self.order[0]])

    def _swap(self, sup: Supervisor, slot: Slot) -> None:
        sup.set_spec(slot, self.spec)
        sup.replace_slot(slot, drain=self.drain)

    def _current(self, sup: Supervisor, slot: Slot) -> bool:
        return not self.done.is_set() and slot.index == self.order[self._at] and sup.specs[slot.index] is self.spec

    def on_ready(self, sup: Supervisor, slot: Slot) -> None:
        """The slot's new incarnation is up: check its signature, then swap the next slot."""
        if not self._current(sup, slot) or slot.info is None:
            return
        old = sup.info
        if old is not None and not self.allow_change and _signature(old) != _signature(slot.info):
            self._fail(sup, slot, SignatureChanged(
                f"the new model's signature differs: inputs {_fmt(slot.info.inputs)} outputs "
                f"{_fmt(slot.info.outputs)}, was inputs {_fmt(old.inputs)} outputs {_fmt(old.outputs)}; "
                "pass allow_signature_change=True to swap anyway"))
            sup.replace_slot(slot, drain=True)  # back to the old model
            return
        self.info = slot.info
        self._at += 1
        if self._at == len(self.order):
            self._finish(sup, slot.info)
        else:
            self._swap(sup, sup.slots[self.order[self._at]])

    def on_start_failed(self, sup: Supervisor, slot: Slot, why: BaseException) -> bool:
        """The new model did not load: rebuild this slot on the old one and stop. True if ours."""
        if not self._current(sup, slot):
            return False
        self._fail(sup, slot, SessionInitError(
            f"the new model failed to load on slot {slot.index}; the old model keeps serving: {why}"))
        sup.respawn(slot)
        return True

    def _fail(self, sup: Supervisor, slot: Slot, error: BaseException) -> None:
        sup.set_spec(slot, self.old)
        self.error = error
        swapped = self.order[: self._at]
        self._finish(sup)
        if swapped:  # later slot: swap the ones already done back, so one version serves
            sup.start_reload(Reload(self.old, self.spec, drain=True, allow_change=True, order=swapped))

    def _finish(self, sup: Supervisor, info: SessionInfo | None = None) -> None:
        sup.end_reload(self, info)
        self.done.set()

    def abort(self, error: BaseException) -> None:
        if not self.done.is_set():
            self.error = self.error or error
            self.done.set()


def _signature(info: SessionInfo) -> tuple[object, ...]:
    return (info.inputs, info.outputs)


def _fmt(specs: tuple[object, ...]) -> str:
    return ", ".join(f"{s.name}:{s.dtype}{s.shape}" for s in specs)  # type: ignore[attr-defined]
