"""One call without a thread hop (issue 21): the owner is a role, and an idle engine lends a
slot to the caller that waits on it.

Whoever holds the owner lock (`OwnerLock`, engine.core.owner) acts as the owner. The owner
thread holds it for its whole step except while it waits in the transport; a caller takes it
for a few microseconds, twice a call, and runs the owner's own code:

    caller thread                                      worker k
     accept (step 2); the queue would wake the owner: the lock is free, nothing else queued,
     no call pending, no slot holds work the owner reads:
       3-4  the dispatcher's own dispatch()  --RunBatch-->  5-7
            its one-task batch went to an idle slot
            whose pipe took it whole: slot k is lent
            (its pipe leaves the owner's selector)
     poll(pipe k, and the lender's eventfd)           <--BatchDone--
       8-9  under the lock: the transport's own read, the coordinator's own handling of what
            it read (Done: step 8's copy out, step 9's finish, once), the slot given back
            (its pipe back in the owner's selector; a group's task's parked there until
            the owner's next wait: see `_park`); the owner is woken only if something
            waits for it (queued work, a close, a reload); the ledger's flush: the Futures
     Future.result() returns at once

Nothing is decided twice: the same code runs under the same lock, so replay, cancel,
quarantine, counters and the ledger stay exact by construction. Everything off that path goes
back to the owner thread, which reads the answer as before while the caller waits on its
Future: a death or an EOF (the sentinel stays in the owner's selector), a kill, a Revoke (a
stall), a pipe that did not take the whole RunBatch (the outbox: its write events are the
owner's), a cancel, close() or a reload, an owner call pending, and more callers queuing
(under load the owner thread batches; a caller steps aside). The owner tells a lender that
its lend ended through `Lend.wake` (the thread's eventfd; an event loop's
call_soon_threadsafe). A transport that cannot lend a slot (Ray's: `can_lend` False) leaves
every call on the owner-thread path.

`infer_async` lends the slot to the event loop (engine.caller.aio): a reader on the dup, the
same `step` on the loop thread, which never waits for the lock: held, the lend is abandoned to
the owner thread (`abandon`), which takes it back at its next step. A loop lend the loop does
not look at for RECLAIM_S (a loop stopped with the call pending) is taken back by the owner
at its next step after that.
"""

from __future__ import annotations

import enum
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

from slabpool.engine.core import interrupts
from slabpool.engine.core.config import usable_cpus
from slabpool.engine.core.owner import OwnerLock
from slabpool.engine.core.slots import SlotRecord
from slabpool.engine.core.task import Batch, Task
from slabpool.engine.core.transport import Event
from slabpool.engine.core.wakefd import thread_wake
from slabpool.workers.errors import EngineInternalError
from slabpool.workers.wire import Spin, polling_peers

if TYPE_CHECKING:
    from slabpool.engine.core.coordinator import Coordinator

log = logging.getLogger("slabpool.engine")
POLL_S = 1.0  # a lender looks at its lend at least this often (a guard: every end wakes it)
RECLAIM_S = 1.0  # an event loop's lend not looked at for this long goes back to the owner
PARK_S = 0.05  # a parked pipe (a group's task's slot, given back) is back in the owner's selector within this


class LendingTransport(Protocol):
    """What a transport that can lend a slot (`can_lend`: the local one) adds to SlotTransport."""

    def lend(self, slot: int, dup: bool = False) -> int | None:
        """The slot's pipe leaves the owner's selector: its fd to poll (`dup`: a dup of it,
        which the lender closes), or None (it cannot be lent now: no pipe, or an outbox waiting)."""

    def give_back(self, slot: int, park: bool = False) -> None:
        """The slot's pipe goes back into the owner's selector (`park`: at the owner's next
        wait, or at a send that is not a lend, whichever comes first)."""

    def read_lent(self, slot: int) -> list[Event]:
        """The owner's read of a lent slot's pipe (one read), as events."""

    def attach(self, lock: OwnerLock, ended: Callable[[int], None], peers: Callable[[], int]) -> None:
        """The owner lock (let go of around the transport's wait), whom to tell when the
        transport itself ends a lend (a death, a kill, a Revoke, an outbox filling), and the
        engine's tasks that poll beside a lent call now (RunBatch.peers: FastPath.peers)."""


Step = Callable[["Lend", bool], Any]  # a lender's step under the owner lock (lend, readable) -> its value


