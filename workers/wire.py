"""Frames on a slot's pipe, read in bulk.

The frame format is multiprocessing.Connection's own (a '!i' length, or -1 and a '!Q' length,
then the bytes), so either end may still send with `Connection.send_bytes`. Reading is where
the cost was: `Connection.recv_bytes` makes two read() calls per message and the loop around
it a poll() before each, four system calls per message; `FrameReader.read` takes every frame
already in the pipe with one read(). On the 2-core VM each call from a thread woken on a core
that a worker just left costs several microseconds (measured, see the throughput issue).
"""

from __future__ import annotations

import os
import select
import struct
import time

_HEAD = struct.Struct("!i")
_LONG = struct.Struct("!Q")
CHUNK = 256 * 1024  # bytes asked for per read(); a longer frame arrives over several reads


SHORT = 0x7FFFFFFF  # the longest frame whose header is a '!i' length alone
short_head = _HEAD.pack  # that header, head(size) for size <= SHORT without the call


def head(size: int) -> bytes:
    """The header of a frame of `size` bytes (what Connection.send_bytes writes before it)."""
    return _HEAD.pack(size) if size <= SHORT else _HEAD.pack(-1) + _LONG.pack(size)


class FrameReader:
    """The reading side of one end of a pipe."""

    def __init__(self, fd: int) -> None:
        self.fd = fd  # blocking on the worker's side; the supervisor's end does not block
        self._poll = _poller(fd).poll  # (poll(0): is a read due? `_poller` says why not select)
        self._buf = bytearray()
        self._frames: list[bytes] = []  # complete frames not yet handed out by recv()
        self.spin = Spin()  # recv(spin)'s

    def read(self) -> list[bytes]:
        """One read() (the caller knows the fd is readable: it never blocks then), and every
        frame it completed. EOFError when the other end is closed and nothing is left, or when it
        closed with frames of ours unread (a socket's ECONNRESET: the supervisor stopped
        reading; under a Ctrl-C storm that reset had been a worker's traceback)."""
        try:
            chunk = os.read(self.fd, CHUNK)
        except BlockingIOError:  # (a non-blocking end woken for writing, or spuriously)
            return []
        except ConnectionResetError:  # the other end closed with our frames unread in it
            raise EOFError("the other end of the pipe is closed (it left frames unread)") from None
        if not chunk:
            raise EOFError("the other end of the pipe is closed")
        if not self._buf and len(chunk) >= 4 and _HEAD.unpack_from(chunk)[0] == len(chunk) - 4:
            return [chunk[4:]]  # one whole frame, the usual read: no buffer, one copy
        self._buf += chunk
        return self._split()

    def read_to_end(self) -> list[bytes]:
        """Every frame that can be read without blocking (the writer may be dead)."""
        frames: list[bytes] = []
        while self._poll(0):
            try:
                frames += self.read()
            except EOFError:
                break
        return frames

    def recv(self, spin: float = 0.0, peers: int = 0) -> bytes:
        """The next frame, waiting for it (the worker's side); polling for up to `spin`
        seconds before it sleeps in read(), while that pays (`Spin`; `peers`: its engine's
        tasks that poll too)."""
        if spin and not self._frames:
            self.spin.wait(self.fd, spin, peers)
        while not self._frames:
            self._frames = self.read()
        return self._frames.pop(0)

    def poll(self) -> bool:
        """A frame is ready for recv() without waiting."""
        while not self._frames and self._poll(0):
            self._frames = self.read()
        return bool(self._frames)

    def _split(self) -> list[bytes]:
        buf, pos, end, out = self._buf, 0, len(self._buf), []
        while end - pos >= 4:
            (size,), head = _HEAD.unpack_from(buf, pos), 4
            if size == -1:
                if end - pos < 12:
                    break
                (size,), head = _LONG.unpack_from(buf, pos + 4), 12
            if end - pos - head < size:
                break
            out.append(bytes(buf[pos + head : pos + head + size]))
            pos += head + size
        if pos:
            del buf[:pos]
        return out


