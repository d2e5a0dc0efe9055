"""The committed gRPC message code is what protoc makes of the vendored .proto, and it lives
in a private descriptor pool (tritonclient.grpc registers the same names in the default one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slabpool.engine.serve.proto import generate


def test_the_committed_stubs_are_regenerated_identically(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    for made in generate.generate(tmp_path):
        assert made.read_text() == (generate.HERE / made.name).read_text(), (
            f"{made.name} is stale: run python -m slabpool.engine.serve.proto.generate")


def test_the_server_and_tritonclient_messages_live_side_by_side() -> None:
    from tritonclient.grpc import service_pb2

    from slabpool.engine.serve.proto import grpc_predict_v2_pb2 as pb

    ours = pb.ModelInferRequest(model_name="m", id="1", raw_input_contents=[b"\x00\x01"])
    theirs = service_pb2.ModelInferRequest.FromString(ours.SerializeToString())
    assert (theirs.model_name, theirs.id, list(theirs.raw_input_contents)) == ("m", "1", [b"\x00\x01"])
