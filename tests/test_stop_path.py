"""The stop path cannot be stopped (issue 19, items 6-7; issue 20, item 7): a rebuilt worker
that never finishes starting, a late wake-up, an error inside the stop itself. Every Future
ends, every arena is freed, close(timeout=) returns."""

from __future__ import annotations

import os

import numpy as np
import pytest

from slabpool import Engine

X = np.random.default_rng(3).standard_normal((2, 16)).astype(np.float32)


def test_a_late_wake_never_writes_into_an_fd_reused_after_the_stop(models):
    """The wake-up pipe was closed before the loop said it had stopped; a caller's wake() in
    between wrote a byte into whatever took the fd number next (another engine's pipe, a
    file). Here the numbers are taken by files at once, and the late wake-up comes after."""
    eng = Engine(models.mlp, workers=1)
    eng.infer(X)
    sup = eng._sup
    numbers = sorted((sup._wake_r, sup._wake_w))
    eng.close()
    held = []
    try:
        while len(held) < 64 and not set(numbers) <= {fd for pair in held for fd in pair}:
            held.append(os.pipe())  # the lowest free numbers: those the wake-up pipe had, soon
        sup._wake_pending = False  # (as after any step that read the pipe)
        sup.wake()  # what a late call() or submit does
        for r, _ in held:
            os.set_blocking(r, False)
            with pytest.raises(BlockingIOError):
                os.read(r, 1)  # nothing was written into a pipe that is not the engine's
    finally:
        for r, w in held:
            os.close(r)
            os.close(w)
