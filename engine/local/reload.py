"""Hot model swap on local workers (the plan and its rules: `engine.core.reload`).

A slot stops taking work, finishes what it holds (drain_slot=True) or hands it back to the
queue uncharged (False), exits, and is rebuilt on the new model; when its Ready arrives the
next slot follows, so at least workers - 1 keep serving. The supervisor thread drives it
through three hooks: `start`, `on_ready`, `on_start_failed`. If the new model fails to load,
that slot is rebuilt on the old model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from slabpool.engine.core.reload import ReloadPlan
from slabpool.workers.errors import SessionInitError

if TYPE_CHECKING:
    from slabpool.engine.local.slot import Slot
    from slabpool.engine.local.supervisor import Supervisor


RELOAD_RETRIES = 2  # start-up deaths of a swapped slot, not reported by its session, retried


@dataclass(eq=False)
class Reload(ReloadPlan):
    """A swap of local workers, driven by the supervisor thread."""

    retries: int = 0  # start-up deaths retried (for the slot being swapped)

    def start(self, sup: Supervisor) -> None:
        self.order = self.order or [s.index for s in sup.slots]
        self._swap(sup, sup.slots[self.at])

    def _swap(self, sup: Supervisor, slot: Slot) -> None:
        sup.set_spec(slot, self.spec)
        sup.replace_slot(slot, drain=self.drain)

    def _current(self, sup: Supervisor, slot: Slot) -> bool:
        """The slot being swapped, in an incarnation started on our spec (not one that was
        already starting on the old model when the swap reached it)."""
        return not self.done.is_set() and slot.index == self.at and slot.spec is self.spec

    def on_ready(self, sup: Supervisor, slot: Slot) -> None:
        """The slot's new incarnation is up: check its signature, then swap the next slot."""
        if not self._current(sup, slot) or slot.info is None:
            return
        refused = self.refused(sup.info, slot.info)
        if refused is not None:
            self._fail(sup, slot, refused)
        elif self.advance(slot.info):
            sup.end_reload(self, slot.info)
            self.settle()
        else:
            self.retries = 0
            self._swap(sup, sup.slots[self.at])

    def on_start_failed(self, sup: Supervisor, slot: Slot, why: BaseException) -> bool:
        """The new model did not load: put the old one back and stop. True if it was ours to
        handle. A death that the session did not report (a signal: a kill from outside, or a
        crash in native code) is retried RELOAD_RETRIES times first, as a start-up death is; a
        rollback whose model no longer loads leaves the slot to the supervisor's start-up
        retries (and their limit)."""
        if not self._current(sup, slot):
            return False
        if slot.init_error is None and self.retries < RELOAD_RETRIES:
            self.retries += 1
            return False  # the supervisor starts it again, on the new model, after a back-off
        self._fail(sup, slot, SessionInitError(
            f"the new model failed to load on slot {slot.index}; the old model keeps serving: {why}"))
        return self.then is None

    def _fail(self, sup: Supervisor, slot: Slot, error: BaseException) -> None:
        self.error = error
        sup.end_reload(self, None)
        if self.then is None:  # this slot, then the ones already swapped, back to the old model
            sup.start_reload(self.rollback([slot.index, *self.swapped()]))
        else:
            self.settle()
