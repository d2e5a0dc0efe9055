"""Ctrl-C and SIGTERM for `slabpool run`, from the first line of the command to its exit, and
the stages where a test may hold the job. Standard library only: the CLI installs this before
it imports numpy, so a signal during the imports is the job's too.

    stage        what a first signal does                          held by SLABPOOL_TEST_HOLD
    imports      stop once they are done: exit 130/143, nothing    imports
                 was written
    start-up     stop before any item is sent (the store opened,   open, engine
                 or the engine started): the job is resumable
    the run      stop sending, finish what is in flight, commit    commit:N (after commit N)
    final write  OUTPUT is not written (rerun: it is, from what     final
                 is durable)
    the summary  nothing: the job is over

A second signal stops at once: while the job waits on its engine, it cancels what is in flight
(StopNow) and commits what has settled; anywhere else the process exits (130/143) where it
stands, which is as safe as a SIGKILL (a shard or a row counts only once journaled). Exit
status 128 + the first signal's number.

`SLABPOOL_TEST_HOLD=STAGE[:N]@FOLDER` (tests only): at its N-th STAGE (N=1 by default) the
job writes FOLDER/held, then opens the fifo FOLDER/go and waits for a writer. A test signals
the job while it is held there, then releases it: what it does then is the stage's rule,
reached by design and not by timing.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

HOLD = "SLABPOOL_TEST_HOLD"
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopNow(Exception):
    """A second Ctrl-C/SIGTERM while the loop waits for work: stop at once."""


class Interrupted(BaseException):
    """A first signal before the run or during the final write: the job stops there. A
    BaseException, as KeyboardInterrupt: no `except Exception` on the way may swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def status(self) -> int:
        return 128 + self.signum


class Interrupts:
    """SIGINT/SIGTERM set flags (no I/O in a handler); the job reads them at its stages
    (`check`). A second one raises StopNow out of a wait, but only while `armed` (waiting for
    the engine, never in the middle of a commit); elsewhere, with `exit_now` (the process is
    the command), it ends the process at once."""

    def __init__(self, *, exit_now: bool = False) -> None:
        self.count = 0
        self.signum = 0
        self.armed = False
        self.exit_now = exit_now
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        self.signum = self.signum or signum
        if self.count < 2:  # said at once (the stage may take a while to end); one write, no buffer
            os.write(2, f"slabpool: {signal.Signals(signum).name}: stopping cleanly; a second one stops now\n".encode())
            return
        if self.armed:
            self.armed = False
            raise StopNow
        if self.exit_now:
            os.write(2, b"slabpool: stopping now; what was committed stays durable\n")
            os._exit(128 + self.signum)

    def check(self) -> None:
        """At a stage's end: a signal so far stops the job here."""
        if self.count:
            raise Interrupted(self.signum)

    def wait(self, it: Iterator[Any]) -> Any:
        """next(it), interruptible by a second signal; None at its end."""
        if self.count >= 2:
            raise StopNow
        self.armed = True
        try:
            return next(it, None)
        finally:
            self.armed = False

    def install(self) -> None:
        for s in SIGNALS:
            self._old[s] = signal.signal(s, self._handler)

    def restore(self) -> None:
        """The handlers as they were; for the command itself, ignored: the work is over, and
        a late signal must turn the exit into neither a traceback nor a kill."""
        for s, old in self._old.items():
            signal.signal(s, signal.SIG_IGN if self.exit_now else old)
        self._old = {}


_current: Interrupts | None = None


@contextlib.contextmanager
def interrupts(*, exit_now: bool = False) -> Iterator[Interrupts]:
    """The process's Interrupts: the CLI's, installed first thing, or (a job run as a
    library) one installed for the job's duration."""
    global _current
    if _current is not None:
        yield _current
        return
    intr = _current = Interrupts(exit_now=exit_now)
    intr.install()
    try:
        yield intr
    finally:
        _current = None
        intr.restore()


def hold(stage: str, n: int = 1) -> None:
    """Tests only (SLABPOOL_TEST_HOLD): wait at the N-th `stage` until the test releases the job."""
    want = os.environ.get(HOLD)
    if not want:
        return
    where, _, folder = want.partition("@")
    name, _, count = where.partition(":")
    if name != stage or int(count or 1) != n:
        return
    # Written whole, then renamed: a test that sees `held` reads all of it, never an empty file.
    Path(folder, "held.part").write_text(f"{stage}:{n} {os.getpid()}\n")
    os.replace(Path(folder, "held.part"), Path(folder, "held"))
    os.close(os.open(Path(folder, "go"), os.O_RDONLY))  # blocks until the test opens it to write
