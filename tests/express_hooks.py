"""An initializer for the express lane's tests (engine.local.express): the express lane takes
only plain inputs (no preprocess, no FaultSpec), so a fault is carried by the input's own
data: the session's run of an input whose first value is a marker dies there, in the run
itself, the way native code dies under a worker.

    KILL  SIGKILL, once        EXIT0  os._exit(0), once        SEGV  SIGSEGV, once
    ALWAYS  SIGKILL every time (a poison input)                HANG  waits for <dir>/open

"Once" is a file in `directory` made before the death (O_EXCL), so the replay runs; it is
named by the marker and the input's second value, so a test can mark a fresh call again.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

KILL, EXIT0, SEGV, ALWAYS, HANG = -1001.0, -1002.0, -1003.0, -1004.0, -1005.0


def die_on_marker(directory: str) -> None:
    """Initializer (runs in each worker before its session is built): ONNX Runtime's and
    LiteRT's sessions."""
    from slabpool.workers import ort

    for name in ("run", "run_into"):
        original = getattr(ort.OrtSession, name)
        setattr(ort.OrtSession, name, _marked(original, directory))
    try:
        from slabpool.workers import litert
    except ImportError:  # (the LiteRT extra not installed: no LiteRT model to mark)
        return
    litert.LiteRtSession.run = _marked(litert.LiteRtSession.run, directory)  # type: ignore[method-assign]


def _marked(original: Any, directory: str) -> Any:
    def run(self: Any, feeds: dict[str, Any], *args: Any, **kw: Any) -> Any:
        x = next(iter(feeds.values()))
        first = float(x.flat[0])
        if first == ALWAYS:
            os.kill(os.getpid(), signal.SIGKILL)
        if first == HANG:
            open(os.path.join(directory, "started"), "w").close()
            deadline = time.monotonic() + 60
            while not os.path.exists(os.path.join(directory, "open")) and time.monotonic() < deadline:
                time.sleep(0.002)
        if first in (KILL, EXIT0, SEGV) and _first_time(directory, f"{first}-{float(x.flat[1])}"):
            if first == EXIT0:
                os._exit(0)
            os.kill(os.getpid(), signal.SIGKILL if first == KILL else signal.SIGSEGV)
        return original(self, feeds, *args, **kw)

    return run


def _first_time(directory: str, marker: str) -> bool:
    try:
        os.close(os.open(os.path.join(directory, f"died{marker}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def record_spins(path: str) -> None:
    """Initializer: each wait of the worker's loop for its next message appends the seconds it
    was told to poll first (RunBatch.spin of the batch it last answered) to `path`, and the
    engine's tasks it was told poll too (RunBatch.peers) to `path`-peers."""
    from slabpool.workers import wire

    original = wire.FrameReader.recv

    def recv(self: Any, spin: float = 0.0, peers: int = 0) -> bytes:
        with open(path, "a") as f:
            f.write(f"{spin!r}\n")
        with open(f"{path}-peers", "a") as f:
            f.write(f"{peers}\n")
        return original(self, spin, peers)

    wire.FrameReader.recv = recv  # type: ignore[method-assign]


def marked_and_spins(directory: str) -> None:
    """Initializer: `die_on_marker(directory)`, and each worker records its spins
    (`record_spins`) in `directory`/spins-<its pid>."""
    die_on_marker(directory)
    record_spins(os.path.join(directory, f"spins-{os.getpid()}"))


def marked_and_logs_when_told(directory: str) -> None:
    """Initializer: `die_on_marker(directory)`, and a thread of each worker's that logs one
    warning ("between tasks") once `directory`/log exists: news on its pipe that no task asked
    for, sent while the worker waits for its next task."""
    import logging
    import threading

    die_on_marker(directory)

    def log_when_told() -> None:
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(directory, "log")) and time.monotonic() < deadline:
            time.sleep(0.002)
        logging.getLogger("tests.between").warning("between tasks, pid %d", os.getpid())

    threading.Thread(target=log_when_told, daemon=True).start()
