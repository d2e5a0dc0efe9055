"""slabpool: model inference on every core of a host, one model session per worker process.

    from slabpool import Engine

    if __name__ == "__main__":               # spawn/forkserver re-import the main module
        with Engine("model.onnx", workers=4) as eng:
            y = eng.infer({"x": batch})

Three layers, each a subpackage, and imports point one way (a test walks them):

    slabpool.engine   policy, in the caller's process: the public Engine, admission, the
        |             supervisor that owns every slot, crash replay, the batch job (CLI),
        |             the Ray backend. Its package docstring draws the flow of one task.
        v
    slabpool.workers  what runs inside a worker process: the loop, one session adapter per
        |             runtime (ONNX Runtime, LiteRT), the pipe messages, and what both sides
        |             share: the error tree (slabpool.workers.errors) and the task context.
        v
    slabpool.shm      mechanism: shared-memory arenas with explicit leases; the only place
                      that creates or unlinks shared memory.

Everything a caller needs is re-exported here, lazily: `import slabpool` loads neither numpy's
heavy users nor any runtime, so a worker importing `slabpool.workers` stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__: str  # set by __getattr__ on first use

if TYPE_CHECKING:
    from slabpool.engine.core.reload import SignatureChanged
    from slabpool.engine.core.stats import EngineStats, ModelDescription, SlotStats
    from slabpool.engine.core.task import Result, Timings
    from slabpool.engine.local.pool import Engine
    from slabpool.engine.ray.backend import RayEngine
    from slabpool.workers.errors import (
        EngineClosed,
        EngineError,
        EngineInternalError,
        InputContractError,
        PoisonTask,
        QueueFull,
        RowsFailed,
        SessionInitError,
        SessionRunError,
        ShmCapacityError,
        TaskCancelled,
        TaskDataError,
        TaskError,
        TaskTimeout,
        WorkerCrashed,
        WorkerError,
    )

_ERRORS = (
    "EngineClosed", "EngineError", "EngineInternalError", "InputContractError", "PoisonTask",
    "QueueFull", "RowsFailed", "SessionInitError", "SessionRunError", "ShmCapacityError", "TaskCancelled", "TaskDataError",
    "TaskError", "TaskTimeout", "WorkerCrashed", "WorkerError",
)
_LAZY = {
    "Engine": "slabpool.engine.local.pool",
    "RayEngine": "slabpool.engine.ray.backend",
    "SignatureChanged": "slabpool.engine.core.reload",
    "EngineStats": "slabpool.engine.core.stats",
    "ModelDescription": "slabpool.engine.core.stats",
    "SlotStats": "slabpool.engine.core.stats",
    "Result": "slabpool.engine.core.task",
    "Timings": "slabpool.engine.core.task",
    **{name: "slabpool.workers.errors" for name in _ERRORS},
}

__all__ = [
    "Engine",
    "EngineClosed",
    "EngineError",
    "EngineInternalError",
    "EngineStats",
    "InputContractError",
    "ModelDescription",
    "PoisonTask",
    "QueueFull",
    "RayEngine",
    "Result",
    "RowsFailed",
    "SessionInitError",
    "SessionRunError",
    "ShmCapacityError",
    "SignatureChanged",
    "SlotStats",
    "TaskCancelled",
    "TaskDataError",
    "TaskError",
    "TaskTimeout",
    "Timings",
    "WorkerCrashed",
    "WorkerError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        try:
            return getattr(importlib.import_module(_LAZY[name]), name)
        except ModuleNotFoundError as exc:
            if exc.name != "ray":
                raise
            raise ModuleNotFoundError(f"slabpool.{name} needs Ray: pip install 'slabpool[ray]'", name="ray") from exc
    if name == "__version__":  # looked up on first use: importlib.metadata costs every worker ~20 ms
        global __version__
        from importlib import metadata

        try:
            __version__ = metadata.version("slabpool")
        except metadata.PackageNotFoundError:  # a source tree that was never installed
            __version__ = "0+unknown"
        return __version__
    raise AttributeError(f"module 'slabpool' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
