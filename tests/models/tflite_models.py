"""TFLite test models written with flatbuffers and the ``tflite`` schema package.

:class:`ModelBuilder` collects buffers, tensors, operator codes and operators of one subgraph,
then serialises them as a schema-version-3 ``.tflite`` file (identifier ``TFL3``) with a
``serving_default`` SignatureDef. Buffer 0 is the empty buffer; weight buffers are 16-byte
aligned. A dynamic batch is expressed as ``shape=[1, ...]`` plus ``shape_signature=[-1, ...]``,
so runtimes need ``resize_tensor_input(i, [B, ...], strict=True)`` + ``allocate_tensors()``.

For the same ``seed``, :func:`mlp` computes the same function as ``onnx_models.mlp`` (the weights
are generated identically and stored transposed, FULLY_CONNECTED weights being [out, in]), so
the two runtimes can be compared against one :func:`mlp_reference`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import flatbuffers  # type: ignore[import-untyped]
import numpy as np
import numpy.typing as npt
import tflite  # type: ignore[import-untyped]

StrPath = str | os.PathLike[str]
FloatArray = npt.NDArray[np.float32]
OptionsWriter = Callable[[flatbuffers.Builder], int]

SCHEMA_VERSION = 3
FILE_IDENTIFIER = b"TFL3"
BUFFER_ALIGNMENT = 16
SIGNATURE_KEY = "serving_default"

_TENSOR_TYPES: dict[np.dtype[np.generic], int] = {
    np.dtype(np.float32): tflite.TensorType.FLOAT32,
    np.dtype(np.int32): tflite.TensorType.INT32,
    np.dtype(np.int64): tflite.TensorType.INT64,
    np.dtype(np.uint8): tflite.TensorType.UINT8,
    np.dtype(np.int8): tflite.TensorType.INT8,
}

__all__ = [
    "ModelBuilder",
    "mlp",
    "mlp_logits",
    "mlp_reference",
    "static_mlp",
    "two_inputs",
    "two_inputs_reference",
]


# --------------------------------------------------------------------------------------------
# flatbuffers helpers (the builder writes back to front; no table may be open while a vector
# or string is written, hence the "children first" order everywhere)


def _offset_vector(b: flatbuffers.Builder, offsets: Sequence[int]) -> int:
    b.StartVector(4, len(offsets), 4)
    for off in reversed(offsets):
        b.PrependUOffsetTRelative(off)
    return int(b.EndVector())


def _int32_vector(b: flatbuffers.Builder, values: Sequence[int]) -> int:
    b.StartVector(4, len(values), 4)
    for v in reversed(values):
        b.PrependInt32(int(v))
    return int(b.EndVector())


def _aligned_bytes(b: flatbuffers.Builder, data: bytes, alignment: int) -> int:
    """A ubyte vector whose first byte is ``alignment``-aligned in the finished file.

    ``Builder.CreateByteVector`` cannot align; this does what it does (same Builder fields)
    after ``StartVector`` has padded for ``alignment``.
    """
    b.StartVector(1, len(data), alignment)
    b.head -= len(data)
    b.Bytes[b.head : b.head + len(data)] = data
    b.vectorNumElems = len(data)
    return int(b.EndVector())


# --------------------------------------------------------------------------------------------
# the builder


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]
    signature: tuple[int, ...] | None
    type_code: int
    buffer: int


@dataclass(frozen=True)
class _Operator:
    opcode: int
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    options_type: int
    options: OptionsWriter | None


@dataclass
class ModelBuilder:
    """One-subgraph TFLite model under construction.

    Add tensors (constants get their own buffer), then operators, then call :meth:`save` (or
    :meth:`build` for the bytes) with the subgraph inputs and outputs; the same lists become
    the ``serving_default`` signature, keyed by tensor name.
    """

    description: str = "slabpool test model"
    _buffers: list[bytes] = field(default_factory=lambda: [b""], init=False, repr=False)
    _tensors: list[_Tensor] = field(default_factory=list, init=False)
    _opcodes: list[int] = field(default_factory=list, init=False)
    _operators: list[_Operator] = field(default_factory=list, init=False)

    # -- graph construction ------------------------------------------------------------------

    def tensor(
        self,
        name: str,
        shape: Sequence[int],
        dtype: npt.DTypeLike = np.float32,
        signature: Sequence[int] | None = None,
    ) -> int:
        """Add an activation tensor; ``signature`` holds -1 for dynamic dims."""
        sig = None if signature is None else tuple(signature)
        return self._add_tensor(name, tuple(shape), sig, np.dtype(dtype), 0)

    def constant(self, name: str, value: npt.NDArray[np.generic]) -> int:
        """Add a constant tensor backed by its own (aligned) buffer."""
        arr = np.ascontiguousarray(value)
        self._buffers.append(arr.astype(arr.dtype.newbyteorder("<")).tobytes())
        return self._add_tensor(name, arr.shape, None, arr.dtype, len(self._buffers) - 1)

    def operator(
        self,
        builtin: int,
        inputs: Sequence[int],
        outputs: Sequence[int],
        options_type: int = tflite.BuiltinOptions.NONE,
        options: OptionsWriter | None = None,
    ) -> None:
        """Append a builtin operator (a ``tflite.BuiltinOperator`` code)."""
        if builtin not in self._opcodes:
            self._opcodes.append(builtin)
        opcode = self._opcodes.index(builtin)
        self._operators.append(
            _Operator(opcode, tuple(inputs), tuple(outputs), options_type, options)
        )

    def fully_connected(
        self, x: int, weights: int, bias: int, out: int, activation: int | None = None
    ) -> None:
        """out = activation(x @ weights.T + bias); ``weights`` is [out, in]."""
        act = tflite.ActivationFunctionType.NONE if activation is None else activation

        def write(b: flatbuffers.Builder) -> int:
            tflite.FullyConnectedOptionsStart(b)
            tflite.FullyConnectedOptionsAddFusedActivationFunction(b, act)
            return int(tflite.FullyConnectedOptionsEnd(b))

        self.operator(
            tflite.BuiltinOperator.FULLY_CONNECTED,
            [x, weights, bias],
            [out],
            tflite.BuiltinOptions.FullyConnectedOptions,
            write,
        )

    def softmax(self, x: int, out: int, beta: float = 1.0) -> None:
        """out = softmax(beta * x) over the last axis."""

        def write(b: flatbuffers.Builder) -> int:
            tflite.SoftmaxOptionsStart(b)
            tflite.SoftmaxOptionsAddBeta(b, beta)
            return int(tflite.SoftmaxOptionsEnd(b))

        self.operator(
            tflite.BuiltinOperator.SOFTMAX, [x], [out], tflite.BuiltinOptions.SoftmaxOptions, write
        )

    def add(self, a: int, b_: int, out: int) -> None:
        """out = a + b (broadcasting), no fused activation."""

        def write(b: flatbuffers.Builder) -> int:
            tflite.AddOptionsStart(b)
            tflite.AddOptionsAddFusedActivationFunction(b, tflite.ActivationFunctionType.NONE)
            return int(tflite.AddOptionsEnd(b))

        self.operator(
            tflite.BuiltinOperator.ADD, [a, b_], [out], tflite.BuiltinOptions.AddOptions, write
        )

    # -- serialisation -----------------------------------------------------------------------

    def build(self, inputs: Sequence[int], outputs: Sequence[int]) -> bytes:
        """Serialise the model with the given subgraph inputs and outputs."""
        b = flatbuffers.Builder(1024)
        buffers = _offset_vector(b, [self._write_buffer(b, data) for data in self._buffers])
        subgraph = self._write_subgraph(b, inputs, outputs)
        opcodes = _offset_vector(b, [self._write_opcode(b, code) for code in self._opcodes])
        signature = self._write_signature(b, inputs, outputs)
        description = b.CreateString(self.description)
        subgraphs = _offset_vector(b, [subgraph])
        signatures = _offset_vector(b, [signature])
        tflite.ModelStart(b)
        tflite.ModelAddVersion(b, SCHEMA_VERSION)
        tflite.ModelAddOperatorCodes(b, opcodes)
        tflite.ModelAddSubgraphs(b, subgraphs)
        tflite.ModelAddDescription(b, description)
        tflite.ModelAddBuffers(b, buffers)
        tflite.ModelAddSignatureDefs(b, signatures)
        b.Finish(tflite.ModelEnd(b), file_identifier=FILE_IDENTIFIER)
        return bytes(b.Output())

    def save(self, path: StrPath, inputs: Sequence[int], outputs: Sequence[int]) -> Path:
        """Write :meth:`build` to ``path`` and return it."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(self.build(inputs, outputs))
        return out

    def _add_tensor(
        self,
        name: str,
        shape: tuple[int, ...],
        signature: tuple[int, ...] | None,
        dtype: np.dtype[np.generic],
        buffer: int,
    ) -> int:
        if dtype not in _TENSOR_TYPES:
            raise ValueError(f"unsupported tensor dtype {dtype}")
        self._tensors.append(_Tensor(name, shape, signature, _TENSOR_TYPES[dtype], buffer))
        return len(self._tensors) - 1

    @staticmethod
    def _write_buffer(b: flatbuffers.Builder, data: bytes) -> int:
        vec = _aligned_bytes(b, data, BUFFER_ALIGNMENT) if data else None
        tflite.BufferStart(b)
        if vec is not None:
            tflite.BufferAddData(b, vec)
        return int(tflite.BufferEnd(b))

    @staticmethod
    def _write_tensor(b: flatbuffers.Builder, t: _Tensor) -> int:
        name = b.CreateString(t.name)
        shape = _int32_vector(b, t.shape)
        sig = None if t.signature is None else _int32_vector(b, t.signature)
        tflite.TensorStart(b)
        tflite.TensorAddShape(b, shape)
        tflite.TensorAddType(b, t.type_code)
        tflite.TensorAddBuffer(b, t.buffer)
        tflite.TensorAddName(b, name)
        if sig is not None:
            tflite.TensorAddShapeSignature(b, sig)
        return int(tflite.TensorEnd(b))

    @staticmethod
    def _write_operator(b: flatbuffers.Builder, op: _Operator) -> int:
        options = None if op.options is None else op.options(b)
        inputs = _int32_vector(b, op.inputs)
        outputs = _int32_vector(b, op.outputs)
        tflite.OperatorStart(b)
        tflite.OperatorAddOpcodeIndex(b, op.opcode)
        tflite.OperatorAddInputs(b, inputs)
        tflite.OperatorAddOutputs(b, outputs)
        if options is not None:
            tflite.OperatorAddBuiltinOptionsType(b, op.options_type)
            tflite.OperatorAddBuiltinOptions(b, options)
        return int(tflite.OperatorEnd(b))

    @staticmethod
    def _write_opcode(b: flatbuffers.Builder, code: int) -> int:
        tflite.OperatorCodeStart(b)
        # Codes < 127 also go in the deprecated int8 field, which older readers still use.
        tflite.OperatorCodeAddDeprecatedBuiltinCode(b, min(code, 127))
        tflite.OperatorCodeAddBuiltinCode(b, code)
        tflite.OperatorCodeAddVersion(b, 1)
        return int(tflite.OperatorCodeEnd(b))

    def _write_subgraph(
        self, b: flatbuffers.Builder, inputs: Sequence[int], outputs: Sequence[int]
    ) -> int:
        tensors = _offset_vector(b, [self._write_tensor(b, t) for t in self._tensors])
        operators = _offset_vector(b, [self._write_operator(b, op) for op in self._operators])
        ins, outs = _int32_vector(b, inputs), _int32_vector(b, outputs)
        name = b.CreateString("main")
        tflite.SubGraphStart(b)
        tflite.SubGraphAddTensors(b, tensors)
        tflite.SubGraphAddInputs(b, ins)
        tflite.SubGraphAddOutputs(b, outs)
        tflite.SubGraphAddOperators(b, operators)
        tflite.SubGraphAddName(b, name)
        return int(tflite.SubGraphEnd(b))

    def _write_tensor_map(self, b: flatbuffers.Builder, index: int) -> int:
        name = b.CreateString(self._tensors[index].name)
        tflite.TensorMapStart(b)
        tflite.TensorMapAddName(b, name)
        tflite.TensorMapAddTensorIndex(b, index)
        return int(tflite.TensorMapEnd(b))

    def _write_signature(
        self, b: flatbuffers.Builder, inputs: Sequence[int], outputs: Sequence[int]
    ) -> int:
        ins = _offset_vector(b, [self._write_tensor_map(b, i) for i in inputs])
        outs = _offset_vector(b, [self._write_tensor_map(b, i) for i in outputs])
        key = b.CreateString(SIGNATURE_KEY)
        tflite.SignatureDefStart(b)
        tflite.SignatureDefAddInputs(b, ins)
        tflite.SignatureDefAddOutputs(b, outs)
        tflite.SignatureDefAddSignatureKey(b, key)
        tflite.SignatureDefAddSubgraphIndex(b, 0)
        return int(tflite.SignatureDefEnd(b))


