"""The protocol over HTTP/REST: the routes, on the server's own HTTP/1.1 (h1.py, httptools, uvloop).

    GET  v2/health/live | v2/health/ready              200 {"live"|"ready": true}; 503 when not ready
    GET  v2                                            server metadata
    GET  v2/models/{m}[/versions/{v}][/ready]          model metadata / readiness
    POST v2/models/{m}[/versions/{v}]/infer            JSON tensors, or the binary tensor extension
    POST v2/repository/index                           the models and their state
    POST v2/repository/models/{m}/load                 hot reload from its file (or "parameters": {"path"})
    GET  metrics                                       Prometheus text

No framework routes it: the paths are few and fixed, and a router's per-request matching
costs more than this whole dispatch (the choice is measured in docs/serve.md). Every route
but inference and reload answers at once, without a task; an inference is one task, which
h1.py cancels when its client disconnects (queued: it never runs). A body past
--max-request-bytes is refused (413) by h1.py before it is buffered whole.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
from collections.abc import Awaitable
from typing import Any

import numpy as np
import orjson

from slabpool.engine.serve import tensors
from slabpool.engine.serve.core import Frontend, InferRequest, InferResponse, Requested, timeout_param
from slabpool.engine.serve.errors import BadRequest, NotFound, ServeError, Status
from slabpool.engine.serve.h1 import Request, Response
from slabpool.engine.serve.metrics import CONTENT_TYPE

HEADER_LENGTH = b"inference-header-content-length"
_OPTS = orjson.OPT_SERIALIZE_NUMPY
_BINARY = b"application/octet-stream"
_METRICS = CONTENT_TYPE.encode()


def refuse(status: int, message: str) -> Response:
    """The protocol's error object."""
    return Response(status, orjson.dumps({"error": message}))


def _error(exc: ServeError) -> Response:
    return refuse(exc.status.http, str(exc))


class HttpApp:
    """h1.py's handler: a request -> its Response, or a coroutine that makes one."""

    def __init__(self, frontend: Frontend) -> None:
        self.fe = frontend

    def __call__(self, req: Request) -> Response | Awaitable[Response]:
        parts = req.path.strip("/").split("/")
        if req.method == "POST" and len(parts) >= 4 and parts[1] == "models" and parts[0] == "v2" \
                and parts[-1] == "infer":
            return self._infer(req, parts)
        try:
            return self._route(req, parts)
        except ServeError as exc:
            return _error(exc)

    def _route(self, req: Request, parts: list[str]) -> Response | Awaitable[Response]:
        fe, method = self.fe, req.method
        if parts == ["metrics"] and method == "GET":
            return Response(200, fe.metrics.render(), _METRICS)
        if parts == ["v2", "health", "live"]:
            return _json_response(Status.OK, {"live": True})
        if parts == ["v2", "health", "ready"]:
            ready = fe.ready()
            return _json_response(Status.OK if ready else Status.UNAVAILABLE, {"ready": ready})
        if parts == ["v2"]:
            return _json_response(Status.OK, fe.server_metadata())
        if len(parts) >= 3 and parts[:2] == ["v2", "models"]:
            name, version, rest = _model_path(parts)
            if rest == []:
                return _json_response(Status.OK, fe.model_metadata(name, version))
            if rest == ["ready"]:
                ready = fe.model_ready(name, version)
                return _json_response(Status.OK if ready else Status.UNAVAILABLE, {"name": name, "ready": ready})
        if method == "POST" and parts[:2] == ["v2", "repository"]:
            return self._repository(parts[2:], req.body)
        raise NotFound(f"no route {method} /{'/'.join(parts)}")

    def _repository(self, parts: list[str], body: bytes) -> Response | Awaitable[Response]:
        fe = self.fe
        head = _json(body) if body else {}
        if parts == ["index"]:
            return _json_response(Status.OK, fe.repository_index(_flag(head, "ready", "the index request")))
        if len(parts) == 3 and parts[0] == "models" and parts[2] == "load":
            return self._load(parts[1], _params(head.get("parameters"), "the load request"))
        if len(parts) == 3 and parts[0] == "models" and parts[2] == "unload":
            fe.unload(parts[1])
        raise NotFound(f"no route POST /v2/repository/{'/'.join(parts)}")

    async def _load(self, name: str, params: dict[str, Any]) -> Response:
        try:
            version = await self.fe.load(name, params)
        except ServeError as exc:
            return _error(exc)
        return _json_response(Status.OK, {"name": name, "version": version})

    # -- inference ------------------------------------------------------------------------------

    async def _infer(self, r: Request, parts: list[str]) -> Response:
        name, version, _ = _model_path(parts[:-1])
        fe, request_id = self.fe, ""
        try:
            req = decode_request(name, version, r.body, r.headers.get(HEADER_LENGTH))
            request_id = req.id
            payload, header_len = encode_response(await fe.infer(req))
        except ServeError as exc:
            resp = _error(exc)
            resp.after = functools.partial(fe.record, name, "http", exc.status, r.started, request_id)
            return resp
        except asyncio.CancelledError:
            if r.gone:  # the client disconnected: its request was cancelled, nobody reads an answer
                fe.record(name, "http", Status.CANCELLED, r.started, request_id)
            raise
        after = functools.partial(fe.record, name, "http", Status.OK, r.started, request_id)
        if header_len is None:
            return Response(200, payload, after=after)
        return Response(200, payload, _BINARY, [(HEADER_LENGTH, b"%d" % header_len)], after=after)


