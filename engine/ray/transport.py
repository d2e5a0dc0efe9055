"""The Ray slot transport (engine.core.transport): each slot is a Ray actor
(engine.ray.actor.SlotActor); a batch is one actor call whose arguments are the tasks'
ObjectRefs. The owner (engine.core.coordinator) is the local engine's, unchanged.

Inside, and nowhere else: actor handles, calls in flight, Ray's restarts (max_restarts=-1:
a `ready()` ping, with back-off, until the restarted actor answers) and Ray's errors. Ray's
completion callbacks only put values into one inbox (`_CallDone`, `_Pinged`, `_WAKE`); the
owner thread reads it in `wait()` and turns it into Ready, Done and Died, in order:

- a call's result becomes a Done once every call sent before it on that slot has ended
  (callbacks may come in any order; a slot's calls run in order);
- a call failing with RayActorError means the actor died: once every call it held has
  resolved, Died names the task of the first of them (the one that was running).
"""

from __future__ import annotations

import logging
import pickle
import queue
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
from ray.exceptions import ActorDiedError, ObjectLostError, RayActorError

from slabpool.engine.core.admission import MAX_GROUP
from slabpool.engine.core.config import EngineConfig
from slabpool.engine.core.states import KillReason
from slabpool.engine.core.task import Batch, Task
from slabpool.engine.core.transport import (
    Died,
    Done,
    Event,
    InHand,
    Outcome,
    Ready,
    Room,
    TransportLost,
    Unsendable,
    sooner,
)
from slabpool.engine.ray import instance
from slabpool.engine.ray.actor import ActorBatch, ActorReady, CallTask, SlotActor
from slabpool.engine.ray.placement import placeable, resources, slot_request
from slabpool.workers import errors as E
from slabpool.workers import packing
from slabpool.workers.pipeline import IDLE, STACKED
from slabpool.workers.protocol import Sealed
from slabpool.workers.session import SessionSpec

log = logging.getLogger("slabpool.engine.ray")
MAX_PING_BACKOFF_S = 2.0
RAY_LOOK_S = 1.0  # the owner's longest wait: it looks that the Ray instance is still there (check_ray)


@dataclass(eq=False)
class _Call:
    """One actor call in flight: one batch."""

    batch: Batch
    ref: Any
    started: float | None  # when it became the first call of its slot (its run started)
    fut: Future[Any] | None = None  # resolved


@dataclass(eq=False)
class _Actor:
    """A slot's actor, and what the transport knows of it."""

    handle: Any = None
    spec: Any = None
    calls: deque[_Call] = field(default_factory=deque)
    pid: int = 0
    rss: int = 0  # its resident memory when it said it was ready (stats() before any call)
    dead: BaseException | None = None  # a call failed with RayActorError (or we killed it)
    fresh: bool = False  # killed for good (no_restart) or broken: the next start makes a new actor
    ping_at: float | None = None  # Ray restarts it: ping then
    backoff: float = 0.05


@dataclass(frozen=True, slots=True)
class Staged:
    """A task's inputs as step 2 left them (`Task.inputs` on Ray): the ObjectRef of its item,
    and its context pickled at submit (a dict the caller changes afterwards is not what the
    task sees, as locally)."""

    ref: Any
    context: Sealed | None


@dataclass(frozen=True, eq=False)
class _CallDone:
    slot: int
    call: _Call
    fut: Future[Any]


@dataclass(frozen=True, eq=False)
class _Pinged:
    slot: int
    handle: Any
    fut: Future[Any]


_WAKE = object()  # the inbox's wake-up value


