"""The server's one inference path, shared by HTTP and gRPC: a transport decodes a request into
an `InferRequest`, `Frontend.infer` runs it on the model's engine, the transport encodes the
`InferResponse`.

    transport (http.py / grpc.py)          Frontend                         Engine (one per model)
    decode once -> InferRequest  ----->    draining? -> 503
                                           model, version -> 404
                                           outputs asked exist? -> 400
                                           submit_async(inputs, deadline) ---> contract (400), queue
                                             under the request's timeout       (503 when full), run,
                                             (504); client gone: cancelled     replay on a crash
    encode once <- InferResponse  <----    outputs selected, as arrays, <---- outputs, the version
                                           with that version                   that computed them

Health is read here too: live while the process answers and no model's engine has stopped for
good; ready while not draining and every model has a slot that can serve (engine/serve/models.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import orjson

from slabpool.engine.serve import tensors
from slabpool.engine.serve.errors import BadRequest, ServeError, Status, Unavailable, from_engine
from slabpool.engine.serve.metrics import RequestMetrics
from slabpool.engine.serve.models import Repository, Served

access_log = logging.getLogger("slabpool.engine.serve.access")


class Requested(NamedTuple):
    """An output the client asked for, and whether it wants it as raw bytes (binary extension).
    (Immutable: a kept binary header's outputs are shared by its requests, http._Plan.)"""

    name: str
    binary: bool


@dataclass
class InferRequest:
    model: str
    version: str
    id: str
    inputs: dict[str, Any]
    outputs: list[Requested] | None  # None: every output
    binary_outputs: bool  # the default for outputs not listed (binary_data_output)
    timeout: float | None  # seconds: the request's `timeout` parameter or the gRPC deadline


@dataclass
class OutputTensor:
    name: str
    datatype: str
    shape: list[int]
    array: np.ndarray[Any, Any]
    binary: bool


@dataclass
class InferResponse:
    model: str
    version: str
    id: str
    outputs: list[OutputTensor]


class Frontend:
    """What both transports serve: health, metadata, inference, drain, accounting."""

    def __init__(self, repo: Repository, metrics: RequestMetrics, *, log_access: bool = False) -> None:
        self.repo = repo
        self.metrics = metrics
        self.log_access = log_access
        self.draining = False
        self.drained_by = "SIGTERM"  # what began the drain (the signal's name), for the 503's words
        self.hurried_by = ""  # the second signal that cut the drain short, if one did
        self.inflight = 0
        self._idle: asyncio.Event | None = None
        self._names = frozenset(repo)  # the models are fixed at start (a reload keeps the name)

    # -- health and metadata --------------------------------------------------------------------

    def ready(self) -> bool:
        return not self.draining and self.repo.ready()

    def live(self) -> bool:
        """False once a model's engine has stopped for good while the server is not stopping it
        (a slot that failed to start again and again, docs/faults.md): nothing brings it back,
        not even a reload, so the process should be restarted (a liveness probe's 503 tells
        Kubernetes so). Was: live while every inference answered 500, for ever."""
        return self.draining or self.repo.alive()

    def model_ready(self, name: str, version: str = "") -> bool:
        served = self.repo[name]
        served.check_version(version)
        return not self.draining and served.ready()

    def model_metadata(self, name: str, version: str = "") -> dict[str, Any]:
        served = self.repo[name]
        served.check_version(version)
        return served.metadata()

    def server_metadata(self) -> dict[str, Any]:
        from slabpool import __version__

        return {"name": "slabpool", "version": __version__, "extensions": list(EXTENSIONS)}

    # -- the repository extension (both transports) -----------------------------------------------

    def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        out = []
        for name, m in self.repo.items():
            ready = m.ready()
            if ready or not ready_only:
                out.append({"name": name, "version": m.version, "state": "READY" if ready else "UNAVAILABLE"})
        return out

    async def load(self, name: str, params: dict[str, Any]) -> str:
        """Reload `name` without downtime (slot by slot, Engine.reload), from its file or from
        params["path"]; the new version. Triton's other load parameters ("config", "file:...")
        are not taken: refused by name, never ignored."""
        served = self.repo[name]
        other = sorted(k for k in params if k != "path")
        if other:
            raise BadRequest(f"load of {name!r}: parameters {other} are not supported; the only one is \"path\" "
                             "(a model file the server can read)")
        path = params.get("path")
        if path is not None and (not isinstance(path, str) or not path):  # ("": was the old file, silently)
            raise BadRequest(f"parameters.path must be a model file's path, got {path!r}")
        from slabpool import EngineClosed, SessionInitError, SignatureChanged

        try:
            return str(await served.reload(path))
        except SignatureChanged as exc:
            raise BadRequest(f"reload of {name!r} refused: {exc.change}; a served model keeps its inputs and "
                             "outputs (its clients are written against them): serve the new one under a name "
                             "of its own; the old model keeps serving") from None
        except (FileNotFoundError, ValueError) as exc:
            raise BadRequest(f"reload of {name!r} refused: {exc}; the old model keeps serving") from None
        except SessionInitError as exc:
            raise ServeError(f"reload of {name!r} failed: {exc}; the old model keeps serving") from None
        except EngineClosed as exc:  # (the server stops: SIGTERM during a reload whose worker never started)
            raise Unavailable(f"reload of {name!r} ended: {exc}") from None

    def unload(self, name: str) -> None:
        self.repo[name]  # an unknown model is 404 / NOT_FOUND
        raise BadRequest("unload is not supported: every model is served from start to shutdown")

    # -- inference ------------------------------------------------------------------------------

    async def infer(self, req: InferRequest) -> InferResponse:
        """One request on its model's engine: checked, run under its timeout, its outputs
        selected, answered with the version that computed them. Engine.submit_async is awaited
        here, not in a helper coroutine: each level is a frame to enter and leave on the
        request's path (docs/serve.md)."""
        if self.draining:
            raise Unavailable(f"the server is draining ({self.drained_by}): it accepts no new request")
        served = self.repo[req.model]
        served.check_version(req.version)
        if req.outputs is not None:
            _check_outputs(served, req.outputs)
        eng = served.engine
        self.inflight += 1
        try:
            if req.timeout is None:
                done = await eng.submit_async(req.inputs)
            else:
                if asyncio.current_task() is None:  # started at once by serve's protocol (eager.py):
                    await asyncio.sleep(0)  # a timeout needs a Task, which this bare yield moves to
                async with asyncio.timeout(req.timeout):  # the engine's deadline covers the queue, this the rest
                    done = await eng.submit_async(req.inputs, deadline=req.timeout, block_timeout=req.timeout)
        except TimeoutError as exc:  # asyncio's, or the engine's TaskTimeout (a deadline, --task-timeout)
            why = str(exc) or f"the request's timeout ({(req.timeout or 0) * 1e6:.0f} us) passed"
            raise ServeError(why, Status.DEADLINE_EXCEEDED) from None
        except Exception as exc:  # noqa: BLE001 - any failure of one request is its answer, not the server's
            raise _in_protocol_words(served, req, from_engine(exc)) from None
        finally:
            self.inflight -= 1
            if self._idle is not None and not self.inflight:
                self._idle.set()
        # the version that computed these outputs (during a reload the slots run two: the
        # engine's own model_version may already name the other)
        return InferResponse(req.model, done.model_version, req.id, _select(done.outputs, req))

    async def wait_idle(self, timeout: float) -> bool:
        """Draining: True once every accepted request has been answered, False at `timeout`."""
        self._idle = asyncio.Event()
        if not self.inflight:
            return True
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    # -- accounting -----------------------------------------------------------------------------

    def record(self, model: str, transport: str, status: Status, started: float, request_id: str = "") -> None:
        """One answered request: its counters, its latency, its access log line (if on)."""
        seconds = time.perf_counter() - started
        if model not in self._names:  # a label per name a client made up would grow without bound
            model = ""
        code = _HTTP_CODES[status] if transport == "http" else status.grpc
        self.metrics.observe(model, transport, code, seconds)
        if self.log_access:
            access_log.info(orjson.dumps({
                "ts": round(time.time(), 6), "transport": transport, "model": model, "code": code,
                "ms": round(seconds * 1e3, 3), "id": request_id,
            }).decode())


def _in_protocol_words(served: Served, req: InferRequest, err: ServeError) -> ServeError:
    """The engine's contract error for a BYTES tensor (a list of strings, the engine's view) sent
    to a model input of another datatype, said as the request said it (was: "expected a
    numpy.ndarray of <f4, got list"). With a preprocess the request's inputs are the hook's."""
    if err.status is not Status.INVALID_ARGUMENT or served.engine.config.preprocess is not None:
        return err
    wanted = {t["name"]: t["datatype"] for t in served.metadata()["inputs"]}  # (the error path only)
    for name, value in req.inputs.items():
        want = wanted.get(name)
        if isinstance(value, list) and want is not None and want != tensors.BYTES:
            return BadRequest(f"input {name!r}: the model takes {want}, got BYTES; nothing is cast silently")
    return err


def timeout_param(us: Any) -> float | None:
    """The `timeout` parameter, in microseconds as tritonclient sends it (both
    transports); 0 or absent: none."""
    if us is None or us == 0:
        return None
    if isinstance(us, bool) or not isinstance(us, int | float) or not us >= 0:  # (NaN too: not >= 0)
        raise BadRequest(f"parameters.timeout must be microseconds >= 0, got {us!r}")
    return float(us) / 1e6


EXTENSIONS = ("binary_tensor_data", "model_repository", "parameters")
_HTTP_CODES = {s: str(s.http) for s in Status}


def _check_outputs(served: Served, outputs: list[Requested]) -> None:
    """Outputs asked for that the model does not have: 400 before anything runs (a postprocess
    may return other names: then they are checked against what it returned). A name asked for
    twice is 400 too (was: answered twice)."""
    names = [r.name for r in outputs]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise BadRequest(f"output(s) {twice} requested more than once; name each output once")
    if served.engine.config.postprocess is not None:
        return
    known = [s.name for s in served.engine.describe().outputs]
    for r in outputs:
        if r.name not in known:
            raise BadRequest(f"unknown output {r.name!r} requested; model {served.name!r} has outputs {known}")


def _select(outputs: Any, req: InferRequest) -> list[OutputTensor]:
    if not isinstance(outputs, dict):
        raise ServeError(f"the postprocess returned a {type(outputs).__name__}; the server needs a dict "
                         "name -> array", Status.INTERNAL)
    wanted = req.outputs if req.outputs is not None else [Requested(n, req.binary_outputs) for n in outputs]
    chosen = []
    for r in wanted:
        if r.name not in outputs:
            raise BadRequest(f"unknown output {r.name!r} requested; the outputs are {list(outputs)}")
        try:
            arr = tensors.as_output(r.name, outputs[r.name])
        except TypeError as exc:
            raise ServeError(str(exc), Status.INTERNAL) from None
        chosen.append(OutputTensor(r.name, tensors.datatype_of(arr.dtype), list(arr.shape), arr, r.binary))
    return chosen
