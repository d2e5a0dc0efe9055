"""Tensors on the wire <-> numpy, once each way, for both transports.

    request tensor                         numpy (what Engine.infer_async takes)
    JSON "data" (flat, row-major)  ---->   np.asarray(data, dtype).reshape(shape)
    binary extension / raw bytes   ---->   np.frombuffer(buf, '<dtype').reshape(shape)   (a view, no copy)
    BYTES (JSON strings / 4-byte          a flat list of `bytes`, row-major (a preprocess takes it:
      little-endian length prefixes)       the engine carries no string tensors)

    outputs: arrays -> (datatype, shape, raw little-endian bytes | flat JSON list)

A tensor whose data does not fill its shape, or a datatype the protocol does not name, is a
`BadRequest` naming the tensor, what was expected and what was got.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson

from slabpool.engine.serve.errors import BadRequest

MAX_DIMS = 64 if np.lib.NumpyVersion(np.__version__) >= "2.0.0" else 32  # NPY_MAXDIMS: no tensor has more
MAX_DIM = (1 << 63) - 1  # the protocol's dims are int64

# the protocol's datatype names (BF16 has no numpy dtype; it is refused by name)
DATATYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"), "UINT16": np.dtype("<u2"), "UINT32": np.dtype("<u4"), "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"), "INT16": np.dtype("<i2"), "INT32": np.dtype("<i4"), "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"), "FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"),
}  # fmt: skip
_NAMES = {(dt.kind, dt.itemsize): name for name, dt in DATATYPES.items()}
_FMAX = {dt: float(np.finfo(dt).max) for dt in (np.dtype("<f2"), np.dtype("<f4"))}
_NAME_OF = {dt: name for name, dt in DATATYPES.items()}  # native little-endian dtypes: the common case
BYTES = "BYTES"


def datatype_of(dtype: str | np.dtype[Any]) -> str:
    """The protocol's name for a numpy dtype (a TensorSpec's dtype string, an array's dtype)."""
    known = _NAME_OF.get(dtype) if isinstance(dtype, np.dtype) else None
    if known is not None:
        return known
    dt = np.dtype(dtype)
    if dt.kind in "OSU":
        return BYTES
    name = _NAMES.get((dt.kind, dt.itemsize))
    if name is None:
        raise TypeError(f"dtype {dt} has no Open Inference Protocol datatype")
    return name


def wire_shape(shape: Sequence[int | None]) -> list[int]:
    """A model's shape for metadata: -1 marks a dynamic dim."""
    return [-1 if d is None else int(d) for d in shape]


def _dtype(name: str, datatype: str) -> np.dtype[Any]:
    dt = DATATYPES.get(datatype)
    if dt is None:
        known = ", ".join([*DATATYPES, BYTES])
        raise BadRequest(f"input {name!r}: datatype {datatype!r} is not supported; expected one of {known}")
    return dt


def check_shape(name: str, shape: Any) -> tuple[int, ...]:
    """A client's shape: at most MAX_DIMS non-negative int64 dimensions whose product an array
    can hold (was: [0, 2**63] or [0, 2**62], no elements, reached numpy's reshape and came back
    a 500; on gRPC UNKNOWN)."""
    if not isinstance(shape, list | tuple) or not all(type(d) is int and 0 <= d <= MAX_DIM for d in shape):
        raise BadRequest(f"input {name!r}: shape must be a list of integers from 0 to 2**63-1, got {shape!r}")
    if len(shape) > MAX_DIMS:
        raise BadRequest(f"input {name!r}: shape has {len(shape)} dimensions, a tensor at most {MAX_DIMS}")
    if math.prod(d for d in shape if d) * 16 > MAX_DIM:  # (numpy refuses such a shape even with no elements)
        raise BadRequest(f"input {name!r}: shape {list(shape)} is larger than any array can be")
    return tuple(shape)


def from_buffer(name: str, datatype: str, shape: tuple[int, ...], buf: bytes | memoryview) -> Any:
    """Raw little-endian contents (binary extension, gRPC raw_input_contents): a read-only view."""
    if datatype == BYTES:
        return _split_bytes(name, shape, buf)
    dt = _dtype(name, datatype)
    want = math.prod(shape) * dt.itemsize
    if len(buf) != want:
        raise BadRequest(f"input {name!r}: shape {list(shape)} of {datatype} takes {want} bytes, got {len(buf)}")
    if dt.kind == "b" and want and (raw := np.frombuffer(buf, np.uint8)).max() > 1:  # (numpy keeps the byte)
        bad = int(np.flatnonzero(raw > 1)[0])
        raise BadRequest(f"input {name!r}: a BOOL element is one byte, 0 (false) or 1 (true); "
                         f"element {bad} is {raw[bad]}")
    return np.frombuffer(buf, dt).reshape(shape)


