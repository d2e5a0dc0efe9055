"""A process forked (os.fork) from one that holds an Engine never touches the parent's workers.

A fork copies the Engine object, but not its owner thread: the child holds a picture of the
parent's engine that nothing runs. Left alone, that picture does harm when the child exits:
multiprocessing's atexit handler walks the child's copy of its children set, finds the
parent's worker processes there, and SIGTERMs them (then, under forkserver, waits for them to
die); the engine's own finalizer would ask the absent owner thread to stop. A healthy task in
the parent then ended as PoisonTask.

So, right after a fork, in the child (os.register_at_fork):
- every worker process object (named slabpool-worker-<slot>) leaves multiprocessing's
  children set: the child's exit signals, reaps and waits for none of them; the child's
  copies of the parent's ends of its pipes are closed, so that the worker still sees its
  parent die (a SIGKILLed parent's workers outlived it while a child it forked lived);
- multiprocessing's record of the parent's forkserver is dropped, so that the child may
  start engines of its own (the forkserver's pid is no child of the child's);
- every engine of this process is marked inherited: submit() (and anything that needs its
  owner thread: cancel, reload) raises EngineClosed naming the fork, close() does nothing,
  its finalizer is detached; nothing it holds is signalled, closed or unlinked by the child.

The hook takes no lock (another thread of the parent may have held any lock at the fork).
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import threading
import weakref
from multiprocessing import forkserver, util
from typing import Any

from slabpool.engine.core.states import EngineState

WORKER_NAME = "slabpool-worker-"  # how engine.local.slot names every worker process (start() drops
# the Process's target, so the name is what tells ours from a user's own)
_ENGINES: weakref.WeakSet[Any] = weakref.WeakSet()  # the engines made in this process
_HOOKED = False


def adopt(engine: Any) -> None:
    """Remember an engine made in this process (from its constructor)."""
    global _HOOKED
    engine._owner_pid = os.getpid()
    _ENGINES.add(engine)
    if not _HOOKED:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _HOOKED = True


def _why(owner_pid: int) -> str:
    return (f"this Engine belongs to process {owner_pid}; process {os.getpid()} inherited it through "
            "fork() and cannot use it (its workers serve the parent alone): make a new Engine here")


def _after_fork_in_child() -> None:
    children: set[Any] = multiprocessing.process._children  # type: ignore[attr-defined]
    for proc in list(children):
        if proc.name.startswith(WORKER_NAME):
            children.discard(proc)
            _close_parents_pipes(proc)
    _forget_parents_forkserver()
    for engine in list(_ENGINES):
        engine._inherited = why = _why(engine._owner_pid)
        engine._state = EngineState.CLOSED  # for this process (repr, stats); the parent's goes on
        combiner = getattr(engine, "_combiner", None)
        if combiner is not None:
            combiner.forsake()  # (its lock may have been held at the fork)
        owner = getattr(engine, "_owner", None)
        if owner is not None:
            owner.forsake(why)  # cancel(), reload(): fail at once instead of waiting for ever
        finalizer = getattr(engine, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()


def _close_parents_pipes(proc: Any) -> None:
    """The child's copies of the parent's ends of a worker's pipes: its sentinel, and the write
    end whose close the worker takes for its parent's death (multiprocessing's Popen keeps both
    for its finalizer, to close; the finalizer goes too). Held here, a SIGKILLed parent's
    workers (and their forkserver) lived as long as this child did."""
    finalizer = getattr(getattr(proc, "_popen", None), "finalizer", None)
    if finalizer is None or getattr(finalizer, "_callback", None) is not getattr(util, "close_fds", None):
        return
    for fd in finalizer._args:
        with contextlib.suppress(OSError):
            os.close(fd)
    finalizer.cancel()


def _forget_parents_forkserver() -> None:
    """The forkserver is the parent's (its pid is no child of ours: ensure_running() raised
    ChildProcessError). What ForkServer._stop_unlocked resets, without stopping or unlinking
    anything of the parent's: an Engine made in the child starts a forkserver of its own."""
    server: Any = forkserver._forkserver  # private attributes below (typeshed lists none)
    if server._forkserver_pid is None:
        return
    with contextlib.suppress(OSError):
        os.close(server._forkserver_alive_fd)  # the child's copy: the parent's keeps it alive
    server._forkserver_alive_fd = server._forkserver_pid = server._forkserver_address = None
    server._lock = threading.Lock()
