"""The public `Engine`: steps 1-2 of the task flow happen here, in the caller's thread."""

from __future__ import annotations

import errno
import functools
import logging
import multiprocessing
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from slabpool.engine.caller.base import BaseEngine
from slabpool.engine.caller.combine import Combiner
from slabpool.engine.caller.handles import TaskFuture, refuse_wait_here
from slabpool.engine.caller.request import Admitted, Request
from slabpool.engine.core import interrupts
from slabpool.engine.core.admission import TaskQueue, superseded_error
from slabpool.engine.core.config import AdmissionPolicy, EngineConfig
from slabpool.engine.core.coordinator import Coordinator
from slabpool.engine.core.fastpath import Lender
from slabpool.engine.core.metrics import Metrics
from slabpool.engine.core.reload import ReloadPlan
from slabpool.engine.core.states import EngineState
from slabpool.engine.core.stats import EngineStats, SlotStats
from slabpool.engine.core.task import Result, Task
from slabpool.engine.local import forks
from slabpool.engine.local.express import Express
from slabpool.engine.local.mainguard import check_main_guard, check_main_importable
from slabpool.engine.local.staged import Staged
from slabpool.engine.local.supervisor import supervisor
from slabpool.shm import (
    Arena,
    CapacityError,
    InstanceLock,
    check_capacity,
    new_instance_id,
    sweep_dead_instances,
)
from slabpool.workers import errors as E
from slabpool.workers import packing
from slabpool.workers.main import WorkerBoot
from slabpool.workers.protocol import Chunk, FaultSpec, FlatSkeleton, Rows, SessionInfo, seal
from slabpool.workers.session import SessionSpec


