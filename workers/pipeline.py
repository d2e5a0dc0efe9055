"""One item's way through a worker, the same in every kind of worker: the process worker
(workers.main), the Ray actor (engine.ray.actor.SlotActor) and Ray Data's predictor
(engine.ray.data.SlabpoolPredictor).

    seed -> preprocess -> input contract -> session.run -> postprocess
      |                        |                 |
      a replay draws the       InputContractError RunTimeout (task_timeout)
      same random numbers      kind "contract"    kind "timeout"; anything else "run"

An error leaves the worker as a `RemoteError` record (kind, class name, message, traceback),
never as a pickled exception (`remote_error`); the caller's side maps it back onto the error
tree (`errors.from_remote`).

`TaskPipeline` holds the four steps once. A task (`__call__`, or the process worker's own
sequence for a batch of tasks: prepare, run, finish) and a map() chunk (`chunk`: the same
steps item by item, an item's error its own outcome) both go through them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from slabpool.workers import contract, faults
from slabpool.workers.errors import ErrorKind, InputContractError, TaskDataError
from slabpool.workers.protocol import FaultSpec, RemoteError
from slabpool.workers.session import ModelSession, RunTimeout

log = logging.getLogger("slabpool.workers")

# A slot's status word in shared memory holds the id of the task its worker is in, or:
IDLE, STACKED = -1, -2  # no task / a stacked batch (every task of it at once)


_worker_pid = 0  # the worker process's own pid (own_worker); 0: not in a worker


def own_worker() -> None:
    """This process is the worker: a process a hook forks is told apart from it (left_by_a_fork)."""
    global _worker_pid
    _worker_pid = os.getpid()


def left_by_a_fork() -> None:
    """After user code: a process a hook forked whose child returned into the worker's code (it
    did not end with os._exit) exits here, before it reads or writes the worker's pipe. Was: both
    processes read the same pipe, and the engine stalled (close() without a timeout never ended)."""
    if _worker_pid and os.getpid() != _worker_pid:
        with contextlib.suppress(OSError):
            os.write(2, b"slabpool: a process forked by a hook returned into the worker's code; it exits "
                        b"(end such a child with os._exit)\n")
        os._exit(0)


def seed_task(seed: int) -> None:
    """Seed numpy's and Python's global generators from the task's seed (before preprocess)."""
    np.random.seed(seed & 0xFFFFFFFF)
    random.seed(seed)


def remote_error(exc: BaseException, kind: ErrorKind) -> RemoteError:
    """`exc` as data. Never raises: an exception whose str() raises (user code's) is named by
    its type, with what its str() raised (was: that error escaped the worker's handler, and
    every task of the batch, every item of a map() chunk, failed with it)."""
    try:
        message = str(exc)
    except Exception as bad:  # noqa: BLE001 - the user's __str__
        message = f"<str() of the {type(exc).__qualname__} raised {type(bad).__qualname__}>"
    try:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    except Exception:  # noqa: BLE001 - (format_exception calls str() too, and the frames' reprs)
        tb = f"{type(exc).__qualname__}: {message} (its traceback could not be formatted)\n"
    return RemoteError(kind, type(exc).__qualname__, message, tb)


def failure(stage: str, exc: BaseException) -> RemoteError:
    """An error of one task (or one item of a chunk) at `stage`, as a RemoteError (logged)."""
    err = remote_error(exc, error_kind(exc))
    log.info("task failed in %s: %s", stage, err.type_name, extra={"error": err.type_name})
    return err


class DeadlinePassed(Exception):
    """The task reached its deadline before it started (it waited in a worker's pipe)."""


# whose fault an exception in the worker is, first match wins; anything else is RUN
_KINDS: tuple[tuple[type[BaseException], ErrorKind], ...] = (
    (InputContractError, ErrorKind.CONTRACT),
    (TaskDataError, ErrorKind.DATA),
    (RunTimeout, ErrorKind.TIMEOUT),
    (DeadlinePassed, ErrorKind.DEADLINE),
)


