"""The slot transport: what differs between backends, behind one small protocol.

The owner (engine.core.coordinator) decides; a transport carries. It starts a slot's worker
on a session spec, sends it a batch, takes a batch back, kills it with a reason, and releases
a task's staged inputs. What happens comes back as event values, in order, from `wait()`:

    Ready   slot k's new incarnation has built its session (pid, SessionInfo)
    Done    slot k ended a batch: per task, outputs already copied out (caller-owned) or an
            error, or `split` (outputs too large beside the others': again apart, uncharged)
    Died    slot k's worker is gone: exit code, the task it had in hand (its status word, or
            the first call that failed), and why it never started, if it never did

Everything else stays inside the transport: pipes, selectors, shared-memory output regions and
their grants (NeedOutput), pinned copies of revoked inputs, status words, a worker's log
records (logged as they come), SIGTERM -> SIGKILL escalation, Ray's actor restarts and pings.
Two implementations: engine.local.transport (processes, pipes, shared memory) and
engine.ray.transport (actors, the object store).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from slabpool.engine.core.states import KillReason
from slabpool.engine.core.task import Batch, Task
from slabpool.workers.errors import SessionInitError
from slabpool.workers.protocol import SessionInfo
from slabpool.workers.session import SessionSpec


@dataclass(frozen=True, slots=True)
class Ready:
    slot: int
    pid: int
    info: SessionInfo | None  # None for a pure preprocessing pool (model=None)
    node: str = ""  # where it runs (a Ray node id; '' locally)


class Outcome(NamedTuple):
    """One task's end inside a Done: outputs (the caller's own copy: step 8 has happened), an
    error, or `split` (run it again apart from the others, uncharged)."""

    task: Task
    outputs: Any = None
    error: BaseException | None = None
    copy_s: float = 0.0
    split: bool = False


class Done(NamedTuple):
    slot: int
    batch_id: int
    outcomes: tuple[Outcome, ...]  # the tasks that had not ended when the batch ended
    run_s: float  # the worker's time on the whole batch
    rss: int = 0  # the worker's resident memory after it (worker_memory_limit), 0: not measured
    in_place: int = 0  # tasks whose outputs the runtime wrote straight into shared memory
    pid: int = 0


@dataclass(frozen=True, slots=True)
class Died:
    slot: int
    pid: int
    exitcode: int | None  # None: not known (a Ray actor)
    running: int  # the task it had in hand (workers.pipeline IDLE, STACKED, or a task id)
    startup_error: SessionInitError | None = None  # it died before its Ready: why, as far as known
    reported: bool = False  # ... and its session said so itself (not a signal, not a kill)
    cause: BaseException | None = None  # what the transport saw (Ray's RayActorError), if anything


Event = Ready | Done | Died


def sooner(timeout: float | None, due: list[float], now: float) -> float | None:
    """The owner's wait `timeout`, cut short by the transport's own next timer (a kill to
    escalate, a ping to send): the earliest of `due` (monotonic times), never negative."""
    if not due:
        return timeout
    left = max(min(due) - now, 0.0)
    return left if timeout is None else min(timeout, left)


@dataclass(frozen=True, slots=True)
class InHand:
    """What a slot's worker is doing now (read for task_timeout and stall decisions)."""

    task: int  # the task in hand: IDLE (none yet), STACKED (a whole stacked batch), or its id
    since: float | None  # monotonic seconds when it took it (None: not known)
    waiting: bool = False  # it waits for output memory: no task's time runs


class Room(NamedTuple):
    """Output sizes learnt so far, for the dispatch limits (engine.core.dispatch.take_limits)."""

    per_task: int = 0
    per_item: int = 0
    capacity: int = 1 << 62  # what one batch's outputs may take at most (no bound: no arena)
    max_tasks: int = 1 << 30  # tasks a group may hold at most (the transport's own limit)


class TransportLost(Exception):
    """What the transport runs on is gone for good (Ray shut down under a RayEngine): raised by
    its `wait`, and the engine fails with `error` (every task still held with it)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class Unsendable(Exception):
    """A batch that cannot be sent (its data will not pickle): the owner takes it back."""


class SlotTransport(Protocol):
    """How a slot starts, how a batch reaches it, how it is revoked or killed. Called from the
    owner thread only (and `wake` from any thread)."""

    quorum: int  # slots that must be up before the engine's constructor returns
    startup_bound: bool  # a slot not up within startup_timeout is killed (a start-up failure)
    can_lend: bool  # a slot's pipe can be lent to the caller that waits on it (engine.core.fastpath)
    takes_back: bool  # a batch sent ahead and revoked never starts (its worker skips it; else it runs, unread)

    def start(self, slot: int, spec: SessionSpec | None) -> int:
        """Build a new incarnation of `slot` on `spec` (after a death, or its first); its pid
        if known now (0: not yet)."""

    def send(self, slot: int, batch: Batch) -> None:
        """Send a batch behind what the slot holds (Unsendable: nothing was sent)."""

    def revoke(self, slot: int, batch: Batch) -> bool:
        """Take back a batch sent ahead to a stalled slot, so that its live tasks can run
        elsewhere (on copies of their inputs where the worker may still read them). False:
        not now (no room for the copies). Its answer still comes, as a Done."""

    def kill(self, slot: int, reason: KillReason, grace: float) -> None:
        """Stop its worker now (the TERM, then after `grace` the KILL, of a process): a Died follows."""

    def retire(self, slot: int) -> None:
        """Ask its worker to exit once it has answered what it holds: a Died follows."""

    def release(self, tasks: Iterable[Task]) -> None:
        """These tasks have ended and no slot reads their inputs: give back what step 2 staged
        (once: a second release of a task is nothing)."""

    def in_hand(self, slot: int) -> InHand: ...

    def waiting(self, slot: int) -> bool:
        """Its running batch waits for output memory (cheap: read on every step)."""

    def room(self) -> Room: ...

    def wait(self, timeout: float | None) -> list[Event]:
        """Wait up to `timeout` s (None: until something happens) for events, or `wake()`."""

    def wake(self) -> None:
        """Make the next (or the current) `wait` return: callable from any thread."""

    def memory(self, slot: int) -> tuple[int, int, int]:
        """(RSS, PSS, shared bytes) of its worker now; zeros where not known."""

    def startup_timeout_error(self, timeout: float, up: int) -> SessionInitError | None:
        """What the engine's constructor raises when not `quorum` slots were up in time
        (`up` were); None: it starts with those."""

    def close(self) -> None:
        """After every slot is gone: let go of what is left (the wake-up pipe, views)."""

    def abort(self) -> None:
        """A failed start: stop every worker started now, and let go of everything."""