def spin_until(fd: int, end: float) -> bool:
    """Poll `fd` without sleeping until it is readable (True) or perf_counter() passes `end`.
    True too once the other end is closed, or `fd` itself is: a lender's pipe closed by the
    owner at a worker's death while it spins; it then looks under the owner lock and finds its
    lend over (select() raised EBADF there, into the caller's infer()).

    A process woken from a sleep in read() or poll() by a pipe write costs ~35 us on the 2-core
    VM (one wake-up; bench.latency's floor); an idle call pays two, the worker's for the task
    and the caller's for the answer. A process that polls instead, for about the time the other
    side takes, is running when the bytes land. Each poll is a system call that lets the GIL
    go. Used only around a lent call (a caller waiting on an idle engine, `EngineConfig.spin_us`),
    never under load, where the peer needs the core. Each turn yields the core (sched_yield)
    to a task waiting for it: with more processes runnable than cores (several engines busy on
    2 cores, measured) a bare poll took the core its own peer was waiting for, and cost 10-20%
    of their calls/s; yielding made it even or better."""
    poll, clock, pause = _poller(fd).poll, time.perf_counter, os.sched_yield
    while not poll(0):
        if clock() >= end:
            return False
        pause()
    return True


class Spin:
    """Polling that stops while it does not pay.

    - A spin that ends with nothing read makes the next 1, 3, 7, ... 63 waits sleep at once
      (after 1..6 such misses in a row); one that catches its bytes spins again next time. A
      caller whose calls come far apart (or whose model runs longer than the spin) pays the
      spin's CPU about once in 64 calls, not on each.
    - No spin while the host has more tasks runnable than this process has CPUs (the running
      count of /proc/loadavg, which counts the looker too, looked at every SAMPLE waits), at
      two looks in a row: a poll then takes a core that something else, maybe the peer
      itself, waits for. Two engines each with a busy caller on 2 cores (4 runnable) were
      10-20% slower polling.
    - The engine's own tasks are not that something else (`peers`: `polling_peers`, not
      counted): each other lent call's caller and worker, which poll too and yield to each
      other each turn, and its callers not lent (woken from a group, or joining one), which
      share the looker's GIL. Two threads calling one engine of 2 workers on 2 cores (4
      runnable) made twice the calls/s once their workers polled for the next call too.
    - One look may still catch a moment's crowd that is no one else's. Stopping on it cost
      the next SAMPLE calls two wake-ups each, whose wakers crowded the next look too (4
      callers on 2 slots: 9,000-17,000 calls/s from one run to the next; 14,900-17,000 with
      two looks). docs/latency.md has the measurements.

    Counters only: a race between threads sharing one costs a spin more or less."""

    MAX_MISSES = 6
    SAMPLE = 8  # waits between two looks at the host's runnable tasks

    def __init__(self, cpus: int | None = None) -> None:
        self.cpus = cpus if cpus is not None else len(os.sched_getaffinity(0))
        self.misses = 0  # spins in a row that caught nothing
        self.skip = 0  # waits left that sleep at once
        self.caught = 0  # spins that caught their bytes (stats for tests and bench)
        self.crowded = False  # at the last two looks, more tasks runnable than CPUs
        self._over = False  # at the last look
        self._waits = 0

    def wait(self, fd: int, seconds: float, peers: int = 0) -> bool:
        """Poll `fd` for up to `seconds` unless recent spins missed or the host is crowded
        (then return at once): whether it is readable now (False: not polled, or nothing came).
        `peers`: tasks of the looker's own engine that poll with it (`polling_peers`), not
        counted against the CPUs."""
        self._waits += 1
        if self._waits % self.SAMPLE == 1:
            over = runnable() > self.cpus + peers
            self.crowded, self._over = over and self._over, over
        if self.crowded:
            return False
        if self.skip:
            self.skip -= 1
            return False
        if spin_until(fd, time.perf_counter() + seconds):
            self.misses = 0
            self.caught += 1
            return True
        self.misses = min(self.misses + 1, self.MAX_MISSES)
        self.skip = (1 << self.misses) - 1
        return False


def polling_peers(lent: int, inside: int = 0) -> int:
    """The engine's own tasks that may run beside one lent call's caller and worker, while
    `lent` calls of it are lent their slots and `inside` of its callers are inside a call:
    each other lent call's caller and worker, and each caller not lent (one woken from a
    group, or joining one: it shares the looker's GIL and soon sleeps again)."""
    return 2 * max(lent - 1, 0) + max(inside - lent, 0)


def runnable() -> int:
    """Tasks runnable on the host now, the looker included (/proc/loadavg's fourth field,
    "running/total"; ~7 us); 0 where it cannot be read."""
    try:
        fd = os.open("/proc/loadavg", os.O_RDONLY)
        try:
            data = os.pread(fd, 128, 0)
        finally:
            os.close(fd)
        return int(data.split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return 0


def _poller(fd: int) -> select.poll:
    """A poll object for `fd`'s input. Not select(): it refuses an fd past FD_SETSIZE (1024),
    which a slot's pipe is in a process holding a thousand files or sockets open (every
    infer() raised ValueError there); poll() takes any fd, and says POLLNVAL for a closed one."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return poller
