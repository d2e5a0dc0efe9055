"""The Ray backend: the same `Engine` API, each slot a Ray actor that owns one session.

    |================= caller process (Ray driver) ================|===== actor, slot k =====|
     RayEngine.submit()      ledger thread                             SlotActor.run()
     1 validate inputs   =>  3 choose a healthy slot with room     =>  5 zero-copy views of
     2 ray.put(inputs)       4 mark task RUNNING, attempt + 1            the inputs (plasma)
       (object store)        (task id, attempt) -> in flight           6 preprocess, check,
       Future  <==========   8 copy outputs out, drop stale        <=     session.run,
                             9 complete the Future once                   postprocess

     crash path: a call fails with RayActorError (the actor process died, or its node)
       a  slot k -> DEAD; wait until every call it held has resolved
       b  Ray restarts the actor (max_restarts=-1), anywhere it fits; a ready() ping
          takes slot k STARTING -> READY (backoff while Ray still restarts it)
       c  its failed tasks go back to the queue, ahead of new work, same task id; any
          healthy slot may run them (Ray's own retries are off: max_task_retries=0)
       d  the task that was running when max_attempts actors died -> PoisonTask

Ray gives at-least-once execution and each ObjectRef resolves once; the ledger turns that
into exactly-once delivery: a completion whose (task id, attempt) is not the one in flight
is dropped. Admission (block / reject / drop_oldest, deadlines, cancel while queued) is the
local engine's `TaskQueue`; errors are the same `slabpool.workers.errors`.

Actors: `RayEngine` (caller's API), `_Ledger` (one thread, the only one that touches slots
and running tasks; it sleeps on one inbox that Ray's completion callbacks and callers feed),
`SlotActor` (inside the actor process; `slabpool.workers.session.load_session` builds its session).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
from ray.exceptions import ActorDiedError, ObjectLostError, RayActorError

from slabpool.engine.caller.base import BaseEngine, TaskFuture
from slabpool.engine.core.admission import TaskQueue, superseded_error
from slabpool.engine.core.config import EngineConfig
from slabpool.engine.core.ledger import TaskLedger
from slabpool.engine.core.metrics import Metrics
from slabpool.engine.core.owner import OwnerThread
from slabpool.engine.core.states import EngineState, SlotState, TaskState
from slabpool.engine.core.stats import EngineStats, SlotStats
from slabpool.engine.core.task import Batch, Result, Task, Timings
from slabpool.workers import context as task_context
from slabpool.workers import errors as E
from slabpool.workers.errors import Crash
from slabpool.workers.pipeline import TaskPipeline, error_kind, remote_error, seed_task
from slabpool.workers.protocol import FaultSpec, Packed, RemoteError, SessionInfo
from slabpool.workers.session import ModelSession, SessionSpec, load_session

log = logging.getLogger("slabpool.engine.ray")

_UNSUPPORTED = {  # settings of the local engine that the Ray backend does not implement (yet)
    "max_batch_size": 1, "task_timeout": None, "max_tasks_per_worker": None, "worker_memory_limit": None,
}  # fmt: skip
_IGNORED = ("start_method", "shm_capacity", "shm_backend")  # process and shared-memory details
_NO_PACK = Packed(None, ())  # Ray tasks carry an ObjectRef instead of a shared-memory layout
MAX_PING_BACKOFF_S = 2.0


# -- inside the actor process: steps 5-7 -----------------------------------------------------


@dataclass(frozen=True)
class ActorReady:
    pid: int
    node_id: str
    info: SessionInfo | None
    error: RemoteError | None  # the session could not be built


@dataclass(frozen=True)
class ActorDone:
    """What one call returns: outputs (arrays go back through the object store) or an error."""

    task_id: int
    attempt: int
    outputs: Any
    error: RemoteError | None
    run_s: float
    pid: int


class SlotActor:
    """One slot: owns exactly one session, built once per actor incarnation."""

    def __init__(
        self,
        slot: int,
        spec: SessionSpec | None,
        preprocess: Callable[..., Any] | None,
        postprocess: Callable[..., Any] | None,
        initializer: Callable[..., Any] | None,
        initargs: tuple[Any, ...],
    ) -> None:
        self.slot = slot
        self.session: ModelSession | None = None
        self.error: RemoteError | None = None
        try:  # every failure goes back as data (a raising constructor would be retried for ever)
            if initializer is not None:
                initializer(*initargs)
            self.session = load_session(spec) if spec is not None else None
        except Exception as exc:  # noqa: BLE001
            self.error = remote_error(exc, "run")
        self.pipeline = TaskPipeline(self.session, preprocess, postprocess)

    def ready(self) -> ActorReady:
        return ActorReady(os.getpid(), ray.get_runtime_context().get_node_id(),
                          self.session.info if self.session else None, self.error)

    def run(self, item: Any, task_id: int, attempt: int, seed: int,
            ctx: dict[str, Any] | None, fault: FaultSpec | None) -> ActorDone:
        t0 = time.perf_counter()
        with task_context.bind(ctx):
            try:
                seed_task(seed)  # before preprocess, as in the local worker
                out = self.pipeline(item, fault=fault)
            except Exception as exc:  # noqa: BLE001 - the user's code or the runtime raised
                log.info("task %d failed in %s: %s", task_id, self.pipeline.stage, type(exc).__name__)
                return self._failed(task_id, attempt, remote_error(exc, error_kind(exc)), t0)
        return ActorDone(task_id, attempt, out, None, time.perf_counter() - t0, os.getpid())

    @staticmethod
    def _failed(task_id: int, attempt: int, err: RemoteError, t0: float) -> ActorDone:
        return ActorDone(task_id, attempt, None, err, time.perf_counter() - t0, os.getpid())


# -- the caller's side -----------------------------------------------------------------------


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
    kill_reason: str | None = None  # "cancel", "shutdown": a death we caused blames no task

    def move(self, new: SlotState) -> None:
        self.state.check(new)
        self.state = new

    @property
    def healthy(self) -> bool:
        return self.state in (SlotState.READY, SlotState.BUSY)


class RayEngine(BaseEngine):
    """`RayEngine(model, workers=N, ...)`: the same API and settings as Engine, slots are Ray actors.

    Ray-only settings: `address` (None: start a local Ray, or join the one this process already
    initialised), `ray_init_kwargs`, `cpus_per_slot` (default 0.5: whole CPUs per actor can
    starve other Ray work on small clusters), `actor_options` (a dict, or a function of the
    slot index returning one, merged into `.options()`: scheduling_strategy, resources, ...).
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        address: str | None = None,
        ray_init_kwargs: Mapping[str, Any] | None = None,
        cpus_per_slot: float = 0.5,
        actor_options: Mapping[str, Any] | Callable[[int], Mapping[str, Any]] | None = None,
        **settings: Any,
    ) -> None:
        """The Ray-only settings here; every other one is Engine's (`BaseEngine.__init__`)."""
        if not cpus_per_slot > 0:
            raise ValueError(f"cpus_per_slot must be > 0, got {cpus_per_slot!r}")
        self._ray_options = (address, dict(ray_init_kwargs or {}), cpus_per_slot, actor_options)
        self._given = frozenset(settings)
        super().__init__(model, **settings)

    def _start(self) -> None:
        address, ray_init_kwargs, cpus_per_slot, actor_options = self._ray_options
        _check_supported(self.config, self._given)
        self._state = EngineState.ACCEPTING
        self._close_lock = threading.Lock()
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            init: dict[str, Any] = {"include_dashboard": False, **ray_init_kwargs}
            if address is not None:
                init["address"] = address
            ray.init(**init)
        self._queue = TaskQueue(self.config.queue_capacity, self.config.admission, self._wake)
        self._metrics = Metrics()
        try:
            self._ledger = _Ledger(self.config, self._queue, self._metrics, cpus_per_slot, actor_options)
            self._ledger.on_stopped = self._on_stopped
            self._ledger.start()
        except BaseException:
            self._shutdown_ray()
            raise
        self._set_specs(self._ledger.info)
        self._finalizer = weakref.finalize(self, _emergency_stop, self._ledger)

    def _wake(self) -> None:
        self._ledger.wake()

    # -- steps 1-2: validate, put into the object store ------------------------------------------

    def submit(
        self,
        inputs: Any,
        *,
        context: dict[str, Any] | None = None,
        deadline: float | None = None,
        block_timeout: float | None = None,
        _fault: FaultSpec | None = None,
        _units: int = 1,
    ) -> Future[Result]:
        """Accept one task; its inputs are in Ray's object store before this returns."""
        if self._state is not EngineState.ACCEPTING:
            raise E.EngineClosed(f"the engine is {self._state.name}: submit() after close()")
        item, shape_key, items = self._admit(inputs)  # step 1: the contract, before accepting
        for old in self._queue.reserve(block_timeout if self.config.admission == "block" else None):
            self._end_queued(old, superseded_error(old))
        try:
            t0 = time.perf_counter()
            ref = ray.put(item)  # step 2: arrays go out of band; the caller may reuse its arrays
            put_s = time.perf_counter() - t0
        except BaseException:
            self._queue.unreserve()
            raise
        fut = TaskFuture(self)
        abs_deadline = None if deadline is None else time.monotonic() + deadline

        def make(task_id: int) -> Task:
            return RayTask(task_id, fut, _NO_PACK, None, shape_key, items, context, self._seed(task_id),
                           abs_deadline, _fault, copy_in_s=put_s, ref=ref, units=_units)

        task = self._queue.accept(make)
        fut.slabpool_task = task
        return fut

    def _end_queued(self, task: Task, error: BaseException | None) -> None:
        task.move(TaskState.CANCELLED)
        with self._queue.lock:
            self._queue.counters.cancelled += 1
            self._queue.counters.items_cancelled += task.units
        if isinstance(task, RayTask):
            task.ref = None
        if error is not None:
            task.future.set_exception(error)

    def close(self, *, cancel_pending: bool = False, timeout: float | None = None) -> None:
        """Stop accepting; drain (or cancel what is queued); kill the actors; shut Ray down if
        this engine started it. Idempotent."""
        self._stop_accepting()
        ledger = self._ledger
        ledger.call(ledger.close, cancel_pending)
        if ledger.on_thread:  # from a done-callback: the loop finishes the job
            return
        if not ledger.join(timeout):
            ledger.call(ledger.abort, f"close(timeout={timeout}) expired before the task ended")
            ledger.join(None)
        self._shutdown_ray()

    def _on_stopped(self) -> None:
        """Called by the ledger thread once every actor is killed."""
        with self._close_lock:
            if self._state is EngineState.ACCEPTING:
                self._state = EngineState.DRAINING
            self._state = EngineState.CLOSED

    def _shutdown_ray(self) -> None:
        if self._owns_ray and ray.is_initialized():
            self._owns_ray = False
            ray.shutdown()

    # -- looking inside -------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        slots = tuple(_slot_stats(s) for s in self._ledger.slots)
        return EngineStats(self._state.name, slots, len(self._queue), **self._counts(),
                           restarts=sum(s.restarts for s in slots),
                           shm_inputs_used=0, shm_outputs_used=0, shm_capacity=0)

    def _info(self) -> SessionInfo | None:
        return self._ledger.info

    def _cancel_in_hand(self, task: Task, kill: bool) -> bool:
        try:
            return self._ledger.call(self._ledger.cancel, task, kill).result()
        except E.EngineClosed:
            return False  # the engine has stopped: every task has already ended

    def placement(self) -> list[tuple[int, str, int]]:
        """(slot, Ray node id, actor pid) of each slot's current incarnation."""
        return [(s.index, s.node_id, s.pid) for s in self._ledger.slots]

    def __repr__(self) -> str:
        slots = self._ledger.slots
        ready = sum(s.state is SlotState.READY for s in slots)
        busy = sum(s.state is SlotState.BUSY for s in slots)
        return (f"<RayEngine {self._state.name} slots={len(slots)} ready={ready} busy={busy} "
                f"queued={len(self._queue)}>")