class RayTransport:
    """Every slot's actor. Called from the owner thread only (`wake` and the callbacks from any)."""

    can_lend = False  # an actor's answer comes through Ray, to the owner thread (engine.core.fastpath)
    takes_back = False  # a call sent to an actor runs (its answer dropped once revoked)
    startup_bound = False  # Ray places an actor when resources allow: a slot may wait STARTING

    def __init__(self, cfg: EngineConfig, cpus_per_slot: float,
                 actor_options: Mapping[str, Any] | Callable[[int], Mapping[str, Any]] | None) -> None:
        self.cfg = cfg
        self._remote = ray.remote(SlotActor)
        self._options = (cpus_per_slot, actor_options)
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._actors = [_Actor() for _ in range(cfg.workers)]
        self._events: list[Event] = []
        self._closed = False
        self.ray = instance.identity()  # the Ray instance its actors live in (engine.ray.instance)
        self._lost = False  # that instance is gone (check_ray): no call of Ray's is made for it again
        self._request = slot_request(cpus_per_slot, actor_options)
        self.quorum, short = placeable(cfg.workers, self._request)
        if short:
            log.warning("%s; slots beyond the first %d stay STARTING until Ray can place them (their tasks "
                        "wait for the other slots)", short, self.quorum)

    def ready_rss(self, slot: int) -> int:
        """The resident memory its actor reported when it was ready (0 until then)."""
        return self._actors[slot].rss

    # -- the protocol ------------------------------------------------------------------------------

    def start(self, slot: int, spec: SessionSpec | None) -> int:
        a = self._actors[slot]
        if not self.ray_here():
            return 0  # (no call of Ray's: it would start a new local Ray; the next wait says it is gone)
        if a.handle is None or a.fresh or a.spec is not spec:
            self._kill_actor(a.handle)
            a.handle, a.spec, a.fresh = self._new_actor(slot, spec), spec, False
        a.dead, a.backoff = None, 0.05
        self._ping(slot)  # b: Ray restarts a dead actor by itself; the ping says when it is up
        return 0

    def send(self, slot: int, batch: Batch) -> None:
        a = self._actors[slot]
        if not self.ray_here():
            return  # (as in start: the next wait fails every task it holds, this batch's too)
        fi = self.cfg.fault_injection
        staged: list[Staged] = [t.inputs for t in batch.tasks]
        tasks = [CallTask(t.id, t.attempts, t.seed, s.context, t.fault if fi else None, t.step)
                 for t, s in zip(batch.tasks, staged, strict=True)]
        try:
            ref = a.handle.run_batch.remote(tasks, batch.stack, [s.ref for s in staged])  # (read there)
        except Exception as exc:
            raise Unsendable(f"{type(exc).__name__}: {exc}") from exc
        call = _Call(batch, ref, time.monotonic() if not a.calls else None)
        a.calls.append(call)
        ref.future().add_done_callback(lambda f, s=slot, c=call: self._inbox.put(_CallDone(s, c, f)))

    def revoke(self, slot: int, batch: Batch) -> bool:
        """A call sent to an actor cannot be taken back; its tasks may run elsewhere all the
        same (their inputs are immutable ObjectRefs), and its answer, when it comes, is dropped."""
        return True

    def kill(self, slot: int, reason: KillReason, grace: float) -> None:
        a = self._actors[slot]
        for_good = reason.planned
        if self.ray_here():
            self._kill_actor(a.handle, restart=not for_good)
        a.fresh = a.fresh or for_good
        a.dead = a.dead or E.WorkerError(f"the actor of slot {slot} was killed ({reason.value})")
        a.ping_at = None
        self._settle(slot)

    def retire(self, slot: int) -> None:
        self.kill(slot, KillReason.RETIRE, 0.0)  # it holds nothing: a new actor takes its place

    def release(self, tasks: Iterable[Task]) -> None:
        for t in tasks:
            t.inputs = None  # the object store may free the inputs now

    def in_hand(self, slot: int) -> InHand:
        calls = self._actors[slot].calls
        if not calls:
            return InHand(IDLE, None)
        head = calls[0]
        b = head.batch
        running = STACKED if b.stack and len(b.tasks) > 1 else (b.tasks[0].id if b.tasks else IDLE)
        return InHand(running, head.started)

    def waiting(self, slot: int) -> bool:
        return False

    def room(self) -> Room:
        # a call of several tasks runs them in turn, and the actor's clock is the call's: with a
        # task_timeout, one task a call (stacked batches are one run, and count as one)
        return Room(max_tasks=1 if self.cfg.task_timeout is not None else MAX_GROUP)

    def wake(self) -> None:
        self._inbox.put(_WAKE)

    def memory(self, slot: int) -> tuple[int, int, int]:
        return 0, 0, 0

    def startup_timeout_error(self, timeout: float, up: int) -> E.SessionInitError | None:
        if up:
            log.warning("%d of %d slots ready after %s s; the others stay STARTING (each slot asks %s; free now: %s)",
                        up, len(self._actors), timeout, self._request, resources(free=True))
            return None
        free = resources(free=True)
        if all(free.get(k, 0.0) >= v for k, v in self._request.items()):  # (room now: it was placed, never ready)
            return E.SessionInitError(
                f"no Ray actor ready after {timeout} s, with room for them ({free} free; each slot asks "
                f"{self._request}): each actor died or hung as it started (its initializer, or its session's "
                "build: Ray restarts a dead one for ever; the raylet's log says how each died), or cannot "
                "import the model's code")
        return E.SessionInitError(
            f"no Ray actor ready after {timeout} s: the cluster lacks the resources "
            f"(each slot asks {self._request}; the cluster has {resources()} in all, "
            f"{free} free) or cannot import the model's code")

    def close(self) -> None:
        self._closed = True  # a late ping or call changes nothing now
        here = self.ray_here()  # (gone: its actors went with it, and a stale handle's kill hung)
        for a in self._actors:
            if here:
                self._kill_actor(a.handle)
            a.handle = None

    def abort(self) -> None:
        self.close()

    # -- the wait ------------------------------------------------------------------------------------

    def wait(self, timeout: float | None) -> list[Event]:
        self.check_ray()  # (~2 us: before any ping, which would start a new local Ray were it gone)
        now = time.monotonic()
        pings = [a.ping_at for a in self._actors if a.ping_at is not None]
        timeout = sooner(RAY_LOOK_S if timeout is None else min(timeout, RAY_LOOK_S), pings, now)
        if not self._events:
            try:
                self._on(self._inbox.get(timeout=timeout))
            except queue.Empty:
                pass
        while True:
            try:
                self._on(self._inbox.get_nowait())
            except queue.Empty:
                break
        now = time.monotonic()
        for i, a in enumerate(self._actors):
            if a.ping_at is not None and now >= a.ping_at:
                self._ping(i)
        events, self._events = self._events, []
        return events

    def check_ray(self) -> None:
        """TransportLost if the Ray instance the actors live in is gone (ray.shutdown() under
        the engine, maybe another ray.init() since): nothing it held will ever answer. Was: the
        tasks in flight never ended, and the next submit started a new local Ray."""
        if self._closed or self.ray_here():
            return
        raise TransportLost(E.WorkerError(
            "Ray was shut down under this engine (ray.shutdown(), or its cluster went away): its actors and the "
            "tasks they held are gone; close it, and make a new RayEngine on the Ray now running"))

    def ray_here(self) -> bool:
        """The Ray instance the actors live in is still this process's."""
        if not self._lost and instance.identity() != self.ray:
            self._lost = True
        return not self._lost

    def _on(self, got: Any) -> None:
        if self._closed or got is _WAKE:
            return
        if type(got) is _CallDone:
            got.call.fut = got.fut
            if isinstance(got.fut.exception(), RayActorError):
                a = self._actors[got.slot]
                a.dead = a.dead or got.fut.exception()
            self._settle(got.slot)
        elif type(got) is _Pinged:
            self._on_ping(got)

    def _settle(self, slot: int) -> None:
        """Dones for the slot's first calls that have ended, in order; once a dead actor's
        calls have all resolved, its Died (the first of them was running)."""
        a = self._actors[slot]
        while a.calls and a.calls[0].fut is not None and (a.dead is None or a.calls[0].fut.exception() is None):
            call = a.calls.popleft()  # (a call that ended before its actor died still counts)
            self._events.append(self._done(slot, call))
            call.fut = None  # (its done-callback holds the call: no cycle left for the collector)
            if a.calls and a.calls[0].started is None:
                a.calls[0].started = time.monotonic()
        if a.dead is None or any(c.fut is None for c in a.calls):
            return
        first = a.calls[0] if a.calls else None
        running = self.in_hand(slot).task if first is not None else IDLE
        a.calls.clear()
        self._events.append(Died(slot, a.pid, None, running, cause=a.dead))

    def _done(self, slot: int, call: _Call) -> Done:
        """Step 8: outputs read from the object store are read-only views; the caller gets its
        own copies. A lost output (its node died) runs again, uncharged."""
        assert call.fut is not None
        exc = call.fut.exception()
        tasks = call.batch.tasks
        if call.batch.revoked:  # its tasks ran elsewhere (the watchdog emptied it): its answer is dropped
            return Done(slot, call.batch.id, (), 0.0)
        if exc is not None:
            lost = isinstance(exc, ObjectLostError)
            return Done(slot, call.batch.id, tuple(Outcome(t, split=True) if lost else Outcome(t, error=_failed(t, exc))
                                                   for t in tasks if not t.state.is_terminal), 0.0)
        got: ActorBatch = call.fut.result()
        outcomes = []
        for t, out, err in zip(tasks, got.outputs, got.errors, strict=True):
            if t.state.is_terminal:
                continue
            if err is not None:
                outcomes.append(Outcome(t, error=E.from_remote(err, t.id)))
                continue
            t0 = time.perf_counter()
            outcomes.append(Outcome(t, outputs=_owned(out), copy_s=time.perf_counter() - t0))
        return Done(slot, call.batch.id, tuple(outcomes), got.run_s, got.rss, 0, got.pid)

    # -- start-up and restarts ------------------------------------------------------------------------

    def _ping(self, slot: int) -> None:
        a = self._actors[slot]
        a.ping_at = None
        handle = a.handle
        if not self.ray_here():
            return
        handle.ready.remote().future().add_done_callback(lambda f, s=slot, h=handle: self._inbox.put(_Pinged(s, h, f)))

    def _on_ping(self, got: _Pinged) -> None:
        a = self._actors[got.slot]
        if got.handle is not a.handle or a.dead is not None:
            return  # an actor swapped out, or killed since: its death is reported instead
        exc = got.fut.exception()
        if exc is None:
            msg: ActorReady = got.fut.result()
            if msg.error is not None:
                a.fresh = True  # its constructor failed: the next start makes a new actor
                err = E.SessionInitError(f"slot {got.slot} could not build its session: {msg.error.type_name}: "
                                         f"{msg.error.message}")
                err.__cause__ = E.RemoteTraceback(msg.error.traceback)
                self._events.append(Died(got.slot, msg.pid, None, IDLE, startup_error=err, reported=True))
                return
            a.pid, a.rss = msg.pid, msg.rss
            self._events.append(Ready(got.slot, msg.pid, msg.info, msg.node_id))
            return
        if isinstance(exc, ActorDiedError):
            # dead for good: a ping to an actor Ray restarts waits for it, so this one will
            # never answer (ray.kill()'s default is no restart; or Ray gave up on it). A start
            # that failed, counted as one; the next start makes a new actor. Was: pinged again
            # for ever unless the error said "max_restarts": the slot STARTING for good, and
            # with one slot every task waited for ever.
            a.fresh = True
            self._events.append(Died(got.slot, a.pid, None, IDLE, startup_error=E.SessionInitError(
                f"the actor of slot {got.slot} is dead for good: {exc}"), cause=exc))
            return
        a.ping_at = time.monotonic() + a.backoff  # Ray is still restarting it (ActorUnavailableError)
        a.backoff = min(a.backoff * 2, MAX_PING_BACKOFF_S)

    def _new_actor(self, index: int, spec: SessionSpec | None) -> Any:
        """The actor of slot `index` on `spec` (Ray restarts it on the same spec)."""
        cpus_per_slot, actor_options = self._options
        opts: dict[str, Any] = {"num_cpus": cpus_per_slot, "max_restarts": -1, "max_task_retries": 0,
                                "max_concurrency": 1}
        extra = actor_options(index) if callable(actor_options) else actor_options
        opts.update(check_actor_options(extra or {}))
        cfg = self.cfg
        return self._remote.options(**opts).remote(
            index, spec, cfg.preprocess, cfg.postprocess, cfg.initializer, cfg.initargs, cfg.task_timeout)

    @staticmethod
    def _kill_actor(handle: Any, restart: bool = False) -> None:
        if handle is None:
            return
        try:
            ray.kill(handle, no_restart=not restart)
        except Exception as exc:  # noqa: BLE001 - Ray already gone: nothing left to kill
            log.debug("could not kill an actor: %s", exc)