# --------------------------------------------------------------------------------------------
# models


@dataclass(frozen=True)
class _MlpWeights:
    w1: FloatArray  # [in_dim, hidden], as in onnx_models (store .T for FULLY_CONNECTED)
    b1: FloatArray
    w2: FloatArray  # [hidden, out_dim]
    b2: FloatArray


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> FloatArray:
    return (rng.standard_normal(shape) * std).astype(np.float32)


def _mlp_weights(in_dim: int, hidden: int, out_dim: int, seed: int) -> _MlpWeights:
    """Identical to ``onnx_models._mlp_weights`` (same draws, same order)."""
    rng = np.random.default_rng(seed)
    return _MlpWeights(
        w1=_normal(rng, (in_dim, hidden), (2.0 / in_dim) ** 0.5),
        b1=_normal(rng, (hidden,), 0.1),
        w2=_normal(rng, (hidden, out_dim), (1.0 / hidden) ** 0.5),
        b2=_normal(rng, (out_dim,), 0.1),
    )


def _mlp_builder(
    batch: int | None, in_dim: int, hidden: int, out_dim: int, seed: int
) -> tuple[ModelBuilder, int, int]:
    """FC+RELU -> FC graph; returns (builder, input tensor, logits tensor).

    ``batch=None`` means dynamic: stored shape 1, shape_signature -1.
    """
    w = _mlp_weights(in_dim, hidden, out_dim, seed)
    m = ModelBuilder()

    def act(name: str, dim: int) -> int:
        if batch is None:
            return m.tensor(name, [1, dim], signature=[-1, dim])
        return m.tensor(name, [batch, dim])

    x, h, logits = act("x", in_dim), act("hidden", hidden), act("logits", out_dim)
    relu = tflite.ActivationFunctionType.RELU
    m.fully_connected(x, m.constant("w1", w.w1.T), m.constant("b1", w.b1), h, relu)
    m.fully_connected(h, m.constant("w2", w.w2.T), m.constant("b2", w.b2), logits)
    return m, x, logits


