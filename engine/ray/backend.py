"""The Ray backend: the same `Engine` API, each slot a Ray actor that owns one session.

    |================= caller process (Ray driver) ================|===== actor, slot k =====|
     RayEngine.submit()      owner thread                              SlotActor.run_batch()
     1 validate inputs   =>  3 choose a slot with room, idle first =>  5 zero-copy views of
     2 ray.put(inputs)       4 mark tasks RUNNING, attempt + 1;        the inputs (plasma)
       (object store)        a batch is one actor call               6 preprocess, check,
       Future  <==========   8 copy outputs out (the transport)   <=     session.run (stacked
                             9 complete the Future once                  or one by one),
                                                                         postprocess
     crash path: a call fails with RayActorError (the actor process died, or its node)
       a  the transport waits until every call it held has resolved, then says Died
          (the first of them was running); slot k -> DEAD
       b  Ray restarts the actor (max_restarts=-1), anywhere it fits; a ready() ping
          takes slot k STARTING -> READY (backoff while Ray still restarts it)
       c  its tasks replay in acceptance order, ahead of new work, same task id; any slot
          may run them (Ray's own retries are off: max_task_retries=0)
       d  who is charged is engine.core.recovery's, as locally: a task charged max_attempts
          times -> PoisonTask

The owner is the local engine's, unchanged (engine.core.coordinator: dispatch, timers,
settlement, replay, quarantine, retire, reload); only the transport differs
(`transport.RayTransport`: actors, calls, pings). Ray gives at-least-once execution; the owner
turns that into exactly-once delivery: a Done for a batch that is not the slot's running one
is dropped, and a replay is a new batch. Admission is the local engine's `TaskQueue`; errors
are the same `slabpool.workers.errors`.

Module by module: `RayEngine` here (the caller's API: steps 1-2), `transport.RayTransport`
(the slot transport), `actor.SlotActor` (inside the actor process: steps 5-7;
`slabpool.workers.session.load_session` builds its session).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import ray

from slabpool.engine.caller.base import BaseEngine
from slabpool.engine.caller.handles import TaskFuture
from slabpool.engine.caller.request import Admitted, Request
from slabpool.engine.core.admission import TaskQueue, superseded_error
from slabpool.engine.core.config import AdmissionPolicy, EngineConfig
from slabpool.engine.core.coordinator import Coordinator
from slabpool.engine.core.metrics import Metrics
from slabpool.engine.core.reload import ReloadPlan
from slabpool.engine.core.slots import SlotRecord
from slabpool.engine.core.states import EngineState, SlotState
from slabpool.engine.core.stats import EngineStats, SlotStats
from slabpool.engine.core.task import Task
from slabpool.engine.ray import instance
from slabpool.engine.ray.transport import RayTransport, Staged, check_actor_options
from slabpool.workers import errors as E
from slabpool.workers import packing
from slabpool.workers.protocol import SessionInfo, seal

log = logging.getLogger("slabpool.engine.ray")

# settings of the local engine that mean nothing on Ray, and why: refused by name when given
_NOT_ON_RAY = {
    "start_method": "an actor is started by Ray, not by multiprocessing",
    "shm_capacity": "inputs and outputs travel through Ray's object store, not shared-memory arenas",
    "shm_backend": "inputs and outputs travel through Ray's object store, not shared-memory arenas",
    "in_place_min_bytes": "outputs come back through Ray's object store: no output region to write in place",
    "spin_us": "a call goes through Ray's own scheduler: no slot is lent to its caller, nothing polls a pipe",
}


class RayEngine(BaseEngine):
    """`RayEngine(model, workers=N, ...)`: the same API and settings as Engine, slots are Ray actors.

    Ray-only settings: `address` (None: start a local Ray, or join the one this process already
    initialised), `ray_init_kwargs`, `cpus_per_slot` (default 0.5: whole CPUs per actor can
    starve other Ray work on small clusters), `actor_options` (a dict, or a function of the
    slot index returning one, merged into `.options()`: scheduling_strategy, resources, ...).
    """

    _reload_plan = ReloadPlan  # a slot's actor is replaced by a new one on the new model
    _ray_use = ""  # this engine's use of a Ray it or another RayEngine started (engine.ray.instance)

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
        if isinstance(actor_options, Mapping):
            check_actor_options(actor_options)  # (a function's: at each actor it makes)
        self._ray_options = (address, dict(ray_init_kwargs or {}), cpus_per_slot, actor_options)
        self._given = frozenset(settings)
        with warnings.catch_warnings():  # (the host's CPUs: actors run on the cluster's, whose fit is checked below)
            warnings.filterwarnings("ignore", message=r"workers=\d+ but this process may use")
            super().__init__(model, **settings)

    def _start(self) -> None:
        address, ray_init_kwargs, cpus_per_slot, actor_options = self._ray_options
        _check_supported(self.config, self._given)
        self._state = EngineState.ACCEPTING
        self._close_lock = threading.Lock()
        init: dict[str, Any] = {"include_dashboard": False, **ray_init_kwargs}
        if address is not None:
            init["address"] = address
        self._ray_use = instance.acquire(init)  # (shared with the other RayEngines: engine.ray.instance)
        # nothing the ledger thread keeps may refer to the engine (a dropped one is collected,
        # and its finalizer stops the actors): no bound methods of it, a weak reference
        self._queue = TaskQueue(self.config.queue_capacity, self.config.admission, _no_wake,
                                self.config.queue_bytes)
        self._metrics = Metrics()
        try:
            self._transport = transport = RayTransport(self.config, cpus_per_slot, actor_options)
            self._ledger = Coordinator(self.config, self._queue, self._metrics, transport, "slabpool-ray-owner")
            self._queue.set_wake(self._ledger.wake)
            self._owner = self._ledger
            self._ledger.on_stopped = functools.partial(_on_stopped, weakref.ref(self))  # every actor killed
            self._ledger.start()
        except BaseException:
            self._shutdown_ray()
            raise
        self._set_specs(self._ledger.info)
        self._finalizer = weakref.finalize(self, _emergency_stop, self._ledger, self._ray_use)

    # -- steps 1-2: validate, put into the object store ------------------------------------------

    def _enqueue(self, request: Request, admitted: Admitted) -> TaskFuture:
        """Step 2: the inputs go into Ray's object store, then the task into the queue (their
        bytes count against queue_bytes, as locally)."""
        block_timeout = request.block_timeout
        item, shape_key, items = admitted
        # the context is pickled now, as locally: one that does not pickle is refused before it is
        # accepted (Ray's cloudpickle would take a lambda), and the task sees what it held at submit
        context = None if request.context is None else seal(request.context, "the context")
        skeleton, arrays = packing.split(item)
        if self.config.preprocess is not None:  # the inputs' objects too, as locally (pool._enqueue)
            seal(skeleton, "the inputs")
        nbytes = sum(a.nbytes for a in arrays)
        if not self._transport.ray_here():
            # (ray.put would start a new local Ray, or put into another: the actors are not there)
            raise E.EngineClosed("Ray was shut down under this engine: it accepts no task; close it, and make a new "
                                 "RayEngine on the Ray now running")
        for old in self._queue.reserve(block_timeout if self.config.admission is AdmissionPolicy.BLOCK else None,
                                       nbytes):
            self._end_queued(old, superseded_error(old))
        try:
            t0 = time.perf_counter()
            ref = ray.put(item)  # step 2: arrays go out of band; the caller may reuse its arrays
            put_s = time.perf_counter() - t0
        except BaseException as exc:
            self._queue.unreserve(nbytes)
            if isinstance(exc, TypeError):  # Ray's serializer: what does not pickle, as locally
                raise E.TaskDataError(f"the inputs cannot be pickled to cross to another process: {_first_line(exc)}") from exc
            raise
        fut = TaskFuture(self._weak)
        abs_deadline = None if request.deadline is None else time.monotonic() + request.deadline

        def make(task_id: int) -> Task:
            return Task(task_id, fut, Staged(ref, context), shape_key, items, request.context, self._seed(task_id),
                        abs_deadline, request.fault, copy_in_s=put_s, nbytes=nbytes, units=request.units,
                        step=request.step)

        task = self._queue.accept(make)
        fut.slabpool_task = task
        return fut

    def _end_queued(self, task: Task, error: BaseException | None) -> None:
        self._cancel_queued(task)
        task.inputs = None  # the object store may free the inputs now
        if error is not None and task.future is not None:
            task.future.set_exception(error)

    def _after_close(self) -> None:
        self._finalizer.detach()  # closed: nothing is left for a collection to stop
        self._shutdown_ray()  # if this engine started Ray

    def _shutdown_ray(self) -> None:
        use, self._ray_use = self._ray_use, ""
        instance.release(use)  # the last engine on the Ray one of them started shuts it down

    # -- looking inside -------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        slots = tuple(_slot_stats(s, s.rss or self._transport.ready_rss(s.index)) for s in self._ledger.slots)
        return EngineStats(self._state.name, slots, len(self._queue), **self._counts(),
                           restarts=sum(s.restarts for s in slots),
                           shm_inputs_used=0, shm_outputs_used=0, shm_capacity=0,
                           pool_shape=self.config.pool_shape)

    def _info(self) -> SessionInfo | None:
        return self._ledger.info


    def placement(self) -> list[tuple[int, str, int]]:
        """(slot, Ray node id, actor pid) of each slot's current incarnation."""
        return [(s.index, s.node, s.pid) for s in self._ledger.slots]

    def __repr__(self) -> str:
        slots = self._ledger.slots
        ready = sum(s.state is SlotState.READY for s in slots)
        busy = sum(s.state is SlotState.BUSY for s in slots)
        return (f"<RayEngine {self._state.name} slots={len(slots)} ready={ready} busy={busy} "
                f"queued={len(self._queue)}>")


