"""In-process, one-thread references: what a pool must reproduce byte for byte."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def ort_run(model: Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(model), sess_options=so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def litert_run(model: Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    from ai_edge_litert.interpreter import Interpreter

    interp = Interpreter(model_path=str(model), num_threads=1)
    details = {d["name"]: d for d in interp.get_input_details()}
    for name, arr in feeds.items():
        interp.resize_tensor_input(details[name]["index"], arr.shape, strict=True)
    interp.allocate_tensors()
    for name, arr in feeds.items():
        interp.set_tensor(details[name]["index"], arr)
    interp.invoke()
    return {d["name"]: interp.get_tensor(d["index"]) for d in interp.get_output_details()}
