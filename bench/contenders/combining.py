"""The batching floor for many callers: what one call costs, with no engine at all, when the
callers that wait at the same moment share one round trip to a worker (bench.latency's
"batching floor" row; issue 21's 8-caller target).

No guarantee of the engine's is kept here (a worker that dies loses its batch and hangs its
callers; no admission bound, no cancel, no deadline, no shared memory: the rows travel
pickled in one message a batch). It is the design's floor, not a contender a user would run:
the distance from it to `Engine.infer` at 8 callers is what the engine's bookkeeping costs.

Combining (leader and followers): a caller appends its rows to the queue; if a worker is idle
it takes the worker and everything queued (its own rows among them), sends that as one batch,
waits for the answer, gives each caller its rows, and hands the worker to the first caller
queued meanwhile (or back to the idle list). The others wait once, on a lock of their own:

    caller   queue += me; a worker idle? -> lead: stack the queue, send, read, split, wake each
                                                  follower, hand the worker on
                                       else   -> wait: my rows' outputs, or a worker to lead
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import pickle
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

_HEAD = struct.Struct("<Q")


def _serve(model: str, rx: Any, tx: Any) -> None:
    """A worker: one session; each message a dict of stacked rows, each answer the outputs."""
    from bench.contenders.remote import make_session

    sess = make_session(model, 1)
    names = [o.name for o in sess.get_outputs()]
    while True:
        feeds = _recv(rx.fileno())
        if feeds is None:
            return
        _send(tx.fileno(), sess.run(names, feeds))


def _send(fd: int, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEAD.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _recv(fd: int) -> Any:
    head = _read(fd, _HEAD.size)
    if head is None:
        return None
    body = _read(fd, _HEAD.unpack(head)[0])
    return None if body is None else pickle.loads(body)


def _read(fd: int, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


class _Waiter:
    __slots__ = ("feeds", "gate", "lead", "out")

    def __init__(self, feeds: dict[str, np.ndarray]) -> None:
        self.feeds = feeds
        self.out: dict[str, np.ndarray] | None = None
        self.lead: int | None = None  # a worker handed to this caller to lead the next batch
        self.gate = threading.Lock()
        self.gate.acquire()


class CombiningPool:
    def __init__(self, model: str, workers: int) -> None:
        ctx = multiprocessing.get_context("forkserver")
        self._pipes, self._procs = [], []
        for _ in range(workers):
            rx, to_worker = ctx.Pipe(duplex=False)
            from_worker, tx = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_serve, args=(model, rx, tx), daemon=True)
            p.start()
            rx.close()
            tx.close()
            self._pipes.append((to_worker, from_worker))
            self._procs.append(p)
        from bench.contenders.remote import make_session

        self.names = [o.name for o in make_session(model, 1).get_outputs()]
        self._lock = threading.Lock()
        self._queue: collections.deque[_Waiter] = collections.deque()
        self._idle = list(range(workers))
        self.batches = self.rows = 0

    def call(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        me = _Waiter(feeds)
        with self._lock:
            self._queue.append(me)
            worker = self._idle.pop() if self._idle else None
            batch = self._take() if worker is not None else []
        if worker is None:
            me.gate.acquire()  # my outputs, or a worker to lead with
            if me.lead is None:
                assert me.out is not None
                return me.out
            worker, me.lead = me.lead, None
            with self._lock:
                batch = [me, *self._take()]
        self._run(worker, batch)
        assert me.out is not None
        return me.out

    def _take(self) -> list[_Waiter]:
        batch = list(self._queue)
        self._queue.clear()
        return batch

    def _run(self, worker: int, batch: list[_Waiter]) -> None:
        to_worker, from_worker = self._pipes[worker]
        names = list(batch[0].feeds)
        counts = [len(w.feeds[names[0]]) for w in batch]
        stacked = {k: np.concatenate([w.feeds[k] for w in batch]) if len(batch) > 1 else batch[0].feeds[k]
                   for k in names}
        _send(to_worker.fileno(), stacked)
        outs = _recv(from_worker.fileno())
        self.batches += 1
        self.rows += len(batch)
        at = 0
        for w, n in zip(batch, counts, strict=True):
            w.out = {k: o[at : at + n] for k, o in zip(self.names, outs, strict=True)}
            at += n
        with self._lock:
            heir = self._queue.popleft() if self._queue else None  # it leads the next batch
            if heir is None:
                self._idle.append(worker)
            else:
                heir.lead = worker
        for w in batch[1:]:  # (batch[0] is the leader: a caller that finds a worker idle finds
            w.gate.release()  # none queued before it, and an heir puts itself first)
        if heir is not None:
            heir.gate.release()

    def close(self) -> None:
        for to_worker, _ in self._pipes:
            to_worker.close()
        for p in self._procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        for _, from_worker in self._pipes:
            from_worker.close()


@contextmanager
def combining(model: str, workers: int) -> Iterator[CombiningPool]:
    pool = CombiningPool(model, workers)
    try:
        yield pool
    finally:
        pool.close()
