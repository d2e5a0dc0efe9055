"""The protocol over HTTP/REST: a plain ASGI app, served by uvicorn with httptools and uvloop.

    GET  v2/health/live | v2/health/ready              200 {"live"|"ready": true}; 503 when not ready
    GET  v2                                            server metadata
    GET  v2/models/{m}[/versions/{v}][/ready]          model metadata / readiness
    POST v2/models/{m}[/versions/{v}]/infer            JSON tensors, or the binary tensor extension
    POST v2/repository/index                           the models and their state
    POST v2/repository/models/{m}/load                 hot reload from its file (or "parameters": {"path"})
    GET  metrics                                       Prometheus text

No framework routes it: the paths are few and fixed, and a router's per-request matching
costs more than this whole dispatch (the choice is measured in docs/serve.md). uvicorn owns
HTTP/1.1 itself (keep-alive, pipelining, 100-continue, HEAD, chunked bodies, flow control,
timeouts). Health and metadata answer without reading a body. While an inference waits, a
client that disconnects cancels its request (queued: it never runs): serve's protocol
(uvproto.py) calls back when the connection is lost.
A body past --max-request-bytes is refused (413) by its Content-Length before it is read, or as
soon as a chunked body passes the limit: never buffered whole. A route that raises answers 500
with the protocol's error object and the connection lives on (uvicorn's own 500 closes it).
Accounting runs once the answer is handed to uvicorn, off the request's latency.

Inference offers serve's protocol an eager route (`HttpApp.eager`): a request that came whole
in one read runs in that read's callback, with no ASGI task and no turn of the event loop
before it, and its answer is written by the protocol (uvproto.py, eager.py); on an idle engine
it is answered before the callback returns. Every other request, and an inference whose body
is still coming, goes through `__call__` as before: the same `_infer`, answered through send.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import numpy as np
import orjson

from slabpool.engine.serve import eager, tensors
from slabpool.engine.serve.core import Frontend, InferRequest, InferResponse, Requested, timeout_param
from slabpool.engine.serve.errors import BadRequest, NotAllowed, NotFound, ServeError, Status, TooLarge
from slabpool.engine.serve.metrics import CONTENT_TYPE
from slabpool.engine.serve.uvproto import DISCONNECT, Handler, Headers, Respond

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

log = logging.getLogger("slabpool.engine.serve")
HEADER_LENGTH = b"inference-header-content-length"
_OPTS = orjson.OPT_SERIALIZE_NUMPY
_JSON = b"application/json"
# a draining server's answers close their connection (was: kept, and a keep-alive client sent its next request on it)
_CLOSE = ((b"connection", b"close"),)
_BINARY = b"application/octet-stream"
_METRICS = CONTENT_TYPE.encode()


class HttpApp:
    def __init__(self, frontend: Frontend, max_request_bytes: int) -> None:
        self.fe = frontend
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan: nothing to start, the engines are up already
            if scope["type"] == "lifespan":
                await _lifespan(receive, send)
            return
        parts = scope["path"].strip("/").split("/")
        method = scope["method"]
        if method == "POST" and _is_infer(parts):
            await self._infer(scope, parts, lambda: _body(scope, receive, self.max_request_bytes), _asgi(send))
            return
        ctype = _JSON
        extra: tuple[tuple[bytes, bytes], ...] = ()  # headers beyond the two every answer has
        try:
            if parts[:2] == ["v2", "repository"] or (len(parts) >= 4 and parts[:2] == ["v2", "models"]
                                                    and parts[-1] == "infer"):
                if method != "POST":
                    raise NotAllowed(f"{method} /{'/'.join(parts)}: this route takes POST", "POST")
                status, body = await self._repository(parts[2:], await _body(scope, receive, self.max_request_bytes))
            elif method not in ("GET", "HEAD"):  # (HEAD: uvicorn sends the head alone)
                self._route("GET", parts)  # an unknown path is 404 whatever the method
                raise NotAllowed(f"{method} /{'/'.join(parts)}: this route takes GET (or HEAD)", "GET, HEAD")
            else:
                status, body, ctype = self._route(method, parts)
        except NotAllowed as exc:
            status, body, extra = exc.status, {"error": str(exc)}, ((b"allow", exc.allow.encode()),)
        except ServeError as exc:
            status, body = exc.status, {"error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - a bug in a route answers 500; the connection lives on
            status, body = _internal(exc)
        if status is Status.CANCELLED:
            return
        await _send(send, status.http, body if isinstance(body, bytes) else orjson.dumps(body), ctype, *extra)

    def eager(self, scope: Scope) -> Handler | None:
        """The inference route, for serve's protocol to start at once when a request comes
        whole in one read (uvproto.py: no ASGI task, no turn of the loop before it runs; its
        answer in the protocol's one write); None for every other route."""
        if scope["method"] != "POST" or self.fe.inflight:  # under load: a turn of the loop gathers them
            return None
        parts = scope["path"].strip("/").split("/")
        if not _is_infer(parts):
            return None
        limit = self.max_request_bytes
        return lambda body, respond: self._infer(scope, parts, lambda: _whole(body, limit), respond)

    def _route(self, method: str, parts: list[str]) -> tuple[Status, Any, bytes]:
        """Every route but inference and the repository (GET): answered from memory, no body read."""
        fe = self.fe
        if parts == ["metrics"]:
            return Status.OK, fe.metrics.render(), _METRICS
        if parts == ["v2", "health", "live"]:
            live = fe.live()
            return (Status.OK, b'{"live":true}', _JSON) if live else (Status.UNAVAILABLE, {"live": False}, _JSON)
        if parts == ["v2", "health", "ready"]:
            ready = fe.ready()
            return (Status.OK, b'{"ready":true}', _JSON) if ready else (Status.UNAVAILABLE, {"ready": False}, _JSON)
        if parts == ["v2"]:
            return Status.OK, fe.server_metadata(), _JSON
        if len(parts) >= 3 and parts[:2] == ["v2", "models"]:
            name, version, rest = _model_path(parts)
            if rest == []:
                return Status.OK, fe.model_metadata(name, version), _JSON
            if rest == ["ready"]:
                ready = fe.model_ready(name, version)
                return (Status.OK if ready else Status.UNAVAILABLE), {"name": name, "ready": ready}, _JSON
        raise NotFound(f"no route {method} /{'/'.join(parts)}")

    async def _repository(self, parts: list[str], body: bytes) -> tuple[Status, Any]:
        fe = self.fe
        head = tensors.json_object(body) if body else {}
        if parts == ["index"]:
            return Status.OK, fe.repository_index(_flag(head, "ready", "the index request"))
        if len(parts) == 3 and parts[0] == "models" and parts[2] == "load":
            version = await fe.load(parts[1], _params(head.get("parameters"), "the load request"))
            return Status.OK, {"name": parts[1], "version": version}
        if len(parts) == 3 and parts[0] == "models" and parts[2] == "unload":
            fe.unload(parts[1])
        raise NotFound(f"no route POST /v2/repository/{'/'.join(parts)}")

    # -- inference ------------------------------------------------------------------------------

    async def _infer(self, scope: Scope, parts: list[str], body_of: Callable[[], Awaitable[bytes]],
                     respond: Respond) -> None:
        """One inference: its body read (`body_of`), decoded, run, encoded, answered
        (`respond`: through ASGI's send, or serve's protocol at once), and counted."""
        started = time.perf_counter()
        name, version, rest = _model_path(parts[:-1])
        fe, request_id = self.fe, ""
        try:
            if rest:  # v2/models/{m}[/versions/{v}]/infer and nothing between
                raise NotFound(f"no route POST /{'/'.join(parts)}")
            fe.repo[name].check_version(version)  # 404 before the body is read
            body = await body_of()
            req = decode_request(name, version, body, _header(scope, HEADER_LENGTH))
            request_id = req.id
            resp = await _watching(scope, fe.infer(req))
            payload, header_len = encode_response(resp)
        except ServeError as exc:
            if exc.status is not Status.CANCELLED:
                err = orjson.dumps({"error": str(exc)})
                await respond(exc.status.http, err, _headers(err, _JSON, closing=fe.draining))
            fe.record(name, "http", exc.status, started, request_id)
            return
        except Exception as exc:  # noqa: BLE001 - a bug answers 500; the connection lives on
            status, why = _internal(exc)
            err = orjson.dumps(why)
            await respond(status.http, err, _headers(err, _JSON, closing=fe.draining))
            fe.record(name, "http", status, started, request_id)
            return
        extra = () if header_len is None else ((HEADER_LENGTH, b"%d" % header_len),)
        await respond(200, payload, _headers(payload, _BINARY if extra else _JSON, *extra, closing=fe.draining))
        fe.record(name, "http", Status.OK, started, request_id)


def _internal(exc: Exception) -> tuple[Status, dict[str, str]]:
    log.error("slabpool serve: a route raised; answered 500", exc_info=exc)
    return Status.INTERNAL, {"error": f"internal error: {exc!r}"}


def _is_infer(parts: list[str]) -> bool:
    return len(parts) >= 4 and parts[1] == "models" and parts[0] == "v2" and parts[-1] == "infer"


def _headers(body: bytes, ctype: bytes, *extra: tuple[bytes, bytes], closing: bool = False) -> Headers:
    return [(b"content-type", ctype), (b"content-length", b"%d" % len(body)), *extra, *(_CLOSE if closing else ())]


def _asgi(send: Send) -> Respond:
    async def respond(status: int, body: bytes, headers: Headers) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return respond


async def _watching(scope: Scope, work: Awaitable[InferResponse]) -> InferResponse:
    """Await `work` in this task; if the client disconnects meanwhile, this task is cancelled,
    and so the request's engine task (queued: it never runs). The protocol says so at once
    (uvproto.DISCONNECT, a callback: no watcher task, no timer); under a server that does not
    offer the extension a disconnect goes unnoticed until the answer is written. Started at
    once by the protocol, "this task" is the one the request goes on in if it waits (eager.py)."""
    on_lost = scope.get("extensions", {}).get(DISCONNECT)
    if on_lost is None:
        return await work
    me = eager.current()
    assert me is not None
    gone = False

    def lost() -> None:
        nonlocal gone
        gone = True
        me.cancel()

    on_lost.append(lost)
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise
        me.uncancel()
        raise ServeError("the client disconnected; its request was cancelled", Status.CANCELLED) from None
    finally:
        on_lost.remove(lost)


def _model_path(parts: list[str]) -> tuple[str, str, list[str]]:
    """v2/models/{name}[/versions/{v}]/rest... -> name, version, rest."""
    name, rest = parts[2], parts[3:]
    if len(rest) >= 2 and rest[0] == "versions":
        return name, rest[1], rest[2:]
    return name, "", rest


def _header(scope: Scope, key: bytes) -> bytes | None:
    for k, v in scope["headers"]:
        if k == key:
            return bytes(v)
    return None


async def _body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole body, refused (413) past the limit: by its Content-Length before a byte is
    read, and while it streams, since a chunked body has no length up front."""
    declared = _header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(f"its Content-Length is {int(declared)} bytes", limit)
    msg = await receive()
    if msg["type"] == "http.disconnect":  # gone before its body came: no body, not an empty one
        raise ServeError("the client disconnected before its request was read", Status.CANCELLED)
    body = msg.get("body", b"")
    if not msg.get("more_body"):
        if len(body) > limit:
            raise _too_large(f"it holds {len(body)} bytes", limit)
        return bytes(body)
    chunks, size = [body], len(body)
    while msg.get("more_body"):
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ServeError("the client disconnected before its request was read", Status.CANCELLED)
        chunks.append(msg.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            raise _too_large(f"{size} bytes of it were read", limit)
    return b"".join(chunks)


async def _whole(body: bytes, limit: int) -> bytes:
    """A body that came whole (a request started at once), refused past the limit as `_body`
    refuses one it reads."""
    if len(body) > limit:
        raise _too_large(f"it holds {len(body)} bytes", limit)
    return body


def _too_large(got: str, limit: int) -> TooLarge:
    return TooLarge(f"the request body is too large: {got}; the limit is {limit} bytes (--max-request-bytes)")


async def _send(send: Send, status: int, body: bytes, ctype: bytes, *extra: tuple[bytes, bytes]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": _headers(body, ctype, *extra)})
    await send({"type": "http.response.body", "body": body})


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


# -- the JSON and binary request and response --------------------------------------------------------


class _Plan(NamedTuple):
    """A binary request's JSON header, read and checked once: what it says, for the next
    request that sends the same header bytes (a client sends the same header for the same
    shapes, so a steady client's header is read once)."""

    inputs: tuple[tuple[str, str, tuple[int, ...], int], ...]  # name, datatype, shape, binary_data_size
    id: str
    outputs: tuple[Requested, ...] | None
    binary: bool
    timeout: float | None


_PLANS: dict[tuple[str, str, bytes], _Plan] = {}
_MAX_PLANS = 256  # headers kept (a client that sends many shapes refills it)


def decode_request(name: str, version: str, body: bytes, header_length: bytes | None) -> InferRequest:
    """The JSON header (all of the body, or its first Inference-Header-Content-Length bytes)
    and the binary tensors after it, each read once, straight into numpy. A header whose
    inputs are all binary is kept (`_Plan`): the same header bytes again are not parsed or
    checked again, only the tensors are read (each still checked against its size)."""
    view = memoryview(body)
    if header_length is None:
        return _decode(name, version, tensors.json_object(view), view[len(view):])[0]
    if not header_length.isdigit():  # ASCII digits only (int() also takes "1_0", " 10", "+10")
        raise BadRequest(f"Inference-Header-Content-Length must be a non-negative integer in digits, "
                         f"got {header_length!r}")
    n = int(header_length)
    if not 0 <= n <= len(view):
        raise BadRequest(f"Inference-Header-Content-Length is {n} but the body holds {len(view)} bytes")
    key = (name, version, bytes(view[:n]))
    plan = _PLANS.get(key)
    if plan is not None:
        return _planned(name, version, plan, view[n:])
    req, plan = _decode(name, version, tensors.json_object(view[:n]), view[n:])
    if plan is not None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    return req


def _planned(name: str, version: str, plan: _Plan, blob: memoryview) -> InferRequest:
    feeds: dict[str, Any] = {}
    pos = 0
    for tname, datatype, shape, size in plan.inputs:
        feeds[tname] = _from_blob(tname, datatype, shape, size, blob, pos)
        pos += size
    _all_read(blob, pos)
    return InferRequest(name, version, plan.id, feeds, None if plan.outputs is None else list(plan.outputs),
                        plan.binary, plan.timeout)


def _decode(name: str, version: str, head: dict[str, Any], blob: memoryview) -> tuple[InferRequest, _Plan | None]:
    """The request, and its plan when every input is binary and none BYTES (what is kept)."""
    inputs = head.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise BadRequest("the request needs \"inputs\": a non-empty list of tensors")
    params = _params(head.get("parameters"), "the request")
    feeds: dict[str, Any] = {}
    read: list[tuple[str, str, tuple[int, ...], int]] = []  # the binary inputs, as a plan keeps them
    pos = 0
    for t in inputs:
        tname, datatype, shape = _tensor_head(t)
        if tname in feeds:  # the last would silently win
            raise BadRequest(f"input {tname!r} is given twice; each input once")
        size = _params(t.get("parameters"), f"input {tname!r}").get("binary_data_size")
        if size is not None:
            if "data" in t:  # one of them would be silently dropped
                raise BadRequest(f"input {tname!r} has both \"data\" and parameters.binary_data_size; "
                                 f"its elements go in one of them")
            if type(size) is not int or size < 0:
                raise BadRequest(f"input {tname!r}: parameters.binary_data_size must be a byte count "
                                 f"(an integer >= 0), got {size!r}")
            feeds[tname] = _from_blob(tname, datatype, shape, size, blob, pos)
            read.append((tname, datatype, shape, size))
            pos += size
        elif "data" in t:
            feeds[tname] = tensors.from_list(tname, datatype, shape, t["data"])
        else:
            raise BadRequest(f"input {tname!r} has neither \"data\" nor parameters.binary_data_size")
    _all_read(blob, pos)
    request_id = head.get("id", "")
    if not isinstance(request_id, str):  # the protocol's id is a string (was: null echoed as "None")
        raise BadRequest(f"\"id\" must be a string, got {request_id!r}")
    binary = _flag(params, "binary_data_output", "the request")
    outputs = _outputs(head.get("outputs"), binary)
    timeout = timeout_param(params.get("timeout"))
    req = InferRequest(name, version, request_id, feeds, outputs, binary, timeout)
    if len(read) < len(inputs) or any(r[1] == tensors.BYTES for r in read):
        return req, None
    return req, _Plan(tuple(read), request_id, None if outputs is None else tuple(outputs), binary, timeout)


def _from_blob(tname: str, datatype: str, shape: tuple[int, ...], size: int, blob: memoryview, pos: int) -> Any:
    if pos + size > len(blob):
        raise BadRequest(f"input {tname!r}: binary_data_size {size} runs past the {len(blob)} bytes "
                         f"of binary data (at offset {pos})")
    return tensors.from_buffer(tname, datatype, shape, blob[pos : pos + size])


def _all_read(blob: memoryview, pos: int) -> None:
    if pos != len(blob):
        raise BadRequest(f"{len(blob) - pos} bytes of binary data after the inputs that claim {pos}")


def _flag(params: dict[str, Any], key: str, whose: str, default: bool = False) -> bool:
    """A true/false parameter (was: any value read as Python truth, so "false" meant true)."""
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise BadRequest(f"{whose}: parameters.{key} must be true or false, got {value!r}")
    return value


def _tensor_head(t: Any) -> tuple[str, str, tuple[int, ...]]:
    if not isinstance(t, dict) or not isinstance(t.get("name"), str):
        raise BadRequest(f"each input needs a \"name\", \"shape\" and \"datatype\"; got {str(t)[:200]}")
    name = t["name"]
    datatype = t.get("datatype")
    if not isinstance(datatype, str):
        raise BadRequest(f"input {name!r} needs a \"datatype\" (FP32, INT64, BYTES, ...), got {datatype!r}")
    return name, datatype, tensors.check_shape(name, t.get("shape"))


def _params(p: Any, whose: str) -> dict[str, Any]:
    if p is None:
        return {}
    if not isinstance(p, dict):
        raise BadRequest(f"{whose}: \"parameters\" must be an object, got {p!r}")
    return p


def _outputs(outputs: Any, binary: bool) -> list[Requested] | None:
    """The outputs asked for, each binary as its own parameters.binary_data says, else as the
    request's binary_data_output (`binary`) says (the binary extension: "unless overridden")."""
    if outputs is None:
        return None
    if not isinstance(outputs, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str)
                                                for o in outputs):
        raise BadRequest(f"\"outputs\" must be a list of {{\"name\": ...}} objects, got {str(outputs)[:200]}")
    if not outputs:
        return None  # (none named: every output, as gRPC reads an empty list; was: none at all)
    return [Requested(o["name"], _flag(_params(o.get("parameters"), f"output {o['name']!r}"), "binary_data",
                                       f"output {o['name']!r}", binary))
            for o in outputs]


def encode_response(resp: InferResponse) -> tuple[bytes, int | None]:
    """The response once: JSON `data` for outputs asked as JSON, raw bytes after the JSON header
    (binary tensor extension) for the others; the header's length when there are any."""
    outs, blobs = [], []
    for o in resp.outputs:
        tensor: dict[str, Any] = {"name": o.name, "datatype": o.datatype, "shape": o.shape}
        if o.binary:
            raw = tensors.to_bytes(o.array)
            tensor["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            tensor["data"] = _json_data(o.name, o.array)
        outs.append(tensor)
    answer: dict[str, Any] = {"model_name": resp.model, "model_version": resp.version}
    if resp.id:  # echoed when the request had one, as Triton does
        answer["id"] = resp.id
    answer["outputs"] = outs
    head = orjson.dumps(answer, option=_OPTS, default=_tolist)
    if not blobs:
        return head, None
    return b"".join((head, *blobs)), len(head)


def _json_data(name: str, arr: Any) -> Any:
    """An output's JSON `data`. NaN and infinities have no JSON number: they go out as the tokens
    NaN, Infinity and -Infinity, as Python's json (and so tritonclient) writes and reads them
    (orjson would write null, which reads back as no number at all)."""
    if arr.dtype.kind == "f":
        if arr.size <= _SMALL:  # a Python list: its sum says at C speed whether all are finite
            flat = arr.reshape(-1).tolist()
            return flat if math.isfinite(sum(flat)) else orjson.Fragment(json.dumps(flat))
        if not np.isfinite(arr).all():
            return orjson.Fragment(json.dumps(arr.reshape(-1).tolist()))
    return tensors.to_list(name, arr)


_SMALL = 4096  # elements: below this a list is quicker than a numpy reduction and orjson's numpy path


def _tolist(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} does not go into JSON")
