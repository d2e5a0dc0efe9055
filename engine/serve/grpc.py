"""The protocol over gRPC: `inference.GRPCInferenceService` on grpcio's asyncio server.

The message classes are protoc's (engine/serve/proto, generated from the vendored
grpc_predict_v2.proto); the service's handlers are registered here by name, which is all the
generated `_pb2_grpc` module would do. Inputs come from `raw_input_contents` (np.frombuffer,
no copy) or typed `contents`; outputs go out in `raw_output_contents`, as Triton does and as
tritonclient reads them. The deadline of the call is the request's timeout; a client that
cancels (or whose deadline passes) cancels its engine task.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

from slabpool.engine.serve import tensors
from slabpool.engine.serve.core import Frontend, InferRequest, InferResponse, Requested, timeout_param
from slabpool.engine.serve.errors import BadRequest, ServeError, Status
from slabpool.engine.serve.proto import grpc_predict_v2_pb2, grpc_repository_pb2

pb: Any = grpc_predict_v2_pb2  # protoc builds its classes at import: no names for mypy to see
rp: Any = grpc_repository_pb2  # Triton's repository messages (the protocol's .proto has none)

SERVICE = "inference.GRPCInferenceService"

# typed contents field per datatype (InferTensorContents)
_CONTENTS = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}  # fmt: skip


class GrpcService:
    def __init__(self, frontend: Frontend) -> None:
        self.fe = frontend

    def handler(self) -> grpc.GenericRpcHandler:
        def unary(fn: Any, req: Any, resp: Any) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(
                _parsed(fn, req), request_deserializer=None, response_serializer=resp.SerializeToString)

        return grpc.method_handlers_generic_handler(SERVICE, {
            "ServerLive": unary(self.server_live, pb.ServerLiveRequest, pb.ServerLiveResponse),
            "ServerReady": unary(self.server_ready, pb.ServerReadyRequest, pb.ServerReadyResponse),
            "ModelReady": unary(self.model_ready, pb.ModelReadyRequest, pb.ModelReadyResponse),
            "ServerMetadata": unary(self.server_metadata, pb.ServerMetadataRequest, pb.ServerMetadataResponse),
            "ModelMetadata": unary(self.model_metadata, pb.ModelMetadataRequest, pb.ModelMetadataResponse),
            "ModelInfer": unary(self.model_infer, pb.ModelInferRequest, pb.ModelInferResponse),
            "RepositoryIndex": unary(self.repository_index, rp.RepositoryIndexRequest, rp.RepositoryIndexResponse),
            "RepositoryModelLoad": unary(self.repository_model_load, rp.RepositoryModelLoadRequest,
                                         rp.RepositoryModelLoadResponse),
            "RepositoryModelUnload": unary(self.repository_model_unload, rp.RepositoryModelUnloadRequest,
                                           rp.RepositoryModelUnloadResponse),
        })

    async def server_live(self, request: Any, context: Any) -> Any:
        return pb.ServerLiveResponse(live=self.fe.live())

    async def server_ready(self, request: Any, context: Any) -> Any:
        return pb.ServerReadyResponse(ready=self.fe.ready())

    async def model_ready(self, request: Any, context: Any) -> Any:
        try:
            return pb.ModelReadyResponse(ready=self.fe.model_ready(request.name, request.version))
        except ServeError as exc:
            await _abort(context, exc)

    async def server_metadata(self, request: Any, context: Any) -> Any:
        return pb.ServerMetadataResponse(**self.fe.server_metadata())

    async def model_metadata(self, request: Any, context: Any) -> Any:
        try:
            meta = self.fe.model_metadata(request.name, request.version)
        except ServeError as exc:
            await _abort(context, exc)
        T = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=meta["name"], versions=meta["versions"], platform=meta["platform"],
            inputs=[T(**t) for t in meta["inputs"]], outputs=[T(**t) for t in meta["outputs"]])

    # -- the repository extension: the same calls as HTTP's v2/repository (core.Frontend) --------------

    async def repository_index(self, request: Any, context: Any) -> Any:
        Index = rp.RepositoryIndexResponse.ModelIndex
        return rp.RepositoryIndexResponse(models=[Index(**m) for m in self.fe.repository_index(request.ready)])

    async def repository_model_load(self, request: Any, context: Any) -> Any:
        """A reload without downtime (slot by slot), as HTTP's load: from the model's file, or
        from parameters["path"] (a string_param)."""
        try:
            params = {k: _param(v) for k, v in request.parameters.items()}
            await self.fe.load(request.model_name, params)
        except ServeError as exc:
            await _abort(context, exc)
        return rp.RepositoryModelLoadResponse()

    async def repository_model_unload(self, request: Any, context: Any) -> Any:
        try:
            self.fe.unload(request.model_name)
        except ServeError as exc:
            await _abort(context, exc)
        raise AssertionError("unload() returned")

    async def model_infer(self, request: Any, context: Any) -> Any:
        started = time.perf_counter()
        try:
            req = decode_request(request, context.time_remaining())
            resp = encode_response(await self.fe.infer(req))
        except ServeError as exc:
            self.fe.record(request.model_name, "grpc", exc.status, started, request.id)
            await _abort(context, exc)
        except asyncio.CancelledError:  # the client cancelled, or its deadline passed: grpc ends the call
            self.fe.record(request.model_name, "grpc", Status.CANCELLED, started, request.id)
            raise
        self.fe.record(request.model_name, "grpc", Status.OK, started, request.id)
        return resp


def _parsed(fn: Any, message: Any) -> Any:
    """The handler on the request's raw bytes, parsed here: bytes that are not the message answer
    INVALID_ARGUMENT (grpcio's own deserializer fails them as UNKNOWN, with no word of why)."""

    async def handle(raw: bytes, context: Any) -> Any:
        try:
            request = message.FromString(raw)
        except DecodeError as exc:
            await _abort(context, BadRequest(f"the request is not a {message.DESCRIPTOR.full_name} message: {exc}"))
        return await fn(request, context)

    return handle


async def _abort(context: Any, exc: ServeError) -> NoReturn:
    await context.abort(getattr(grpc.StatusCode, exc.status.grpc), str(exc))
    raise AssertionError("grpc's abort() returned")  # it raises, to end the call


def _param(p: Any) -> Any:
    which = p.WhichOneof("parameter_choice")
    return None if which is None else getattr(p, which)


def decode_request(request: Any, remaining: float | None) -> InferRequest:
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise BadRequest(f"raw_input_contents holds {len(raw)} tensors for {len(request.inputs)} inputs")
    feeds: dict[str, Any] = {}
    for i, t in enumerate(request.inputs):
        shape = tensors.check_shape(t.name, list(t.shape))
        if t.name in feeds:  # the last would silently win
            raise BadRequest(f"input {t.name!r} is given twice; each input once")
        given = [f.name for f, _ in t.contents.ListFields()]  # the typed fields that hold elements
        if raw:
            if given:  # one of the two would be silently dropped
                raise BadRequest(f"input {t.name!r} has both raw_input_contents and contents.{given[0]}; "
                                 f"its elements go in one of them")
            feeds[t.name] = tensors.from_buffer(t.name, t.datatype, shape, raw[i])
        else:
            field = _CONTENTS.get(t.datatype)
            if field is None:
                raise BadRequest(f"input {t.name!r}: datatype {t.datatype!r} has no typed contents field; "
                                 f"expected one of {sorted(_CONTENTS)} (or send raw_input_contents)")
            other = [f for f in given if f != field]
            if other:
                raise BadRequest(f"input {t.name!r}: {t.datatype} takes its elements in contents.{field}, "
                                 f"got contents.{other[0]}")
            feeds[t.name] = tensors.from_list(t.name, t.datatype, shape, list(getattr(t.contents, field)))
    if not feeds:
        raise BadRequest("the request needs inputs")
    params = {k: _param(v) for k, v in request.parameters.items()}
    outputs = [Requested(o.name, True) for o in request.outputs] or None
    timeout = remaining
    asked = timeout_param(params.get("timeout"))
    if asked is not None:  # tritonclient's `timeout` parameter; the tighter of it and the deadline wins
        timeout = min(asked, timeout) if timeout is not None else asked
    return InferRequest(request.model_name, request.model_version, request.id, feeds, outputs, True, timeout)


def encode_response(resp: InferResponse) -> Any:
    out = pb.ModelInferResponse(model_name=resp.model, model_version=resp.version, id=resp.id)
    for o in resp.outputs:
        out.outputs.add(name=o.name, datatype=o.datatype, shape=o.shape)
    out.raw_output_contents.extend([tensors.to_bytes(o.array) for o in resp.outputs])
    return out