class Engine(BaseEngine):
    """A pool of worker processes, one model session each, fed through shared memory.

        with Engine("model.onnx", workers=4) as eng:
            y = eng.infer({"x": batch})            # dict name -> array
            fut = eng.submit({"x": batch})         # Future[Result]
            for res in eng.map(items): ...         # ordered, bounded in flight
    """

    chunked_map = True
    _reload_plan = ReloadPlan  # a slot's worker exits and is rebuilt on the new model

    def _start(self) -> None:
        cfg = self.config
        self._state = EngineState.ACCEPTING
        self._close_lock = threading.Lock()
        self._lending = threading.local()  # .who: who waits on this thread's submit (core.fastpath.Lender)
        self._metrics = Metrics()
        self._instance = new_instance_id()
        self._lock: InstanceLock | None = None
        check_main_guard(cfg.start_method)
        check_main_importable(cfg.start_method, {
            "preprocess": cfg.preprocess, "postprocess": cfg.postprocess, "initializer": cfg.initializer})
        forks.adopt(self)  # a process forked from this one never touches its workers
        try:  # any BaseException (Ctrl-C while the workers start, too) leaves nothing behind
            self._build(cfg)
        except CapacityError as exc:
            self._release_shm()
            raise E.ShmCapacityError(str(exc), needed=exc.needed, available=exc.available) from None
        except OSError as exc:  # (at its limit on open files: its selector's pipe, an arena; was a bare OSError)
            self._release_shm()
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                raise E.engine_unstartable(exc) from None
            raise
        except BaseException:
            self._release_shm()
            raise

    @property
    def _init_fault(self) -> FaultSpec | None:
        return self._init_fault_spec

    @_init_fault.setter
    def _init_fault(self, spec: FaultSpec | None) -> None:
        """Tests: a fault in the initializer of every worker started from now on."""
        self._init_fault_spec = spec
        if hasattr(self, "_transport"):
            self._transport.boot = self._boot_factory(self.config)

    def _boot_factory(self, cfg: EngineConfig) -> functools.partial[WorkerBoot]:
        """What the supervisor calls to boot a worker: a module function, not a method (the
        supervisor must not keep the Engine alive)."""
        return functools.partial(_boot, cfg, self._inputs.capacity, self._outputs.capacity, self._init_fault_spec)

    def _build(self, cfg: EngineConfig) -> None:
        """Arenas, queue, supervisor, workers. Nothing the supervisor thread keeps refers to
        the Engine (a weak reference at most): an engine nobody holds is collected, and then
        stops its workers (as ProcessPoolExecutor does)."""
        check_capacity(2 * cfg.shm_capacity, cfg.shm_backend)
        if cfg.shm_backend == "posix":
            sweep_dead_instances()
            self._lock = InstanceLock(self._instance)
        # the first 8 MiB are backed at once, the rest as leases reach it (64 MiB at a time):
        # backing (fallocate + pre-faulting) 2 x 64 MiB up front took ~80 ms of every start
        first = 8 << 20
        self._inputs = Arena("in", cfg.shm_capacity, backend=cfg.shm_backend, instance=self._instance,
                             initial_commit=first)
        self._outputs = Arena("out", cfg.shm_capacity, backend=cfg.shm_backend, instance=self._instance,
                              initial_commit=first)
        self._queue = TaskQueue(cfg.queue_capacity, cfg.admission, _no_wake, cfg.queue_bytes)
        self._sup, self._transport = supervisor(
            cfg, self._queue, self._inputs, self._outputs,
            multiprocessing.get_context(cfg.start_method), self._boot_factory(cfg), self._metrics,
        )
        self._queue.set_wake(self._sup.fast.on_wake)  # a caller may dispatch itself (core.fastpath)
        self._express = Express(self)
        self._combiner = Combiner(self.config, self._sup.dispatcher)
        self._sup.fast.inside = self._combiner.inside_now  # (the polls' crowd: FastPath.peers)
        self._owner = self._sup
        self._sup.start()
        self._sup.on_stopped = functools.partial(
            _on_stopped, weakref.ref(self), self._inputs, self._outputs, self._lock)
        self._set_specs(self._sup.info)
        self._finalizer = weakref.finalize(self, _emergency_stop, self._sup)

    # -- steps 1-2: validate, lease, copy in -----------------------------------------------------

    def _submit_chunk(self, inputs: list[Any], context: dict[str, Any] | None) -> Future[Result]:
        """Several items as one task (Engine.map): its Result's outputs are a Chunk, one
        outcome per item (see workers/protocol.Chunk)."""
        self._check_accepting()
        chunk = Chunk(self._admit(x)[0] for x in inputs)  # each item checked at the door
        return self._enqueue(Request(chunk, context, units=0), (chunk, ("chunk", len(chunk)), 0))

    def _enqueue(self, request: Request, admitted: Admitted) -> TaskFuture:
        """Step 2: seal user data, lease input memory and copy the inputs in, then queue."""
        context, block_timeout = request.context, request.block_timeout
        item, shape_key, items = admitted
        skeleton, arrays = packing.split(item)
        if self.config.preprocess is not None and not _plain(skeleton):  # user data: a TypeError
            skeleton = _seal_items(skeleton) if type(skeleton) is Chunk else seal(skeleton, "the inputs")
        wire_context = None if context is None else seal(context, "the context")
        offsets, nbytes = packing.layout(arrays)
        if nbytes > self._inputs.capacity:
            raise E.ShmCapacityError(
                f"the inputs take {nbytes} bytes but the input arena holds {self._inputs.capacity} "
                "bytes; raise shm_capacity", needed=nbytes, available=self._inputs.capacity)
        t_start = time.monotonic()
        for old in self._queue.reserve(block_timeout if self.config.admission is AdmissionPolicy.BLOCK else None,
                                       nbytes):
            self._end_queued(old, superseded_error(old))
        try:
            lease = None
            if nbytes:  # step 2: lease and copy; the caller may reuse its arrays on return
                left = None if block_timeout is None else max(block_timeout - (time.monotonic() - t_start), 0)
                try:
                    lease = self._inputs.lease(nbytes, timeout=left)
                except TimeoutError:
                    raise E.QueueFull(f"no {nbytes} bytes of shared memory free after {block_timeout} s") from None
                except CapacityError as exc:  # (it could not grow: the host's shared memory ran out since)
                    raise E.ShmCapacityError(str(exc), needed=exc.needed, available=exc.available) from None
            t0 = time.perf_counter()
            packed = packing.write(skeleton, arrays, lease.offset if lease else 0, self._inputs.array, offsets)
            copy_s = time.perf_counter() - t0
            interrupts.enter()  # from here until the lend's wait a Ctrl-C waits (engine.core.interrupts)
        except BaseException:
            if lease is not None:
                self._inputs.release(lease)
            self._queue.unreserve(nbytes)
            raise
        fut = TaskFuture(self._weak)
        abs_deadline = None if request.deadline is None else time.monotonic() + request.deadline

        def make(task_id: int) -> Task:
            task = Task(task_id, fut, Staged(packed, lease, wire_context), shape_key, items, context,
                        self._seed(task_id), abs_deadline, request.fault, copy_in_s=copy_s, nbytes=nbytes,
                        units=request.units, step=request.step)
            fut.slabpool_task = task  # before it can run: a caller's own dispatch (core.fastpath) runs
            return task  # it before accept() returns, and cancel(fut) looks the task up here

        who = getattr(self._lending, "who", Lender.NONE)
        try:  # steps 3-4 on this thread when it waits on the task and the engine is idle
            _, fut.lend = self._sup.fast.accept(functools.partial(self._queue.accept, make), who)
        except BaseException:
            if lease is not None and getattr(fut, "slabpool_task", None) is None:  # never accepted
                self._inputs.release(lease)  # (accepted, its batch's end frees it: once)
            interrupts.leave_quietly()
            raise
        if fut.lend is None or who is Lender.NONE or who is Lender.LOOP:
            self._leave_stretch(fut)
        return fut  # a thread's lend: its wait ends the stretch (FastPath.wait)

    def _leave_stretch(self, fut: TaskFuture) -> None:
        """The end of the stretch `_enqueue` began: a Ctrl-C deferred in it is raised here, and
        a lend made meanwhile goes back to the owner thread (nobody will wait on it)."""
        try:
            interrupts.leave()
        except KeyboardInterrupt:
            if fut.lend is not None:
                self._sup.fast.forsake_lend(fut.lend)
            raise

    def _call(self, inputs: Any, kw: dict[str, Any]) -> Any:
        refuse_wait_here(self, "infer()")
        if not kw:  # alone while the engine has room, else in a group (engine.caller.combine)
            return self._combiner.call(self, inputs, self._alone, self._run_group)
        return self._lent_call(functools.partial(self.submit, inputs, **kw))

    def _alone(self, inputs: Any) -> Any:
        """One plain call as one task: an idle engine's in the fewest steps (engine.local.express)."""
        outputs = self._express.call(self, inputs)
        if outputs is not None:
            return outputs
        return self._lent_call(functools.partial(self.submit, inputs))

    def _run_group(self, request: Request) -> Any:
        """A group's task (engine.caller.combine), on its leader's thread: the express lane's
        when a slot is idle, else lent a slot wherever one is idle (Lender.LEADER)."""
        if request.step:
            outputs = self._express.call(self, request.inputs, request.step)
            if outputs is not None:
                return outputs
        return self._lent_call(functools.partial(self._submit, request), Lender.LEADER)

    def _lent_call(self, submit: Callable[[], Future[Result]], who: Lender = Lender.THREAD) -> Any:
        """infer() of one task: on an idle engine its slot is lent to this thread, which
        waits on the worker's pipe and runs steps 8-9 itself (engine.core.fastpath); else, or
        once the owner thread takes over, it waits on the Future. (`who`: LEADER, a group's
        task, engine.caller.combine: lent wherever a slot is idle.)"""
        fut = self._lending_submit(submit, who)
        lend = getattr(fut, "lend", None)
        if lend is not None:
            self._sup.fast.wait(lend)  # (it ends the stretch _enqueue began)
        return fut.result().outputs

    def _lending_submit(self, submit: Callable[[], Future[Result]], who: Lender) -> Future[Result]:
        """`submit()` for a caller that waits on the task at once (`who`: a thread, or an
        event loop): its Future's `lend` is the slot lent to it, if one was (see `_lent_call`,
        engine.caller.aio)."""
        lending = self._lending
        lending.who = who
        try:
            return submit()
        finally:
            lending.who = Lender.NONE

    def _end_queued(self, task: Task, error: BaseException | None) -> None:
        """End a task that a caller thread took out of the queue (it never reached a slot)."""
        self._cancel_queued(task)
        staged: Staged = task.inputs
        if staged.lease is not None:
            self._inputs.release(staged.lease)
            staged.lease = None
        if error is not None and task.future is not None:
            task.future.set_exception(error)

    def _release_shm(self) -> None:
        _release_shm(getattr(self, "_inputs", None), getattr(self, "_outputs", None), self._lock)

    # -- looking inside -------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        slots = tuple(_slot_stats(s, self._transport.memory(s.index)) for s in self._sup.slots)
        return EngineStats(
            self._state.name, slots, len(self._queue), **self._counts(),
            restarts=sum(s.restarts for s in slots),
            shm_inputs_used=self._inputs.used, shm_outputs_used=self._outputs.used,
            shm_capacity=self._inputs.capacity, pool_shape=self.config.pool_shape,
        )

    def _info(self) -> SessionInfo | None:
        return self._sup.info


    def __repr__(self) -> str:
        slots = self._sup.slots
        ready = sum(s.state.name == "READY" for s in slots)
        busy = sum(s.state.name == "BUSY" for s in slots)
        return f"<Engine {self._state.name} slots={len(slots)} ready={ready} busy={busy} queued={len(self._queue)}>"


