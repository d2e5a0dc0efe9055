"""The owner thread of a RayEngine (steps 3-4, 8-9 and the crash path a-d of the diagram in
`engine.ray.backend`): `_Ledger` runs on `engine.core.owner.OwnerThread` with the task ledger
`engine.core.ledger.TaskLedger`; `_RaySlot` is one slot (an actor), `_Flight` one call in
flight, `RayTask` a task whose inputs are in Ray's object store."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
from ray.exceptions import ActorDiedError, ObjectLostError, RayActorError

from slabpool.engine.core.admission import TaskQueue
from slabpool.engine.core.config import EngineConfig
from slabpool.engine.core.ledger import TaskLedger
from slabpool.engine.core.metrics import Metrics
from slabpool.engine.core.owner import OwnerThread
from slabpool.engine.core.states import KillReason, SlotState, TaskState
from slabpool.engine.core.task import Batch, Task
from slabpool.engine.ray.actor import ActorDone, ActorReady, SlotActor
from slabpool.engine.ray.placement import placeable, resources, slot_request
from slabpool.engine.ray.reload import RayReload
from slabpool.workers import errors as E
from slabpool.workers.errors import Crash
from slabpool.workers.protocol import SessionInfo
from slabpool.workers.session import SessionSpec

log = logging.getLogger("slabpool.engine.ray")

MAX_PING_BACKOFF_S = 2.0


@dataclass(eq=False)
class RayTask(Task):
    """A `Task` whose inputs live in Ray's object store: replays reuse the same ObjectRef."""

    ref: Any = None


@dataclass(eq=False)
class _Flight:
    """One call in flight: the (task id, attempt) whose completion is the only one accepted."""

    task: RayTask
    attempt: int
    slot: int
    seq: int  # dispatch order on its slot: the lowest failed one was running when it died
    call: Any  # the ObjectRef of the call
    resolved: bool = False
    died: BaseException | None = None


@dataclass(eq=False)
class _RaySlot:
    index: int
    actor: Any
    state: SlotState = SlotState.NEW
    pid: int = 0
    node_id: str = ""
    info: SessionInfo | None = None
    flights: list[_Flight] = field(default_factory=list)  # in dispatch order
    seq: int = 0
    incarnation: int = 0  # +1 each time a ready() ping succeeds
    restarts: int = 0
    tasks_done: int = 0
    ping_at: float | None = None  # next ready() ping while Ray restarts it
    ping_backoff: float = 0.05
    pinging: bool = False
    kill_reason: KillReason | None = None  # a death we caused (cancel(kill=True)) blames no task
    swapping: bool = False  # a reload swaps its actor: no new work for it

    def move(self, new: SlotState) -> None:
        self.state = new

    @property
    def healthy(self) -> bool:
        return self.state in (SlotState.READY, SlotState.BUSY)

    @property
    def open(self) -> bool:
        """It may be sent work."""
        return self.healthy and not self.swapping