# what the engine's recovery rests on: Ray restarts a dead actor (and the engine replays what it
# held, quarantines what killed it), retries no call itself, and runs one call at a time
_ENGINE_OWNS = ("max_restarts", "max_task_retries", "max_concurrency")


def check_actor_options(options: Mapping[str, Any]) -> Mapping[str, Any]:
    """`actor_options`, refused where they would take over what the engine's recovery needs.
    Was: merged over the engine's own, so max_restarts=0 left a crashed slot STARTING for good
    (every Future hung) and max_task_retries=-1 had Ray retry a poison task for ever."""
    taken = [k for k in _ENGINE_OWNS if k in options]
    if taken:
        raise ValueError(f"actor_options {taken} are the engine's: it restarts every dead actor itself "
                         "(max_restarts=-1), replays and quarantines what it held (max_task_retries=0), one "
                         "call at a time (max_concurrency=1); use max_attempts and task_timeout instead")
    return options


def _failed(task: Task, exc: BaseException) -> E.SessionRunError:
    err = E.SessionRunError(f"task {task.id} failed in Ray: {type(exc).__name__}", task_id=task.id)
    err.__cause__ = exc
    return err


def _owned(obj: Any) -> Any:
    """Outputs read from the object store are read-only views: give the caller its own copies,
    in containers of the classes they came in (an OrderedDict, a namedtuple, ... as locally:
    workers.packing.like)."""
    if isinstance(obj, np.ndarray):
        return obj if obj.flags.writeable and obj.flags.owndata else obj.copy()
    if type(obj) is dict:
        return {k: _owned(v) for k, v in obj.items()}
    if type(obj) is list or type(obj) is tuple:
        return type(obj)(_owned(v) for v in obj)
    if isinstance(obj, (dict, list, tuple)):
        return packing.like(obj, [_owned(v) for v in (obj.values() if isinstance(obj, dict) else obj)])
    if obj is None or isinstance(obj, (str, bytes, int, float, complex, np.generic)):
        return obj
    try:  # any other object (a postprocess's dataclass) may hold views too: a copy of it, as locally
        return pickle.loads(pickle.dumps(obj, protocol=4))  # (5 keeps a read-only array read-only)
    except Exception:  # noqa: BLE001 - what plain pickle cannot copy (Ray's cloudpickle made it) stays
        return obj
