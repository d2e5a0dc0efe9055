"""What the person running the job sees: the progress display (a bar on a terminal, lines
otherwise). Ctrl-C/SIGTERM (the first drains, the second stops now): engine.job.signals."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

MIN_RATE_S = 0.1  # a rate over a shorter running phase is timer noise ("1,422,952.8 items/s"): not shown


def rate(items: int, seconds: float) -> float | None:
    """Items a second over the running phase, or None when it is too short to give one."""
    return items / seconds if seconds >= MIN_RATE_S else None


class Progress:
    """A tqdm bar on a terminal; plain lines every `log_every` seconds otherwise (CI, nohup).
    Rates count over the running phase alone (`begin` to `end`: start-up and the final writes
    are not in it), the same figure as the report's throughput."""

    def __init__(self, total: int, initial: int, log_every: float, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.total, self.initial, self.log_every = total, initial, log_every
        self.start = self.last_line = time.monotonic()
        self.stop: float | None = None
        self.tty = self.stream.isatty()
        self.bar: Any = None

    def begin(self) -> None:
        """The engine is ready: rates count from now."""
        self.start = self.last_line = time.monotonic()
        if self.tty:
            from tqdm import tqdm

            # smoothing=0: the bar's rate is the mean over the running phase, as the report's
            # (its default, a moving average of the last updates, swings with each block)
            self.bar = tqdm(total=self.total, initial=self.initial, unit="item", file=self.stream,
                            dynamic_ncols=True, desc="slabpool", smoothing=0)

    def end(self) -> float:
        """The running phase is over (nothing more is sent or settled): its seconds."""
        self.stop = time.monotonic()
        return self.stop - self.start

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
        per_s = rate(settled - self.initial, (self.stop or now) - self.start)
        left = self.total - settled
        eta = "0 s" if left <= 0 else f"{left / per_s:.0f} s" if per_s else "unknown"
        pct = 100.0 * settled / max(self.total, 1)
        shown = f"{per_s:.1f} items/s" if per_s is not None else "- items/s"
        self.note(f"progress: {settled}/{self.total} items ({pct:.0f}%), {shown}, "
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