def _owned(obj: Any) -> Any:
    """Outputs read from the object store are read-only views: give the caller its own copies."""
    if isinstance(obj, np.ndarray):
        return obj if obj.flags.writeable and obj.flags.owndata else obj.copy()
    if isinstance(obj, dict):
        return {k: _owned(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_owned(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_owned(v) for v in obj)
    return obj


class _Ledger(OwnerThread, TaskLedger):
    """The owner thread of a RayEngine (engine.core.owner) with its task ledger (engine.core.ledger):
    the only thread that changes slots and running tasks. It sleeps on one inbox that Ray's
    completion callbacks and callers' calls feed."""

    def __init__(
        self,
        cfg: EngineConfig,
        q: TaskQueue,
        metrics: Metrics,
        cpus_per_slot: float,
        actor_options: Mapping[str, Any] | Callable[[int], Mapping[str, Any]] | None,
    ) -> None:
        OwnerThread.__init__(self, "slabpool-ray-ledger", self)
        TaskLedger.__init__(self, q, metrics, self._release, self._kill_running)
        self.cfg = cfg
        self.info: SessionInfo | None = None
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._flights: dict[int, _Flight] = {}  # task id -> its one call in flight
        self._stopping = False  # the actors are being killed: a late ping changes nothing
        self._remote = ray.remote(SlotActor)
        self._actor_options = (cpus_per_slot, actor_options)
        self.spec = cfg.session_spec()  # the model the engine serves
        self.reload: RayReload | None = None  # a hot model swap in progress
        self.slots = [_RaySlot(i, self.new_actor(i, self.spec)) for i in range(cfg.workers)]
        self.on_stopped: Callable[[], None] = lambda: None

    def new_actor(self, index: int, spec: SessionSpec | None) -> Any:
        """Start the actor of slot `index` on `spec` (Ray restarts it on the same spec)."""
        cpus_per_slot, actor_options = self._actor_options
        opts: dict[str, Any] = {"num_cpus": cpus_per_slot, "max_restarts": -1, "max_task_retries": 0,
                                "max_concurrency": 1}
        extra = actor_options(index) if callable(actor_options) else actor_options
        opts.update(extra or {})
        cfg = self.cfg
        return self._remote.options(**opts).remote(
            index, spec, cfg.preprocess, cfg.postprocess, cfg.initializer, cfg.initargs)

    # -- start ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Wait until the slots the cluster can hold have built their sessions (at least one);
        SessionInitError if one cannot, or if none is up within startup_timeout. A slot Ray
        cannot place now stays STARTING, with a warning naming the resource it lacks; it
        serves once Ray places it, and its tasks wait for the other slots meanwhile."""
        for s in self.slots:
            s.move(SlotState.STARTING)
        refs = [s.actor.ready.remote() for s in self.slots]
        request = slot_request(*self._actor_options)
        need, short = placeable(len(self.slots), request)
        if short:
            log.warning("%s; slots beyond the first %d stay STARTING until Ray can place them (their tasks "
                        "wait for the other slots)", short, need)
        try:
            ready, _ = ray.wait(refs, num_returns=need, timeout=self.cfg.startup_timeout)
            if not ready:
                raise E.SessionInitError(
                    f"no Ray actor ready after {self.cfg.startup_timeout} s: the cluster lacks the resources "
                    f"(each slot asks {request}; the cluster has {resources()} in all, "
                    f"{resources(free=True)} free) or cannot import the model's code")
            if len(ready) < need:
                log.warning("%d of %d slots ready after %s s; the others stay STARTING (each slot asks %s; "
                            "free now: %s)", len(ready), len(refs), self.cfg.startup_timeout, request,
                            resources(free=True))
            done = set(ready)
            for s, ref in zip(self.slots, refs, strict=True):
                if ref in done:
                    self._on_ready(s, ray.get(ref))
                    if self.failure is not None:
                        raise self.failure
                else:  # answered later, on the loop (as a restarted actor's ping is)
                    s.pinging = True
                    ref.future().add_done_callback(lambda f, s=s: self.post(("ready", s, f)))
        except RayActorError as exc:
            self._kill_all()
            raise E.SessionInitError(f"a Ray actor died during start-up: {exc}") from None
        except BaseException:
            self._kill_all()
            raise
        self.start_loop()

    def _on_ready(self, s: _RaySlot, msg: ActorReady) -> None:
        if msg.error is not None:
            exc = E.SessionInitError(
                f"slot {s.index} could not build its session: {msg.error.type_name}: {msg.error.message}")
            exc.__cause__ = E.RemoteTraceback(msg.error.traceback)
            self.fail(exc)
            return
        s.move(SlotState.READY)
        self._up(s, msg)
        s.ping_backoff, s.pinging, s.ping_at, s.kill_reason = 0.05, False, None, None
        if msg.info is not None:
            self.info = self.info or msg.info

    @staticmethod
    def _up(s: _RaySlot, msg: ActorReady) -> None:
        """A (new) incarnation of the slot's actor answered."""
        s.pid, s.node_id, s.incarnation = msg.pid, msg.node_id, s.incarnation + 1
        s.info = msg.info or s.info

    # -- the loop (engine.core.owner) ---------------------------------------------------------------

    def wake(self) -> None:
        self._inbox.put(("wake",))

    def post(self, event: tuple[Any, ...]) -> None:
        self._inbox.put(event)

    def step(self) -> None:
        timer = self._next_timer(time.monotonic())
        try:
            event = self._inbox.get(timeout=timer)
        except queue.Empty:
            event = ("wake",)
        while True:
            self._handle(event)
            try:
                event = self._inbox.get_nowait()
            except queue.Empty:
                break
        self.run_calls()
        now = time.monotonic()
        self._timers(now)
        if self.reload is not None:
            self.reload.step(self)
        self._dispatch(now)
        self.flush()

    def _handle(self, event: tuple[Any, ...]) -> None:
        kind = event[0]
        if kind == "done":
            self._on_done(event[1], event[2])
        elif kind == "ready":
            self._on_ping(event[1], event[2])
        elif kind == "reload":
            if self.reload is not None and self.reload.on_ready(self, event[1], event[2]):
                return
            self.kill_actor(event[1])  # a swap that ended before its actor answered

    def finished(self) -> bool:
        if self.failure is not None:
            return True
        return self.closing is not None and len(self.queue) == 0 and not self._flights

    def fail(self, error: BaseException) -> None:
        self.fail_all(error)

    def stopped(self) -> None:
        if self.reload is not None:
            self.reload.abort(E.EngineClosed("the engine closed during the reload"))
            self.kill_actor(self.reload.actor)
        self.abort("the engine closed while it ran")
        self._kill_all()
        self.flush()
        self.on_stopped()

    # -- the ledger's hooks (engine.core.ledger) ----------------------------------------------------

    def _kill_running(self, task: Task) -> None:
        flight = self._flights.get(task.id)
        if flight is None:
            return
        slot = self.slots[flight.slot]
        if slot.healthy and slot.flights and slot.flights[0] is flight:
            slot.kill_reason = KillReason.CANCEL
            ray.kill(slot.actor, no_restart=False)  # Ray restarts it; its other tasks replay

    def _release(self, task: Task) -> None:
        if isinstance(task, RayTask):
            task.ref = None  # the object store may free the inputs now

    def abort(self, reason: str) -> None:
        """close() ran out of time (or the loop ends): every task ends now, cancelled."""
        self.abort_in_hand(reason)
        self._flights.clear()
        for s in self.slots:
            s.flights.clear()
        self.failure = self.failure or E.EngineClosed(reason)

    # -- dispatch (steps 3-4) ------------------------------------------------------------------

    def _dispatch(self, now: float) -> None:
        depth = self.cfg.inflight_per_slot
        while True:
            open_slots = [s for s in self.slots if s.open and len(s.flights) < depth]
            if not open_slots:
                return
            slot = min(open_slots, key=lambda s: len(s.flights))  # idle slots first
            got = self.queue.take(1, 0.0, now, max_tasks=1)  # one task per actor call
            if not isinstance(got, Batch):
                return
            for task in got.tasks:
                assert isinstance(task, RayTask)
                self._send(slot, task, now)

    def _send(self, slot: _RaySlot, task: RayTask, now: float) -> None:
        if not self.dispatchable(task):
            return
        task.move(TaskState.RUNNING)
        task.attempts += 1
        task.dispatched_at = task.dispatched_at or now
        fault = task.fault if self.cfg.fault_injection else None
        call = slot.actor.run.remote(task.ref, task.id, task.attempts, task.seed, task.context, fault, task.step)
        slot.seq += 1
        flight = _Flight(task, task.attempts, slot.index, slot.seq, call)
        slot.flights.append(flight)
        self._flights[task.id] = flight
        if slot.state is SlotState.READY:
            slot.move(SlotState.BUSY)
        call.future().add_done_callback(lambda f, fl=flight: self.post(("done", fl, f)))

    # -- completions (steps 8-9) ---------------------------------------------------------------

    def _on_done(self, flight: _Flight, fut: Future[Any]) -> None:
        flight.resolved = True
        slot = self.slots[flight.slot]
        if flight not in slot.flights:  # a call of an actor that a reload swapped out: settled
            return
        exc = fut.exception()
        if isinstance(exc, RayActorError):
            flight.died = exc
            if slot.healthy:
                slot.move(SlotState.DEAD)  # a: its other calls are failing too
            self._maybe_settle(slot)
            return
        current = self._current(flight)
        self._unlink(slot, flight)
        if not current:
            log.warning("dropped a stale completion of task %d attempt %d", flight.task.id, flight.attempt)
            return
        task = flight.task
        if isinstance(exc, ObjectLostError):  # the output was lost with its node: run it again
            self._requeue([task])
        elif exc is not None:
            err = E.SessionRunError(f"task {task.id} failed in Ray: {type(exc).__name__}", task_id=task.id)
            err.__cause__ = exc
            self.finish(task, error=err)
        else:
            self._on_result(slot, task, fut.result())
        self._maybe_settle(slot)

    def _on_result(self, slot: _RaySlot, task: RayTask, done: ActorDone) -> None:
        slot.tasks_done += 1
        if done.error is not None:
            self.finish(task, error=E.from_remote(done.error, task.id))
            return
        t0 = time.perf_counter()
        outputs = _owned(done.outputs)  # step 8
        copy_s = time.perf_counter() - t0
        version = slot.info.model_digest if slot.info else ""
        self.finish(task, result=task.result(outputs, version, slot.index, done.pid, done.run_s, copy_s,
                                             time.monotonic()))

    def _current(self, flight: _Flight) -> bool:
        """Exactly-once: only the (task id, attempt) in flight may complete its task."""
        return self._flights.get(flight.task.id) is flight and flight.task.attempts == flight.attempt

    def _unlink(self, slot: _RaySlot, flight: _Flight) -> None:
        if flight in slot.flights:
            slot.flights.remove(flight)
        if self._flights.get(flight.task.id) is flight:
            del self._flights[flight.task.id]
        if slot.state is SlotState.BUSY and not slot.flights:
            slot.move(SlotState.READY)

    # -- deaths (the crash path: a-d) ----------------------------------------------------------

    def _maybe_settle(self, slot: _RaySlot) -> None:
        """Once every call a dead slot held has resolved: decide each task's fate, then ping."""
        if slot.state is not SlotState.DEAD or slot.pinging or slot.ping_at is not None:
            return
        if any(not f.resolved for f in slot.flights):
            return
        died = [f for f in slot.flights if f.died is not None]
        for f in list(slot.flights):
            self._unlink(slot, f)
        reason = slot.kill_reason
        slot.restarts += 1
        if reason is None:
            log.warning("actor of slot %d (pid %d) died holding %d task(s): %s", slot.index, slot.pid,
                        len(died), died[0].died if died else "")
        replays: list[RayTask] = []
        for i, f in enumerate(sorted(died, key=lambda f: f.seq)):
            task = f.task
            if task.state.is_terminal:  # cancelled while it ran
                continue
            if i == 0 and reason is None:  # d: the one running when the actor died
                task.crashes.append(Crash(slot.index, slot.pid, None))
                if len(task.crashes) >= self.cfg.max_attempts:
                    self.quarantine(task, f.died)
                    continue
            replays.append(task)
        self._requeue(replays)  # c
        slot.move(SlotState.STARTING)  # b: Ray restarts the actor; ping until it answers
        slot.ping_at = time.monotonic()

    def _requeue(self, tasks: list[RayTask]) -> None:
        tasks = [t for t in tasks if not t.state.is_terminal]  # cancelled meanwhile: never again
        for t in tasks:
            t.move(TaskState.QUEUED)
        if tasks:
            self.queue.push_replays([Batch([t], stack=False) for t in sorted(tasks, key=lambda t: t.id)])

    def _ping(self, slot: _RaySlot) -> None:
        slot.ping_at, slot.pinging = None, True
        ref = slot.actor.ready.remote()
        ref.future().add_done_callback(lambda f, s=slot: self.post(("ready", s, f)))

    def _on_ping(self, slot: _RaySlot, fut: Future[Any]) -> None:
        slot.pinging = False
        if self._stopping:
            return
        exc = fut.exception()
        if exc is None:
            self._on_ready(slot, fut.result())
            log.info("slot %d is back (pid %d, node %s)", slot.index, slot.pid, slot.node_id[:8])
            return
        if _permanently_dead(exc):
            self.fail(E.WorkerError(f"the actor of slot {slot.index} is dead for good: {exc}"))
            return
        slot.ping_at = time.monotonic() + slot.ping_backoff  # Ray is still restarting it
        slot.ping_backoff = min(slot.ping_backoff * 2, MAX_PING_BACKOFF_S)

    # -- timers --------------------------------------------------------------------------------

    def _next_timer(self, now: float) -> float | None:
        times = [self.queue.next_deadline()] + [s.ping_at for s in self.slots]
        due = [t for t in times if t is not None]
        return max(min(due) - now, 0.0) if due else None

    def _timers(self, now: float) -> None:
        self.expire(now)
        for s in self.slots:
            if s.ping_at is not None and now >= s.ping_at:
                self._ping(s)

    # -- hot model swaps (engine.ray.reload) ----------------------------------------------------

    def model_spec(self) -> SessionSpec | None:
        return self.spec

    def start_reload(self, plan: RayReload) -> None:
        if self.reload is not None:
            plan.abort(E.EngineError("a reload is already in progress"))
        elif self.closing is not None or self.failure is not None:
            plan.abort(E.EngineClosed("the engine is closing"))
        else:
            self.reload = plan
            plan.start(self)

    def end_reload(self, plan: RayReload, info: SessionInfo | None) -> None:
        """A swap ended: its model is the engine's from now on (None: unchanged)."""
        if info is not None:
            self.info, self.spec = info, plan.spec
        if self.reload is plan:
            self.reload = None

    def hand_back(self, slot: _RaySlot) -> None:
        """Its calls in flight go back to the queue uncharged (their completions are dropped)."""
        tasks = [f.task for f in slot.flights if not f.task.state.is_terminal]
        for f in list(slot.flights):
            self._unlink(slot, f)
        self._requeue(tasks)

    def swap_actor(self, slot: _RaySlot, actor: Any, msg: ActorReady) -> None:
        """The slot's actor is now `actor` (ready, running the new model); the old one goes."""
        old, slot.actor, slot.swapping = slot.actor, actor, False
        self._up(slot, msg)
        self.kill_actor(old)

    @staticmethod
    def kill_actor(actor: Any) -> None:
        if actor is None:
            return
        try:
            ray.kill(actor, no_restart=True)
        except Exception as exc:  # noqa: BLE001 - Ray already gone: nothing left to kill
            log.debug("could not kill an actor: %s", exc)

    def _kill_all(self) -> None:
        self._stopping = True
        for s in self.slots:
            self.kill_actor(s.actor)
            if s.state is not SlotState.STOPPED:
                s.state = SlotState.STOPPED


def _permanently_dead(exc: BaseException) -> bool:
    """ActorDiedError after Ray gave up restarting it (it never does with max_restarts=-1 unless
    the actor's owner died): anything else is Ray still restarting it, so the ping retries."""
    return isinstance(exc, ActorDiedError) and "max_restarts" in str(exc)
