"""Preprocess hooks for the CLI tests (tests/test_cli.py); workers import them by name.

Items are JSON objects: {"i": index, "x": [16 floats], ...} with optional marks:
  "log": path   append the index to this file each time the item is computed (resume counting)
  "sleep": s    take this long (so a test can interrupt a run in the middle)
  "poison": 1   kill the worker, every time (the engine ends the item with PoisonTask)
  "bad": 1      raise (the engine ends the item with SessionRunError)
  "truncate": path, "rewrite": path
                cut this file (the job's INPUT) to half its size, or write it again in place
                with the same length and other bytes (its producer rewriting it mid-job)
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np


def feeds(item: Any) -> dict[str, np.ndarray]:
    """A JSON item -> the mlp's feeds (batch of one); honours every mark above."""
    if item.get("log"):
        fd = os.open(item["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{item['i']}\n".encode())
        finally:
            os.close(fd)
    if item.get("sleep"):
        time.sleep(float(item["sleep"]))
    if item.get("poison"):
        os.kill(os.getpid(), signal.SIGKILL)
    if item.get("bad"):
        raise ValueError(f"item {item['i']} is marked bad")
    if item.get("truncate"):
        os.truncate(item["truncate"], os.path.getsize(item["truncate"]) // 2)
    if item.get("rewrite"):
        with open(item["rewrite"], "r+b") as f:
            data = f.read()
            f.seek(0)
            f.write(data[::-1])
    return {"x": np.asarray(item["x"], dtype=np.float32)[None]}


def square(line: Any) -> dict[str, np.ndarray]:
    """Model-less: a text line holding a number -> its square (the whole task)."""
    v = float(line)
    return {"y": np.asarray([v, v * v], dtype=np.float64)}


# -- input formats (tests/test_formats.py) ----------------------------------------------------------


def load_image(path: str) -> dict[str, np.ndarray]:
    """A 4x4 image file (any format Pillow reads) -> the mlp's 16 features in [0, 1]."""
    from PIL import Image

    with Image.open(path) as im:
        pixels = np.asarray(im.convert("L"), dtype=np.float32)
    return {"x": (pixels.reshape(1, 16) / 255.0).astype(np.float32)}


def label(outputs: dict[str, np.ndarray], item: Any) -> dict[str, Any]:
    """The mlp's outputs -> a label string, a Python float and the probabilities (a vector)."""
    probs = outputs["probs"][0]
    return {"label": f"class-{int(np.argmax(probs))}", "score": float(probs.max()), "probs": probs}


def row_features(row: dict[str, Any]) -> dict[str, np.ndarray]:
    """A table row with columns f0..f15 -> the mlp's feeds."""
    return {"x": np.asarray([[row[f"f{k}"] for k in range(16)]], dtype=np.float32)}


def needs_label(row: dict[str, Any]) -> dict[str, np.ndarray]:
    """A hook with a systematic bug: it reads a column the data lacks."""
    return {"x": np.asarray([row["label"]], dtype=np.float32)}


def feeds_batch(items: list[Any]) -> dict[str, np.ndarray]:
    """Batched: JSON items -> stacked feeds; an item marked bad fails the call (and so alone,
    when the job retries the list item by item)."""
    for it in items:
        if it.get("bad"):
            raise ValueError(f"item {it['i']} is marked bad")
    return {"x": np.asarray([it["x"] for it in items], dtype=np.float32)}


feeds_batch.batched = True  # type: ignore[attr-defined]


def labels_batch(outputs: dict[str, np.ndarray], items: list[Any]) -> list[str]:
    """Batched postprocess: one label per item of the block."""
    return [f"class-{int(k)}" for k in np.argmax(outputs["probs"], axis=1)]


labels_batch.batched = True  # type: ignore[attr-defined]


def wrong_count(outputs: dict[str, np.ndarray], items: list[Any]) -> list[str]:
    """Batched postprocess that returns one result too few."""
    return ["x"] * (len(items) - 1)


wrong_count.batched = True  # type: ignore[attr-defined]


def named_like_savez(outputs: dict[str, np.ndarray], item: Any) -> dict[str, np.ndarray]:
    """Outputs named after np.savez's own keywords."""
    return {"file": outputs["probs"][0], "allow_pickle": outputs["logits"][0]}


def shaped(item: dict[str, Any]) -> np.ndarray:
    """No model: a row of item["n"] numbers of item.get("dtype", float32) (a misfit for some)."""
    return np.arange(item["n"], dtype=item.get("dtype", "float32")) + item["i"]


def feeds_rows(item: Any) -> dict[str, np.ndarray]:
    """A JSON item -> the mlp's feeds with item["rows"] rows (1 unless given): 0 or 2 rows is
    not one item's worth."""
    x = np.asarray(item["x"], dtype=np.float32)[None]
    return {"x": np.repeat(x, int(item.get("rows", 1)), axis=0)}


def tagged(outputs: dict[str, np.ndarray], item: Any) -> dict[str, Any]:
    """A postprocess that reads its item: the item's "i" next to the label."""
    return {"i": int(item["i"]), "label": int(np.argmax(outputs["probs"][0]))}


def tagged_batch(outputs: dict[str, np.ndarray], items: list[Any]) -> list[dict[str, Any]]:
    """Batched: one {"i", "label"} per item of the block."""
    return [{"i": int(it["i"]), "label": int(k)} for it, k in zip(items, np.argmax(outputs["probs"], axis=1),
                                                                    strict=True)]


tagged_batch.batched = True  # type: ignore[attr-defined]


def row_feeds(row: Any) -> dict[str, np.ndarray]:
    """A row of an .npy input (what a hook gets from one: the row, or a dict name -> row) -> x."""
    if isinstance(row, dict):
        row = row["x"]
    return {"x": np.asarray(row, dtype=np.float32)[None]}



def _index(item: Any) -> int:
    """An item's "i": a JSON object's or a table row's key, a file's name (`17.txt`), a line."""
    if isinstance(item, dict):
        return int(item["i"])
    if isinstance(item, str) and os.sep in item:
        return int(os.path.basename(item).split(".")[0])
    return int(item)


def zeros_batch(items: list[Any]) -> np.ndarray:
    """Batched, no model: 13 numbers a row, each its item's "i" (issue 24's hook, zeros + i)."""
    return np.zeros((len(items), 13), dtype=np.float32) + np.asarray([_index(it) for it in items], np.float32)[:, None]


zeros_batch.batched = True  # type: ignore[attr-defined]


def sized(item: dict[str, Any]) -> dict[str, np.ndarray]:
    """A JSON item -> x of shape (1, h, w), filled with i + a ramp (outputs of varying shape)."""
    if item.get("bad"):
        raise ValueError(f"item {item['i']} is marked bad")
    h, w = int(item["h"]), int(item["w"])
    return {"x": (np.arange(h * w, dtype=np.float32).reshape(1, h, w) + item["i"])}
