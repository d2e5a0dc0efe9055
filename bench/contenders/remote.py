"""What runs inside a pool's worker process (and in-process): one ORT session, one item per call.

Kept light: pool workers import this module by name to unpickle `init_session`/`run_item`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_session: Any = None
_names: list[str] = []


def make_session(path: str, threads: int = 1) -> Any:
    """The same session options as a slabpool worker; spinning stays ORT's default above 1
    thread (what a user running one session with N threads gets)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    if threads == 1:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(path, sess_options=so, providers=["CPUExecutionProvider"])


def init_session(path: str, threads: int = 1) -> None:
    """Pool initializer: build this process's session once."""
    global _session, _names
    _session = make_session(path, threads)
    _names = [o.name for o in _session.get_outputs()]


def run_item(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One task: arrays arrive pickled, outputs leave pickled."""
    return dict(zip(_names, _session.run(_names, feeds), strict=True))
