"""What the person running the job sees and does: the progress display (a bar on a terminal,
lines otherwise) and Ctrl-C/SIGTERM (the first drains, the second stops now)."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any, TextIO


class Progress:
    """A tqdm bar on a terminal; plain lines every `log_every` seconds otherwise (CI, nohup)."""

    def __init__(self, total: int, initial: int, log_every: float, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.total, self.initial, self.log_every = total, initial, log_every
        self.start = self.last_line = time.monotonic()
        self.tty = self.stream.isatty()
        self.bar: Any = None

    def begin(self) -> None:
        """The engine is ready: rates count from now."""
        self.start = self.last_line = time.monotonic()
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=self.initial, unit="item", file=self.stream,
                            dynamic_ncols=True, desc="slabpool")

    def update(self, settled: int, failed: int, restarts: int) -> None:
        if self.tty:
            if self.bar is None:
                return
            self.bar.update(settled - self.bar.n)
            self.bar.set_postfix(restarts=restarts, failed=failed, refresh=False)
        elif time.monotonic() - self.last_line >= self.log_every:
            self.line(settled, failed, restarts)

    def line(self, settled: int, failed: int, restarts: int) -> None:
        self.last_line = now = time.monotonic()
        rate = (settled - self.initial) / max(now - self.start, 1e-9)
        left = self.total - settled
        eta = "0 s" if left <= 0 else f"{left / rate:.0f} s" if rate > 0 else "unknown"
        pct = 100.0 * settled / max(self.total, 1)
        self.note(f"progress: {settled}/{self.total} items ({pct:.0f}%), {rate:.1f} items/s, "
                  f"eta {eta}, restarts {restarts}, failed {failed}")

    def note(self, message: str) -> None:
        if self.bar is not None:
            self.bar.write(f"slabpool: {message}", file=self.stream)
        else:
            print(f"slabpool: {message}", file=self.stream, flush=True)

    def close(self, settled: int, failed: int, restarts: int) -> None:
        if self.bar is not None:
            self.update(settled, failed, restarts)
            self.bar.close()
        else:
            self.line(settled, failed, restarts)


class StopNow(Exception):
    """A second Ctrl-C/SIGTERM while the loop waits for work: stop at once."""


class Interrupts:
    """SIGINT/SIGTERM set flags (no I/O in a handler); the loop reads them. A second one
    raises StopNow out of a wait, but only while `armed` (waiting for the engine, never in
    the middle of a commit)."""

    def __init__(self) -> None:
        self.count = 0
        self.signum = 0
        self.armed = False
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        self.signum = self.signum or signum
        if self.count >= 2 and self.armed:
            self.armed = False
            raise StopNow

    def wait(self, it: Iterator[Any]) -> Any:
        """next(it), interruptible by a second signal; None at its end."""
        if self.count >= 2:
            raise StopNow
        self.armed = True
        try:
            return next(it, None)
        finally:
            self.armed = False

    def __enter__(self) -> Interrupts:
        for s in (signal.SIGINT, signal.SIGTERM):
            self._old[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *_: Any) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
