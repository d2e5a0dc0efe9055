"""Hot model swap on Ray actors (the plan and its rules: `engine.core.reload`).

For each slot in turn, a new actor is started on the new model next to the old one, which
keeps serving meanwhile. Once the new actor answers (and its signature is accepted), the slot
takes no more work; it finishes what it holds (drain_slot=True) or hands it back to the queue
(False), then the new actor takes its place and the old one is killed. If the new model fails,
the new actor is killed (the old one never stopped serving) and the slots already swapped are
swapped back. Ray restarts a swapped actor on the new model: an actor's constructor arguments
are its spec.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from slabpool.engine.core.reload import ReloadPlan
from slabpool.engine.core.states import SlotState
from slabpool.workers.errors import SessionInitError

if TYPE_CHECKING:
    from slabpool.engine.ray.actor import ActorReady
    from slabpool.engine.ray.ledger import _Ledger


@dataclass(eq=False)
class RayReload(ReloadPlan):
    """A swap of Ray actors, driven by the ledger thread: `start`, `on_ready`, `step`."""

    actor: Any = None  # the new actor of the slot being swapped
    ready: ActorReady | None = None  # its answer, once it has built the new session

    def start(self, led: _Ledger) -> None:  # type: ignore[override]
        self.order = self.order or [s.index for s in led.slots]
        self._launch(led)

    def _launch(self, led: _Ledger) -> None:
        self.actor, self.ready = led.new_actor(self.at, self.spec), None
        self.actor.ready.remote().future().add_done_callback(
            lambda f, a=self.actor: led.post(("reload", a, f)))

    def on_ready(self, led: _Ledger, actor: Any, fut: Future[ActorReady]) -> bool:  # type: ignore[override]
        """The new actor answered (or died building its session). False if it is not ours."""
        if actor is not self.actor or self.done.is_set():
            return False
        exc = fut.exception()  # the actor died building its session
        msg = fut.result() if exc is None else None
        if msg is None or msg.error is not None or msg.info is None:
            why = f"{msg.error.type_name}: {msg.error.message}" if msg and msg.error else exc
            self._fail(led, SessionInitError(
                f"the new model failed to load on slot {self.at}; the old model keeps serving: {why}"))
            return True
        refused = self.refused(led.info, msg.info)
        if refused is not None:
            self._fail(led, refused)
            return True
        self.ready = msg
        led.slots[self.at].swapping = True  # no new work: it finishes (or hands back) what it holds
        return True

    def step(self, led: _Ledger) -> None:
        """Each ledger step: swap the slot once it holds nothing and is up."""
        if self.ready is None or self.done.is_set():
            return
        slot = led.slots[self.at]
        if not self.drain and slot.healthy:
            led.hand_back(slot)
        if slot.state is not SlotState.READY or slot.flights:
            return  # still finishing its calls, or Ray is restarting its old actor
        led.swap_actor(slot, self.actor, self.ready)
        info = self.ready.info
        assert info is not None
        self.actor = None
        if self.advance(info):
            led.end_reload(self, info)
            self.settle()
        else:
            self._launch(led)

    def _fail(self, led: _Ledger, error: BaseException) -> None:  # type: ignore[override]
        """The new actor goes (the old one never stopped serving); the slots already swapped
        are swapped back before the caller learns why."""
        led.kill_actor(self.actor)
        self.actor = None
        led.slots[self.at].swapping = False
        self.error = error
        led.end_reload(self, None)
        if self.swapped() and self.then is None:
            led.start_reload(self.rollback(self.swapped()))
        else:
            self.settle()
