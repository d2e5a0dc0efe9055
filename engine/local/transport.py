"""The local slot transport (engine.core.transport): worker processes, their pipes, one
selector, and the shared memory a batch reads and writes. What pebble calls the worker
manager; the owner (engine.core.coordinator) holds it and decides everything else.

Inside, and nowhere else: output regions and their grants (NeedOutput, engine.local.regions),
the copies of revoked inputs (the originals stay pinned until the worker answers), each slot's
status words, step 8 (outputs copied out of shared memory into the caller's arrays), worker
log records (logged as they come), SIGTERM -> SIGKILL escalation.

A slot's pipe can be lent to the caller that waits on its one task (engine.core.fastpath):
it leaves the selector, the caller polls it (an event loop a dup of it, which the loop closes)
and reads it with this transport's own read (`read_lent`, under the owner lock), then gives it
back (parked, a group's task under load: see engine.local.selector). The transport ends a lend itself
when the owner's path must take over: a death (the sentinel never leaves the selector), a
kill, a Revoke, an outbox filling (its write events are the selector's).

Each slot's status words live in one cache line at the start of the output arena: the id of
the task its worker is in (IDLE, or STACKED for a whole stacked batch), read after a death,
and when that task's time started (task_timeout).
"""

from __future__ import annotations

import logging
import os
import selectors
import sys
import time
from collections.abc import Callable, Iterable
from multiprocessing.context import BaseContext
from typing import Any

import numpy as np
import psutil

from slabpool.engine.core.config import EngineConfig
from slabpool.engine.core.owner import OwnerLock
from slabpool.engine.core.states import KillReason, TaskState
from slabpool.engine.core.task import Batch, Task
from slabpool.engine.core.transport import Died, Done, Event, InHand, Ready, Room, Unsendable, sooner
from slabpool.engine.local.delivery import batch_outcomes
from slabpool.engine.local.regions import OutputRegions, Sent
from slabpool.engine.local.selector import SlotSelector, Watched
from slabpool.engine.local.slot import Slot
from slabpool.engine.local.staged import Staged
from slabpool.shm import Arena
from slabpool.workers import errors as E
from slabpool.workers.errors import crash_hint, describe_exit
from slabpool.workers.main import WorkerBoot
from slabpool.workers.pipeline import IDLE
from slabpool.workers.protocol import (
    BatchDone,
    InitFailed,
    LogRecord,
    NeedOutput,
    OutputGrant,
    RemoteError,
    Revoke,
    RunBatch,
    TaskSpec,
    decode,
    encode,
)
from slabpool.workers.protocol import (
    Ready as WorkerReady,
)
from slabpool.workers.session import SessionSpec

log = logging.getLogger("slabpool.engine")
RETIRE_GRACE = 10.0  # seconds a retiring worker has to exit on its Shutdown before SIGKILL