def from_list(name: str, datatype: str, shape: tuple[int, ...], data: Any) -> Any:
    """JSON `data` (flat row-major, or nested as the shape) or gRPC typed contents, as an array
    of the datatype. Nothing is cast silently: each element must be a value of that datatype
    (`true`/`false` for BOOL, integers for the integer types, numbers for the float types), in
    its range (an integer past it, or a number past FP16/FP32's largest, is refused)."""
    if datatype == BYTES:
        return _strings(name, shape, data)
    dt = _dtype(name, datatype)
    flat, kinds = _flat_types(name, data)
    if not kinds <= _ELEMENT_TYPES[dt.kind]:
        _check_elements(name, datatype, dt, flat)
    fits = dt.kind != "f" or dt.itemsize == 8 or (flat and -_FMAX[dt] <= min(flat) and max(flat) <= _FMAX[dt])
    try:
        if fits:  # (a NaN first makes min/max NaN: then the check below runs)
            arr = np.asarray(data, dtype=dt)
        else:
            with np.errstate(over="ignore"):  # a float past FP16/FP32's range: refused below, by element
                arr = np.asarray(data, dtype=dt)
    except OverflowError as exc:
        raise BadRequest(f"input {name!r}: a value is out of range for {datatype}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"input {name!r}: data does not read as {datatype}: {exc}") from None
    if arr.size != math.prod(shape):
        raise BadRequest(f"input {name!r}: shape {list(shape)} holds {math.prod(shape)} elements, got {arr.size}")
    if arr.ndim > 1 and arr.shape != shape:
        raise BadRequest(f"input {name!r}: nested data of shape {list(arr.shape)} for shape {list(shape)}; "
                         "send it flat (row-major) or nested as the shape")
    if not fits:
        _check_float_range(name, datatype, arr, flat)
    return arr.reshape(shape)


# the Python types a JSON (or gRPC typed) element of each kind may have: no bool as a number,
# no number as a bool, no string or null as anything
_ELEMENT_TYPES: dict[str, frozenset[type]] = {
    "b": frozenset((bool,)), "i": frozenset((int,)), "u": frozenset((int,)), "f": frozenset((int, float))}


def _check_elements(name: str, datatype: str, dt: np.dtype[Any], flat: list[Any]) -> None:
    allowed = _ELEMENT_TYPES[dt.kind]
    for i, v in enumerate(flat):
        if type(v) not in allowed:
            if dt.kind in "iu" and type(v) is float and v.is_integer() and abs(v) >= 2**63:
                raise BadRequest(f"input {name!r}: element {i} ({v:.0f}) is out of range for {datatype} "
                                 "(an integer past 64 bits, which JSON parsers read as a float)")
            what = {"b": "true or false", "i": "integers", "u": "integers", "f": "numbers"}[dt.kind]
            raise BadRequest(f"input {name!r}: {datatype} data must be {what}; element {i} is {v!r} "
                             f"({type(v).__name__}); nothing is cast silently")


def _check_float_range(name: str, datatype: str, arr: np.ndarray[Any, Any], flat: list[Any]) -> None:
    """A finite number that became inf in FP16/FP32 was out of its range (inf given stays inf)."""
    became = np.isinf(arr.reshape(-1))
    if not became.any():
        return
    given = np.isinf(np.asarray(flat, dtype=np.float64))
    over = np.flatnonzero(became & ~given)
    if over.size:
        i = int(over[0])
        raise BadRequest(f"input {name!r}: element {i} ({flat[i]!r}) is out of range for {datatype} "
                         f"(largest {float(np.finfo(arr.dtype).max):g})")


def _flat_types(name: str, data: Any) -> tuple[list[Any], set[type]]:
    """The elements flat, and their Python types (one set, built at C speed: the check of a
    flat list of numbers costs no Python loop)."""
    if type(data) is list:
        kinds = set(map(type, data))
        if list not in kinds and tuple not in kinds:
            return data, kinds
    flat = _flat(name, data)
    return flat, set(map(type, flat))


def _flat(name: str, data: Any) -> list[Any]:
    """Nested lists' elements in row-major order, without recursion: data nested deeper than a
    tensor can be (numpy's MAX_DIMS) is the client's mistake, a 400 (was: a RecursionError, a
    500 with a 167 KB traceback logged, from a 1 KB body nested 500 deep)."""
    if not isinstance(data, list | tuple):
        return [data]
    out: list[Any] = []
    stack = [iter(data)]
    while stack:
        for v in stack[-1]:
            if isinstance(v, list | tuple):
                if len(stack) >= MAX_DIMS:
                    raise BadRequest(f"input {name!r}: data nested deeper than {MAX_DIMS} levels "
                                     "(a tensor has at most that many dimensions)")
                stack.append(iter(v))
                break
            out.append(v)
        else:
            stack.pop()
    return out


def _strings(name: str, shape: tuple[int, ...], data: Any) -> list[bytes]:
    """BYTES JSON data: strings, flat or nested exactly as the shape (was: nested unevenly, as
    ["a", ["b"]] for [2], accepted; a number's error said "takes 2 strings, got 2 items")."""
    flat = _flat(name, data)
    items = [v.encode() if isinstance(v, str) else v for v in flat]
    bad = next((i for i, v in enumerate(items) if not isinstance(v, bytes)), None)
    if bad is not None:
        raise BadRequest(f"input {name!r}: BYTES data must be strings; element {bad} is {flat[bad]!r} "
                         f"({type(flat[bad]).__name__}); nothing is cast silently")
    if len(items) != math.prod(shape):
        raise BadRequest(f"input {name!r}: BYTES of shape {list(shape)} takes {math.prod(shape)} strings, "
                         f"got {len(items)}")
    if isinstance(data, list | tuple) and any(isinstance(v, list | tuple) for v in data):
        nested = _nested_shape(data)
        if nested != shape:
            got = "unevenly" if nested is None else f"as shape {list(nested)}"
            raise BadRequest(f"input {name!r}: BYTES data nested {got} for shape {list(shape)}; send it flat "
                             "(row-major) or nested as the shape")
    return items


def _nested_shape(data: Any) -> tuple[int, ...] | None:
    """The shape of lists nested regularly (every list of a level as long, lists all the way down
    to the same depth); None if they are not."""
    shape: list[int] = []
    level = [data]
    while all(isinstance(v, list | tuple) for v in level):
        sizes = {len(v) for v in level}
        if len(sizes) != 1:
            return None
        shape.append(sizes.pop())
        level = [w for v in level for w in v]
        if not level:
            return tuple(shape)
    return None if any(isinstance(v, list | tuple) for v in level) else tuple(shape)


def _split_bytes(name: str, shape: tuple[int, ...], buf: bytes | memoryview) -> list[bytes]:
    """BYTES in the binary format: each element a 4-byte little-endian length, then its bytes."""
    view, pos = memoryview(buf), 0
    out: list[bytes] = []
    while pos < len(view):
        if pos + 4 > len(view):
            raise BadRequest(f"input {name!r}: BYTES element {len(out)} is cut off in its length prefix")
        (n,) = struct.unpack_from("<I", view, pos)
        if pos + 4 + n > len(view):
            raise BadRequest(f"input {name!r}: BYTES element {len(out)} says {n} bytes, "
                             f"{len(view) - pos - 4} are left")
        out.append(bytes(view[pos + 4 : pos + 4 + n]))
        pos += 4 + n
    if len(out) != math.prod(shape):
        raise BadRequest(f"input {name!r}: BYTES of shape {list(shape)} takes {math.prod(shape)} elements, got {len(out)}")
    return out


def json_object(data: bytes | memoryview) -> dict[str, Any]:
    """A JSON request body (HTTP's, a binary request's header), which must be an object."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        try:  # NaN / Infinity / -Infinity: not JSON, but what tritonclient sends (and this server writes)
            obj = json.loads(bytes(data))  # for such floats; orjson refuses them, Python's json reads them
        except ValueError:
            raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(obj).__name__}")
    return obj


# -- outputs --------------------------------------------------------------------------------------


def as_output(name: str, value: Any) -> np.ndarray[Any, Any]:
    """An output value as a C-contiguous little-endian array (strings as an object array)."""
    if type(value) is np.ndarray and value.dtype in _NAME_OF and value.flags.c_contiguous:
        return value  # what the engine returns: nothing to do
    arr = np.asarray(value)
    if arr.dtype.kind in "SU" and type(value) is not np.ndarray:  # (a postprocess's list of strings:
        arr = np.array(value, dtype=object)  # fixed-width S/U would drop each string's trailing NULs)
    if arr.dtype.kind in "OSU":
        return arr
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    try:
        datatype_of(arr.dtype)
    except TypeError:
        raise TypeError(f"output {name!r} has dtype {arr.dtype}, which the protocol cannot carry") from None
    return np.ascontiguousarray(arr)


def to_bytes(arr: np.ndarray[Any, Any]) -> bytes:
    """Raw little-endian contents; BYTES elements length-prefixed."""
    if arr.dtype.kind not in "OSU":
        return arr.tobytes()
    parts = []
    for v in arr.reshape(-1):
        b = v.encode() if isinstance(v, str) else bytes(v)
        parts.append(struct.pack("<I", len(b)))
        parts.append(b)
    return b"".join(parts)


def to_list(name: str, arr: np.ndarray[Any, Any]) -> Any:
    """JSON `data`: the array flat (orjson writes numeric arrays natively); BYTES as strings.
    BYTES that are not UTF-8 have no JSON string: refused, never changed (the binary form carries them)."""
    flat = arr.reshape(-1)
    if arr.dtype.kind not in "OSU":
        return flat
    out = []
    for i, v in enumerate(flat):
        if not isinstance(v, bytes):
            out.append(str(v))
            continue
        try:
            out.append(v.decode())
        except UnicodeDecodeError:
            raise BadRequest(f"output {name!r}: BYTES element {i} ({v[:32]!r}) is not UTF-8 and has no JSON "
                             "string; request this output with \"binary_data\": true") from None
    return out