def _check_supported(cfg: EngineConfig, given: frozenset[str]) -> None:
    for name, default in _UNSUPPORTED.items():
        if getattr(cfg, name) != default:
            raise ValueError(f"{name}={getattr(cfg, name)!r} is not supported by the Ray backend (yet)")
    for name in _IGNORED:
        if name in given:
            log.debug("%s has no meaning on the Ray backend; ignored", name)





def _slot_stats(s: _RaySlot) -> SlotStats:
    info = s.info
    return SlotStats(
        s.index, s.pid, s.state.name, s.tasks_done, s.restarts,
        info.runtime if info else "", info.runtime_version if info else "",
        info.requested if info else (), info.applied if info else (),
        info.degraded if info else False, info.model_digest if info else "", 0,
    )


def _emergency_stop(ledger: _Ledger) -> None:
    """The engine was dropped without close(): kill the actors rather than leak them."""
    if not ledger.join(0):
        ledger.call(ledger.abort, "the engine was garbage-collected without close()")
        ledger.join(10)


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


# -- the ledger thread: steps 3-4, 8-9 and the crash path ------------------------------------


class _Ledger(OwnerThread, TaskLedger):
    """The owner thread of a RayEngine (engine.owner) with its task ledger (engine.ledger):
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
        OwnerThread.__init__(self, "slabpool-ray-ledger")
        TaskLedger.__init__(self, q, metrics)
        self.cfg = cfg
        self.info: SessionInfo | None = None
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._flights: dict[int, _Flight] = {}  # task id -> its one call in flight
        self._stopping = False  # the actors are being killed: a late ping changes nothing
        remote = ray.remote(SlotActor)
        self.slots: list[_RaySlot] = []
        for i in range(cfg.workers):
            opts: dict[str, Any] = {"num_cpus": cpus_per_slot, "max_restarts": -1, "max_task_retries": 0,
                                    "max_concurrency": 1}
            extra = actor_options(i) if callable(actor_options) else actor_options
            opts.update(extra or {})
            actor = remote.options(**opts).remote(
                i, cfg.session_spec(), cfg.preprocess, cfg.postprocess, cfg.initializer, cfg.initargs)
            self.slots.append(_RaySlot(i, actor))
        self.on_stopped: Callable[[], None] = lambda: None

    # -- start ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Wait until every actor has built its session; SessionInitError if one cannot."""
        for s in self.slots:
            s.move(SlotState.STARTING)
        refs = [s.actor.ready.remote() for s in self.slots]
        try:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.cfg.startup_timeout)
            if len(ready) < len(refs):
                raise E.SessionInitError(
                    f"Ray actors not ready after {self.cfg.startup_timeout} s: the cluster lacks "
                    "the resources (cpus_per_slot, actor_options) or cannot import the model's code")
            for s, ref in zip(self.slots, refs, strict=True):
                self._on_ready(s, ray.get(ref))
                if self.failure is not None:
                    raise self.failure
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
            self._fail(exc)
            return
        s.move(SlotState.READY)
        s.pid, s.node_id, s.incarnation = msg.pid, msg.node_id, s.incarnation + 1
        s.ping_backoff, s.pinging, s.ping_at, s.kill_reason = 0.05, False, None, None
        if msg.info is not None:
            self.info = self.info or msg.info
            s.info = msg.info

    # -- the loop (engine.owner) ---------------------------------------------------------------

    def wake(self) -> None:
        self._inbox.put(("wake",))

    def post(self, event: tuple[Any, ...]) -> None:
        self._inbox.put(event)

    def _step(self) -> None:
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
        self._dispatch(now)
        self.flush()

    def _handle(self, event: tuple[Any, ...]) -> None:
        kind = event[0]
        if kind == "done":
            self._on_done(event[1], event[2])
        elif kind == "ready":
            self._on_ping(event[1], event[2])

    def _finished(self) -> bool:
        if self.failure is not None:
            return True
        return self.closing is not None and len(self.queue) == 0 and not self._flights

    def _fail(self, error: BaseException) -> None:
        self.fail_all(error)

    def _stopped(self) -> None:
        self.abort("the engine closed while it ran")
        self._kill_all()
        self.flush()
        self.on_stopped()

    # -- the ledger's hooks (engine.ledger) ----------------------------------------------------

    def _in_hand(self) -> Iterable[Task]:
        return [f.task for f in self._flights.values()]

    def _kill_running(self, task: Task) -> None:
        flight = self._flights.get(task.id)
        if flight is None:
            return
        slot = self.slots[flight.slot]
        if slot.healthy and slot.flights and slot.flights[0] is flight:
            slot.kill_reason = "cancel"
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
            open_slots = [s for s in self.slots if s.healthy and len(s.flights) < depth]
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
        if task.attempts == 0 and not task.future.set_running_or_notify_cancel():
            task.state = TaskState.CANCELLED  # cancelled between the queue and here
            self.count("cancelled")
            self.count("items_cancelled", task.units)
            task.ref = None
            return
        task.move(TaskState.RUNNING)
        task.attempts += 1
        task.dispatched_at = task.dispatched_at or now
        fault = task.fault if self.cfg.fault_injection else None
        call = slot.actor.run.remote(task.ref, task.id, task.attempts, task.seed, task.context, fault)
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
        now = time.monotonic()
        timings = Timings(queued=max(task.dispatched_at - task.accepted_at, 0.0),
                          transfer=task.copy_in_s + copy_s, run=done.run_s, total=now - task.accepted_at)
        version = slot.info.model_digest if slot.info else ""
        self.finish(task, result=Result(task.id, outputs, version, slot.index, done.pid, task.attempts,
                                        timings, task.context))

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
            self._fail(E.WorkerError(f"the actor of slot {slot.index} is dead for good: {exc}"))
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

    def _kill_all(self) -> None:
        self._stopping = True
        for s in self.slots:
            try:
                ray.kill(s.actor, no_restart=True)
            except Exception as exc:  # noqa: BLE001 - Ray already gone: nothing left to kill
                log.debug("could not kill the actor of slot %d: %s", s.index, exc)
            if s.state is not SlotState.STOPPED:
                s.state = SlotState.STOPPED


def _permanently_dead(exc: BaseException) -> bool:
    """ActorDiedError after Ray gave up restarting it (it never does with max_restarts=-1 unless
    the actor's owner died): anything else is Ray still restarting it, so the ping retries."""
    return isinstance(exc, ActorDiedError) and "max_restarts" in str(exc)