def _first_line(exc: BaseException) -> str:
    """Ray's serialization error runs to a page, the inputs' repr in it: its cause (pickle's own
    error) says what failed."""
    cause = exc.__cause__ or exc.__context__ or exc
    text = str(cause).strip()
    return f"{type(cause).__name__}: {text.splitlines()[0] if text else ''}"


def _check_supported(cfg: EngineConfig, given: frozenset[str]) -> None:
    """A setting that means nothing on Ray is refused by name, with the reason, when given."""
    for name, why in _NOT_ON_RAY.items():
        if name in given:
            raise ValueError(f"{name}={getattr(cfg, name)!r} does not apply to the Ray backend: {why}")


def _slot_stats(s: SlotRecord, rss: int) -> SlotStats:
    """`rss`: what its actor reported after its last call, or when it was ready."""
    info = s.info
    return SlotStats(
        s.index, s.pid, s.state.name, s.tasks_done, s.restarts,
        info.runtime if info else "", info.runtime_version if info else "",
        info.requested if info else (), info.applied if info else (),
        info.degraded if info else False, info.model_digest if info else "", rss,
        weights=info.weights if info else "",  # (pss and shared pages: an actor may be on another node)
    )


def _no_wake() -> None:
    """The queue's wake-up until the ledger exists."""


def _on_stopped(ref: weakref.ReferenceType[RayEngine]) -> None:
    """Called by the ledger thread once every actor is killed: the engine, if it still exists,
    is CLOSED."""
    engine = ref()
    if engine is not None:
        engine._mark_closed()


def _emergency_stop(ledger: Coordinator, ray_use: str) -> None:
    """The engine was dropped without close(): kill the actors rather than leak them (and shut
    down the Ray it started)."""
    if not ledger.join(0):
        warnings.warn(
            "a RayEngine was garbage-collected without close(): its actors were killed and what it "
            "still held was cancelled; use `with RayEngine(...)` or call close()", ResourceWarning, stacklevel=2)
        ledger.call(ledger.abort, "the engine was garbage-collected without close()")
        ledger.join(10)
    instance.release(ray_use)
