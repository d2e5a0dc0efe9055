"""The FastAPI + ProcessPoolExecutor server a user writes instead of `slabpool serve` (bench/serve.py):

    python bench/serve_fastapi.py MODEL PORT WORKERS

The V2 JSON inference route only (what the load generator sends), one onnxruntime session per
pool process, the request's tensors decoded with numpy and the outputs encoded as JSON lists.
Runs in the benchmark's throwaway venv (bench/serve.py: fastapi comes with MLServer there).
"""

import asyncio
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
from fastapi import FastAPI, Request  # at module level: FastAPI resolves the handler's annotations here
from fastapi.responses import Response

_sess: Any = None
DTYPES = {"FP32": np.float32, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32}


def _init(model: str) -> None:
    global _sess
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    _sess = ort.InferenceSession(model, sess_options=so, providers=["CPUExecutionProvider"])


def _run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in _sess.get_outputs()]
    return dict(zip(names, _sess.run(names, feeds), strict=True))


def build(model: str, workers: int) -> Any:
    pool = ProcessPoolExecutor(workers, initializer=_init, initargs=(model,))
    app = FastAPI()

    @app.get("/v2/health/ready")
    async def ready() -> Response:
        return Response(status_code=200)

    @app.post("/v2/models/{name}/infer")
    async def infer(name: str, request: Request) -> Any:
        body = await request.json()
        feeds = {t["name"]: np.asarray(t["data"], DTYPES[t["datatype"]]).reshape(t["shape"]) for t in body["inputs"]}
        out = await asyncio.get_running_loop().run_in_executor(pool, _run, feeds)
        return {"model_name": name, "outputs": [
            {"name": k, "datatype": "FP32", "shape": list(v.shape), "data": v.ravel().tolist()} for k, v in out.items()]}

    return app


if __name__ == "__main__":
    import uvicorn

    model, port, workers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    uvicorn.run(build(model, workers), host="127.0.0.1", port=port, log_level="warning", access_log=False)