def _softmax_mlp(path: StrPath, batch: int | None, dims: tuple[int, int, int], seed: int) -> Path:
    m, x, logits = _mlp_builder(batch, *dims, seed)
    out_dim = dims[2]
    if batch is None:
        probs = m.tensor("probs", [1, out_dim], signature=[-1, out_dim])
    else:
        probs = m.tensor("probs", [batch, out_dim])
    m.softmax(logits, probs)
    return m.save(path, [x], [probs])


def mlp(path: StrPath, in_dim: int = 16, hidden: int = 32, out_dim: int = 8, seed: int = 0) -> Path:
    """x[-1,in_dim] -> FULLY_CONNECTED (fused RELU) -> FULLY_CONNECTED -> SOFTMAX = probs.

    The batch dim is dynamic (stored as 1, shape_signature -1).
    """
    return _softmax_mlp(path, None, (in_dim, hidden, out_dim), seed)


def mlp_logits(
    path: StrPath, in_dim: int = 16, hidden: int = 32, out_dim: int = 8, seed: int = 0
) -> Path:
    """:func:`mlp` without the SOFTMAX: output ``logits`` [-1,out_dim]."""
    m, x, logits = _mlp_builder(None, in_dim, hidden, out_dim, seed)
    return m.save(path, [x], [logits])


