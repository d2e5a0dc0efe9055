"""A thread's eventfd, on which the owner thread tells a lender that its lend is over
(engine.core.fastpath): made on the thread's first lend, kept for the next ones, closed with
the thread's locals; a forked child makes its own."""

from __future__ import annotations

import os
import threading


class WakeFd:
    """A thread's eventfd, on which the owner tells it that its lend is over (closed with the
    thread's locals)."""

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def wake(self) -> None:
        try:
            os.eventfd_write(self.fd, 1)
        except OSError:
            pass  # (closed: its thread has ended, nobody waits)

    def __del__(self) -> None:
        if hasattr(self, "fd"):  # (none if the eventfd could not be made: out of file descriptors)
            os.close(self.fd)


_THREAD = threading.local()


def _forget_thread_wakes() -> None:
    """In a forked child: the eventfds are the parent's threads' too (a wake meant for a
    parent's lender must not be read here); the child makes its own when it lends."""
    global _THREAD
    _THREAD = threading.local()


os.register_at_fork(after_in_child=_forget_thread_wakes)


def thread_wake() -> WakeFd:
    """This thread's eventfd (made on its first lend, kept for the next ones)."""
    got: WakeFd | None = getattr(_THREAD, "wake", None)
    if got is None:
        got = _THREAD.wake = WakeFd()
    return got
