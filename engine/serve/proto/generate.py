"""Regenerate grpc_predict_v2_pb2.py and grpc_repository_pb2.py from their .proto (needs grpcio-tools,
in the dev extra):

    python -m slabpool.engine.serve.proto.generate

The .proto is the Open Inference Protocol's `open_inference_grpc.proto`, vendored unchanged
from kserve/open-inference-protocol (commit d49cc23f); grpc_repository.proto holds the repository
messages of Triton's grpc_service.proto (the protocol's has none). The generated message code is committed:
the server needs only protobuf and grpcio at run time, not grpcio-tools and its bundled protoc
(tests/test_serve_proto.py checks that the committed files are what this script makes).

One edit is made to protoc's output: the messages go into a private descriptor pool, not
protobuf's default one. tritonclient.grpc registers the same names (`inference.ModelInferRequest`,
...) in the default pool from its own copy of the proto; two registrations of one name in one
pool fail, so a process that runs the server and a tritonclient (a test, a benchmark) could not
import both. The wire format does not carry these names; the service path
(`/inference.GRPCInferenceService/...`) is written in engine/serve/grpc.py.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
PROTOS = ("grpc_predict_v2.proto", "grpc_repository.proto")
DEFAULT_POOL = "_descriptor_pool.Default().AddSerializedFile"
PRIVATE_POOL = "_POOL.AddSerializedFile"
SYM_DB = "_sym_db = _symbol_database.Default()"
POOL_LINE = "_POOL = _descriptor_pool.DescriptorPool()  # private: tritonclient registers the same names"


def generate(out: Path) -> list[Path]:
    """Run protoc (grpcio-tools) on the vendored .proto files into `out`; the files written."""
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{HERE}", f"--python_out={out}",
         *(str(HERE / p) for p in PROTOS)],
        check=True,
    )
    made = []
    for proto in PROTOS:
        py = out / proto.replace(".proto", "_pb2.py")
        text = py.read_text()
        if DEFAULT_POOL not in text or SYM_DB not in text:
            raise RuntimeError(f"protoc's output changed shape; update {__file__}")
        py.write_text(text.replace(SYM_DB, POOL_LINE).replace(DEFAULT_POOL, PRIVATE_POOL))
        made.append(py)
    return made


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            (HERE / path.name).write_text(path.read_text())
            print(f"wrote {HERE / path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
