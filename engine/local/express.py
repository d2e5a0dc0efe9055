"""The express lane (issue 21): one `infer()` or `infer_async()` on an idle engine in the
fewest steps.

The fast path (engine.core.fastpath) already runs an idle call's steps 3-9 on the caller's
thread, but through every general step on the way: the admission queue's reserve, accept and
take, the dispatcher's search for a slot and its group limits, a general wait. An idle call
needs none of their decisions, and they were most of its ~5,800 interpreted opcodes
(docs/latency.md). The express lane makes the same records (a Task with its Future, a Batch
on a slot, the input lease, the lend) and skips only the choosing:

    caller thread, the owner lock taken (a thread waits for it; an event loop takes it only
    if free, and never while another call of the engine is in flight)
     nothing queued, no close, reload, failure or owner call pending; a READY slot holding
     nothing (with dynamic batching, `max_batch_size` > 1: and no slot holding the owner's
     work, which stacks the calls that queue under load): else no express, the general path
       step 2   the inputs' layout learnt once per signature; lease, copy in
                the queue accepts it running (`TaskQueue.accept_running`: the next id, counted)
       3-4      the dispatcher's own `send_batch` to that slot, lent to this thread (an
                event loop: after calm calls, as the fast path lends one)
     the lend's wait: `FastPath.wait` (a loop: `aio.watch_lend`) with this lane's step, under
     the lock: the task's BatchDone alone, plain outputs: steps 8-9 in place (the outputs
     copied out, `TaskLedger.delivered`, the slot given back); anything else read goes to
     the transport's and the owner's own handling (`FastPath.step`)

So everything off the happy path is the same code as every other call's: a death, a kill, a
stall, close(), a reload, a cancel or a Ctrl-C finds a task in a batch on a slot, in the
ledger, lent, and ends it as it ends any other. Only plain dict inputs (or the bare array of a
one-input model) of a signature already checked, no context or deadline, no preprocess or
postprocess, and inputs of at most EXPRESS_MAX_BYTES take this lane (the copy runs under the
owner lock).
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from slabpool.engine.caller import aio
from slabpool.engine.caller.handles import TaskFuture
from slabpool.engine.caller.request import as_block
from slabpool.engine.core import interrupts
from slabpool.engine.core.fastpath import Lend
from slabpool.engine.core.slots import SlotRecord
from slabpool.engine.core.states import SlotState, TaskState
from slabpool.engine.core.task import Batch, Task
from slabpool.engine.local.staged import Staged
from slabpool.shm.alloc import align_up
from slabpool.shm.errors import CapacityError
from slabpool.workers import contract, packing
from slabpool.workers.protocol import BatchDone, FlatSkeleton, decode

if TYPE_CHECKING:
    from slabpool.engine.local.pool import Engine

EXPRESS_MAX_BYTES = 64 << 10  # inputs copied under the owner lock: small ones only
_LAYOUTS = 256  # signatures whose layout is kept (as contract.Checked keeps checked ones)


class Express:
    """The express lane of one local Engine."""

    def __init__(self, eng: Engine) -> None:
        co = eng._sup
        self.co, self.fast, self.lock = co, co.fast, co.fast.lock
        self.queue, self.ledger, self.dispatcher, self.slots = eng._queue, co.ledger, co.dispatcher, co.slots
        self.arena, self.transport = eng._inputs, eng._transport
        self._dtypes: dict[str, np.dtype[Any]] = {}
        cfg = eng.config
        self.on = self.fast.enabled and cfg.preprocess is None and cfg.postprocess is None
        self.stacks = cfg.max_batch_size > 1  # the owner stacks what queues under load: see _dispatch
        # a dispatch here sets no timer sooner than this (a stall, task_timeout: FastPath._tell_owner)
        self.horizon = min(cfg.stall_after, cfg.task_timeout if cfg.task_timeout is not None else math.inf)
        self._layouts: dict[tuple[Any, ...], tuple[Any, list[int], int] | None] = {}
        self.taken = 0  # calls accepted through this lane (stats for tests and bench.latency)

    def call(self, eng: Engine, inputs: Any, step: int = 0) -> Any:
        """The outputs of `infer(inputs)` taken through the express lane; None when it does not
        take it (nothing was accepted: the caller goes the general way). `step`: the inputs are
        a group of callers' rows (engine.caller.combine), one task that counts no items, a
        session call of `step` rows each, as `Request(units=0, step=step)` makes it."""
        fut = self._take(eng, inputs, loop=False, step=step)
        if fut is None:
            return None
        lend = fut.lend
        if lend is None:
            interrupts.leave()
            return fut.result().outputs
        return self._wait(lend, fut)

    def call_async(self, eng: Engine, inputs: Any, loop: asyncio.AbstractEventLoop,
                   result: bool = False) -> tuple[TaskFuture, asyncio.Future[Any]] | None:
        """`infer_async(inputs)` through the express lane: its task's Future and the asyncio
        future of its outputs (`result`: of its Result, as `submit_async` gives it), or None
        (nothing accepted). The slot is lent to the loop: a reader on its pipe runs the same
        step on the loop thread, which never waits for the owner lock (held: the lend goes
        back to the owner thread, FastPath.abandon)."""
        fut = self._take(eng, inputs, loop=True)
        if fut is None:
            return None
        lend = fut.lend
        try:
            interrupts.leave()
        except KeyboardInterrupt:
            if lend is not None:
                self.fast.forsake_lend(lend)
            raise
        waiter = aio.bridge(loop, fut, outputs=not result)  # (off the happy path its Future completes)
        if lend is not None:
            self._watch(loop, lend, waiter, self._step_result if result else self._step)
        return fut, waiter

    def _take(self, eng: Engine, inputs: Any, loop: bool, step: int = 0) -> TaskFuture | None:
        """Steps 1-4 if the lane takes this call: its Future (`lend`: the slot lent to it), in
        the Ctrl-C stretch that the wait ends; None, nothing accepted, no stretch."""
        fast = self.fast
        if not self.on or not fast.enabled or (loop and (not fast.loop_calm or fast.lent or self.ledger.in_flight())):
            return None  # (a loop with calls in flight: declined before any work, see _dispatch)
        inputs = contract.one_input(inputs, eng._specs)
        if type(inputs) is not dict:
            return None
        sig = contract.signature(inputs)
        known = eng._admitted.get(sig)  # step 1: a signature the door has checked
        if known is None:
            return None
        if step:  # (a block, as BaseEngine._submit admits one: never stacked, no items)
            known = as_block(*known)
        lay = self._layouts[sig] if sig in self._layouts else self._learn(sig, inputs)
        if lay is None:
            return None
        interrupts.enter()  # (from the accept to the lend's wait a Ctrl-C waits: engine.core.interrupts)
        try:
            fut = self._dispatch(eng, inputs, known, lay, loop, step)
        except BaseException:
            interrupts.leave_quietly()
            raise
        if fut is None:
            interrupts.leave()
            return None
        self.taken += 1
        return fut

    def _learn(self, sig: tuple[Any, ...], inputs: dict[Any, Any]) -> tuple[Any, list[int], int] | None:
        skeleton, arrays = packing.split(inputs)
        offsets, nbytes = packing.layout(arrays)
        plain = type(skeleton) is FlatSkeleton and len(arrays) == len(inputs)  # (plain arrays, in order)
        lay = (skeleton, offsets, nbytes) if plain and 0 < nbytes <= EXPRESS_MAX_BYTES else None
        if len(self._layouts) >= _LAYOUTS:
            self._layouts.clear()
        self._layouts[sig] = lay
        return lay

    def _dispatch(self, eng: Engine, inputs: dict[Any, Any], known: tuple[Any, int],
                  lay: tuple[Any, list[int], int], loop: bool, step: int = 0) -> TaskFuture | None:
        """Steps 2-4 under the owner lock, if a slot is idle; the Future (its `lend` the slot
        lent to this thread), or None: nothing accepted.

        A thread waits for the lock, and takes any idle slot even while another holds the
        owner's work. Declined, its call went through the owner thread, and that slot's work
        then declined the next call in turn: at 2 callers three calls in five went the
        owner's way once one had (the lock held by the other caller's step); waiting, 2
        callers made 12,389 calls/s against 11,314 and 3 callers 8,870 against 6,843
        (docs/latency.md). A group's task (`step`: engine.caller.combine) is a thread's too:
        at 8 callers a quarter of the groups went the owner's way. Only with dynamic batching
        (`stacks`) is an idle slot left to the owner while another holds its work: the owner
        stacks the calls that queue under load, and a call that took the idle slot would
        stack nothing.

        An event loop is lent a slot only when nothing else of the engine is in flight, and
        was not at its last accept either (`FastPath.loop_calm`, as FastPath._idle: a loop that
        serves waves of requests would hold a lent slot idle until it looks). A call this lane
        takes leaves `loop_calm` as it was (True: this accept was idle too); one it declines is
        the general path's, which updates it once."""
        if loop:
            if not self.lock.try_own():
                return None  # (a loop never waits: it serves its other calls meanwhile)
        elif self.lock.held_here:
            return None  # (a caller holding it already: the general way, not a wait on itself)
        else:
            self.lock.own()
        try:
            slot = self._idle_slot(any_idle=bool(step) or not (loop or self.stacks))
            if loop and not (slot is not None and self.fast.loop_calm and not (self.fast.lent or self.ledger.in_flight())):
                return None  # (loop_calm is the general path's to update for this call: one accept, once)
            if slot is None:
                return None
            skeleton, offsets, nbytes = lay
            arena = self.arena
            try:
                lease = arena.try_lease(nbytes)
            except CapacityError:  # (it could not grow: the general path says so, ShmCapacityError)
                return None
            if lease is None:
                return None
            try:
                t0 = time.perf_counter()
                packed = packing.write(skeleton, list(inputs.values()), lease.offset, arena.array, offsets)
                copy_s = time.perf_counter() - t0
                fut = TaskFuture(eng._weak)
                key, items = known
                task = self.queue.accept_running(lambda task_id: Task(
                    task_id, fut, Staged(packed, lease, None), key, items, None, 0, None, None, copy_in_s=copy_s,
                    nbytes=nbytes, units=0 if step else 1, step=step))
            except BaseException:
                arena.release(lease)
                raise
            if task is None:
                arena.release(lease)
                return None
            fut.slabpool_task = task
            self._send(slot, task, fut, loop)
            return fut
        finally:
            self.lock.let_go()

    def _send(self, slot: SlotRecord, task: Task, fut: TaskFuture, loop: bool) -> None:
        """Steps 3-4 of an accepted task, as the owner's dispatcher takes them (lent to this
        thread by `FastPath._before_send`); what interrupts them fails the engine, as a bug on
        the owner thread does."""
        fast = self.fast
        local = fast._local
        try:
            now = time.monotonic()
            local.task, local.lend, local.dup = task, None, loop  # (an event loop's fd: a dup, Lend.dup)
            try:
                self.dispatcher.send_batch(slot, Batch([task], stack=False), now)
            finally:
                lend = local.lend
                local.task = local.lend = None
                local.dup = False
            if lend is not None and not lend.over and not fast._waiting(lend):
                fast.give_back(lend)  # (its batch was not sent: Unsendable)
                lend = None
            fut.lend = lend
            if now + self.horizon < fast.sleep_until:  # (the owner wakes before any timer this sets)
                fast._tell_owner(now)
            self.ledger.flush()
        except BaseException as exc:
            fast._interrupted(exc)
            raise

    def _idle_slot(self, any_idle: bool = False) -> SlotRecord | None:
        """Under the lock: a READY slot holding nothing, not lent, on an engine with nothing
        else for the owner to do first (nothing queued or to replay, no close, reload,
        failure or owner call pending, no slot holding work the owner thread reads: unless
        `any_idle`, see _dispatch); else None."""
        co = self.co
        if (co.ledger.closing is not None or co.ledger.failure is not None or co.reload is not None
                or co.thread.pending):
            return None
        lent = self.fast.lent
        idle = None
        for s in self.slots:
            if s.batches:
                if s.index not in lent and not any_idle:
                    return None  # the owner thread's work: under load it batches (FastPath._idle)
            elif idle is None and s.state is SlotState.READY and s.index not in lent:
                idle = s
        return idle

    # -- the lend's wait, and steps 8-9 of its happy path ------------------------------------------

    def _wait(self, lend: Lend, fut: TaskFuture) -> Any:
        """`FastPath.wait` with this lane's step: the outputs, or (off the happy path) the
        Future's once the owner's code has ended the task."""
        outputs = self.fast.wait(lend, self._step)
        return outputs if outputs is not None else fut.result().outputs

    def _watch(self, loop: asyncio.AbstractEventLoop, lend: Lend, waiter: asyncio.Future[Any], step: Any) -> None:
        """The loop waits on its lent slot (aio.watch_lend) with this lane's step; what its
        happy path gives settles the waiter at once (else the Future does, through bridge)."""

        def deliver(outputs: Any) -> None:
            if not waiter.done():
                waiter.set_result(outputs)

        aio.watch_lend(loop, lend, step, deliver)

    def _step(self, lend: Lend, readable: bool) -> Any:
        """Under the lock: the outputs, if the worker's answer was this task's BatchDone alone
        and it ended there; else None after the owner's own step (`FastPath.step`)."""
        return self._look(lend, readable, False)

    def _step_result(self, lend: Lend, readable: bool) -> Any:
        """`_step` for a caller that awaits the task's Result (`submit_async`): the Result the
        owner's path makes (`Task.result`: the model version and the slot that computed it)."""
        return self._look(lend, readable, True)

    def _look(self, lend: Lend, readable: bool, result: bool) -> Any:
        if lend.over or not readable:
            self.fast.step(lend, readable)
            return None
        t = self.transport
        frames = t.lent_frames(lend.slot)
        if frames is None:  # (an EOF: the transport has ended the lend; the owner sees the death)
            self.fast.step(lend, False, t.take_events())
            return None
        w = t.workers[lend.slot]
        msg = decode(frames[0]) if len(frames) == 1 else None
        batch, task = lend.batch, lend.task
        slot = self.slots[lend.slot]
        if (type(msg) is not BatchDone or msg.batch_id != batch.id or len(msg.outcomes) != 1
                or msg.outcomes[0].error is not None or not w.sent or w.sent[0].batch is not batch
                or slot.state is not SlotState.BUSY or batch.revoked or task.state is not TaskState.RUNNING
                or type(getattr(msg.outcomes[0].outputs, "skeleton", None)) is not FlatSkeleton):
            return self._general(lend, w, frames)
        t0 = time.perf_counter()
        got = self._copy_out(msg.outcomes[0].outputs)  # step 8
        if got is None:
            return self._general(lend, w, frames)
        return self._finish(lend, slot, msg, got, time.perf_counter() - t0, result)

    def _general(self, lend: Lend, w: Any, frames: list[bytes]) -> None:
        """What was read, handled as the transport's own read and the owner's step handle it."""
        self.transport.take_frames(w, frames)
        self.fast.step(lend, False, self.transport.take_events())

    def _copy_out(self, packed: Any) -> tuple[dict[Any, np.ndarray], int] | None:
        """Step 8 for a flat dict of small outputs: each copied out of the output arena into an
        array the caller owns; their region's size. None (nothing changed) for large ones, or
        no memory for the copies: `delivery.copy_out` then says what failed."""
        array_at, dtypes = self.transport.outputs.array, self._dtypes
        outputs: dict[Any, np.ndarray] = {}
        used = 0
        try:
            for name, ref in zip(packed.skeleton, packed.arrays, strict=True):  # (FlatSkeleton: holes in order)
                dt = dtypes.get(ref.dtype)
                if dt is None:
                    dt = dtypes[ref.dtype] = np.dtype(ref.dtype)
                n = dt.itemsize * math.prod(ref.shape)
                if n > EXPRESS_MAX_BYTES:
                    return None
                outputs[name] = array_at(ref.offset, dt, ref.shape).copy()
                used = align_up(used + n)
        except MemoryError:
            return None
        return outputs, used

    def _finish(self, lend: Lend, slot: SlotRecord, msg: BatchDone, got: tuple[dict[Any, np.ndarray], int],
                copy_s: float, result: bool = False) -> Any:
        """Steps 8-9 of the happy path: the outputs copied out, the region and the inputs back,
        the task ended (counted; its Future is not completed: nobody but this call holds it),
        the slot idle and given back; what queued meanwhile dispatched, as after any Done. The
        outputs, or (`result`) the Result the owner's path would have made."""
        task = lend.task
        now = time.monotonic()
        outputs, used = got
        timings = task.timings(msg.run_s, copy_s, now)
        self.transport.delivered(lend.slot, used)
        self.dispatcher.delivered(slot, timings, msg.rss, msg.in_place, now)
        self.fast.served += 1
        self.fast.give_back(lend, self.fast._park(lend))
        if len(self.queue) or not self.queue.hungry:  # (as FastPath.step, after a Done)
            self.dispatcher.dispatch(now)
            self.fast._tell_owner(now)
        elif self.fast.owner_waits():  # (a close drains: this task's end is its news)
            self.co.wake()
        self.ledger.flush()
        if result:  # (the slot's incarnation, and so its version, is the one that ran it)
            return task.result(outputs, slot.model_version, slot.index, slot.pid, timings)
        return outputs
