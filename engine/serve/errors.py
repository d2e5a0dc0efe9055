"""What a request's failure means, once, for both transports: an HTTP status and a gRPC code.

    ServeError(status, message)               raised where the mistake is seen
    ├── BadRequest      400 INVALID_ARGUMENT   the request breaks the protocol or the model's contract
    ├── NotFound        404 NOT_FOUND          no such model (or version, or route)
    ├── NotAllowed      405                    a route asked with a method it does not take (HTTP only)
    ├── TooLarge        413 RESOURCE_EXHAUSTED the request is larger than --max-request-bytes
    └── Unavailable     503 UNAVAILABLE        the queue is full, or the server is draining

    engine errors (slabpool.workers.errors) -> `from_engine`:
        InputContractError                    400 INVALID_ARGUMENT   names the input, expected, got
        QueueFull, EngineClosed, TaskCancelled 503 UNAVAILABLE       retry later / elsewhere (a
                                                                     cancel is the server's: shutting down)
        TaskTimeout, the request's timeout    504 DEADLINE_EXCEEDED
        PoisonTask                            500 INTERNAL           lists each exit code / signal
        SessionRunError, WorkerError, ...     500 INTERNAL

The body on HTTP is the protocol's error object `{"error": message}`; on gRPC, the status and message.
"""

from __future__ import annotations

import enum

from slabpool.workers import errors as E


class Status(enum.Enum):
    """(HTTP status, gRPC status code name)."""

    OK = (200, "OK")
    INVALID_ARGUMENT = (400, "INVALID_ARGUMENT")
    NOT_FOUND = (404, "NOT_FOUND")
    METHOD_NOT_ALLOWED = (405, "UNIMPLEMENTED")  # (HTTP's alone: a gRPC method has no other verb)
    TOO_LARGE = (413, "RESOURCE_EXHAUSTED")
    INTERNAL = (500, "INTERNAL")
    UNAVAILABLE = (503, "UNAVAILABLE")
    DEADLINE_EXCEEDED = (504, "DEADLINE_EXCEEDED")
    CANCELLED = (499, "CANCELLED")  # the client went away; nobody reads the answer

    @property
    def http(self) -> int:
        return self.value[0]

    @property
    def grpc(self) -> str:
        return self.value[1]


class ServeError(Exception):
    status = Status.INTERNAL

    def __init__(self, message: str, status: Status | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status


class BadRequest(ServeError):
    status = Status.INVALID_ARGUMENT


class NotFound(ServeError):
    status = Status.NOT_FOUND


class NotAllowed(ServeError):
    status = Status.METHOD_NOT_ALLOWED

    def __init__(self, message: str, allow: str) -> None:
        super().__init__(message)
        self.allow = allow  # the methods the route takes (the Allow header RFC 9110 asks for)


class TooLarge(ServeError):
    status = Status.TOO_LARGE


class Unavailable(ServeError):
    status = Status.UNAVAILABLE


def from_engine(exc: BaseException) -> ServeError:
    """The protocol's meaning of an error the engine raised for one request."""
    if isinstance(exc, ServeError):
        return exc
    text = str(exc) or type(exc).__name__
    if isinstance(exc, E.InputContractError):
        return BadRequest(text)
    if isinstance(exc, E.QueueFull):
        return Unavailable(f"the queue is full: {text}; retry later")
    if isinstance(exc, E.EngineClosed | E.TaskCancelled):
        return Unavailable(f"the model is not accepting requests: {text}")
    if isinstance(exc, E.TaskTimeout | TimeoutError):
        return ServeError(text, Status.DEADLINE_EXCEEDED)
    if isinstance(exc, E.PoisonTask):
        return ServeError(f"poison request: {text}", Status.INTERNAL)
    return ServeError(f"{type(exc).__name__}: {text}", Status.INTERNAL)
