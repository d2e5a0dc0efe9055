"""Every error slabpool raises, and whose fault it is.

    EngineError
    ├── EngineClosed           you closed it: submit() after close() began
    ├── QueueFull              backpressure: the queue is full (admission="reject", or
    │                          block_timeout expired); retry later
    ├── ShmCapacityError       not enough shared memory for the request; says how much is free
    │                          (at submit(), or in the Future when outputs can never fit)
    ├── TaskError              one task failed; carries .task_id
    │   ├── TaskCancelled      cancelled (also concurrent.futures.CancelledError); .reason
    │   ├── TaskTimeout        queued past its deadline, or ran past task_timeout (also TimeoutError)
    │   ├── InputContractError the input does not match the model (also ValueError); names the
    │   │                      input, what was expected and what was got
    │   ├── SessionRunError    the runtime or the user's pre/postprocess raised; the remote
    │   │                      traceback is the __cause__
    │   ├── TaskDataError      the task's context, inputs or result cannot cross between
    │   │                      processes (pickle); also TypeError; that task alone fails
    │   └── PoisonTask         killed max_attempts workers; .crashes lists each exit code/signal
    ├── RowsFailed             some rows of infer(batch_size=) failed: .rows, .errors (each
    │                          row's own error), .outputs (the other rows; failed rows NaN, 0
    │                          for integer outputs)
    ├── WorkerError            not the caller's fault
    │   ├── WorkerCrashed      a worker died: .slot .pid .exitcode .signal
    │   └── SessionInitError   the model or its provider/delegate failed to load; the pool
    │                          fails fast, with the worker's traceback
    └── EngineInternalError    a bug in slabpool (an illegal state transition, say)

Errors cross the process boundary as `RemoteError` records (an `ErrorKind`, class name,
message, formatted traceback), never as pickled runtime exceptions: unpickling onnxruntime's
exception classes would need onnxruntime in the caller's process. `from_remote` maps a kind
back onto the tree through one table (`_FROM_REMOTE`).
"""

from __future__ import annotations

import concurrent.futures
import signal
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # workers import this module: no import of theirs at run time
    from slabpool.workers.protocol import RemoteError


class EngineError(Exception):
    """Base of every slabpool error."""


class EngineClosed(EngineError):
    """The engine is closed, or closing: it accepts no new task."""


class QueueFull(EngineError):
    """The admission queue is full; nothing was accepted."""


class ShmCapacityError(EngineError):
    """Not enough shared memory; `needed` and `available` are in bytes."""

    def __init__(self, message: str, *, needed: int = 0, available: int = 0) -> None:
        super().__init__(message)
        self.needed = needed
        self.available = available


class TaskError(EngineError):
    """One task ended in failure."""

    def __init__(self, message: str, *, task_id: int | None = None) -> None:
        super().__init__(message)
        self.task_id = task_id

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (_rebuild, (type(self), self.args, self.__dict__))


class TaskCancelled(TaskError, concurrent.futures.CancelledError):
    """Cancelled before it ran, or cancelled while running (its result was dropped)."""

    def __init__(self, message: str, *, task_id: int | None = None, reason: str = "") -> None:
        super().__init__(message, task_id=task_id)
        self.reason = reason


class TaskTimeout(TaskError, TimeoutError):
    """Still queued at its deadline, or still running at task_timeout."""


class InputContractError(TaskError, ValueError):
    """The input does not match the model: names the input, what was expected and what was got."""


class SessionRunError(TaskError):
    """The runtime (or preprocess/postprocess) raised; the remote traceback is __cause__."""


class TaskDataError(TaskError, TypeError):
    """The task's context, inputs or result could not be pickled or unpickled on its way
    between processes. Raised at submit() when known there, else in that task's Future."""


@dataclass(frozen=True)
class Crash:
    """One worker death: who, how, with which task in hand."""

    slot: int
    pid: int
    exitcode: int | None

    @property
    def signal(self) -> str:
        return describe_exit(self.exitcode)


class PoisonTask(TaskError):
    """The task was in hand when max_attempts workers died; it is not retried again."""

    def __init__(self, message: str, *, task_id: int | None = None, crashes: tuple[Crash, ...] = ()):
        super().__init__(message, task_id=task_id)
        self.crashes = crashes


class RowsFailed(EngineError):
    """Some rows of `infer(feeds, batch_size=...)` failed, each alone (its block was cut down
    to it); the other rows have their outputs.

    `rows`: the failed row indices, sorted; `errors`: row index -> its error (PoisonTask,
    SessionRunError, ...); `outputs`: dict name -> array of every row, the failed ones NaN
    (0 for integer outputs), or None when no row succeeded (the output shapes are unknown)."""

    def __init__(self, message: str, *, rows: list[int], errors: dict[int, BaseException],
                 outputs: dict[str, Any] | None) -> None:
        super().__init__(message)
        self.rows = rows
        self.errors = errors
        self.outputs = outputs

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (_rebuild, (type(self), self.args, self.__dict__))


class WorkerError(EngineError):
    """A worker failed: not the caller's fault."""


class WorkerCrashed(WorkerError):
    """A worker process died."""

    def __init__(self, message: str, *, slot: int, pid: int, exitcode: int | None) -> None:
        super().__init__(message)
        self.slot = slot
        self.pid = pid
        self.exitcode = exitcode
        self.signal = describe_exit(exitcode)