def error_kind(exc: BaseException) -> ErrorKind:
    """Whose fault, as the caller's side maps it: the input contract, data that does not
    (un)pickle, the time limit, the queue deadline, or the run itself (the runtime, or the
    user's pre/postprocess)."""
    return next((kind for cls, kind in _KINDS if isinstance(exc, cls)), ErrorKind.RUN)


def spans(rows: int, step: int) -> list[tuple[int, int]]:
    """[lo, hi) of each session call of a block of `rows` rows run `step` rows at a time (0:
    the whole block at once). Byte for byte, what those blocks give run one after another."""
    if not step or rows <= step:
        return [(0, rows)]
    return [(lo, min(lo + step, rows)) for lo in range(0, rows, step)]


def rows_in(feeds: dict[str, np.ndarray]) -> int:
    return int(next(iter(feeds.values())).shape[0]) if feeds else 0


def in_steps(
    feeds: dict[str, np.ndarray], step: int, timeout: float | None,
) -> Iterator[tuple[int, int, dict[str, np.ndarray], float | None]]:
    """(lo, hi, rows [lo, hi) of every input, time left) for each session call of a block run
    `step` rows at a time; `timeout` holds for the whole block (RunTimeout once it is spent).
    One call: `feeds` itself (`part is feeds`: its outputs need no row axis)."""
    cuts = spans(rows_in(feeds), step)
    if len(cuts) == 1:
        yield 0, cuts[0][1], feeds, timeout
        return
    end = None if timeout is None else time.monotonic() + timeout
    for lo, hi in cuts:
        left = None if end is None else end - time.monotonic()
        if left is not None and left <= 0:
            raise RunTimeout(f"the block ran past {timeout} s (rows {lo} on not started)")
        yield lo, hi, {k: v[lo:hi] for k, v in feeds.items()}, left


def run_in_steps(
    run: Callable[[dict[str, np.ndarray], float | None], dict[str, np.ndarray]],
    feeds: dict[str, np.ndarray], step: int, timeout: float | None,
) -> dict[str, np.ndarray]:
    """run(feeds) in session calls of `step` rows (spans), the outputs concatenated on axis 0.
    Each call's outputs must hold its own rows on axis 0 (else ValueError): concatenated, they
    are cut back into each call's rows (infer(batch_size=), a group of callers:
    engine.caller.combine), and another count would hand one call's values to another."""
    parts = []
    for lo, hi, part, left in in_steps(feeds, step, timeout):
        out = run(part, left)
        if part is not feeds:
            for name, v in out.items():
                if getattr(v, "ndim", 0) == 0 or v.shape[0] != hi - lo:
                    raise ValueError(f"output {name!r} of a session call of rows [{lo}, {hi}) has shape "
                                     f"{getattr(v, 'shape', ())}, not those {hi - lo} rows on axis 0")
        parts.append(out)
    return parts[0] if len(parts) == 1 else {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def run_stacked(
    run: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]],
    names: list[str], feeds: list[dict[str, np.ndarray]],
) -> list[dict[str, np.ndarray]]:
    """A stacked batch (dynamic batching): the feeds concatenated on axis 0, `run` once, the
    outputs split back, each task its rows. An output without that batch axis is refused:
    it cannot be split."""
    counts = [f[names[0]].shape[0] for f in feeds]
    out = run({n: np.concatenate([f[n] for f in feeds]) for n in names})
    total = sum(counts)
    for name, arr in out.items():
        if arr.ndim == 0 or arr.shape[0] != total:
            raise ValueError(f"output {name!r} has no batch axis 0; cannot split a batch")
    bounds = np.cumsum(counts)[:-1]
    split = {name: np.split(arr, bounds) for name, arr in out.items()}
    return [{name: split[name][i] for name in out} for i in range(len(feeds))]


