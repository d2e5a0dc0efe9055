"""The one selector of a local Engine: every worker's pipe, every worker's process sentinel,
and the wake-up pipe other threads write to. Part of the local transport
(engine.local.transport), which alone calls it, holding the owner lock (`wake` from any
thread). The owner thread waits in it without the lock (`wait`, after `prepare`); a caller
acting as the owner meanwhile may take a slot's pipe out (`lend`: the caller polls it) and put
it back (`give_back`): epoll's set changes at once, under a wait in progress too. A pipe given
back parked (a group's task's, under load: its slot is lent again within microseconds) stays
out until the owner's next wait (`prepare`) or a send that is not a lend (`unpark`): the lends
of back-to-back tasks cost no epoll_ctl (engine.core.fastpath, PARK_S).

Keys are values (`Key`: what an fd stands for, and the object it belongs to), compared by
the identity of that object: a pipe or a process that has gone is never mistaken for the
next one on the same fd number.

It is `select.epoll` itself, not the `selectors` module over it: a lend and its give-back
change the set on every idle call, and `selectors`' own bookkeeping around each epoll_ctl (a
SelectorKey, its fd lookup, its map) was 147 of a call's 6,195 opcodes. What `wait`
returns keeps `selectors`' event bits (EVENT_READ, EVENT_WRITE).
"""

from __future__ import annotations

import enum
import os
import select
import selectors
import threading
from dataclasses import dataclass
from typing import Any

from slabpool.engine.local.slot import Slot


class Watched(enum.Enum):
    WAKE = "wake"
    CONN = "conn"  # a worker's pipe: readable (and writable while its outbox holds something)
    EXIT = "exit"  # a worker's process sentinel


@dataclass(frozen=True, eq=False)
class Key:
    kind: Watched
    worker: Slot | None
    obj: Any  # the Connection or the Process it stands for