class LocalTransport:
    """Every slot's process and pipe, the selector over them, the output regions. Not
    thread-safe: the owner thread (and, before it starts, the constructor's thread) alone
    calls these; `wake` from any thread."""

    def __init__(
        self, cfg: EngineConfig, inputs: Arena, outputs: Arena, ctx: BaseContext,
        boot: Callable[[int, int, SessionSpec | None, int], WorkerBoot],
    ) -> None:
        self.cfg, self.inputs, self.outputs, self.ctx, self.boot = cfg, inputs, outputs, ctx, boot
        self.quorum = cfg.workers
        self.startup_bound = True
        self.can_lend = True
        self.takes_back = True  # (a worker looks for a Revoke before it starts a batch: workers.main)
        self.spin_s = cfg.spin_us / 1e6  # a lent batch's worker polls this long for the next (RunBatch.spin)
        self._peers: Callable[[], int] = lambda: 0  # the engine's tasks polling beside a lent call (attach)
        self._lock = OwnerLock()  # the owner's (attach): let go of around the wait
        self._lend_ended: Callable[[int], None] = _nothing
        self.workers = [Slot(i) for i in range(cfg.workers)]
        self.selector = SlotSelector()
        for w in self.workers:
            w.on_backlog = self._on_backlog
        self._status_lease = outputs.lease(64 * cfg.workers)
        self.status = outputs.array(self._status_lease.offset, np.dtype(np.int64), (cfg.workers, 8))
        self.status[:, 0] = IDLE
        self.regions = OutputRegions(outputs, 64 * cfg.workers)
        self._events: list[Event] = []

    # -- the protocol: what the owner asks ---------------------------------------------------------

    def start(self, slot: int, spec: SessionSpec | None) -> int:
        w = self.workers[slot]
        self.selector.dirty = True
        self.status[slot, 0:2] = IDLE, 0
        w.spawn(self.ctx, self.boot(slot, w.incarnation + 1, spec, self._status_offset(slot)),
                self.inputs.fd, self.outputs.fd)
        return w.pid

    def send(self, slot: int, batch: Batch) -> None:
        """Steps 3-4's I/O: a region sized like the last outputs of these shapes, the RunBatch
        on the pipe (on a broken pipe the sentinel fires next and the batch replays)."""
        w = self.workers[slot]
        if not w.lent:
            self.selector.unpark(w)  # (its answer is the owner thread's to read)
        sent = Sent(batch)
        out = self.regions.lease_predicted(sent, ahead=len(w.sent) > 0)
        fi = self.cfg.fault_injection
        specs = tuple([TaskSpec(t.id, t.attempts, t.seed, t.inputs.packed, t.inputs.context, t.fault if fi else None,
                                t.deadline, t.step) for t in batch.tasks])
        spin = self.spin_s if w.lent else 0.0  # (a caller waits on it: a call alone's or a group's; never a block)
        try:
            data = encode(RunBatch(batch.id, specs, batch.stack, out.offset if out else -1, out.nbytes if out else 0,
                                   spin, self._peers() if spin else 0))
        except Exception as exc:
            self.regions.release(sent)
            raise Unsendable(f"{type(exc).__name__}: {exc}") from exc
        w.sent.append(sent)
        w.send_bytes(data)

    def revoke(self, slot: int, batch: Batch) -> bool:
        """Copies of the live tasks' inputs (their handles now point at them); the originals,
        and the inputs of tasks that ended meanwhile, stay pinned until the worker answers."""
        w = self.workers[slot]
        sent = next((s for s in w.sent if s.batch is batch), None)
        if sent is None:
            return False
        live = [t for t in batch.tasks if t.state is TaskState.RUNNING]
        if not _copy_inputs(live, self.inputs, sent.pinned):
            return False
        for t in batch.tasks:
            st: Staged = t.inputs
            if t.state.is_terminal and st.lease is not None:
                sent.pinned.append(st.lease)
                st.lease = None
        self._unlend(w)  # its tasks run elsewhere: the owner reads this answer
        w.send(Revoke(batch.id))
        return True

    def kill(self, slot: int, reason: KillReason, grace: float) -> None:
        w = self.workers[slot]
        self._unlend(w)  # its death is the owner thread's to see
        w.kill(grace)
        if grace <= 0:
            w.escalate()

    def retire(self, slot: int) -> None:
        self.workers[slot].ask_exit(RETIRE_GRACE)

    def release(self, tasks: Iterable[Task]) -> None:
        leases = []
        for t in tasks:
            st: Staged | None = t.inputs
            if st is not None and st.lease is not None:
                leases.append(st.lease)
                st.lease = None
        if leases:
            self.inputs.release_many(leases)  # one lock for the batch

    def in_hand(self, slot: int) -> InHand:
        words = self.status[slot]
        task_id, began = int(words[0]), int(words[1])
        if task_id == IDLE or int(words[0]) != task_id:  # (word 1 is written first: a pair read
            return InHand(IDLE, None, self.waiting(slot))  # across a change waits)
        return InHand(task_id, began / 1e9, self.waiting(slot))

    def waiting(self, slot: int) -> bool:
        """Its running batch waits for output memory (no task's time runs meanwhile)."""
        sent = self.workers[slot].sent
        return bool(sent) and sent[0].out_wanted > 0

    def room(self) -> Room:
        return Room(self.regions.per_task, self.regions.per_item, self.outputs.capacity)

    def wake(self) -> None:
        self.selector.wake()

    def memory(self, slot: int) -> tuple[int, int, int]:
        w = self.workers[slot]
        return worker_memory(w.pid) if w.pid and w.process is not None else (0, 0, 0)

    def startup_timeout_error(self, timeout: float, up: int) -> E.SessionInitError | None:
        return E.SessionInitError(f"workers not ready after {timeout} s")

    def alive(self, slot: int) -> bool:
        return self.workers[slot].process is not None

    def close(self) -> None:
        """After every worker is reaped: drop the last view into an arena, close the wake-up pipe."""
        if hasattr(self, "status"):
            del self.status
        self.selector.close()

    def abort(self) -> None:
        """A failed start: every worker started is killed and reaped, nothing is left."""
        for w in self.workers:
            if w.process is not None:
                w.kill(0.0)
                w.escalate()
                self.selector.forget_worker(w)
                w.reap()
        self.close()

    # -- lending a slot (engine.core.fastpath.LendingTransport) -----------------------------------

    def attach(self, lock: OwnerLock, ended: Callable[[int], None], peers: Callable[[], int]) -> None:
        self._lock, self._lend_ended, self._peers = lock, ended, peers

    def lend(self, slot: int, dup: bool = False) -> int | None:
        w = self.workers[slot]
        if w.conn is None or w.outbox or w.lent:
            return None
        fd = w.fd
        if dup:
            try:
                fd = os.dup(w.fd)
            except OSError:  # (this process out of file descriptors, a server at its limit: the
                return None  # call goes unlent, the owner's way; raised here, it stopped the engine)
        w.lent = True
        self.selector.lend(w)
        return fd

    def give_back(self, slot: int, park: bool = False) -> None:
        w = self.workers[slot]
        if w.lent:
            w.lent = False
            self.selector.give_back(w, park)

    def read_lent(self, slot: int) -> list[Event]:
        w = self.workers[slot]
        if w.lent and w.conn is not None:
            self._drain(w)
        return self.take_events()

    def lent_frames(self, slot: int) -> list[bytes] | None:
        """`read_lent`'s read without the handling (engine.local.express): the frames, or None
        (the slot is no longer lent, or its pipe ended: then the lend is over)."""
        w = self.workers[slot]
        return self._read(w) if w.lent and w.conn is not None else None

    def delivered(self, slot: int, used: int) -> None:
        """The head batch of a lent slot ended, its outputs (`used` bytes) copied out by its
        lender (engine.local.express): learnt and given back as `_on_batch_done` does."""
        w = self.workers[slot]
        self.regions.observed(w.sent[0].batch, used)
        self._end_head(w)

    def take_frames(self, w: Slot, frames: list[bytes]) -> None:
        """Frames a lender read off a lent pipe itself (engine.local.express), handled as this
        transport's own read handles them; their events wait for `take_events`."""
        for frame in frames:
            self._on_message(w, decode(frame))

    def take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def _unlend(self, w: Slot) -> None:
        """The owner's path takes over a lent slot: its pipe back, its lender told."""
        if w.lent:
            self.give_back(w.index)
            self._lend_ended(w.index)

    # -- the wait: what happened, as events ---------------------------------------------------------

    def wait(self, timeout: float | None) -> list[Event]:
        """The selector's wait, without the owner lock (a caller may act meanwhile), then
        what it saw, holding it; a lent slot's pipe is its caller's (a stale readiness seen
        before the lend is skipped)."""
        escalations = [w.kill_escalate_at for w in self.workers if w.kill_escalate_at is not None]
        self.selector.prepare(self.workers)
        with self._lock.released():
            got = self.selector.wait(sooner(timeout, escalations, time.monotonic()))
        conns, exits = set(), set()
        for key, mask in got:
            w = key.worker
            if w is None:
                continue
            if key.kind is Watched.CONN and key.obj is w.conn and not w.lent:
                if mask & selectors.EVENT_WRITE:
                    self._flush(w)  # what waits in its outbox, before anything new
                if mask & selectors.EVENT_READ:
                    conns.add(w.index)
            elif key.kind is Watched.EXIT and key.obj is w.process:
                exits.add(w.index)
        for w in self.workers:
            if w.index in conns and w.conn is not None:
                self._drain(w)
            if w.index in exits and w.process is not None:
                self._on_exit(w)
        if escalations:
            now = time.monotonic()
            for w in self.workers:
                if w.kill_escalate_at is not None and now >= w.kill_escalate_at:
                    w.escalate()
        events, self._events = self._events, []
        return events

    def _drain(self, w: Slot, to_end: bool = False) -> None:
        """What the worker sent: one read() when its pipe is readable; everything that can be
        read when it is dead (`to_end`: what it sent before dying still counts)."""
        self.take_frames(w, self._read(w, to_end) or [])

    def _read(self, w: Slot, to_end: bool = False) -> list[bytes] | None:
        """The frames one read() gives (`to_end`: all there are); None at the pipe's end."""
        conn, reader = w.conn, w.reader
        assert conn is not None and reader is not None
        try:
            return reader.read_to_end() if to_end else reader.read()
        except (EOFError, OSError):
            pass
        w.conn, w.fd = None, -1  # the worker is gone; its sentinel will fire
        self.selector.forget(conn.fileno())
        conn.close()
        self._unlend(w)  # (an EOF on a lent pipe: the death is the owner thread's)
        return None

    def _on_message(self, w: Slot, msg: Any) -> None:
        if type(msg) is BatchDone:
            self._on_batch_done(w, msg)
        elif type(msg) is NeedOutput:
            sent = next((s for s in w.sent if s.batch.id == msg.batch_id), None)
            grant = self.regions.on_need(sent, msg.nbytes) if sent is not None else None
            if grant is not None:  # (None: it waits for the next release, grant_waiting)
                w.send(grant)
        elif type(msg) is LogRecord:  # worker logs join the caller's logging
            logging.getLogger(None if msg.name == "root" else msg.name).log(msg.level, msg.message, extra=msg.fields)
        elif type(msg) is WorkerReady:
            w.up, w.pid = True, msg.pid
            self._events.append(Ready(w.index, msg.pid, msg.info))
        elif type(msg) is InitFailed:
            w.init_error = msg.error

    def _on_batch_done(self, w: Slot, msg: BatchDone) -> None:
        if not w.sent or w.sent[0].batch.id != msg.batch_id:
            log.warning("dropped a stale completion of batch %d from slot %d", msg.batch_id, w.index)
            return
        sent = w.sent[0]
        outcomes = () if sent.batch.revoked else batch_outcomes(sent.batch, msg, self.regions, self.outputs)
        self._end_head(w)
        self._events.append(Done(w.index, msg.batch_id, outcomes, msg.run_s, msg.rss, msg.in_place, w.pid))

    def _end_head(self, w: Slot) -> None:
        """The answered batch leaves the slot: the run has really ended, its region and pinned
        inputs go back; then the next one starts running."""
        self._end(w.sent.popleft())
        if w.sent:
            self._promote(w, w.sent[0])

    def _promote(self, w: Slot, head: Sent) -> None:
        """The next batch starts running now: give it its output region ahead of time."""
        if head.batch.revoked or head.out_lease is not None:
            return  # answered without a run: no region
        lease = self.regions.lease_predicted(head)
        if lease is not None:
            w.send(OutputGrant(head.batch.id, lease.offset, lease.nbytes))

    def _end(self, sent: Sent) -> None:
        if self.regions.release(sent):
            for to, grant in self.regions.grant_waiting([(w, s) for w in self.workers for s in w.sent]):
                to.send(grant)
        self._unpin(sent)

    def _unpin(self, sent: Sent) -> None:
        """The originals of revoked inputs, kept while the worker might still read them."""
        if sent.pinned:
            self.inputs.release_many(sent.pinned)
            sent.pinned = []

    def _on_exit(self, w: Slot) -> None:
        """The crash path's a: the process is reaped before any region it held is reused."""
        self._unlend(w)
        if w.conn is not None:
            self._drain(w, to_end=True)  # what it sent before dying still counts
        pid = w.pid
        self.selector.forget_worker(w)
        code = w.reap()
        running = int(self.status[w.index, 0])  # no writer is left: read what it was doing
        for sent in w.sent:
            self.regions.release(sent)
            self._unpin(sent)
        w.sent.clear()
        why = None if w.up else self._init_error(w, code)
        self._events.append(Died(w.index, pid, code, running, startup_error=why, reported=w.init_error is not None))

    def _init_error(self, w: Slot, code: int | None) -> E.SessionInitError:
        if w.init_error is not None:
            err: RemoteError = w.init_error
            exc = E.SessionInitError(f"slot {w.index} could not build its session: {err.type_name}: {err.message}")
            exc.__cause__ = E.RemoteTraceback(err.traceback)
            return exc
        return E.SessionInitError(
            f"slot {w.index} (pid {w.pid}) died during start-up with {describe_exit(code)}."
            + (_unreported(self.cfg.start_method) if code == 1 else crash_hint(code)))

    # -- the pipes' outboxes -------------------------------------------------------------------------

    def _on_backlog(self, w: Slot) -> None:
        """A worker's outbox holds what its pipe did not take: watch the pipe for writing
        (a lent pipe first comes back: its write events are the selector's)."""
        self._unlend(w)
        self.selector.set_writing(w, True)

    def _flush(self, w: Slot) -> None:
        """Its pipe is writable: write what waits; stop watching for writing once all is out."""
        if w.flush():
            self.selector.set_writing(w, False)

    def _status_offset(self, slot: int) -> int:
        return self._status_lease.offset + 64 * slot


