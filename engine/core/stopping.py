"""The stop path (the coordinator's `stopped`, on the owner thread, after the loop): stop every
slot, end every task that is left, let go of what the backend holds. The same for every
backend, through the public methods of the parts.

No step can stop the others: an engine that failed of a MemoryError meets it again here, so
each step is contained and logged, and a last pass ends any Future still pending with an error
made at import time (it needs no memory). Workers are stopped through the same transport wait
the loop used, which reads and writes their pipes meanwhile: a worker blocked sending would
otherwise never take its Shutdown.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from slabpool.engine.core.ledger import cancelled
from slabpool.engine.core.slots import SlotRecord
from slabpool.engine.core.states import KillReason, SlotEvent, SlotState
from slabpool.engine.core.transport import Died, Done, TransportLost
from slabpool.workers import errors as E

if TYPE_CHECKING:
    from slabpool.engine.core.coordinator import Coordinator

log = logging.getLogger("slabpool.engine")
# made now: when nothing else can be made (no memory), a Future left pending still ends with it
_STOP_FAILED = E.EngineInternalError("the engine's stop failed before this task ended (see the log)")
SHUTDOWN_GRACE = 5.0  # seconds a worker has to exit on Shutdown before SIGKILL
_REAP_S = 30.0  # after SIGKILL: how long to wait for the deaths (only a stuck kernel reaches it)


def stop(co: Coordinator) -> None:
    """After the loop: stop every worker, end what is left, let the backend's resources go.
    No step can stop the others (an engine that failed of a MemoryError meets it again
    here): each is contained, and every Future ends whatever happened before. What has
    ended already (every task, when the engine failed) is told to its callers first, not
    after the workers' stop (a hung worker's grace: seconds)."""
    steps: tuple[Callable[[], None], ...] = (
        partial(_abort_reload, co), co.ledger.flush, partial(_shutdown_slots, co), partial(_end_the_rest, co),
        co.ledger.flush, co.transport.close, co.on_stopped)
    for step in steps:
        try:
            step()
        except BaseException:  # logged; the next step runs still
            log.exception("stopping the engine: %s failed", getattr(step, "func", step).__name__)
    _last_resort(co)


def _abort_reload(co: Coordinator) -> None:
    if co.reload is not None:
        co.reload.abort(E.EngineClosed("the engine closed during the reload"))


def _end_the_rest(co: Coordinator) -> None:
    """Whatever has not ended (the loop failed before it could end it) ends now."""
    why = co.ledger.failure or E.EngineClosed("the engine stopped before this task ended")
    for task in co.queue.drain_all() + co.ledger.unfinished():
        co.ledger.finish(task, error=why)


def _last_resort(co: Coordinator) -> None:
    """Futures that no step could end (finish itself failed) end with an error made
    before anything could fail."""
    for fut in co.ledger.pending_futures():
        try:
            if not fut.done():
                fut.set_exception(_STOP_FAILED)
        except BaseException:  # noqa: BLE001 - it ended meanwhile
            continue


def _shutdown_slots(co: Coordinator) -> None:
    """Stop every worker: Shutdown, a grace, then SIGKILL; every death handled. Their pipes
    are read and written meanwhile (the transport's wait)."""
    for slot in co.slots:
        if slot.state is SlotState.STARTING:
            slot.kill_reason = slot.kill_reason or KillReason.SHUTDOWN
            co.transport.kill(slot.index, KillReason.SHUTDOWN, 0.0)  # it holds nothing, and may
            # never read a Shutdown (a hung initializer)
        elif slot.state.live and slot.kill_reason is None:
            slot.kill_reason = KillReason.SHUTDOWN
            co.transport.retire(slot.index)
    _pump(co, time.monotonic() + SHUTDOWN_GRACE)
    for slot in co.slots:
        if slot.state.live:
            co.transport.kill(slot.index, KillReason.SHUTDOWN, 0.0)
    _pump(co, time.monotonic() + _REAP_S)
    for slot in co.slots:
        slot.fire(SlotEvent.STOP)


def _pump(co: Coordinator, deadline: float) -> None:
    """Waits of the stop path until every slot has died (or the deadline): what the workers
    still answer ends its tasks as usual."""
    while any(s.state.live for s in co.slots) and time.monotonic() < deadline:
        try:
            events = co.transport.wait(max(deadline - time.monotonic(), 0.0))
        except TransportLost:
            return  # (what the workers ran on is gone: nothing more will come from them)
        for ev in events:
            if type(ev) is Done:
                co.dispatcher.on_done(ev, time.monotonic())
            elif type(ev) is Died:
                _on_death_final(co, co.slots[ev.slot])


def _on_death_final(co: Coordinator, slot: SlotRecord) -> None:
    for b in slot.batches:
        for t in b.tasks:
            t.in_batch = None
            co.ledger.finish(t, error=cancelled(t, "the engine closed while it ran", "closed"))
        co.transport.release(b.tasks)
    slot.batches.clear()
    slot.fire(SlotEvent.STOP)