class TaskPipeline:
    """preprocess -> contract -> run -> postprocess for one item, in the worker that owns
    `session` (None: preprocess is the whole task). `stage` names the step last entered."""

    def __init__(
        self,
        session: ModelSession | None,
        preprocess: Callable[..., Any] | None,
        postprocess: Callable[..., Any] | None,
    ) -> None:
        self.session = session
        self.preprocess = preprocess
        self.postprocess = postprocess
        self.stage = ""
        self._checked = contract.Checked()

    def prepare(self, item: Any) -> Any:
        """preprocess, then the input contract: the feeds for one session call."""
        self.stage = "preprocess"
        if self.preprocess is not None:
            item = self.preprocess(item)
        if self.session is not None:
            sig = contract.signature(item) if type(item) is dict else None
            if sig is not None and self._checked.get(sig):
                return dict(item)  # inputs like these passed already
            specs = self.session.info.inputs
            item = contract.check(contract.normalize(item, specs), specs)
            if sig is not None:
                self._checked.add(sig)
        return item

    def passed(self, sig: tuple[Any, ...]) -> bool:
        """Inputs of this signature (contract.signature) passed the contract here already."""
        return bool(self._checked.get(sig))

    def run(self, feeds: Any, timeout: float | None = None, step: int = 0) -> Any:
        self.stage = "run"
        if self.session is None:
            return feeds
        return run_in_steps(self.session.run, feeds, step, timeout) if step else self.session.run(feeds, timeout)

    def finish(self, outputs: Any, item: Any) -> Any:
        self.stage = "postprocess"
        return self.postprocess(outputs, item) if self.postprocess is not None else outputs

    def chunk(
        self,
        items: list[Any],
        timeout: float | None,
        fault: FaultSpec | None = None,
        stacked: Callable[[list[Any]], list[Any] | None] | None = None,
        fields: Callable[[str], AbstractContextManager[None]] = lambda _: contextlib.nullcontext(),
    ) -> list[Any]:
        """A map() chunk's items through the same four steps, item by item: each item's
        outcome is its outputs or its own error (a RemoteError in its place); an item that
        failed goes no further. Without a preprocess the items are fed as they are (each
        passed the input contract at the door). `stacked(feeds)` may run the prepared items
        in one session call (None: it could not, and they run one by one); `fields(stage)`
        binds the log fields of the stage (the caller's task and attempt)."""
        faults.inject(fault, "preprocess")
        if self.preprocess is None:
            outs = list(items)
        else:
            with fields("preprocess"):
                outs = _each("preprocess", self.prepare, items)
        ok = [i for i, f in enumerate(outs) if type(f) is not RemoteError]
        if self.session is not None and ok:
            faults.inject(fault, "run")
            done = stacked([outs[i] for i in ok]) if stacked is not None and len(ok) > 1 else None
            if done is not None:
                for n, i in enumerate(ok):
                    outs[i] = done[n]
            else:
                outs = _each("run", functools.partial(self.run, timeout=timeout), outs)
        if self.postprocess is not None:
            faults.inject(fault, "postprocess")
            with fields("postprocess"):
                outs = _each("postprocess", self.finish, outs, items)
        return outs

    def __call__(self, item: Any, timeout: float | None = None, fault: FaultSpec | None = None,
                 step: int = 0) -> Any:
        """All four steps for one item (a block of rows: `step` rows a session call); `fault`
        (tests) strikes at the stage it names."""
        faults.inject(fault, "preprocess")
        outputs = feeds = self.prepare(item)
        if self.session is not None:
            faults.inject(fault, "run")
            outputs = self.run(feeds, timeout, step)
        if self.postprocess is not None:
            faults.inject(fault, "postprocess")
            outputs = self.finish(outputs, item)
        faults.inject(fault, "write_outputs")
        return outputs


def _each(stage: str, fn: Callable[..., Any], values: list[Any], *more: list[Any]) -> list[Any]:
    """fn(value, *more values at its place) for each value of a chunk, or that item's error
    as its RemoteError; a value that is a RemoteError already stays as it is."""
    out = []
    for j, v in enumerate(values):
        if type(v) is RemoteError:
            out.append(v)
            continue
        try:
            out.append(fn(v, *(m[j] for m in more)))
        except BaseException as exc:  # noqa: BLE001 - the item's own error, SystemExit and KeyboardInterrupt too
            left_by_a_fork()  # (user code's: the worker ignores SIGINT; was: the worker died)
            out.append(failure(stage, exc))
        left_by_a_fork()
    return out
