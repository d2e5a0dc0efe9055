"""Serve a model through slabpool from Starlette (optional dependency: pip install starlette uvicorn).

    SLABPOOL_MODEL=engine/data/demo.onnx uvicorn examples.starlette_app:app

    POST /predict   body: one image, raw float32 bytes (application/octet-stream) of the model's
                    input shape without the batch axis, or JSON {"image": nested lists}
    GET  /metrics   the engine's Prometheus text
    GET  /healthz   the engine's state

The CPU-heavy work runs in slabpool's worker processes; the event loop only awaits. A request
that times out, or whose client goes away, cancels its task: still queued, it never runs;
already running, its result is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from slabpool import Engine
from slabpool.workers.errors import EngineClosed, InputContractError, QueueFull

MODEL = os.environ.get("SLABPOOL_MODEL", os.path.join(os.path.dirname(__file__), "..", "engine", "data", "demo.onnx"))
WORKERS = int(os.environ.get("SLABPOOL_WORKERS", "0")) or None  # None: every usable CPU
REQUEST_TIMEOUT_S = float(os.environ.get("SLABPOOL_REQUEST_TIMEOUT", "5"))
ADMISSION_WAIT_S = 1.0  # a full queue for this long answers 503 instead of piling up requests


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    engine = await asyncio.to_thread(Engine, MODEL, workers=WORKERS)  # start-up waits for workers
    async with engine:  # on shutdown: close() on a thread, draining what was accepted
        app.state.engine = engine
        yield


async def predict(request: Request) -> Response:
    engine: Engine = request.app.state.engine
    spec = engine.describe().inputs[0]
    try:
        image = await _read_image(request, spec.dtype, spec.shape[1:])
    except ValueError as exc:
        return JSONResponse({"error": str(exc)}, status_code=422)
    context = {"request_id": request.headers.get("x-request-id", "")}
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            result = await _unless_disconnected(request, engine.submit_async(
                {spec.name: image[None]}, context=context, block_timeout=ADMISSION_WAIT_S))
    except TimeoutError:
        return JSONResponse({"error": "timed out"}, status_code=504)
    except (QueueFull, EngineClosed) as exc:
        return JSONResponse({"error": str(exc)}, status_code=503)
    except InputContractError as exc:
        return JSONResponse({"error": str(exc)}, status_code=422)
    if result is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    probs = next(iter(result.outputs.values()))[0]
    return JSONResponse({"label": int(probs.argmax()), "probs": probs.tolist(),
                         "task_id": result.task_id, "model_version": result.model_version})


async def _read_image(request: Request, dtype: str, shape: tuple[Any, ...]) -> np.ndarray:
    if request.headers.get("content-type", "").startswith("application/json"):
        image = np.asarray((await request.json())["image"], dtype=dtype)
    else:
        image = np.frombuffer(await request.body(), dtype=dtype)
    if None in shape or image.size != int(np.prod(shape)):
        raise ValueError(f"expected {shape} values of {dtype}, got {image.size}")
    return image.reshape(shape)


async def _unless_disconnected(request: Request, work: Any) -> Any:
    """Await `work`, or cancel it (and return None) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        task.cancel()  # still waiting (client gone, or our own timeout): cancels the engine task
    return task.result() if task in done else None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def metrics(request: Request) -> Response:
    return PlainTextResponse(request.app.state.engine.metrics_text(),
                             media_type="text/plain; version=0.0.4; charset=utf-8")


async def healthz(request: Request) -> Response:
    engine: Engine = request.app.state.engine
    return PlainTextResponse(repr(engine), status_code=200 if engine.state.name == "ACCEPTING" else 503)


app = Starlette(
    routes=[
        Route("/predict", predict, methods=["POST"]),
        Route("/metrics", metrics),
        Route("/healthz", healthz),
    ],
    lifespan=lifespan,
)
