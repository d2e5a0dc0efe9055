"""Callers combined under load (issue 21): one task carries the rows of many `infer()` calls.

One `infer()` costs the engine one task: its records, its lease, its RunBatch, its answer, its
Future, about 190 Python calls of the caller's process, whoever makes them. Under load that
bookkeeping is what sets the pace (the owner thread and the callers share one GIL; the workers
wait on it: docs/latency.md). So when calls queue, the callers that arrive meanwhile wait
together, and their rows go as ONE task, a block of rows run one session call per caller:

    infer(x), plain inputs, no dynamic batching
      room: a token free (one task of ours a slot), no group waiting, no more callers inside
      than slots                                   -> alone: the express lane or the fast path
      else: joins the group forming for x's signature (or opens one), waits on its own lock
    a group is due (takes a token) when it holds its share of the crowd, every caller of the
    crowd not in flight, or as many as fit; or when nothing of ours is in flight (`_due`).
    Whoever finds it due (a caller joining it, a caller whose call or group has ended) wakes
    its first caller: the leader
    the leader: its callers' inputs concatenated on axis 0 -> Request(units=0, step=r): one
      task, one session call per caller, one after another (the worker checks that each
      call's outputs have its rows on axis 0) -> run the way a call alone runs (a local
      engine: the express lane on an idle slot, else a slot lent to the leader's thread) ->
      the outputs; it wakes the others, each copies its own rows out, and the next group due
      is handed on

A caller's outputs are byte for byte what its call alone would have given: the same session
call on the same rows (never stacked with another caller's). Everything that can go wrong with
the group's task sends each of its callers alone (`_fallback`): the group could not be
submitted (closed, queue full, shared memory), or its task failed (a row's own error, a
worker killed by one of them again and again, a timeout, outputs without rows).
Each caller then runs its own call, gets its own outputs or its own error, and nothing is
lost or answered twice. The engine's guarantees hold for the group's task as for any other
(replay after a death, in acceptance order; the ledger; counters: the task counts no items,
its callers count theirs here).

Only plain calls combine: `infer(x)` with no keyword (no context, deadline or block_timeout),
inputs of a signature the door has checked whose every array has the same rows on axis 0, a
model whose every input has a dynamic axis 0, no preprocess or postprocess (they see a task's
rows at once), `max_batch_size` 1 (dynamic batching stacks calls under load itself), and at
most MAX_GROUP_BYTES of inputs a group. Anything else goes alone; so do the calls of a model
whose group takes more than SLOW_S a caller (the run, not the engine's cost a task, sets the
pace there, and a task a call keeps its slot fed: one sent ahead while the last runs).
"""

from __future__ import annotations

import _thread
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from slabpool.engine.caller.request import Outputs, Request
from slabpool.workers import contract

if TYPE_CHECKING:
    from slabpool.engine.caller.base import BaseEngine
    from slabpool.engine.core.config import EngineConfig
    from slabpool.engine.core.dispatcher import Dispatcher

Run = Callable[[Request], Outputs]  # a request as one task, on the caller's thread: its outputs

MAX_GROUP = 64  # callers in one group
MAX_GROUP_BYTES = 1 << 20  # a group's inputs, together
SLOW_S = 0.0005  # a group's time a caller past which callers go alone (until the workers' run time
# a task, all single calls then, is back under half of it: a model swapped for a faster one)
CROWD_S = 0.02  # the crowd (the most callers inside at once) is forgotten after this
GUARD_S = 1.0  # a waiting caller looks at its group at least this often (a guard: every end kicks)
_SIGNATURES = 256  # signatures whose combinability is kept