def _slot_stats(slot: Any, memory: tuple[int, int, int]) -> SlotStats:
    info = slot.info
    rss, pss, shared = memory
    return SlotStats(
        slot.index, slot.pid, slot.state.name, slot.tasks_done, slot.restarts,
        info.runtime if info else "", info.runtime_version if info else "",
        info.requested if info else (), info.applied if info else (),
        info.degraded if info else False, slot.model_version, rss, pss, shared,
        info.weights if info else "",
    )


def _plain(skeleton: Any) -> bool:
    """A dict of arrays with string keys, a plain scalar, or a chunk of scalars: nothing in it
    that could fail to (un)pickle. A chunk of dicts of arrays stacked (Rows) travels as it is:
    only its names are the caller's (and a name that does not pickle is caught when the batch
    is sent, failing that task alone)."""
    if type(skeleton) is Rows or type(skeleton) in _SCALARS:
        return True
    if type(skeleton) is Chunk:  # a chunk of lines or numbers (a job's JSONL, text)
        return all(type(v) in _SCALARS for v in skeleton)
    return type(skeleton) is FlatSkeleton and all(type(k) is str for k in skeleton)


_SCALARS = frozenset((str, bytes, int, float, bool, type(None)))  # always (un)pickle


def _seal_items(chunk: Chunk) -> Chunk:
    """A chunk's items sealed one by one: in the worker, an item that does not unpickle fails alone."""
    return Chunk(seal(item, f"the inputs of item {i}") for i, item in enumerate(chunk))