class SessionInitError(WorkerError):
    """The session (model, provider or delegate) could not be built in a worker."""


class EngineInternalError(EngineError):
    """A bug in slabpool."""


class RemoteTraceback(Exception):
    """Carries a worker's formatted traceback as the __cause__ of the error raised here."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0]) if self.args else ""


def _rebuild(cls, args, state):  # type: ignore[no-untyped-def]
    obj = cls.__new__(cls)
    Exception.__init__(obj, *args)
    obj.__dict__.update(state)
    return obj


class ErrorKind(StrEnum):
    """Whose fault a worker's error is, as a `RemoteError` says it (a str: it compares and
    prints as its value)."""

    CONTRACT = "contract"  # the input does not match the model
    RUN = "run"  # the runtime, or the user's preprocess/postprocess, raised
    TIMEOUT = "timeout"  # it ran past task_timeout
    DEADLINE = "deadline"  # it waited in a worker's pipe past its deadline; not started
    DATA = "data"  # its context, inputs or result do not (un)pickle
    CAPACITY = "capacity"  # its outputs can never fit the output arena
    SPLIT = "split"  # a batch's outputs do not fit one region together: sent again apart, uncharged


# kind -> the caller's exception class and its message ({task_id}, {message}, {type_name});
# CAPACITY is no TaskError (it says how much memory there is): from_remote builds it
_FROM_REMOTE: dict[ErrorKind, tuple[type[TaskError], str]] = {
    ErrorKind.DATA: (TaskDataError, "task {task_id}: {message}"),
    ErrorKind.CONTRACT: (InputContractError, "task {task_id}: {message}"),
    ErrorKind.DEADLINE: (TaskTimeout, "task {task_id} was still queued at its deadline; it was not started"),
    ErrorKind.TIMEOUT: (TaskTimeout, "task {task_id} ran past task_timeout and was terminated: {message}"),
    ErrorKind.RUN: (SessionRunError, "task {task_id} failed: {type_name}: {message}"),
}


def from_remote(err: RemoteError, task_id: int) -> EngineError:
    """The caller's exception for a worker's RemoteError (a whole task's, or one chunk item's);
    a kind the table does not name (SPLIT, which the owner handles before) reads as RUN."""
    exc: EngineError
    if err.kind == ErrorKind.CAPACITY:
        exc = ShmCapacityError(f"task {task_id}: {err.message}", needed=err.needed, available=err.available)
    else:
        cls, template = _FROM_REMOTE.get(err.kind) or _FROM_REMOTE[ErrorKind.RUN]
        exc = cls(template.format(task_id=task_id, message=err.message, type_name=err.type_name), task_id=task_id)
    if err.traceback:
        exc.__cause__ = RemoteTraceback(err.traceback)
    return exc


def unstartable(slot: int, exc: OSError) -> SessionInitError:
    """A worker process the OS would not start, in words that name the limit behind it."""
    what, why = _os_words(exc)
    return SessionInitError(f"slot {slot}'s worker process could not be started ({what}){why}")


def engine_unstartable(exc: OSError) -> SessionInitError:
    """The engine's own start refused by the OS (its selector's pipe, its arenas: a process at
    its limit on open files), in the same words."""
    what, why = _os_words(exc)
    return SessionInitError(f"the engine could not start ({what}){why}")


def _os_words(exc: OSError) -> tuple[str, str]:
    """The OS's refusal ("[Errno 24] Too many open files"), and words for the limit behind it."""
    import errno  # (the supervisor's only: a worker never imports these)
    import resource

    why = ""
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        limit = "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
        which = "this process" if exc.errno == errno.EMFILE else "the host"
        why = (f": {which} is out of file descriptors (this process may hold {limit} open files: "
               "RLIMIT_NOFILE, `ulimit -n`; each worker takes a few). Raise the limit, or close files")
    elif exc.errno == errno.EAGAIN:
        why = ": the OS refused a new process (RLIMIT_NPROC, `ulimit -u`, or the container's pids limit)"
    elif exc.errno == errno.ENOMEM:
        why = ": the host is out of memory for a new process"
    what = f"[Errno {exc.errno}] {exc.strerror}" if exc.errno is not None else str(exc)  # (not the file it opened)
    return what, why


def describe_exit(exitcode: int | None) -> str:
    """`SIGKILL(-9)`, `SIGSEGV(-11)`, `exit(3)`; '' while still running."""
    if exitcode is None:
        return ""
    if exitcode < 0:
        try:
            return f"{signal.Signals(-exitcode).name}({exitcode})"
        except ValueError:
            return f"signal({exitcode})"
    return f"exit({exitcode})"


def crash_hint(exitcode: int | None, rss: int | None = None, limit: int | None = None) -> str:
    """What a death most likely means, in words a user can act on."""
    if exitcode == -signal.SIGBUS:
        return (
            " SIGBUS in a worker is a shared-memory fault: /dev/shm too small or a segment "
            "truncated. Give the container more shared memory (Docker --shm-size) or lower "
            "shm_capacity."
        )
    if exitcode in (-signal.SIGKILL, 137) and rss and limit and rss > 0.8 * limit:
        return " Killed near the memory limit: likely the OOM killer."
    if exitcode in (-signal.SIGKILL, 137):
        return " SIGKILL: killed from outside (the OOM killer, a user, a timeout)."
    return ""