def _json_response(status: Status, body: Any) -> Response:
    return Response(status.http, orjson.dumps(body))


def _model_path(parts: list[str]) -> tuple[str, str, list[str]]:
    """v2/models/{name}[/versions/{v}]/rest... -> name, version, rest."""
    name, rest = parts[2], parts[3:]
    if len(rest) >= 2 and rest[0] == "versions":
        return name, rest[1], rest[2:]
    return name, "", rest


# -- the JSON and binary request and response --------------------------------------------------------


def _json(data: bytes | memoryview) -> dict[str, Any]:
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(obj).__name__}")
    return obj


def decode_request(name: str, version: str, body: bytes, header_length: bytes | None) -> InferRequest:
    """The JSON header (all of the body, or its first Inference-Header-Content-Length bytes)
    and the binary tensors after it, each read once, straight into numpy."""
    view = memoryview(body)
    if header_length is None:
        head, blob = _json(view), view[len(view):]
    else:
        if not header_length.isdigit():  # ASCII digits only (int() also takes "1_0", " 10", "+10")
            raise BadRequest(f"Inference-Header-Content-Length must be a non-negative integer in digits, "
                             f"got {header_length!r}")
        n = int(header_length)
        if not 0 <= n <= len(view):
            raise BadRequest(f"Inference-Header-Content-Length is {n} but the body holds {len(view)} bytes")
        head, blob = _json(view[:n]), view[n:]
    inputs = head.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise BadRequest("the request needs \"inputs\": a non-empty list of tensors")
    params = _params(head.get("parameters"), "the request")
    feeds: dict[str, Any] = {}
    pos = 0
    for t in inputs:
        tname, datatype, shape = _tensor_head(t)
        if tname in feeds:  # the last would silently win
            raise BadRequest(f"input {tname!r} is given twice; each input once")
        size = _params(t.get("parameters"), f"input {tname!r}").get("binary_data_size")
        if size is not None:
            if type(size) is not int or size < 0 or pos + size > len(blob):
                raise BadRequest(f"input {tname!r}: binary_data_size {size!r} runs past the {len(blob)} bytes "
                                 f"of binary data (at offset {pos})")
            feeds[tname] = tensors.from_buffer(tname, datatype, shape, blob[pos : pos + size])
            pos += size
        elif "data" in t:
            feeds[tname] = tensors.from_list(tname, datatype, shape, t["data"])
        else:
            raise BadRequest(f"input {tname!r} has neither \"data\" nor parameters.binary_data_size")
    if pos != len(blob):
        raise BadRequest(f"{len(blob) - pos} bytes of binary data after the inputs that claim {pos}")
    request_id = head.get("id", "")
    if not isinstance(request_id, str):  # the protocol's id is a string (was: null echoed as "None")
        raise BadRequest(f"\"id\" must be a string, got {request_id!r}")
    return InferRequest(name, version, request_id, feeds, _outputs(head.get("outputs")),
                        _flag(params, "binary_data_output", "the request"), timeout_param(params.get("timeout")))


def _flag(params: dict[str, Any], key: str, whose: str) -> bool:
    """A true/false parameter (was: any value read as Python truth, so "false" meant true)."""
    value = params.get(key, False)
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


def _outputs(outputs: Any) -> list[Requested] | None:
    if outputs is None:
        return None
    if not isinstance(outputs, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str)
                                                for o in outputs):
        raise BadRequest(f"\"outputs\" must be a list of {{\"name\": ...}} objects, got {str(outputs)[:200]}")
    return [Requested(o["name"], _flag(_params(o.get("parameters"), f"output {o['name']!r}"), "binary_data",
                                       f"output {o['name']!r}"))
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
