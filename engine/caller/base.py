"""The caller's side that every backend shares: the local `Engine` and `RayEngine` differ in
where tasks run, not in how a caller talks to them.

A backend provides `_start` (its owner thread, `_owner`), `_enqueue(request, admitted)`
(step 2: hand a checked task over), `_end_queued`, `_info()`, `stats()`, `_after_close` and
`_reload_plan` (how it swaps a slot's model); `submit`, `close`, `cancel`, `infer`, `map`,
`reload` and the rest are built here on those and on the owner thread's `call()`. Every way in
builds one `request.Request` and hands it to `_submit`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import threading
import weakref
from collections.abc import AsyncIterable, AsyncIterator, Callable, Generator, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Literal, Self, cast, overload

from slabpool.engine.caller import aio, blocks, faults, lanes, mapping
from slabpool.engine.caller.calls import InitSignature, check_constructor, map_call, public
from slabpool.engine.caller.handles import Owner, TaskFuture, applier, close_within
from slabpool.engine.caller.request import Admitted, Outputs, Request, as_block
from slabpool.engine.core import config as settings
from slabpool.engine.core.admission import TaskQueue
from slabpool.engine.core.config import Admission, EngineConfig, MiB, resolve, seconds, waits
from slabpool.engine.core.metrics import Histogram, Metrics, render
from slabpool.engine.core.reload import ReloadPlan
from slabpool.engine.core.states import EngineState, TaskState
from slabpool.engine.core.stats import EngineStats, ModelDescription
from slabpool.engine.core.task import Result, Task
from slabpool.workers import contract
from slabpool.workers import errors as E
from slabpool.workers.protocol import SessionInfo, TensorSpec
from slabpool.workers.session import detect_backend, model_digest

log = logging.getLogger("slabpool.engine")

Hook = Callable[..., Any] | str | None  # a module-level function, or "module:function"


class BaseEngine:
    """The caller's API, shared by every backend: `Engine` (local worker processes) and
    `RayEngine` (Ray actors). The constructor is here, once: every setting is a typed
    keyword-only parameter with its default, validated by `engine.core.config.resolve`."""

    chunked_map = False  # map() may send several items as one task (a local Engine)
    _inherited = ""  # in a process that got this engine through os.fork: why it cannot use it (local.forks)
    config: EngineConfig
    _queue: TaskQueue
    _state: EngineState
    _specs: tuple[TensorSpec, ...]
    _batchable: bool
    _close_lock: threading.Lock
    _metrics: Metrics
    _owner: Owner  # the backend's owner thread (engine.core.owner) with its task ledger

    __signature__ = InitSignature()  # help(Engine), inspect.signature(Engine): __init__'s, not __new__'s

    def __new__(cls, *args: Any, **kw: Any) -> Self:
        """The call checked before __init__ starts anything ("Engine() got an unexpected setting
        'max_workers'; did you mean 'workers'?")."""
        check_constructor(cls, args, kw)
        return super().__new__(cls)

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        workers: int | Literal["auto"] | None = None,
        start_method: Literal["forkserver", "spawn"] = "forkserver",
        backend: Literal["auto", "onnxruntime", "litert"] = "auto",
        providers: Sequence[Any] | None = None,
        delegate: str | None = None,
        delegate_options: Mapping[str, str] | None = None,
        allow_fallback: bool = False,
        threads_per_worker: int = 1,
        preprocess: Hook = None,
        postprocess: Hook = None,
        initializer: Hook = None,
        initargs: Sequence[Any] = (),
        queue_capacity: int = 0,
        admission: Admission = "block",
        max_attempts: int = 3,
        task_timeout: float | None = None,
        max_tasks_per_worker: int | None = None,
        worker_memory_limit: int | None = None,
        seed: int = 0,
        max_batch_size: int = 1,
        max_batch_wait_ms: float = 2.0,
        inflight_per_slot: int = 2,
        in_place_min_bytes: int | None = MiB,
        shm_capacity: int = 0,
        queue_bytes: int = 64 * MiB,
        shm_backend: Literal["memfd", "posix"] = "memfd",
        startup_timeout: float = 120.0,
        stall_after: float = 10.0,
        spin_us: float = 250.0,
        share_weights: bool = True,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        """Start the pool: every worker has built its session when this returns.

        model: an .onnx or .tflite file (None: preprocess is the whole task). workers: worker
        processes (None: the usable CPUs). Hooks (preprocess, postprocess, initializer) are
        module-level functions or 'module:function' strings; workers import them by name.
        Each setting's type and default is this signature; what it does, README.md and docs/; a bad
        one raises ValueError or TypeError naming it (tests inject faults through engine.caller.faults)."""
        settings = {k: v for k, v in locals().items() if k not in ("self", "model", "__class__")}
        injection = faults.armed()
        settings["fault_injection"] = injection is not None
        self._init_fault = injection.init if injection is not None else None
        self.config = resolve(model, **settings)
        self._weak = weakref.ref(self)  # what a TaskFuture holds: a kept Future keeps no engine alive
        self._start()

    # -- what a backend provides ----------------------------------------------------------------

    def _start(self) -> None:
        """Build the slots from self.config; return once every one is ready (or raise)."""
        raise NotImplementedError

    @public
    def submit(
        self,
        inputs: Any,
        *,
        context: dict[str, Any] | None = None,
        deadline: float | None = None,
        block_timeout: float | None = None,
    ) -> Future[Result]:
        """Accept one task: its inputs are checked against the model (step 1) and handed over
        (step 2: copied into shared memory, or put into Ray's object store) before this returns.
        A Future of its Result. `deadline`: seconds it may wait in the queue; `block_timeout`:
        how long a full queue may block this call (admission="block")."""
        return self._submit(Request(inputs, context, deadline, block_timeout))

    def _submit(self, request: Request) -> Future[Result]:
        """The one internal way in (engine.caller.request): submit(), map(), infer(batch_size=),
        the batch job and the tests' faults all build a Request and hand it here. Step 1, the
        input contract, then the backend's `_enqueue` (step 2)."""
        self._check_accepting()
        if request.deadline is not None or request.block_timeout is not None or request.context is not None:
            waits(request.deadline, request.block_timeout, request.context)
        admitted = self._admit(request.inputs)  # step 1: the contract, before accepting
        if not request.units:  # a block of rows (infer(batch_size=), the job): never stacked with others
            item, shape_key, items = admitted
            admitted = (item, *as_block(shape_key, items))
        return self._enqueue(request, admitted)

    def _check_accepting(self) -> None:
        if self._state is not EngineState.ACCEPTING:
            if self._inherited:
                raise E.EngineClosed(self._inherited)
            self._queue.raise_if_closed()  # why it stopped: the engine's failure, or close()
            raise E.EngineClosed(f"the engine is {self._state.name}: submit() after close()")

    def _enqueue(self, request: Request, admitted: Admitted) -> Future[Result]:
        """Step 2, the backend's: hand one checked task over and put it in the queue (its
        inputs as step 1 `admitted` them, the rest of the task as `request` asks)."""
        raise NotImplementedError

    def close(self, *, cancel_pending: bool = False, timeout: float | None = None) -> None:
        """Stop accepting; drain (or cancel what is queued); stop every slot; free what the
        engine holds. Idempotent, callable from any thread and from a Future's done-callback.
        `timeout`: then what still runs is cancelled and its slots stopped; it returns within
        `timeout` even so (the last of it, stopping the workers, may then go on in the background)."""
        if self._inherited:  # a forked child's copy: the workers and memory are the parent's
            return
        seconds("timeout", timeout, at_least=0.0)  # (before anything stops)
        self._stop_accepting()
        lanes.stop_lanes(self)
        owner = self._owner
        owner.call(owner.close, cancel_pending)
        if owner.on_thread:  # from a done-callback: the loop finishes the job
            return
        if timeout is None:
            owner.join(None)
        elif not close_within(owner, timeout):
            log.warning("close(timeout=%s) returns while the workers are still being stopped", timeout)
            return
        self._after_close()

    def _after_close(self) -> None:
        """Once the owner thread has stopped (from close(), not from a done-callback)."""

    def _stop_accepting(self) -> None:
        """ACCEPTING -> DRAINING, once: later submits raise EngineClosed."""
        with self._close_lock:
            if self._state is EngineState.ACCEPTING:
                self._state = EngineState.DRAINING
                self._queue.close(E.EngineClosed("the engine is closed: submit() after close()"))

    def _end_queued(self, task: Task, error: BaseException | None) -> None:
        raise NotImplementedError

    _reload_plan: type[ReloadPlan] = ReloadPlan  # the backend's: how it swaps a slot's model

    def _info(self) -> SessionInfo | None:
        raise NotImplementedError

    def stats(self) -> EngineStats:
        """A snapshot: counters, every slot, shared memory in use."""
        raise NotImplementedError

    def _cancel_in_hand(self, task: Task, kill: bool) -> bool:
        """cancel() of a task the queue no longer holds: ask the owner thread."""
        try:
            return bool(self._owner.call(self._owner.cancel, task, kill).result())
        except E.EngineClosed:
            return False  # the engine has stopped: every task has already ended

    # -- step 1 and the task's identity ---------------------------------------------------------

    def _admit(self, inputs: Any) -> Admitted:
        """Check the input contract at the door (no preprocess); return item, batch key, items.

        Inputs of a signature (names, exact array types, dtypes, shapes) already checked are
        not checked again: the contract depends on nothing else."""
        if self.config.preprocess is not None or not self._specs:
            return inputs, ("item",), 1
        inputs = contract.one_input(inputs, self._specs)  # a bare array: checked once too
        sig = contract.signature(inputs) if type(inputs) is dict else None
        if sig is not None:
            known = self._admitted.get(sig)
            if known is not None:
                return dict(inputs), known[0], known[1]
        feeds = contract.check(contract.normalize(inputs, self._specs), self._specs)
        key = tuple((n, a.dtype.str, a.shape[1:]) for n, a in feeds.items())
        items = next(iter(feeds.values())).shape[0] if self._batchable else 1
        if sig is not None:
            self._admitted.add(sig, (key, items))
        return feeds, key, items

    def _set_specs(self, info: SessionInfo | None) -> None:
        self._specs = info.inputs if info else ()
        self._batchable = contract.batchable(self._specs)
        self._admitted = contract.Checked()  # signature -> (batch key, items)
        self.model_version = info.model_digest if info else ""

    def _seed(self, task_id: int) -> int:
        """The task's seed, from (engine seed, task id): a replay draws the same numbers. Only
        user code draws them (the worker seeds before preprocess/postprocess): 0 without it."""
        if self.config.preprocess is None and self.config.postprocess is None:
            return 0
        digest = hashlib.blake2b(f"{self.config.seed}:{task_id}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little")

    def _on_cancelled(self, fut: TaskFuture) -> None:
        """Future.cancel() on a queued task: out of the queue, its inputs freed now, its waiters
        notified (concurrent.futures.wait() and as_completed() see it done: they never did)."""
        task = fut.slabpool_task
        if self._queue.discard(task):
            self._end_queued(task, None)
            fut.set_running_or_notify_cancel()

    # -- the rest of the caller's API -----------------------------------------------------------

    @public
    def infer(self, inputs: Any, *, batch_size: int | str | None = None, **kw: Any) -> Outputs:
        """Submit and wait: the outputs, a dict name -> array (with a postprocess: what it
        returned; the type says dict, the value is the hook's).

        Without `batch_size` the inputs are one task. With `batch_size=N` (or "auto": calls of
        ~2 ms, from the measured run time per row) the rows on axis 0 go as blocks of N rows, a
        session call each, several blocks to a task (~30 ms of calls: the engine's cost per task
        is paid once for them; one block a task when a preprocess or postprocess sees them), on
        every worker, and the outputs come back concatenated:
        byte-identical to running the same blocks one after the other in one session (a block
        is never stacked with other work). A block that fails is cut down to
        the rows that fail alone; then RowsFailed carries their indices, each row's own error,
        and the outputs of the other rows (failed rows NaN, 0 for integer outputs).

        Data that does not fit in memory: hand `map()` the blocks (slices of a memory-mapped
        array, say); it yields their outputs in order with a bounded number in flight, a
        block per task (`chunk=1`)."""
        if batch_size is None:
            return self._call(inputs, kw)
        unknown = set(kw) - {"context", "block_timeout"}
        if unknown:
            raise TypeError(f"infer(batch_size=...) takes context and block_timeout, not {sorted(unknown)}")
        return blocks.infer_rows(self, self._specs, inputs, batch_size, kw.get("context"), kw.get("block_timeout"))

    def _call(self, inputs: Any, kw: dict[str, Any]) -> Outputs:
        """infer() of one task (a backend may wait on its slot itself: engine.local.pool)."""
        return cast(Outputs, self.submit(inputs, **kw).result().outputs)

    def _submit_chunk(self, inputs: list[Any], context: dict[str, Any] | None) -> Future[Result]:
        raise NotImplementedError

    # -- map() and the asyncio front end (engine.caller.mapping, engine.caller.aio) ------------

    @overload
    def map(
        self, items: Iterable[Any], *, window: int | None = ..., return_exceptions: Literal[False] = ...,
        context: dict[str, Any] | None = ..., chunk: int | None = ..., ordered: bool = ...,
    ) -> Generator[Result, None, None]: ...

    @overload
    def map(
        self, items: Iterable[Any], *, window: int | None = ..., return_exceptions: bool,
        context: dict[str, Any] | None = ..., chunk: int | None = ..., ordered: bool = ...,
    ) -> Generator[Result | BaseException, None, None]: ...

    @public
    def map(
        self, items: Iterable[Any], *, window: int | None = None, return_exceptions: bool = False,
        context: dict[str, Any] | None = None, chunk: int | None = None, ordered: bool = True,
    ) -> Generator[Result | BaseException, None, None]:
        """Results in submission order, at most `window` items in flight (memory stays bounded).
        `ordered=False`: in the order tasks finish instead (a slow item holds nothing up; the
        items of one chunk still come together, in their order). Either way each Result's
        `index` is its item's position in `items` (0-based), whatever chunk, replay or
        item-by-item rerun computed it, and a yielded error (`return_exceptions`) carries it
        as `.index` too; `context` is on every Result.

        A failed item raises at its position, unless `return_exceptions` yields the error
        instead. Abandoning the iterator cancels what is still queued.

        `chunk`: items per task. None: sized from the measured run time per item, so that a
        task runs ~CHUNK_TARGET_S (tiny items go up to MAX_CHUNK to a task and pay one task's
        overhead between them; items of milliseconds go one by one). 1: a task per item.
        A chunk's items run in one worker, one by one (byte-identical to a task each), or
        stacked into one session call when dynamic batching is on (max_batch_size > 1: the
        same float tolerance as batching); each keeps its own outcome, and its Result carries
        the chunk's task id (and stats() counts it as one task). A chunk that kills workers
        runs again item by item, so a poison item fails alone.

        A generator of Results (of errors too, with `return_exceptions`); `close()` it to
        abandon it at once."""
        map_call(f"{type(self).__name__}.map()", items, context)
        return mapping.results(self, items, window=window, return_exceptions=return_exceptions, context=context,
                               chunk=chunk, ordered=ordered)

    def _map_parts(self, items: Iterable[Any], *, window: int | None = None, contain: bool = False,
                   context: dict[str, Any] | None = None, chunk: int | None = None,
                   ordered: bool = True) -> Generator[mapping.MapPart, None, None]:
        """map() one task at a time (`engine.caller.mapping.parts`): the batch job's way in."""
        return mapping.parts(self, items, window=window, contain=contain, context=context, chunk=chunk,
                             ordered=ordered)

    async def submit_async(
        self, inputs: Any, *, context: dict[str, Any] | None = None, deadline: float | None = None,
        block_timeout: float | None = None,
    ) -> Result:
        """Accept one task and await its `Result`; the same arguments and errors as `submit`.

        Cancelling the awaiting coroutine cancels the task: queued, it never runs; running, it
        ends with TaskCancelled and its result is never delivered."""
        return await aio.submit_async(self, inputs, context=context, deadline=deadline, block_timeout=block_timeout)

    async def infer_async(self, inputs: Any, **kw: Any) -> Outputs:
        """`submit_async`, then the outputs: a dict name -> array (a postprocess's: its value)."""
        return cast(Outputs, await aio.infer_async(self, inputs, kw))  # one call, not two, per task

    @overload
    def map_async(
        self, items: AsyncIterable[Any] | Iterable[Any], *, window: int | None = ...,
        return_exceptions: Literal[False] = ..., context: dict[str, Any] | None = ...,
    ) -> AsyncIterator[Result]: ...

    @overload
    def map_async(
        self, items: AsyncIterable[Any] | Iterable[Any], *, window: int | None = ...,
        return_exceptions: bool, context: dict[str, Any] | None = ...,
    ) -> AsyncIterator[Result | BaseException]: ...

    def map_async(
        self, items: AsyncIterable[Any] | Iterable[Any], *, window: int | None = None,
        return_exceptions: bool = False, context: dict[str, Any] | None = None,
    ) -> AsyncIterator[Result | BaseException]:
        """Results in submission order, at most `window` tasks accepted and not yet yielded.

        `items` may be an async iterable (pulled lazily, never more than `window` ahead of the
        consumer) or a plain iterable (its `next()` runs on the loop thread: keep it cheap). A
        failed task (an item refused at the door too) raises at its position, unless
        `return_exceptions` yields the error; `index` is its item's position in `items`. When the
        consumer stops early (break, cancellation, an error), what is in flight is cancelled."""
        map_call(f"{type(self).__name__}.map_async()", items, context)
        return aio.map_async(self, items, window, return_exceptions, context)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: Any, *_: Any) -> None:
        """close() on a thread of its own (it waits for the drain); cancel what is queued when
        the block raised. Cancelled while closing: the close goes on, the caller moves on."""
        await aio.close_async(self, cancel_pending=exc_type is not None)

    def cancel(self, future: Future[Result], *, kill: bool = False) -> bool:
        """Cancel a task. Queued (or sent ahead to a busy worker, locally): it never runs. Running:
        its result is never delivered (it ends with TaskCancelled now; its buffers are freed once
        the run ends); `kill=True` rebuilds its slot to stop the run, and the slot's other tasks replay.
        In a process that got the engine through os.fork: False, and nothing is touched."""
        if future.cancel():  # (TaskFuture.cancel: False in such a process; so is the owner's call)
            return True
        task: Task | None = getattr(future, "slabpool_task", None)
        if task is None or future.done():
            return False
        return self._cancel_in_hand(task, kill)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """As `concurrent.futures.Executor.shutdown`: stop accepting now; `cancel_futures`
        cancels what is still queued (running tasks finish); `wait` returns once every worker
        has stopped and the shared memory is freed, else at once while the engine finishes in
        the background (a later close() joins it)."""
        self._stop_accepting()
        if wait:
            self.close(cancel_pending=cancel_futures)
            return
        threading.Thread(target=self.close, kwargs={"cancel_pending": cancel_futures},
                         name="slabpool-shutdown", daemon=True).start()

    @public
    def reload(
        self,
        model: str | os.PathLike[str],
        *,
        drain_slot: bool = True,
        allow_signature_change: bool = False,
        timeout: float | None = None,
    ) -> str:
        """Swap the model slot by slot, serving throughout; return the new model version
        (`engine.core.reload`). `drain_slot`: a slot finishes what it holds before it swaps
        (False: hands it back to the queue, to run again elsewhere).

        Raises SessionInitError if the new model fails to load (the old one keeps serving),
        SignatureChanged if its inputs/outputs differ and `allow_signature_change` is False,
        ValueError if it is the other runtime's model and the engine has providers= or delegate=,
        TimeoutError once `timeout` s have passed (the swap goes on)."""
        seconds("timeout", timeout, at_least=0.0)
        path = os.path.abspath(model)  # (as Engine() makes it: a slot rebuilt after a chdir opens this file)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"model file not found: {os.fspath(model)}")
        if (old := self._owner.model_spec()) is None:
            raise E.EngineError("this engine has no model (model=None): nothing to reload")
        backend = self.config.backend or detect_backend(path)
        settings.runtime_settings(backend, old.providers, old.delegate, old.delegate_options, reload=path)
        spec = dataclasses.replace(old, path=path, backend=backend, digest=model_digest(path))  # the new version
        plan = self._reload_plan(spec, old, drain_slot, allow_signature_change, apply=applier(self._weak))
        self._owner.call(self._owner.start_reload, plan).result()  # EngineClosed once it has stopped
        if not plan.done.wait(timeout):
            raise TimeoutError(f"reload still in progress after {timeout} s (it goes on, and the "
                               "engine takes the new model when it ends)")
        if plan.error is not None:
            raise plan.error
        return self.model_version

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.close(cancel_pending=exc_type is not None)

    @property
    def state(self) -> EngineState:
        return self._state

    def metrics_text(self) -> str:
        """Counters, gauges and latency histograms in the Prometheus text format (0.0.4)."""
        return render(self)

    def histograms(self) -> dict[str, Histogram]:
        """Seconds per delivered task (queue wait, run, end to end), as cumulative histograms."""
        return self._metrics.snapshot()

    def describe(self) -> ModelDescription:
        info = self._info()
        if info is None:
            return ModelDescription((), (), "", "", "", False)
        return ModelDescription(info.inputs, info.outputs, info.runtime, info.runtime_version,
                                info.model_digest, self._batchable, info.weights)

    def _counts(self) -> dict[str, int]:
        with self._queue.lock:
            return self._queue.counters.snapshot()

    def _tally(self, *, accepted: int = 0, completed: int = 0, failed: int = 0, cancelled: int = 0) -> None:
        """Count the caller's items of chunks and blocks (their tasks count none themselves)."""
        with self._queue.lock:
            c = self._queue.counters
            c.items_accepted += accepted
            c.items_completed += completed
            c.items_failed += failed
            c.items_cancelled += cancelled

    def _cancel_queued(self, task: Task) -> None:
        """A task taken out of the queue ends CANCELLED, counted with its items."""
        task.move(TaskState.CANCELLED)
        with self._queue.lock:
            self._queue.counters.cancelled += 1
            self._queue.counters.items_cancelled += task.units

    def _mark_closed(self) -> None:
        """The owner thread has stopped every slot: the engine is CLOSED."""
        with self._close_lock:
            self._state = EngineState.CLOSED
