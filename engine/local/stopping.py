"""The stop path of a local Engine's supervisor (its `_stopped`, on the owner thread, after the
loop): stop every worker, end every task that is left, let the arenas go.

No step can stop the others: an engine that failed of a MemoryError meets it again here, so
each step is contained and logged, and a last pass ends any Future still pending with an error
made at import time (it needs no memory). Workers are stopped through the same selector the
loop used, reading and writing their pipes meanwhile: a worker blocked sending would otherwise
never take its Shutdown.
"""

from __future__ import annotations

import logging
import os
import selectors
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from slabpool.engine.core.ledger import cancelled
from slabpool.engine.core.states import KillReason, SlotState
from slabpool.engine.local.slot import Slot
from slabpool.workers import errors as E
from slabpool.workers.protocol import Shutdown

if TYPE_CHECKING:
    from slabpool.engine.local.supervisor import Supervisor

log = logging.getLogger("slabpool.engine")
# made now: when nothing else can be made (no memory), a Future left pending still ends with it
_STOP_FAILED = E.EngineInternalError("the engine's stop failed before this task ended (see the log)")
SHUTDOWN_GRACE = 5.0  # seconds a worker has to exit on Shutdown before SIGKILL


def stop(sup: Supervisor) -> None:
    """After the loop: stop every worker, end what is left, let the arenas go. No step
    can stop the others (an engine that failed of a MemoryError meets it again here):
    each is contained, and every Future ends whatever happened before."""
    steps: tuple[Callable[[], None], ...] = (
        partial(_abort_reload, sup), partial(_shutdown_slots, sup), partial(_end_the_rest, sup), sup.flush,
        partial(_drop_status, sup), sup.on_stopped)
    for step in steps:
        try:
            step()
        except BaseException:  # logged; the next step runs still
            log.exception("stopping the engine: %s failed", getattr(step, "func", step).__name__)
    _last_resort(sup)


def _abort_reload(sup: Supervisor) -> None:
    if sup.reload is not None:
        sup.reload.abort(E.EngineClosed("the engine closed during the reload"))


def _end_the_rest(sup: Supervisor) -> None:
    """Whatever has not ended (the loop failed before it could end it) ends now."""
    why = sup.failure or E.EngineClosed("the engine stopped before this task ended")
    for task in sup.queue.drain_all() + list(sup._unfinished.values()):
        sup.finish(task, error=why)


def _drop_status(sup: Supervisor) -> None:
    if hasattr(sup, "status"):
        del sup.status  # the last view into an arena: they can be unmapped now


def _last_resort(sup: Supervisor) -> None:
    """Futures that no step could end (finish itself failed) end with an error made
    before anything could fail."""
    futures = [t.future for t in sup._unfinished.values()] + [c[0] for c in sup._completions]
    for fut in futures:
        try:
            if not fut.done():
                fut.set_exception(_STOP_FAILED)
        except BaseException:  # noqa: BLE001 - it ended meanwhile
            continue


def _shutdown_slots(sup: Supervisor) -> None:
    """Stop every worker: Shutdown, a grace, then SIGKILL; reap all; release every lease.
    Their pipes are read and written meanwhile: a worker blocked sending would otherwise
    never take its Shutdown."""
    for slot in sup.slots:
        if slot.process is not None and slot.state is SlotState.STARTING:
            slot.escalate()  # it holds nothing, and may never read a Shutdown (a hung initializer)
        elif slot.process is not None and slot.kill_reason is None:
            slot.kill_reason = KillReason.SHUTDOWN
            slot.send(Shutdown())
    deadline = time.monotonic() + SHUTDOWN_GRACE
    while any(s.process is not None for s in sup.slots) and time.monotonic() < deadline:
        _pump(sup, deadline - time.monotonic())
    for slot in sup.slots:
        if slot.process is not None:
            slot.escalate()
            _on_death_final(sup, slot)


def _pump(sup: Supervisor, timeout: float) -> None:
    """One wait of the stop path: read, write, and reap whatever is ready."""
    if sup._watch_dirty:
        sup._sync_watch()
    for key, mask in sup._selector.select(max(timeout, 0.0)):
        kind, slot, obj = key.data
        if kind == "wake":
            os.read(sup._wake_r, 4096)
        elif kind == "conn" and slot.conn is obj:
            if mask & selectors.EVENT_WRITE:
                sup._flush(slot)
            if mask & selectors.EVENT_READ:
                sup._drain(slot)
        elif kind == "exit" and slot.process is obj:
            _on_death_final(sup, slot)


def _on_death_final(sup: Supervisor, slot: Slot) -> None:
    if slot.conn is not None:
        sup._drain(slot, to_end=True)
    sup._forget_slot(slot)
    slot.reap()
    for b in slot.batches:
        sup.regions.release(b)
        sup._unpin(b)
        for t in b.tasks:
            t.in_batch = None
            sup.finish(t, error=cancelled(t, "the engine closed while it ran", "closed"))
            sup._release_input(t)
    slot.batches.clear()
    slot.state = SlotState.STOPPED