class Lender(enum.Enum):
    """Who waits on a task it submits: no one (submit()), a thread blocked in `FastPath.wait`,
    or an event loop (a reader on the pipe, engine.caller.aio)."""

    NONE = "none"
    THREAD = "thread"
    LOOP = "loop"
    LEADER = "leader"  # a thread that runs a group of callers' task (engine.caller.combine)


@dataclass(eq=False)
class Lend:
    """A slot lent to one waiting caller while it runs that caller's one-task batch."""

    slot: int
    batch: Batch
    task: Task
    fd: int  # the slot's pipe, polled without the lock (see `dup`)
    dup: bool = False  # `fd` is a dup of it, which the lender closes (an event loop's: its
    # reader must not outlive the fd; a thread's poll of a pipe closed meanwhile, its lend
    # ended first under the lock, wakes on POLLNVAL or on its eventfd and finds the lend over)
    over: bool = False
    abandoned: bool = False  # the lender let go without the lock: the owner takes it back
    reclaim_at: float | None = None  # an event loop's: the owner takes it back after this
    wake: Callable[[], None] = field(default=lambda: None)  # tells the lender it is over
    fast: FastPath | None = None

    def loop_lend(self, now: float) -> None:
        """Its lender is an event loop (it may stop looking: see RECLAIM_S)."""
        self.reclaim_at = now + RECLAIM_S

    def look(self, step: Step | None = None) -> Any:
        """An event loop's look (its pipe readable, or told the lend is over): what the step
        returned (`FastPath.try_step`)."""
        return self.fast.try_step(self, step) if self.fast is not None else None