def _boot(
    cfg: EngineConfig, in_capacity: int, out_capacity: int, init_fault: FaultSpec | None,
    slot: int, incarnation: int, spec: SessionSpec | None, status_offset: int,
) -> WorkerBoot:
    """What a new worker of `slot` is given (module level: the supervisor keeps no Engine)."""
    return WorkerBoot(
        slot=slot,
        incarnation=incarnation,
        session=spec,
        preprocess=cfg.preprocess,
        postprocess=cfg.postprocess,
        initializer=cfg.initializer,
        initargs=cfg.initargs,
        in_capacity=in_capacity,
        out_capacity=out_capacity,
        task_timeout=cfg.task_timeout,
        report_rss=cfg.worker_memory_limit is not None,
        log_level=logging.getLogger().getEffectiveLevel(),
        status_offset=status_offset,
        in_place_min_bytes=cfg.in_place_min_bytes,
        stack_chunks=cfg.max_batch_size > 1,
        init_fault=init_fault,
    )


def _no_wake() -> None:
    """The queue's wake-up until the supervisor exists."""


def _release_shm(inputs: Arena | None, outputs: Arena | None, lock: InstanceLock | None) -> None:
    for arena in (inputs, outputs):
        if arena is not None:
            arena.close()
    if lock is not None:
        lock.release()


def _on_stopped(
    ref: weakref.ReferenceType[Engine], inputs: Arena, outputs: Arena, lock: InstanceLock | None,
) -> None:
    """Called by the supervisor thread after every worker is reaped (and the transport has
    closed): free the memory, and mark the engine CLOSED if it still exists."""
    _release_shm(inputs, outputs, lock)
    engine = ref()
    if engine is not None:
        engine._mark_closed()


def _emergency_stop(sup: Coordinator) -> None:
    """The engine was dropped without close(): stop the workers rather than leak them."""
    if sup.join(0):
        return
    warnings.warn(
        "an Engine was garbage-collected without close(): its workers were stopped and what it "
        "still held was cancelled; use `with Engine(...)` or call close()", ResourceWarning, stacklevel=2)
    sup.call(sup.abort, "the engine was garbage-collected without close()")
    sup.join(10)

