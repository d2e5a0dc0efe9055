"""The owner thread both backends share: the one thread that touches slots and running tasks.

Other threads never change engine state; they hand the owner a callable (trio's
`run_sync_soon`): `owner.call(fn, *args)` returns a Future of what `fn` returned, run on the
owner thread at its next step. A call greps to its callers, needs no dispatch table, and a late
one fails loudly: every call still pending when the loop exits fails with EngineClosed.

    caller threads                  owner thread
      call(fn, *args) --append-->   body.step(): wait for work (the transport's wait: a
                      --wake()-->            selector over pipes and sentinels, or an inbox)
      Future <------------------           run_calls(): each fn on this thread, in order
                                             ... the owner's work ...
                                    body.finished()? -> body.stopped(), then every pending call fails

The owner is a role (issue 21, engine.core.fastpath): whoever holds `lock` acts. The thread
holds it for each step except while it waits in the transport; a caller that finds it free
may run the owner's own code meanwhile, and counts as on the owner's thread while it holds it
(a done-callback it runs that calls `call` runs the call at once, as on the thread).

It holds its `body` (a `LoopBody`: the coordinator, engine.core.coordinator) rather than being
its base: `body.fail(error)` is what an internal bug leads to (the engine fails loudly, nothing
is left running).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

from slabpool.workers import errors

T = TypeVar("T")
log = logging.getLogger("slabpool.engine")


class OwnerLock:
    """The owner role: a lock and who holds it (`held_here`, `released` by the owner thread
    around its wait)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.holder = 0  # the thread id holding it (0: none)

    @property
    def held_here(self) -> bool:
        return self.holder == threading.get_ident()

    @contextmanager
    def owning(self) -> Iterator[None]:
        """Act as the owner (waits for the lock); reentrant on the same thread."""
        if self.held_here:
            yield
            return
        self._lock.acquire()
        self.holder = threading.get_ident()
        try:
            yield
        finally:
            self.holder = 0
            self._lock.release()

    def own(self) -> None:
        """Take the lock, waiting for it (not held by this thread: see `owning`)."""
        self._lock.acquire()
        self.holder = threading.get_ident()

    def try_own(self) -> bool:
        """Take the lock if it is free now (never waits; False when this thread holds it)."""
        if self.held_here or not self._lock.acquire(blocking=False):
            return False
        self.holder = threading.get_ident()
        return True

    def let_go(self) -> None:
        self.holder = 0
        self._lock.release()

    @contextmanager
    def released(self) -> Iterator[None]:
        """Around the owner thread's wait: a caller may act meanwhile."""
        if not self.held_here:
            yield
            return
        self.let_go()
        try:
            yield
        finally:
            self._lock.acquire()
            self.holder = threading.get_ident()


class LoopBody(Protocol):
    """What the owner thread runs: one step at a time until finished, then the stop path."""

    def wake(self) -> None:
        """Make the body's next wait return (callable from any thread)."""

    def step(self) -> None:
        """Wait for work once, then do it (the thread's run_calls included)."""

    def finished(self) -> bool: ...

    def fail(self, error: BaseException) -> None:
        """The engine cannot go on: every waiting and running task fails with `error`."""

    def stopped(self) -> None:
        """On the owner thread, after the loop: stop every slot, complete what is left."""


class OwnerThread:
    """The loop skeleton, the call bus and the thread. See the module docstring."""

    def __init__(self, name: str, body: LoopBody) -> None:
        self.body = body
        self._calls: deque[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]]] = deque()
        self._calls_lock = threading.Lock()
        self._loop_done = False  # set once, under _calls_lock: later calls fail at once
        self._forsaken = ""  # in a forked child: why no loop runs here (see forsake)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._exited = threading.Event()  # the loop has exited (set last): what join waits on
        self.lock = OwnerLock()  # the owner role (engine.core.fastpath)

    # -- the call bus ----------------------------------------------------------------------------

    def call(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run `fn(*args)` on the owner thread; a Future of its return value. On the owner
        thread itself it runs now. After the loop has exited the Future fails (EngineClosed).
        `fn` must not raise: what it raises is a bug, and fails the engine."""
        fut: Future[T] = Future()
        if self.on_thread:
            _settle(fut, fn, args)
            return fut
        with self._calls_lock:
            if self._loop_done:
                fut.set_exception(errors.EngineClosed(self._forsaken or "the engine has stopped: nothing runs this call"))
                return fut
            self._calls.append((fn, args, fut))
        self.body.wake()
        return fut

    @property
    def pending(self) -> bool:
        """A call waits to run (a caller acting as the owner leaves it to the thread)."""
        return bool(self._calls)

    def run_calls(self) -> None:
        """Run every pending call (on the owner thread, from the body's step)."""
        while self._calls:
            fn, args, fut = self._calls.popleft()
            _settle(fut, fn, args)

    def forsake(self, why: str) -> None:
        """In a process forked from the owner's (engine.local.forks): no thread runs the loop
        here, so every call fails at once (EngineClosed(why)) and wakes nothing (the wake-up
        pipe is the parent's). Takes no lock: another thread may have held one at the fork."""
        self._calls_lock = threading.Lock()
        self.lock = OwnerLock()
        self._calls.clear()
        self._forsaken, self._loop_done = why, True
        self._exited = threading.Event()  # (a fresh one: another thread may have held its lock)
        self._exited.set()  # (join: no loop runs here to wait for)

    # -- the thread ------------------------------------------------------------------------------

    def start_loop(self) -> None:
        self._thread.start()

    def join(self, timeout: float | None) -> bool:
        """Wait for the loop to exit; False if it still runs (or if called from the loop).

        It waits on the loop's own end, not on the thread's: a KeyboardInterrupt inside
        Thread.join() marks the thread stopped while it still runs (CPython 3.11,
        threading._wait_for_tstate_lock), and a close() interrupted by a Ctrl-C then found the
        engine stopped at its next call, returned at once with every Future pending and the
        workers running, and the exit-time stop was skipped."""
        if self.on_thread:
            return False
        if self._thread.ident is None:
            return True  # (never started: no loop to wait for)
        return self._exited.wait(timeout)

    @property
    def on_thread(self) -> bool:
        """On the owner thread, or on a caller acting as the owner (it holds `lock`)."""
        return threading.current_thread() is self._thread or self.lock.held_here

    def _run(self) -> None:
        try:
            while not self.body.finished():
                self.body.step()
        except BaseException as exc:  # a bug in slabpool: fail everything, loudly
            log.exception("%s failed", self._thread.name)
            self.body.fail(errors.EngineInternalError(f"{self._thread.name} thread failed: {exc!r}"))
        finally:
            try:
                self.body.stopped()
            finally:
                with self._calls_lock:
                    self._loop_done = True
                self._fail_late_calls()
                self._exited.set()

    def _fail_late_calls(self) -> None:
        """Calls that arrived while the loop was exiting: they find no loop to run them."""
        while self._calls:
            _, _, fut = self._calls.popleft()
            if fut.set_running_or_notify_cancel():
                fut.set_exception(errors.EngineClosed("the engine stopped before this call ran"))


def _settle(fut: Future[T], fn: Callable[..., T], args: tuple[Any, ...]) -> None:
    """Run one call. What it raises is a bug of the owner's (calls hold no user code): the
    caller's Future carries it, and it goes on up to fail the loop, loudly."""
    if not fut.set_running_or_notify_cancel():
        return
    try:
        fut.set_result(fn(*args))
    except BaseException as exc:
        fut.set_exception(exc)
        raise