def static_mlp(
    path: StrPath, in_dim: int = 16, hidden: int = 32, out_dim: int = 8, seed: int = 0
) -> Path:
    """:func:`mlp` with a fixed batch of 2 (no shape_signature, nothing to resize)."""
    return _softmax_mlp(path, 2, (in_dim, hidden, out_dim), seed)


def mlp_reference(
    x: npt.ArrayLike, in_dim: int = 16, hidden: int = 32, out_dim: int = 8, seed: int = 0
) -> dict[str, FloatArray]:
    """Numpy ``{"probs", "logits"}`` of :func:`mlp` / :func:`mlp_logits` / :func:`static_mlp`."""
    w = _mlp_weights(in_dim, hidden, out_dim, seed)
    h = np.maximum(np.asarray(x, np.float64) @ w.w1 + w.b1, 0.0)
    logits = h @ w.w2 + w.b2
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs = e / e.sum(axis=-1, keepdims=True)
    return {"probs": probs.astype(np.float32), "logits": logits.astype(np.float32)}


def two_inputs(path: StrPath) -> Path:
    """a[-1,4] + b[-1,4] -> ADD -> sum[-1,4] (two named inputs)."""
    m = ModelBuilder()
    a = m.tensor("a", [1, 4], signature=[-1, 4])
    b = m.tensor("b", [1, 4], signature=[-1, 4])
    total = m.tensor("sum", [1, 4], signature=[-1, 4])
    m.add(a, b, total)
    return m.save(path, [a, b], [total])


def two_inputs_reference(a: npt.ArrayLike, b: npt.ArrayLike) -> dict[str, FloatArray]:
    """Numpy ``{"sum"}`` of :func:`two_inputs`."""
    return {"sum": (np.asarray(a, np.float32) + np.asarray(b, np.float32)).astype(np.float32)}