class SlotSelector:
    def __init__(self) -> None:
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._wake_pending = False
        # closed under this lock, and never written once closed (CPython's _ThreadWakeup): a
        # caller's late wake() must not write into an fd number that something else now holds
        self._wake_lock = threading.Lock()
        self._wake_closed = False
        self._epoll = select.epoll()
        self._watched: dict[int, Key] = {}  # fd -> what it stands for, as registered
        self._events: dict[int, int] = {}  # fd -> the EVENT_* bits it is registered for
        self._lendable: dict[int, Key] = {}  # a worker pipe's key, kept while it is lent
        self._parked: dict[int, Slot] = {}  # pipes given back parked: out of the set until `prepare`
        self._wake_key = Key(Watched.WAKE, None, None)
        self.dirty = True  # set whenever a pipe or a process comes or goes

    def wake(self) -> None:
        if self._wake_pending:
            return  # a byte is already on its way: one wake-up serves every caller before it
        with self._wake_lock:
            if self._wake_closed:
                return  # the loop has stopped: nothing to wake
            self._wake_pending = True
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:
                pass  # the pipe is full: it is awake already

    def select(self, workers: list[Slot], timeout: float | None) -> list[tuple[Key, int]]:
        self.prepare(workers)
        return self.wait(timeout)

    def prepare(self, workers: list[Slot]) -> None:
        """Before a wait, holding the owner lock: the watched set in line with the slots
        (every parked pipe back in it)."""
        if self._parked:
            parked, self._parked = self._parked, {}
            for w in parked.values():
                self.give_back(w)
        if self.dirty:
            self._sync(workers)

    def wait(self, timeout: float | None) -> list[tuple[Key, int]]:
        """One wait; the wake-up pipe is read here (a wake() from then on writes again, and
        one that saw a byte pending is served by the caller's step: its work is queued)."""
        got: list[tuple[Key, int]] = []
        for fd, ev in self._epoll.poll(-1 if timeout is None else max(timeout, 0.0)):
            key = self._watched.get(fd)
            if key is None:
                continue  # (unwatched by a caller since the kernel reported it)
            mask = (selectors.EVENT_WRITE if ev & ~select.EPOLLIN else 0) | (
                selectors.EVENT_READ if ev & ~select.EPOLLOUT else 0)
            if key.kind is Watched.WAKE:
                os.read(self._wake_r, 4096)
                self._wake_pending = False
            got.append((key, mask))
        return got

    def _sync(self, workers: list[Slot]) -> None:
        """Bring the persistent selector in line with the live pipes and sentinels. Only after
        a spawn, a death or a closed pipe: a fresh poll set per step cost a third of the loop.
        A pipe is watched for writing too while its worker's outbox holds something."""
        want: dict[int, Key] = {self._wake_r: self._wake_key}
        for w in workers:
            if w.conn is not None and not w.lent:  # (a lent pipe is its caller's to poll)
                want[w.conn.fileno()] = _same_or_new(self._watched, w.conn.fileno(), Watched.CONN, w, w.conn)
            if w.process is not None:
                want[w.process.sentinel] = _same_or_new(self._watched, w.process.sentinel, Watched.EXIT, w,
                                                        w.process)
        for fd, key in list(self._watched.items()):
            if want.get(fd) is not key:
                self._unregister(fd)
        for fd, key in want.items():
            if fd not in self._watched:
                self._register(fd, key, _events(key))
        self.dirty = False

    def set_writing(self, w: Slot, on: bool) -> None:
        """Watch a worker's pipe for writing too (its outbox holds something), or no longer."""
        if w.conn is None:
            return
        fd = w.conn.fileno()
        key = self._watched.get(fd)
        if key is None:
            self.dirty = True  # registered with its outbox's events on the next sync
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if on else 0)
        if self._events[fd] != events:
            self._epoll.modify(fd, _epoll_mask(events))
            self._events[fd] = events

    def lend(self, w: Slot) -> None:
        """A worker's pipe leaves the selector (w.lent is set): a caller polls it."""
        assert w.conn is not None
        fd = w.fd
        if self._parked.pop(fd, None) is not None:
            return  # (out of the set already)
        key = self._watched.get(fd)
        if key is not None:
            self._lendable[fd] = key
            self._unregister(fd)

    def give_back(self, w: Slot, park: bool = False) -> None:
        """A lent pipe comes back (w.lent is cleared), with its outbox's events; `park`: not
        before the owner's next wait, or a send that is not a lend (`unpark`)."""
        if w.conn is None or self._wake_closed:
            return
        fd = w.fd
        if park:
            self._parked[fd] = w
            return
        if fd not in self._watched:
            key = _same_or_new(self._lendable, fd, Watched.CONN, w, w.conn)
            self._lendable.pop(fd, None)
            self._register(fd, key, _events(key))

    def unpark(self, w: Slot) -> None:
        """A parked pipe back in the set now (the owner thread will read what it answers)."""
        if self._parked and self._parked.pop(w.fd, None) is not None:
            self.give_back(w)

    def forget(self, fd: int) -> None:
        """Unwatch an fd before it is closed (its number may be reused at once)."""
        self._lendable.pop(fd, None)
        self._parked.pop(fd, None)
        if fd in self._watched:
            self._unregister(fd)
        self.dirty = True

    def forget_worker(self, w: Slot) -> None:
        if w.conn is not None:
            self.forget(w.conn.fileno())
        if w.process is not None:
            self.forget(w.process.sentinel)

    def _register(self, fd: int, key: Key, events: int) -> None:
        self._epoll.register(fd, _epoll_mask(events))
        self._watched[fd] = key
        self._events[fd] = events

    def _unregister(self, fd: int) -> None:
        """Out of the set and the maps (an fd already closed is out of epoll's set already)."""
        del self._watched[fd]
        del self._events[fd]
        try:
            self._epoll.unregister(fd)
        except (ValueError, OSError):
            pass

    def close(self) -> None:
        with self._wake_lock:
            if self._wake_closed:
                return
            self._wake_closed = True
            self._epoll.close()
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)


def _same_or_new(watched: dict[int, Key], fd: int, kind: Watched, w: Slot, obj: Any) -> Key:
    """The key `watched` holds for `fd` if it stands for the same object, else a new one (made
    only then: give_back asks on every lent call)."""
    old = watched.get(fd)
    if old is not None and old.kind is kind and old.worker is w and old.obj is obj:
        return old
    return Key(kind, w, obj)


def _epoll_mask(events: int) -> int:
    return (select.EPOLLIN if events & selectors.EVENT_READ else 0) | (
        select.EPOLLOUT if events & selectors.EVENT_WRITE else 0)


def _events(key: Key) -> int:
    """What to watch an fd for: a worker's pipe also for writing while its outbox is not empty."""
    if key.kind is Watched.CONN and key.worker is not None and key.worker.outbox:
        return selectors.EVENT_READ | selectors.EVENT_WRITE
    return selectors.EVENT_READ
