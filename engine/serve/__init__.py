"""`slabpool serve`: the Open Inference Protocol (KServe V2) over HTTP and gRPC, on the engine.

An application on the engine (DESIGN.md, "Applications on the engine"): it uses `Engine`'s
public interface only (`submit_async`, `stats()`, `describe()`, `reload()`, the metrics module).

    client (tritonclient, curl, KServe)
      |  HTTP/REST: JSON or binary tensors            gRPC: inference.GRPCInferenceService
      v                                               v
    http.py (ASGI on uvicorn: httptools, uvloop;    grpc.py (grpc.aio)
      an inference whole in one read starts at once:
      uvproto.py, eager.py)
      |                                               |  + Triton's repository calls
      |  decode once into numpy (tensors.py)          |  raw_input_contents -> np.frombuffer
      +--------------------> core.Frontend <----------+
                               |  health, metadata: models.py (stats(), describe())
                               |  infer: Engine.submit_async, one engine per model
                               v
                             Engine: admission queue (503 when full), workers, crash replay
      <-- encode once: raw bytes / JSON data (tensors.py), errors as errors.py maps them

    cli         `slabpool serve` arguments (argparse only)     server   both servers, signals, drain, gc.freeze
    core        the one inference path, health, repository,    models   engines, readiness, metadata, reload
                accounting
    http / grpc the two transports                             tensors  wire <-> numpy
    uvproto     uvicorn's protocol as serve runs it: one write an answer, the disconnect told,
                an inference started in the read that brought it
    eager       a coroutine's first steps run now, the rest in a Task if it waits (3.12's eager tasks)
    errors      status codes of both transports                metrics  /metrics
    proto/      the vendored .proto files and protoc's message code (generate.py)
"""