def _copy_inputs(live: list[Task], inputs: Arena, pinned: list[Any]) -> bool:
    """Each live task's inputs copied to a fresh lease (its handle then points there), the
    original pinned; False (nothing changed) if the arena has no room for every copy."""
    olds = [t.inputs.lease for t in live]
    fresh = [inputs.try_lease(old.nbytes) if old is not None else None for old in olds]
    if any(n is None and o is not None for n, o in zip(fresh, olds, strict=True)):
        inputs.release_many([n for n in fresh if n is not None])
        return False
    for t, old, new in zip(live, olds, fresh, strict=True):
        if old is not None and new is not None:
            src = inputs.array(old.offset, np.dtype(np.uint8), (old.nbytes,))
            inputs.array(new.offset, np.dtype(np.uint8), (old.nbytes,))[:] = src
            st: Staged = t.inputs
            refs = tuple(r._replace(offset=r.offset - old.offset + new.offset) for r in st.packed.arrays)
            t.inputs = Staged(st.packed._replace(arrays=refs), new, st.context)
            pinned.append(old)
    return True


def worker_memory(pid: int) -> tuple[int, int, int]:
    """(RSS, PSS, shared bytes) of a process (/proc/PID/smaps_rollup); zeros once it is gone."""
    try:
        m = psutil.Process(pid).memory_full_info()
    except psutil.Error:
        return 0, 0, 0
    return m.rss, m.pss, max(m.rss - m.uss, 0)


def _unreported(start_method: str) -> str:
    """Why a worker exits with 1 before its handshake and sends no error: Python exits so on an
    exception nothing caught, and the worker reports every exception from its entry point on.
    So, unless user code called os._exit(1), it was raised while multiprocessing started the
    process, before slabpool's code ran there (its traceback only on the worker's stderr)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    name = getattr(getattr(main, "__spec__", None), "name", None)
    where = f"importing the main module {name or path!r} again (as __mp_main__), or " if name or path else ""
    return (f" No error came back: most likely an exception was raised while multiprocessing started it "
            f"(start_method={start_method!r}), before slabpool's code ran there: {where}unpickling the "
            "initializer's initargs. Its traceback is on the worker's stderr, above.")


def _nothing(slot: int) -> None:
    """No lend is made before the owner attaches (engine.core.fastpath)."""