class FastPath:
    """The owner lock's other users: callers that dispatch, and the lends they wait on."""

    def __init__(self, co: Coordinator) -> None:
        self.co = co
        self.lock: OwnerLock = co.thread.lock
        can = bool(getattr(co.transport, "can_lend", False))
        self.transport = cast(LendingTransport, co.transport) if can else None
        self.enabled = can  # (False: every call takes the owner thread's path; bench.latency's A/B)
        self.lent: dict[int, Lend] = co.dispatcher.lent  # slot index -> its lend
        self.sleep_until = 0.0  # when the owner thread's wait ends (monotonic; inf: no timer)
        self.lends = 0  # slots lent so far
        self.loop_calm = False  # the last accept found the engine idle: a loop may be lent next (see _idle)
        self.served = 0  # lent calls whose answer their caller read (the whole call off the owner thread)
        self.parks = 0  # slots given back parked (a group's task's: see `_park`)
        self._parks_seen = 0  # ... when the owner last went to sleep (`owner_timeout`)
        self.spin_s = co.cfg.spin_us / 1e6  # a lender polls its pipe this long before it sleeps,
        self.spin = Spin(usable_cpus())  # while that pays (workers.wire.Spin: one for the lenders of this engine)
        self.inside: Callable[[], int] = lambda: 0  # the engine's callers inside a call now (its Combiner's)
        self._local = threading.local()
        if self.transport is not None:
            self.transport.attach(self.lock, self._ended, self.peers)
            co.dispatcher.before_send = self._before_send

    # -- step 2 -> 3-4 -----------------------------------------------------------------------------

    def on_wake(self) -> None:
        """The queue's wake-up: deferred while this thread accepts a task it will wait on."""
        local = self._local
        if getattr(local, "accepting", False):
            local.wanted = True
            return
        self.co.wake()

    def accept(self, accept: Callable[[], Task], lending: Lender) -> tuple[Task, Lend | None]:
        """`accept()` (the queue's); then, for a caller that will wait on its task
        (`lending`), if the queue asked for a dispatch, dispatch from this thread when the
        owner is free, the slot lent to it. The task and its lend, if any: the caller sets
        `Lend.wake`, then looks at `Lend.over` (the owner may end it before)."""
        if lending is Lender.NONE or not self.enabled:
            return accept(), None
        local = self._local
        local.accepting, local.wanted = True, False
        try:
            task = accept()
        finally:
            local.accepting = False
        if not local.wanted:
            self.loop_calm = False  # (busy: a loop lends again after two idle accepts in a row)
            return task, None  # every slot is full: a completion dispatches it
        return task, self._dispatch_here(task, lending)

    def _dispatch_here(self, task: Task, lending: Lender) -> Lend | None:
        if not self.lock.try_own():
            self.loop_calm = False  # (the owner is busy: not an idle accept)
            self.co.wake()
            return None
        try:
            if not self._idle(lending):
                self.co.wake()
                return None
            now = time.monotonic()
            self._local.task, self._local.lend, self._local.dup = task, None, lending is Lender.LOOP
            try:
                self.co.dispatcher.dispatch(now, once=True)
            finally:
                lend: Lend | None = self._local.lend
                self._local.task = self._local.lend = None
                self._local.dup = False
            if lend is not None and not lend.over and not self._waiting(lend):
                self.give_back(lend)  # (its batch was not sent: Unsendable)
            self._tell_owner(now)
            self.co.ledger.flush()
            return lend
        except BaseException as exc:
            self._interrupted(exc)
            raise
        finally:
            self.lock.let_go()

    def _idle(self, lending: Lender) -> bool:
        """Nothing for the owner thread to do but this task: no close, failure or reload, no
        call pending, nothing else queued, no slot holding work the owner reads.

        For an event loop, no other task in flight at all, and none at its accept before
        either (`loop_calm`): a loop serves its other tasks between the answer and its look,
        and a lent slot takes no work meanwhile. Where one loop has many calls in flight (a
        server under load), the first accept of each wave finds the engine idle, and lending
        it put that wave on the other slots while the lent one waited for the loop (measured:
        serve at 8 connections, 0.9x without lends, docs/latency.md); two idle accepts in a row
        say the loop is calling one at a time."""
        co = self.co
        if co.ledger.closing is not None or co.ledger.failure is not None or co.reload is not None:
            return False
        alone = len(co.queue) == 1
        if lending is Lender.LOOP:
            calm, self.loop_calm = self.loop_calm, alone and not (self.lent or co.ledger.in_flight())
            if not (calm and self.loop_calm):
                return False
        if co.thread.pending:
            return False
        if lending is Lender.LEADER:  # (the callers are batched already: any idle slot will do)
            return True
        if not alone:
            return False
        for s in co.slots:  # (a loop, not any() of a generator: asked on every call)
            if s.batches and s.index not in self.lent:
                return False
        return True

    def _before_send(self, slot: SlotRecord, batch: Batch) -> None:
        """The dispatcher's, as a RunBatch is about to leave: lend the slot to the caller
        that dispatches, if the batch is its task alone and the slot holds nothing else. Before
        the write: the answer, which may come before this thread runs again (the write wakes
        the worker, which may take this core), must not wake the owner's selector. A write
        that leaves an outbox ends the lend (the transport's `_on_backlog`); a batch that
        could not be sent ends it below (`_dispatch_here`)."""
        task = getattr(self._local, "task", None)
        if task is None or batch.tasks != [task] or len(slot.batches) != 1 or not self.lock.held_here:
            return
        assert self.transport is not None
        dup = getattr(self._local, "dup", False)  # (an event loop's: see Lend.dup)
        fd = self.transport.lend(slot.index, dup)
        if fd is not None:
            self._local.lend = self.lent[slot.index] = Lend(slot.index, batch, task, fd, dup, fast=self)
            self.lends += 1

    def _tell_owner(self, now: float) -> None:
        """After a dispatch here: wake the owner thread if it has something to do (a close, a
        reload, a call, a failure), or if a timer now comes before the end of its sleep
        (task_timeout, a stall, a batch filling, a deadline, a loop's lend to look at). A task
        still queued needs no wake-up: every slot that holds work is either the owner's, which
        dispatches at its completion, or lent, and its lender dispatches when it gives it back
        (or tells the owner, off the happy path)."""
        co = self.co
        if self.owner_waits():
            co.wake()
            return
        wait = co.next_timer(now, self.reclaim_at())
        if wait is not None and now + wait < self.sleep_until:
            co.wake()

    def owner_waits(self) -> bool:
        """The owner thread has something to do as soon as a lent call has ended: a close (it
        drains: the end of each task in flight is its news), a reload, a call, a failure."""
        co = self.co
        return (co.thread.pending or co.reload is not None or co.ledger.closing is not None
                or co.ledger.failure is not None)

    def _interrupted(self, exc: BaseException) -> None:
        """What interrupts a caller's turn as the owner (the lock held) fails the engine, as a
        bug on the owner thread does: a step left half done would leave a task that never ends."""
        log.exception("a caller acting as the owner was interrupted")
        self.co.fail(EngineInternalError(
            f"a caller acting as the engine's owner was interrupted ({exc!r}); the engine stopped"))
        self.co.ledger.flush()
        self.co.wake()

    # -- 8-9 on the lender's thread ----------------------------------------------------------------

    def wait(self, lend: Lend, step: Step | None = None) -> Any:
        """A thread's wait on its lend: poll the pipe and the thread's eventfd, handle what
        comes under the lock (`step`, `FastPath.step` by default); return once the lend is
        over (the Future is then complete, or the owner thread has the task), with what the
        last step returned. It ends the Ctrl-C stretch the accept began
        (engine.core.interrupts): a KeyboardInterrupt comes at once while it polls, is
        deferred while it holds the lock, and gives the lend back to the owner thread."""
        got = None
        try:
            interrupts.leave()
            try:
                waker = thread_wake()
            except OSError:  # (no eventfd: this process is out of file descriptors, a server at
                return got  # its limit) the lend goes back, the owner reads the answer: the Future's
            lend.wake = waker.wake
            wake_fd = waker.fd
            poller = select.poll()
            poller.register(lend.fd, select.POLLIN)
            poller.register(wake_fd, select.POLLIN)
            if self.spin_s:  # (the answer mostly lands within it: no wake-up; see workers.wire.Spin.
                # A group of callers' rows (engine.caller.combine) too: 3 and 4 callers made 1.3-1.7x
                # the calls/s with its leader and worker polling, 8 or more the same)
                self.spin.wait(lend.fd, self.spin_s, self.peers())
            while not lend.over:
                got = [fd for fd, _ in poller.poll(POLL_S * 1000.0)]
                readable = lend.fd in got
                if wake_fd in got:
                    try:
                        os.eventfd_read(wake_fd)
                    except BlockingIOError:
                        pass  # (read by another poll of this thread's: nothing pending)
                interrupts.enter()
                try:
                    self.lock.own()
                    got = self._step_and_let_go(lend, readable, step)
                finally:
                    interrupts.leave()
        finally:
            if not lend.over:  # interrupted while it waited (Ctrl-C): the owner reads the answer
                self.forsake_lend(lend)
            elif lend.dup:
                os.close(lend.fd)
        return got

    def peers(self) -> int:
        """The engine's own tasks that poll beside a lent call now, for its caller's poll and
        (RunBatch.peers) its worker's: workers.wire.polling_peers."""
        return polling_peers(len(self.lent), self.inside())

    def forsake_lend(self, lend: Lend) -> None:
        """Its lender will not wait on it (interrupted): the slot goes back to the owner
        thread, which reads the answer; the lender's dup of the pipe, if any, is closed."""
        interrupts.enter()
        try:
            with self.lock.owning():
                self.give_back(lend)
                self.co.wake()
        finally:
            if lend.dup:
                os.close(lend.fd)
            interrupts.leave()

    def try_step(self, lend: Lend, step: Step | None = None) -> Any:
        """An event loop's look at its lend: `step` if the lock is free now (what it returned),
        else the lend goes back to the owner thread (the loop never waits for the lock)."""
        if lend.over:
            return None
        if not self.lock.try_own():
            self.abandon(lend)
            return None
        return self._step_and_let_go(lend, True, step)

    def _step_and_let_go(self, lend: Lend, readable: bool, step: Step | None = None) -> Any:
        """`step` (`FastPath.step` by default) with the lock this thread has just taken, which
        it lets go of after; what interrupts it fails the engine (`_interrupted`)."""
        try:
            return (step or self.step)(lend, readable)
        except BaseException as exc:
            self._interrupted(exc)
            raise
        finally:
            self.lock.let_go()

    def abandon(self, lend: Lend) -> None:
        """The lender lets go without the lock: the owner thread takes it back (`reclaim`)."""
        lend.abandoned = True
        self.co.wake()

    def step(self, lend: Lend, readable: bool, events: list[Event] | None = None) -> None:
        """Under the lock: what the worker sent (read here when `readable`, or read already:
        `events`), handled as the owner handles it; the slot goes back once the batch has
        ended (or the task has), and the owner is woken when something waits for it."""
        co = self.co
        if readable and not lend.over:
            assert self.transport is not None
            events = self.transport.read_lent(lend.slot)
        if events:
            co.handle(events, time.monotonic())
        if lend.over and not events:
            return
        if lend.reclaim_at is not None:
            lend.reclaim_at = time.monotonic() + RECLAIM_S
        if lend.over:  # the transport ended it (an EOF, a death): the owner thread's from here
            co.wake()
            co.ledger.flush()
            return
        if self._waiting(lend):
            co.ledger.flush()
            return
        self.served += lend.batch not in co.slots[lend.slot].batches  # (answered, not cancelled)
        self.give_back(lend, self._park(lend))
        if len(co.queue) or not co.queue.hungry:  # (hungry and empty: the next accept dispatches)
            now = time.monotonic()
            co.dispatcher.dispatch(now)  # what queued meanwhile, as the owner would after a Done
            self._tell_owner(now)  # (no dispatch, no new timer: the owner's can only have ended)
        elif self.owner_waits():
            co.wake()
        co.ledger.flush()

    def _waiting(self, lend: Lend) -> bool:
        slot = self.co.slots[lend.slot]
        return (not lend.task.state.is_terminal and bool(slot.batches) and slot.batches[0] is lend.batch
                and not lend.batch.revoked and slot.kill_reason is None)


    # -- the owner's side ----------------------------------------------------------------------------

    def give_back(self, lend: Lend, park: bool = False) -> None:
        """Under the lock: the slot's pipe goes back into the owner's selector (`park`: see
        `_park`)."""
        if lend.over:
            return
        lend.over = True
        if self.lent.get(lend.slot) is lend:
            del self.lent[lend.slot]
            assert self.transport is not None
            self.transport.give_back(lend.slot, park)

    def _park(self, lend: Lend) -> bool:
        """Under the lock, a lend answered: whether its pipe goes back parked (out of the
        owner's selector until the owner's next wait: engine.local.selector). A group's
        task's does (engine.caller.combine: under load, the slot is lent to the next group's
        leader within microseconds, and a lend and give-back of a pipe in the selector cost
        two epoll_ctl, each a turn of the GIL); nothing else does. The owner sleeps at most
        PARK_S while groups park (`owner_timeout`), and is woken now if it sleeps longer: a
        parked pipe's unasked-for news (a log record, an EOF) waits no longer than that."""
        if not lend.task.step:
            return False
        self.parks += 1
        if self.sleep_until > time.monotonic() + PARK_S:
            self.co.wake()
        return True

    def owner_timeout(self, timeout: float | None) -> float | None:
        """The owner thread's wait: at most PARK_S if a pipe was parked since its last."""
        if self.parks == self._parks_seen:
            return timeout
        self._parks_seen = self.parks
        return PARK_S if timeout is None else min(timeout, PARK_S)

    def _ended(self, slot: int) -> None:
        """The transport ended a lend itself (a death, a kill, a Revoke, an outbox): the
        lender is told, and waits on its Future."""
        lend = self.lent.pop(slot, None)
        if lend is not None:
            lend.over = True
            lend.wake()

    def review(self, now: float) -> None:
        """Under the lock, at the end of the owner's step (and after a cancel): a lend whose
        task ended (a cancel), whose batch was taken back or whose slot is being stopped, or
        that its lender abandoned or stopped looking at, goes back to the owner thread; so
        does an event loop's while work queues behind it (the loop may look late: the owner
        reads the answer and feeds the slot)."""
        if not self.lent:
            return
        queued = len(self.co.queue)
        for lend in list(self.lent.values()):
            due = lend.reclaim_at is not None and (lend.reclaim_at <= now or queued)
            if lend.abandoned or due or not self._waiting(lend):
                self.give_back(lend)
                lend.wake()

    def reclaim_at(self) -> float | None:
        """When the owner must look at an event loop's lend next (see RECLAIM_S)."""
        due: float | None = None  # (a loop: asked twice a call, where a thread's lend has none)
        for lend in self.lent.values():
            if lend.reclaim_at is not None and (due is None or lend.reclaim_at < due):
                due = lend.reclaim_at
        return due

    def end_all(self) -> None:
        """The stop path (under the lock): every lend goes back, none is made again."""
        self.enabled = False
        for lend in list(self.lent.values()):
            self.give_back(lend)
            lend.wake()

    def forsake(self) -> None:
        """In a forked child (engine.local.forks): no lend is made or waited on here; takes no
        lock (another thread may have held one at the fork)."""
        self.enabled = False
        self.lent.clear()
        self.lock = self.co.thread.lock  # (a new one: the parent's may have been held at the fork)
