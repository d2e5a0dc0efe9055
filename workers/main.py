"""The worker process: handshake, then one loop over the pipe. Steps 5-7 of the task flow.

    boot -> map arenas -> watch parent -> initializer -> build session -> Ready | InitFailed
    loop:  RunBatch -> (5) view inputs -> (6) preprocess, check, run -> postprocess
                    -> (7) write outputs into the output region -> BatchDone
           Shutdown | EOF (supervisor gone) -> exit

The worker owns exactly one session; nothing else in the process touches it. It ignores
SIGINT (Ctrl-C belongs to the supervisor, which drains) and exits on its own the moment
its supervisor dies, whatever kills it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import fcntl
import functools
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from slabpool.shm.mapping import Mapping
from slabpool.workers import context, contract, faults, packing
from slabpool.workers.errors import ErrorKind, TaskDataError
from slabpool.workers.inplace import OutputPlanner, Placed
from slabpool.workers.lean import LeanPath, rss
from slabpool.workers.pipeline import (
    IDLE,
    STACKED,
    DeadlinePassed,
    TaskPipeline,
    failure,
    in_steps,
    left_by_a_fork,
    own_worker,
    remote_error,
    run_stacked,
    seed_task,
)
from slabpool.workers.protocol import (
    SPLIT,
    BatchDone,
    Chunk,
    FaultSpec,
    FlatSkeleton,
    Hole,
    InitFailed,
    NeedOutput,
    Outcome,
    OutputGrant,
    Ready,
    RemoteError,
    Revoke,
    Rows,
    RunBatch,
    Sealed,
    Shutdown,
    TaskSpec,
    decode,
    seal,
    unseal,
)
from slabpool.workers.session import ModelSession, RunTimeout, SessionSpec, load_session
from slabpool.workers.wire import FrameReader
from slabpool.workers.worklog import Outbox, SupervisorGone, install_pipe_logging, task_fields

log = logging.getLogger("slabpool.workers")


@dataclass(frozen=True)
class WorkerBoot:
    """Everything a worker needs, picklable: sent once as the process argument."""

    slot: int
    incarnation: int
    session: SessionSpec | None
    preprocess: Callable[..., Any] | None
    postprocess: Callable[..., Any] | None
    initializer: Callable[..., Any] | None
    initargs: tuple[Any, ...]
    in_capacity: int
    out_capacity: int
    task_timeout: float | None
    report_rss: bool
    log_level: int
    status_offset: int = -1  # this slot's status word in the output arena (see the supervisor)
    init_fault: FaultSpec | None = None
    in_place_min_bytes: int | None = None  # see EngineConfig; None: outputs are always copied
    stack_chunks: bool = False  # run a chunk's items in one session call (max_batch_size > 1)



@dataclass(frozen=True)
class SealedBoot:
    """A WorkerBoot pickled in the caller and unpickled by main() itself, inside the handshake:
    what unpickling it imports (the hooks' modules) may fail in the worker alone, and that
    error goes back as InitFailed instead of killing the process before it could say why.
    `initargs` travel as they are (multiprocessing's pickler: they may hold its objects)."""

    data: bytes
    initargs: tuple[Any, ...]

    @classmethod
    def of(cls, boot: WorkerBoot) -> SealedBoot:
        return cls(pickle.dumps(dataclasses.replace(boot, initargs=())), boot.initargs)

    def open(self) -> WorkerBoot:
        boot: WorkerBoot = pickle.loads(self.data)
        return dataclasses.replace(boot, initargs=self.initargs)


def main(sealed: SealedBoot, conn: Connection, in_fd: int, out_fd: int) -> None:
    """Process entry point (a module-level function: spawn and forkserver import it)."""
    try:
        _main(sealed, conn, in_fd, out_fd)
    except SupervisorGone:
        pass  # the supervisor stopped reading (it is stopping this worker): exit quietly
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        # a thread a hook started and left running: multiprocessing would join it before the
        # process ends, and a retiring or closing worker stalled until its kill (10 s, 5 s)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(0)


def _main(sealed: SealedBoot, conn: Connection, in_fd: int, out_fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    own_worker()
    faulthandler.enable(os.fdopen(os.dup(2), "w"))  # its own fd 2: kept while fd 2 is redirected
    _watch_parent()
    outbox = Outbox(conn)
    try:
        boot = sealed.open()
    except BaseException as exc:  # noqa: BLE001 - a hook's module failed to import here
        outbox.send(InitFailed(remote_error(exc, ErrorKind.RUN)))
        return
    inputs = Mapping(in_fd, boot.in_capacity, writable=False)
    outputs = Mapping(out_fd, boot.out_capacity, writable=True)
    install_pipe_logging(outbox, boot.slot, boot.log_level)
    try:
        faults.inject(boot.init_fault, "init")
        if boot.initializer is not None:
            boot.initializer(*boot.initargs)
        session = load_session(boot.session) if boot.session is not None else None
    except BaseException as exc:  # noqa: BLE001 - every failure goes back as data
        outbox.send(InitFailed(remote_error(exc, ErrorKind.RUN)))
        return
    outbox.send(Ready(os.getpid(), session.info if session else None))
    Worker(boot, conn, outbox, inputs, outputs, session).loop()


def _watch_parent() -> None:
    """Exit at once when the supervisor dies (even by SIGKILL): never linger as an orphan.

    Two watches of the parent's sentinel (a pipe whose last writer is the parent: its death
    closes it). The kernel's: the pipe's reader is signalled when its writer closes (O_ASYNC),
    with SIGKILL (F_SETSIG), which needs no Python to run here: native code stuck holding the
    GIL (a deadlock) kept the thread below from running, and the worker, its forkserver and
    the resource tracker outlived the supervisor for good. Nothing else is ever written to
    that pipe once the worker has read its start-up data, so nothing else signals. And a
    thread's, where the kernel's cannot be set."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    with contextlib.suppress(OSError, AttributeError):  # (F_SETSIG: Linux)
        fd = parent.sentinel
        fcntl.fcntl(fd, fcntl.F_SETOWN, os.getpid())
        fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGKILL)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_ASYNC)

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class Worker:
    """The loop of one worker process: reads RunBatch messages, runs each batch's tasks through
    the pipeline (steps 5-7: inputs viewed in place, preprocess, contract, run, postprocess,
    outputs into the granted region), answers BatchDone; the slot's status words say which
    task it holds. It owns the process's one session."""

    def __init__(
        self,
        boot: WorkerBoot,
        conn: Connection,
        outbox: Outbox,
        inputs: Mapping,
        outputs: Mapping,
        session: ModelSession | None,
    ) -> None:
        self.boot, self.outbox = boot, outbox
        self.reader = FrameReader(conn.fileno())  # conn stays open (and sends, via the outbox)
        self.inputs, self.outputs, self.session = inputs, outputs, session
        self.pipeline = TaskPipeline(session, boot.preprocess, boot.postprocess)
        self.pending: deque[Any] = deque()  # messages read while waiting for an OutputGrant
        in_place = session is not None and session.writes_in_place and boot.in_place_min_bytes is not None
        self.planner = OutputPlanner(outputs, boot.in_place_min_bytes or 0) if in_place else None
        # the task in hand, for the supervisor to read if this process dies; with task_timeout,
        # word 1 is when that task's time started counting (see _hand)
        self.status = outputs.array(boot.status_offset, np.dtype(np.int64), (2,))
        self._timed = boot.task_timeout is not None
        self._in_hand, self._since = IDLE, 0
        self._spent: dict[int, int] = {}  # ns each task of this batch has run so far
        # user code makes the results (postprocess, or preprocess without a model): they may
        # not pickle, or not unpickle in the caller; each is then sealed alone (protocol.Sealed)
        self._seal_results = boot.postprocess is not None or session is None
        # the common task (one plain task, no option) in the fewest steps: workers.lean
        hooked = boot.preprocess is not None or boot.postprocess is not None
        self.lean = LeanPath(self) if session is not None and not hooked else None

    def loop(self) -> None:
        lean, reader, spin, peers = self.lean, self.reader, 0.0, 0
        while True:
            try:
                msg = self.pending.popleft() if self.pending else decode(reader.recv(spin, peers))
            except EOFError:
                return  # the supervisor is gone
            spin = 0.0
            if isinstance(msg, RunBatch):
                done: BatchDone | bytes | None = None  # (bytes: the lean path's, encoded)
                try:
                    if (self.pending or reader.poll()) and self._revoked(msg.batch_id):
                        done = BatchDone(msg.batch_id, (), 0.0, 0)
                    else:
                        done = (lean.run(msg) if lean is not None else None) or self.run_batch(msg)
                except SupervisorGone:
                    raise  # (asking for an output region: nobody reads it any more)
                except Exception as exc:  # noqa: BLE001 - a bug here must not kill the worker
                    err = remote_error(exc, ErrorKind.RUN)
                    done = BatchDone(msg.batch_id, tuple(Outcome(t.task_id, None, err) for t in msg.tasks), 0.0, 0)
                self.status[0] = IDLE
                self._in_hand = IDLE
                self._spent.clear()
                if type(done) is bytes:
                    self.outbox.send_encoded(done)
                else:
                    self.outbox.send(done)
                spin, peers = msg.spin, msg.peers  # (a lent batch's: its caller's next call may come at once)
            elif isinstance(msg, Shutdown):
                return

    # -- one batch ---------------------------------------------------------------------------

    def run_batch(self, msg: RunBatch) -> BatchDone:
        t0 = time.perf_counter()
        results: dict[int, Any] = {}  # task id -> outputs, or RemoteError
        tasks = [t for t in msg.tasks if type(t.item.skeleton) not in (Chunk, Rows)]  # chunks: _run_chunk
        feeds = {t.task_id: self._guarded(t, "preprocess", functools.partial(self._prepare, t)) for t in tasks}
        results.update((i, f) for i, f in feeds.items() if isinstance(f, RemoteError))
        ready = [t for t in tasks if t.task_id not in results]
        region = (msg.out_offset, msg.out_nbytes) if msg.out_offset >= 0 else self._granted(msg.batch_id)
        if self.session is None:
            for t in ready:
                results[t.task_id] = feeds[t.task_id]
        elif ready:
            self._run(msg.stack, ready, feeds, results, self._plan(msg, region, ready, feeds))
        if self.boot.postprocess is not None:
            for t in ready:
                if not isinstance(results[t.task_id], RemoteError):
                    post = functools.partial(self._post, results[t.task_id], t)
                    results[t.task_id] = self._guarded(t, "postprocess", post)
        for t in msg.tasks:
            if t.task_id not in feeds:
                results[t.task_id] = self._guarded(t, "run", functools.partial(self._run_chunk, t))
        run_s = time.perf_counter() - t0
        in_place = sum(type(r) is Placed for r in results.values())
        outcomes = self._write(msg, region, results)
        return BatchDone(msg.batch_id, outcomes, run_s, rss() if self.boot.report_rss else 0, in_place)

    def _plan(self, msg: RunBatch, region: tuple[int, int], ready: list[TaskSpec],
              feeds: dict[int, Any]) -> dict[int, Placed]:
        """Where the runtime may write each task's outputs itself (see workers/inplace.py):
        unstacked runs whose outputs go to shared memory as they are (no postprocess)."""
        if self.planner is None or self.boot.postprocess is not None or (msg.stack and len(ready) > 1):
            return {}
        return self.planner.plan(region, ready, feeds) or {}

    def _prepare(self, t: TaskSpec) -> Any:
        # step 5: views of the task's inputs (read-only: the mapping is PROT_READ)
        if t.deadline is not None and time.monotonic() > t.deadline:
            raise DeadlinePassed(f"task {t.task_id} waited past its deadline behind other work; not started")
        if self.boot.preprocess is not None or self.boot.postprocess is not None:
            seed_task(t.seed)  # before preprocess, so a replay draws the same random numbers
        item = packing.unpack(t.item, self.inputs.array)
        faults.inject(t.fault, "preprocess")
        return self.pipeline.prepare(item)  # preprocess, then the input contract

    def _run_chunk(self, t: TaskSpec) -> Chunk:
        """A chunk task (Engine.map): its items through the pipeline item by item (run stacked
        in one session call when they can be: stack_chunks); an item's error is that item's
        outcome alone. The context is bound by the caller (_guarded)."""
        if self.boot.preprocess is not None or self.boot.postprocess is not None:
            seed_task(t.seed)
        items = packing.unpack(t.item, self.inputs.array)
        stacked = self._stack_items if self.boot.stack_chunks else None  # opt-in, as batching: bits may move
        fields = functools.partial(self._fields, t)
        return Chunk(self.pipeline.chunk(items, self.boot.task_timeout, t.fault, stacked, fields))

    def _stack_items(self, feeds: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]] | None:
        """One session call for items of equal trailing shapes on a batchable model; None if
        they cannot be stacked or the stacked run fails (then each runs alone)."""
        assert self.session is not None
        specs = self.session.info.inputs
        if not contract.batchable(specs):
            return None
        first = feeds[0]
        if any(f[s.name].shape[1:] != first[s.name].shape[1:] for f in feeds for s in specs):
            return None
        try:
            return self._stacked_run(feeds)
        except Exception:  # noqa: BLE001 - run them one by one: each error is its item's
            log.debug("stacked run of a chunk failed; running its %d items one by one", len(feeds))
            return None

    def _run(self, stack: bool, ready: list[TaskSpec], feeds: dict[int, Any], results: dict[int, Any],
             plan: dict[int, Placed]) -> None:
        # step 6: one session call for the whole batch when stacked, else one per task
        assert self.session is not None
        if stack and len(ready) > 1:
            try:
                for t, out in zip(ready, self._run_stacked(ready, feeds), strict=True):
                    results[t.task_id] = out
                return
            except Exception:  # noqa: BLE001 - find the guilty item: run each on its own
                log.debug("stacked run failed; running the batch's %d items one by one", len(ready))
        for t in ready:
            run = functools.partial(self._run_one, t, feeds[t.task_id], plan.get(t.task_id))
            results[t.task_id] = self._guarded(t, "run", run)

    def _run_one(self, t: TaskSpec, feeds: dict[str, np.ndarray], placed: Placed | None) -> Any:
        """The outputs (a dict), or `placed` once the runtime has written them in place."""
        assert self.session is not None
        faults.inject(t.fault, "run")
        if placed is not None:
            try:
                self._run_into(feeds, placed.dests, t.step)
                return placed
            except RunTimeout:
                raise
            except Exception:  # noqa: BLE001 - a plain run tells a shape change from a real error
                log.debug("in-place run of task %d failed; running it plainly", t.task_id)
        out = self.pipeline.run(feeds, self.boot.task_timeout, t.step)
        if self.planner is not None:
            if placed is not None:
                self.planner.forget(placed.key)  # the shapes vary with the data: never bind them
            else:
                self.planner.learn(feeds, out)
        return out

    def _run_into(self, feeds: dict[str, np.ndarray], dests: dict[str, np.ndarray], step: int) -> None:
        """The runtime writes the outputs into `dests`, `step` rows a session call (a block)."""
        assert self.session is not None
        for lo, hi, part, left in in_steps(feeds, step, self.boot.task_timeout):
            self.session.run_into(part, dests if part is feeds else {k: d[lo:hi] for k, d in dests.items()}, left)

    def _run_stacked(self, ready: list[TaskSpec], feeds: dict[int, Any]) -> list[dict[str, np.ndarray]]:
        self._hand(STACKED)
        for t in ready:
            faults.inject(t.fault, "run")
        return self._stacked_run([feeds[t.task_id] for t in ready])

    def _stacked_run(self, feeds: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        """One session call for the batch, split back into each item's rows (pipeline.run_stacked)."""
        session = self.session
        assert session is not None
        timeout = self.boot.task_timeout
        return run_stacked(lambda stacked: session.run(stacked, timeout),
                           [s.name for s in session.info.inputs], feeds)

    def _post(self, outputs: Any, t: TaskSpec) -> Any:
        faults.inject(t.fault, "postprocess")
        item = packing.unpack(t.item, self.inputs.array)
        return self.pipeline.finish(outputs, item)

    def _guarded(self, t: TaskSpec, stage: str, thunk: Callable[[], Any]) -> Any:
        """Run one stage of one task with its context bound; an error becomes a RemoteError."""
        self._hand(t.task_id)
        ctx: Any = t.context
        if type(ctx) is Sealed:
            try:
                ctx = unseal(ctx, "the context")
            except TaskDataError as exc:
                return remote_error(exc, ErrorKind.DATA)
        # the log fields set and reset by hand, and no context bound when the task has none
        # (the loop runs with the empty one): two generator-based context managers were a
        # fifth of the worker's Python on a one-row task (docs/latency.md)
        token = task_fields.set({"task_id": t.task_id, "attempt": t.attempt, "stage": stage})
        try:
            if not ctx:
                return self._attempt(stage, thunk)
            with context.bind(ctx):
                return self._attempt(stage, thunk)
        finally:
            task_fields.reset(token)

    def _hand(self, task_id: int) -> None:
        """Mark the task in hand (status word 0, read by the supervisor after a death). With
        task_timeout, word 1 is when its time started counting (monotonic ns, less what it
        already ran in this batch): the limit holds per task, whatever the group's size."""
        if task_id == self._in_hand:
            return  # the words say so already (a stage after another of the same task)
        if self._timed:
            now = time.monotonic_ns()
            if self._in_hand != IDLE:
                self._spent[self._in_hand] = self._spent.get(self._in_hand, 0) + now - self._since
            self._since = now
            self.status[1] = now - self._spent.get(task_id, 0)  # before word 0: read in that order
        self._in_hand = task_id
        self.status[0] = task_id

    @contextlib.contextmanager
    def _fields(self, t: TaskSpec, stage: str) -> Iterator[None]:
        """The task's fields on every log record of this stage."""
        token = task_fields.set({"task_id": t.task_id, "attempt": t.attempt, "stage": stage})
        try:
            yield
        finally:
            task_fields.reset(token)

    @staticmethod
    def _attempt(stage: str, thunk: Callable[[], Any]) -> Any:
        """thunk(), or its error as a RemoteError (logged)."""
        try:
            out = thunk()
        except SupervisorGone:
            raise  # (asking for an output region: nobody reads this worker any more)
        except BaseException as exc:  # noqa: BLE001 - the user's code or the runtime raised; SystemExit and
            left_by_a_fork()  # KeyboardInterrupt too (the worker ignores SIGINT: user code raised them;
            return failure(stage, exc)  # was: the worker died, and the task was quarantined after killing three)
        left_by_a_fork()
        return out

    # -- step 7: outputs into shared memory ----------------------------------------------------

    def _write(self, msg: RunBatch, region: tuple[int, int], results: dict[int, Any]) -> tuple[Outcome, ...]:
        placed = [r for r in results.values() if type(r) is Placed]
        if placed and len(placed) + sum(isinstance(r, RemoteError) for r in results.values()) == len(results):
            return self._report_placed(msg, results)
        for task_id, res in results.items():  # some fell back to a plain run: write every one
            if type(res) is Placed:  # anew (out of the region first: it may be replaced)
                results[task_id] = {name: dst.copy() for name, dst in res.dests.items()}
        parts: list[tuple[TaskSpec, Any, list[np.ndarray], RemoteError | None]] = []
        for t in msg.tasks:
            res = results[t.task_id]
            if isinstance(res, RemoteError):
                parts.append((t, None, [], res))
                continue
            try:
                skeleton, arrays = _split(res)
                if self._seal_results and type(skeleton) is not FlatSkeleton:
                    skeleton = self._seal_result(skeleton)
            except Exception as exc:  # noqa: BLE001 - the task's own data (an object array, a
                # structure too deep to walk, ...): it fails alone
                parts.append((t, None, [], remote_error(exc, ErrorKind.DATA if isinstance(exc, TaskDataError) else ErrorKind.RUN)))
                continue
            parts.append((t, skeleton, arrays, None))
        layouts = [packing.layout(arrays) for _, _, arrays, _ in parts]  # laid out once: write takes the offsets
        total = sum(size for _, size in layouts)
        base, room = region
        if total > 0 and (base < 0 or total > room):
            grant = self._ask_output(msg.batch_id, total)
            base = grant.offset
            if grant.error:
                denied = _denied(grant, total)
                return tuple(Outcome(t.task_id, None, e or denied) for t, _, _, e in parts)
        outcomes = []
        for (t, skeleton, arrays, failed), (offsets, size) in zip(parts, layouts, strict=True):
            if failed is not None:
                outcomes.append(Outcome(t.task_id, None, failed))
                continue
            self._hand(t.task_id)
            faults.inject(t.fault, "write_outputs")
            outcomes.append(Outcome(t.task_id, packing.write(skeleton, arrays, base, self.outputs.array, offsets)))
            base += size
        return tuple(outcomes)

    def _report_placed(self, msg: RunBatch, results: dict[int, Any]) -> tuple[Outcome, ...]:
        """Every output already is where the runtime wrote it: the write stage only reports."""
        outcomes = []
        for t in msg.tasks:
            res = results[t.task_id]
            if isinstance(res, RemoteError):
                outcomes.append(Outcome(t.task_id, None, res))
                continue
            self._hand(t.task_id)
            faults.inject(t.fault, "write_outputs")
            outcomes.append(Outcome(t.task_id, res.packed))
        return tuple(outcomes)

    def _read_waiting(self) -> None:
        """Every message already in the pipe, into `pending` (read while a batch runs)."""
        while self.reader.poll():
            self.pending.append(decode(self.reader.recv()))

    def _revoked(self, batch_id: int) -> bool:
        """Whether a Revoke of this batch waits in the pipe (it was sent while this process
        made no progress, so it is there before the batch starts)."""
        self._read_waiting()
        for msg in self.pending:
            if type(msg) is Revoke and msg.batch_id == batch_id:
                self.pending.remove(msg)
                return True
        return False

    def _granted(self, batch_id: int) -> tuple[int, int]:
        """The region of an OutputGrant for this batch already in the pipe (sent when the batch
        became its slot's head), without waiting; (-1, 0) if none is there."""
        self._read_waiting()
        for msg in self.pending:
            if isinstance(msg, OutputGrant) and msg.batch_id == batch_id and not msg.error:
                self.pending.remove(msg)
                return msg.offset, msg.nbytes
        return -1, 0

    @staticmethod
    def _seal_result(skeleton: Any) -> Any:
        """A result made by user code, pickled alone (a chunk: item by item, so that an item
        that cannot be pickled fails alone); TaskDataError if the whole cannot be."""
        what = "the result (what postprocess, or preprocess without a model, returned)"
        if type(skeleton) is not Chunk:
            return seal(skeleton, what)
        items = []
        for item in skeleton:
            if isinstance(item, RemoteError) or _plain(item):
                items.append(item)
                continue
            try:
                items.append(seal(item, what))
            except TaskDataError as exc:
                items.append(remote_error(exc, ErrorKind.DATA))
        return Chunk(items)

    def _ask_output(self, batch_id: int, nbytes: int) -> OutputGrant:
        """A region of at least `nbytes` for this batch. The grant may already wait in the pipe
        (sent when the batch became its slot's head); else ask. Smaller grants are stale."""
        self._read_waiting()
        for msg in [m for m in self.pending if isinstance(m, OutputGrant)]:
            self.pending.remove(msg)
            if msg.batch_id == batch_id and (msg.error or msg.nbytes >= nbytes):
                return msg
        self.outbox.send(NeedOutput(batch_id, nbytes))
        while True:
            msg = decode(self.reader.recv())
            if not isinstance(msg, OutputGrant):
                self.pending.append(msg)
            elif msg.batch_id == batch_id and (msg.error or msg.nbytes >= nbytes):
                return msg


def _plain(item: Any) -> bool:
    """A dict of arrays with string keys (now holes): nothing in it to fail pickling."""
    return type(item) is dict and all(type(k) is str and type(v) is Hole for k, v in item.items())


def _denied(grant: OutputGrant, total: int) -> RemoteError:
    """Why no output region came: the batch must be split (its tasks go back, uncharged), or
    the outputs can never fit (grant.nbytes: the largest region there is)."""
    if grant.error == SPLIT:
        return RemoteError(SPLIT, "", "outputs too large to share one region", "")
    return RemoteError(ErrorKind.CAPACITY, "ShmCapacityError", grant.error, "", needed=total, available=grant.nbytes)


def _split(res: Any) -> tuple[Any, list[np.ndarray]]:
    """packing.split, contained per item for a chunk: an item whose outputs cannot be walked
    (an object array, a structure too deep) becomes that item's error, the others go on."""
    try:
        return packing.split(res)
    except Exception:
        if type(res) is not Chunk:
            raise
    items = []
    for out in res:
        try:
            packing.split(out)
            items.append(out)
        except Exception as exc:  # noqa: BLE001 - that item's own data
            items.append(remote_error(exc, ErrorKind.RUN))
    return packing.split(Chunk(items))

