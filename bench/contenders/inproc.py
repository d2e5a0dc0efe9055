"""In the bench's own process: the serial reference and one session with N intra-op threads."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

from bench.contenders.base import Done, NoSample
from bench.contenders.remote import make_session


class InProcess(NoSample):
    """One ORT session in this process; items run one call each, in this thread."""

    def __init__(self, name: str, threads: int | None, note: str) -> None:
        self.name, self.note = name, note
        self._threads = threads  # None: as many as the pool has workers
        self._sess: Any = None
        self._names: list[str] = []

    def setup(self, model: str, workers: int) -> None:
        self._sess = make_session(model, self._threads or workers)
        self._names = [o.name for o in self._sess.get_outputs()]

    def run(self, items: Sequence[Any]) -> Iterator[Done]:
        run, names = self._sess.run, self._names
        for item in items:
            t0 = time.perf_counter()
            values = run(names, item)
            yield Done(dict(zip(names, values, strict=True)), time.perf_counter() - t0)

    def close(self) -> None:
        self._sess = None


def serial() -> InProcess:
    return InProcess("serial", 1, "1 session in-process, 1 thread (the reference; limit = workers x its rate)")


def threads() -> InProcess:
    return InProcess("ort-threads", None, "1 session in-process, intra_op_num_threads = workers (ORT's default spinning)")
