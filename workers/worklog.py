"""Worker logs reach the supervisor's logging: records travel the pipe as data.

Each record carries slot, pid, task id, attempt, stage and the context's tenant/request_id,
never input or output data. The supervisor re-emits them on its own loggers, so a user
configures logging once, in the main process.
"""

from __future__ import annotations

import contextvars
import logging
import os
import threading
from collections.abc import Mapping
from multiprocessing.connection import Connection
from types import MappingProxyType
from typing import Any

from slabpool.workers import context
from slabpool.workers.protocol import LogRecord, encode
from slabpool.workers.wire import SHORT, head, short_head

_FIELDS = ("task_id", "attempt", "stage", "error")
_CONTEXT_FIELDS = ("tenant", "request_id")
# the task, attempt and stage in hand: every record logged meanwhile carries them,
# including records from the user's own hooks
_NO_TASK: Mapping[str, Any] = MappingProxyType({})
task_fields: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar("slabpool_task_fields", default=_NO_TASK)


class SupervisorGone(Exception):
    """The supervisor's end of the pipe is closed (it is stopping this worker now, or it has
    died): nothing will read what this worker sends, so it exits quietly, as it does at EOF on
    its read (a BrokenPipeError's traceback on the worker's stderr, under `slabpool run`'s
    'stopping now', was seen by a Ctrl-C storm test)."""


class Outbox:
    """The worker's one way to send: a lock keeps messages from interleaving across threads.
    A message is one frame in Connection's format (workers.wire), written with os.writev
    itself: `Connection.send_bytes` is ~100 opcodes of checks and calls a message, on a
    one-row task's path (docs/latency.md)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn  # (kept open: its fd is written to)
        self._fd = conn.fileno()
        self._lock = threading.Lock()

    def send(self, msg: Any) -> None:
        """Send one message; SupervisorGone if nobody reads the pipe any more."""
        self.send_encoded(encode(msg))

    def send_encoded(self, data: bytes) -> None:
        """`send` of a message already encoded (protocol.encode, or encode_done)."""
        with self._lock:
            try:
                _write_frame(self._fd, data)
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise SupervisorGone(f"the supervisor closed its end of the pipe ({exc})") from None


def _write_frame(fd: int, data: bytes) -> None:
    """One frame (its head, then `data`) in one writev, as the supervisor sends
    (engine.local.slot.Slot.send_bytes); the worker's end blocks, so a frame larger than the
    pipe's room goes on as the supervisor reads."""
    n = len(data)
    frame = short_head(n) if n <= SHORT else head(n)  # (wire.head, without its call: the usual frame)
    sent = os.writev(fd, (frame, data))
    if sent < len(frame) + n:
        view = memoryview(frame + data)[sent:]
        while view.nbytes:
            view = view[os.write(fd, view):]


class PipeHandler(logging.Handler):
    def __init__(self, outbox: Outbox, slot: int) -> None:
        super().__init__()
        self.outbox = outbox
        self.base = {"slot": slot, "pid": os.getpid()}

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields = dict(self.base)
            fields.update(task_fields.get())
            fields.update((k, getattr(record, k)) for k in _FIELDS if hasattr(record, k))
            ctx = context.current()
            fields.update((k, ctx[k]) for k in _CONTEXT_FIELDS if k in ctx)
            self.outbox.send(LogRecord(record.name, record.levelno, record.getMessage(), fields))
        except SupervisorGone:
            return  # nobody reads it: the worker is being stopped
        except Exception:  # noqa: BLE001 - logging must never kill a worker
            self.handleError(record)


def install_pipe_logging(outbox: Outbox, slot: int, level: int) -> None:
    root = logging.getLogger()
    root.handlers[:] = [PipeHandler(outbox, slot)]
    root.setLevel(level)
