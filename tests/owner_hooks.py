"""Hooks for the owner-side reliability tests (cancel in every queue, start-up of a rebuilt
worker, pipes that cannot deadlock). Each fault or wait is pinned by the task itself or by a
file the test controls, never by timing: a hook that waits, waits for a file to go, and gives
up only after a deadline that a deadlock alone reaches."""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat
import time
from typing import Any

import numpy as np

DEADLOCK_S = 120.0  # only a test that has already failed waits this long
log = logging.getLogger("tests.owner_hooks")


def touch_first(path: str) -> bool:
    """Create `path`; True only for the first process that does (O_EXCL)."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    return True


def wait_gone(path: str, limit: float = DEADLOCK_S) -> None:
    """Block while `path` exists (the test removes it to let this process go on)."""
    end = time.monotonic() + limit
    while os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"{path} still there after {limit} s")
        time.sleep(0.005)


def gated(item: Any) -> dict[str, np.ndarray]:
    """A preprocess for the mlp. `kill_once`: SIGKILL this worker the first time any process
    sees the item; `gate`: say so in `gate + ".in"`, then wait while the gate file exists."""
    kill = item.get("kill_once")
    if kill is not None and touch_first(kill):
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    gate = item.get("gate")
    if gate is not None:
        touch_first(gate + ".in")
        wait_gone(gate)
    return {"x": np.asarray(item["x"], dtype=np.float32)}


def hold_rebuilt(directory: str) -> None:
    """An initializer: the k-th worker to start (k = 1, 2, ...) writes `started-k`, then
    waits while `hold-k` exists. The test holds a rebuilt slot in STARTING with it."""
    k = 1
    while not touch_first(os.path.join(directory, f"started-{k}")):
        k += 1
    wait_gone(os.path.join(directory, f"hold-{k}"), 2 * DEADLOCK_S)  # past any wait of the test


def kill_rebuilt(directory: str, first: int, last: int) -> None:
    """An initializer: the k-th worker to start (k = 1, 2, ...) writes `started-k`; the ones
    from `first` to `last` then SIGKILL themselves (a start-up killed from outside, as the OOM
    killer would)."""
    k = 1
    while not touch_first(os.path.join(directory, f"started-{k}")):
        k += 1
    if first <= k <= last:
        os.kill(os.getpid(), signal.SIGKILL)


def refuse_rebuilt(directory: str, first: int, last: int) -> None:
    """An initializer: the k-th worker to start (k = 1, 2, ...) writes `started-k`; the ones
    from `first` to `last` raise (a start-up error their session reports, as a missing licence
    server's would, once)."""
    k = 1
    while not touch_first(os.path.join(directory, f"started-{k}")):
        k += 1
    if first <= k <= last:
        raise RuntimeError(f"start {k} refused")


def shrink_sockets(nbytes: int = 4096) -> int:
    """Shrink the buffers of every Unix socket of this process (a slot's pipe is a socket
    pair) to about `nbytes`: a message larger than that blocks a writer until it is read.
    Returns how many sockets it shrank. An initializer (the worker's end) and a call in the
    test (the supervisor's end)."""
    n = 0
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with sock:
            if sock.family != socket.AF_UNIX:
                continue
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, nbytes)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, nbytes)
            n += 1
    return n


def big_text(item: Any) -> str:
    """A preprocess with no model: a string of item["n"] bytes comes back (a large BatchDone)."""
    return str(item["c"]) * int(item["n"])


def chatty(item: Any) -> dict[str, np.ndarray]:
    """A preprocess for the mlp that logs item["logs"] warnings (log records cross the pipe)."""
    for i in range(int(item.get("logs", 0))):
        log.warning("record %d of item %s", i, item.get("i"))
    return {"x": np.asarray(item["x"], dtype=np.float32)}


def shrink_then_hold(directory: str) -> None:
    """An initializer: tiny socket buffers on the worker's end, then hold_rebuilt."""
    shrink_sockets()
    hold_rebuilt(directory)


def upper_line(line: str) -> str:
    """A preprocess for `slabpool run --text` with no model: a string back, as long as the line."""
    return line.upper()
