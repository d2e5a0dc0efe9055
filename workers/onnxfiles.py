"""The files an ONNX model is made of: the `.onnx` itself and the external data files it names.

A model saved with external data keeps its large tensors in other files next to it (TensorProto
`data_location = EXTERNAL`, `external_data` entry `location`). The model's version (its digest)
and the copy an engine pins must cover them all. onnx is not a dependency of the engine, so this
walks the protobuf wire format itself, descending only into the messages that can hold a tensor
(graph, node attribute, sparse tensor, function) and skipping every payload by its length: a
model of a few GB is read through a memory map, its weights never copied.

Field numbers are those of onnx/onnx.proto3 (stable since IR 3).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator

# message -> {field number: message it holds}; every other field is skipped
_MODEL = "model"
_GRAPH = "graph"
_NODE = "node"
_ATTR = "attr"
_TENSOR = "tensor"
_SPARSE = "sparse"
_FUNC = "func"
_CHILDREN: dict[str, dict[int, str]] = {
    _MODEL: {7: _GRAPH, 25: _FUNC},  # ModelProto.graph, .functions
    _GRAPH: {1: _NODE, 5: _TENSOR, 15: _SPARSE},  # GraphProto.node, .initializer, .sparse_initializer
    _NODE: {5: _ATTR},  # NodeProto.attribute
    _ATTR: {5: _TENSOR, 6: _GRAPH, 10: _TENSOR, 11: _GRAPH, 22: _SPARSE, 23: _SPARSE},
    _SPARSE: {1: _TENSOR, 2: _TENSOR},  # SparseTensorProto.values, .indices
    _FUNC: {7: _NODE},  # FunctionProto.node
}
_EXTERNAL_DATA = 13  # TensorProto.external_data: repeated StringStringEntryProto (key 1, value 2)


class BadModelFile(ValueError):
    """The file is not an ONNX model this walk can read (the runtime will say why)."""


class DataOutsideFolder(ValueError):
    """The model names an external data file outside its own folder: refused."""


def external_files(path: str) -> list[str]:
    """The external data files `path` names, relative to its folder, sorted, each once."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise BadModelFile(f"{path} is empty: not an ONNX model")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            buf = memoryview(m)
            try:
                found = {loc for loc in _locations(buf, 0, len(buf), _MODEL)}
            finally:
                buf.release()
    for loc in found:
        norm = os.path.normpath(loc)
        if os.path.isabs(loc) or norm.startswith(".."):
            raise DataOutsideFolder(f"{path} names external data {loc!r} outside its folder: keep a "
                                    "model's data files in its folder (or below it)")
    return sorted(os.path.normpath(loc) for loc in found)


def _locations(buf: memoryview, pos: int, end: int, kind: str) -> Iterator[str]:
    children = _CHILDREN.get(kind, {})
    while pos < end:
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 2:
            size, pos = _varint(buf, pos)
            if pos + size > end:
                raise BadModelFile("a length-delimited field runs past its message: not an ONNX model")
            if kind == _TENSOR and field == _EXTERNAL_DATA:
                loc = _location(buf, pos, pos + size)
                if loc is not None:
                    yield loc
            elif field in children:
                yield from _locations(buf, pos, pos + size, children[field])
            pos += size
        elif wire == 0:
            _, pos = _varint(buf, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise BadModelFile(f"protobuf wire type {wire} at byte {pos}: not an ONNX model")


def _location(buf: memoryview, pos: int, end: int) -> str | None:
    """The value of a StringStringEntryProto whose key is 'location'."""
    key = value = None
    while pos < end:
        tag, pos = _varint(buf, pos)
        if tag & 7 != 2:
            raise BadModelFile("an external_data entry with a non-string field: not an ONNX model")
        size, pos = _varint(buf, pos)
        text = bytes(buf[pos:pos + size]).decode("utf-8", errors="strict")
        if tag >> 3 == 1:
            key = text
        elif tag >> 3 == 2:
            value = text
        pos += size
    return value if key == "location" else None


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise BadModelFile("a truncated varint: not an ONNX model")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