class Group:
    """Callers waiting together: their inputs (one signature) and locks; then its outputs."""

    __slots__ = ("chosen", "ended", "inputs", "nbytes", "outputs", "rows", "running", "sig", "waiters")

    def __init__(self, sig: Any, rows: int) -> None:
        self.sig, self.rows = sig, rows
        self.inputs: list[dict[str, Any]] = []
        self.waiters: list[Any] = []  # each caller's lock, held until it is woken (None: it left)
        self.nbytes = 0
        self.chosen: int | None = None  # the caller chosen to lead it
        self.running = False  # its leader has begun
        self.outputs: Outputs | None = None  # the task's, once it has ended well
        self.ended = False  # the task has ended (or will never run): `outputs`, or each caller alone


class Combiner:
    """The combining of one engine's plain `infer()` calls.

    Tokens: at most one task of ours a slot (`active` < `slots`). A call that finds a token
    free, no group waiting and no more callers inside than slots takes one and goes alone.
    Else it joins the group forming for its signature. A group is due (takes a token) once it
    holds its share of the crowd (`crowd` / `slots`), every caller of the crowd not in flight
    (`crowd` - `flying`), or as many as fit, or once nothing of ours is in flight; whoever
    finds it due hands it to one of its callers, the leader, which runs its task the way a
    call alone runs (`run`: on a local engine, the express lane or a slot lent to the leader's
    thread, steps 3-9 there) and wakes the others."""

    def __init__(self, cfg: EngineConfig, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher  # (its task_s: the workers' run time a task, lately)
        self.on = cfg.preprocess is None and cfg.postprocess is None and cfg.max_batch_size <= 1
        self.slots = cfg.workers
        self.lock = threading.Lock()
        self.active = 0  # tokens taken: calls of ours alone in the engine, and groups' tasks
        self.flying = 0  # callers whose call or group holds a token
        self.inside = 0  # callers in `call` now
        self.crowd = 0  # the most callers inside at once lately (CROWD_S): who will come back
        self._crowd_at = 0.0
        self.per_call = 0.0  # a group's time a caller (EWMA): combining pays only for short calls
        self.line: deque[Group] = deque()  # groups waiting to go, oldest first
        self.forming: dict[Any, Group] = {}  # signature -> the group that takes callers now
        self._rows: dict[Any, int | None] = {}  # signature -> a caller's rows, None: goes alone
        self.groups = 0  # groups of callers whose task gave their outputs (stats for tests and bench.latency)
        self.combined = 0  # calls answered through those

    def inside_now(self) -> int:
        """Callers inside `call` now: a lent call's poll does not count them as the host's crowd
        (workers.wire.polling_peers). A read without the lock: a count, maybe one off."""
        return self.inside

    def forsake(self) -> None:
        """In a forked child: no lock of the parent's is taken (the engine refuses calls there)."""
        self.on = False
        self.lock = threading.Lock()

    # -- a call -------------------------------------------------------------------------------------

    def call(self, eng: BaseEngine, inputs: Any, alone: Callable[[Any], Outputs], run: Run) -> Outputs:
        """`eng.infer(inputs)`: alone while the engine has room (`alone(inputs)`), else in a
        group, whose task its leader runs with `run(request)` (its outputs). The engine is
        handed in at each call, not kept: no cycle holds it (a dropped engine stops at once)."""
        if not self.on:
            return alone(inputs)
        token = False  # this call holds a token: it goes alone
        now = time.monotonic()
        with self.lock:
            self.inside += 1
            if self.inside >= self.crowd or now - self._crowd_at > CROWD_S:
                self.crowd, self._crowd_at = self.inside, now
            if not self.line and self.active < self.slots and self.inside <= self.slots:
                self.active += 1
                self.flying += 1
                token = True
            elif self.per_call > SLOW_S:  # (a slow model: each call its own task, pipelined to its slot)
                task_s = self.dispatcher.task_s
                if task_s is not None and task_s < SLOW_S / 2:
                    self.per_call = 0.0  # (fast again: combine)
                else:
                    self.active += 1
                    self.flying += 1
                    token = True
        try:
            if token:
                return alone(inputs)
            got = self._combinable(eng, inputs)
            if got is None:
                with self.lock:
                    self.active += 1
                    self.flying += 1
                    token = True
                return alone(inputs)
            group, index, lock, lead = self._join(*got)
            try:
                while not lead and not lock.acquire(timeout=GUARD_S):  # (a guard: every end hands on what is due)
                    lead = self._hand_on(group, index)
                if not group.ended:  # (woken to lead it, or found it due itself)
                    group.running = True
            except BaseException:  # (a Ctrl-C while it waits: the group must not wait for it)
                self._leave(group, index)
                raise
            if not group.ended:
                self._lead(eng, group, index, alone, run)
            return self._answer(eng, group, index, inputs, run)
        finally:
            with self.lock:
                self.inside -= 1
                if token:
                    self.active -= 1
                    self.flying -= 1
                due = self._due()
            if due is not None:
                self._hand(due)  # (its first caller leads it)

    def _join(self, feeds: dict[str, Any], sig: Any, rows: int) -> tuple[Group, int, Any, bool]:
        """This caller in the group forming for its signature (a new one if none, or full): the
        group, its place there, the lock it waits on, and whether it leads the group now (its
        joining made it due)."""
        lock = _thread.allocate_lock()
        lock.acquire()
        nbytes = _nbytes(feeds)
        with self.lock:
            group = self.forming.get(sig)
            if group is None or len(group.inputs) >= MAX_GROUP or group.nbytes + nbytes > MAX_GROUP_BYTES:
                group = self.forming[sig] = Group(sig, rows)
                self.line.append(group)
            index = len(group.inputs)
            group.inputs.append(feeds)
            group.waiters.append(lock)
            group.nbytes += nbytes
            due = self._due()
            if due is group:
                group.chosen = index
        if due is not None and due is not group:
            self._hand(due)
        return group, index, lock, due is group

    def _hand_on(self, mine: Group, index: int) -> bool:
        """A waiting caller's guard: the group due now, if any, to its leader; True if it is
        this caller's (it leads it)."""
        with self.lock:
            due = self._due()
            if due is mine:
                mine.chosen = index
        if due is None or due is mine:
            return due is mine
        self._hand(due)
        return False

    def _hand(self, group: Group) -> None:
        """A group due: its first caller still waiting is woken to lead it; none left (each
        interrupted), it is dropped and its token goes on."""
        with self.lock:
            i = next((i for i, w in enumerate(group.waiters) if w is not None), None)
            group.chosen = i
            lock = None if i is None else group.waiters[i]
            if lock is None:
                group.ended = True
                self.active -= 1
                self.flying -= len(group.inputs)
                due = self._due()
        if lock is not None:
            lock.release()
        elif due is not None:
            self._hand(due)

    def _leave(self, group: Group, index: int) -> None:
        """A caller interrupted while it waits leaves its group (its rows still run, their
        outputs unread); if it was woken to lead it, the next caller leads instead."""
        with self.lock:
            group.waiters[index] = None
            handed = group.chosen == index and not group.running and not group.ended
        if handed:
            self._hand(group)

    def _combinable(self, eng: BaseEngine, inputs: Any) -> tuple[dict[str, Any], Any, int] | None:
        """The inputs as a dict, their signature, and a caller's rows, if this call may join a
        group (its signature checked at the door already); else None."""
        feeds = contract.one_input(inputs, eng._specs)
        if type(feeds) is not dict:
            return None
        sig = contract.signature(feeds)
        if eng._admitted.get(sig) is None:
            return None  # (the door checks it alone first)
        rows = self._rows.get(sig, -1)
        if rows == -1:
            rows = self._learn(eng, sig, feeds)
        return None if rows is None else (feeds, sig, rows)

    def _learn(self, eng: BaseEngine, sig: Any, feeds: dict[str, Any]) -> int | None:
        specs = eng._specs
        lengths = {a.shape[0] if isinstance(a, np.ndarray) and a.ndim else None for a in feeds.values()}
        dynamic = bool(specs) and all(s.shape and s.shape[0] is None for s in specs)
        rows = next(iter(lengths)) if dynamic and len(lengths) == 1 else None
        got = rows if rows else None  # (a caller of 0 rows goes alone)
        if len(self._rows) >= _SIGNATURES:
            self._rows.clear()
        self._rows[sig] = got
        return got

    # -- groups going ---------------------------------------------------------------------------------

    def _due(self) -> Group | None:
        """Under the lock: the oldest group waiting, taken off the line with a token, if it
        should go now: a token is free, and nothing of ours is in flight (whose end would hand
        it on later), or it holds its share of the crowd (a slot's), or every caller of the
        crowd not in flight (no one else is coming: a slow model's groups, of unequal sizes,
        must not wait for each other), or it is full (another group of its signature forms)."""
        if not self.line:
            return None
        if self.active:
            group = self.line[0]
            n = len(group.inputs)
            short = n * self.slots < self.crowd and n < self.crowd - self.flying
            if self.active >= self.slots or (short and self.forming.get(group.sig) is group):
                return None  # (short and still forming: more callers are coming)
        group = self.line.popleft()
        if self.forming.get(group.sig) is group:
            del self.forming[group.sig]
        self.active += 1
        self.flying += len(group.inputs)
        return group

    def _lead(self, eng: BaseEngine, group: Group, index: int, alone: Callable[[Any], Outputs], run: Run) -> None:
        """The group's task, run on this caller's thread as a call alone runs (a group of one:
        that call); then every other caller of it is woken, and the next group due handed on.
        What fails leaves `outputs` None: each caller then goes alone."""
        k = len(group.inputs)
        try:
            if k == 1:
                group.outputs = alone(group.inputs[0])
            else:
                names = list(group.inputs[0])
                feeds = {n: np.concatenate([f[n] for f in group.inputs]) for n in names}
                eng._tally(accepted=k)  # (its callers' items: the task counts none)
                t0 = time.perf_counter()
                outputs = run(Request(feeds, units=0, step=group.rows))
                per_call = (time.perf_counter() - t0) / k
                self.per_call = per_call if not self.per_call else 0.8 * self.per_call + 0.2 * per_call
                group.outputs = outputs  # (each call's rows on axis 0: the worker checks, run_in_steps)
                eng._tally(completed=k)
        except Exception:  # the callers learn what failed from their own calls
            if k == 1:
                raise
        finally:
            group.ended = True
            with self.lock:
                self.active -= 1
                self.flying -= k
                if k > 1 and group.outputs is not None:
                    self.groups += 1
                    self.combined += sum(w is not None for w in group.waiters)  # (not those that left)
                due = self._due()
            for i, w in enumerate(group.waiters):
                if i != index and w is not None:
                    w.release()
            if due is not None:
                self._hand(due)

    # -- a caller's answer -----------------------------------------------------------------------------

    def _answer(self, eng: BaseEngine, group: Group, index: int, inputs: Any, run: Run) -> Outputs:
        """This caller's rows of its group's outputs; its own call alone if the group's task
        failed."""
        outputs = group.outputs
        k = len(group.inputs)
        if outputs is None:
            return self._fallback(eng, inputs, run)
        if k == 1:
            return outputs
        rows = group.rows
        return {n: v[index * rows:(index + 1) * rows].copy() for n, v in outputs.items()}

    def _fallback(self, eng: BaseEngine, inputs: Any, run: Run) -> Outputs:
        """A caller of a group whose task failed: its own call, as one task (its item counted
        accepted already), its own outputs or its own error."""
        try:
            outputs = run(Request(inputs, units=0))
        except BaseException:
            eng._tally(failed=1)
            raise
        eng._tally(completed=1)
        return outputs


def _nbytes(feeds: dict[str, Any]) -> int:
    return sum(int(getattr(a, "nbytes", 0)) for a in feeds.values())
