"""What the person running the job sees: the progress display (a bar on a terminal, lines
otherwise). Ctrl-C/SIGTERM (the first drains, the second stops now): engine.job.signals."""

from __future__ import annotations

import sys
import time
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
