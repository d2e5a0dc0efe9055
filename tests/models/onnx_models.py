"""ONNX test models built with ``onnx.helper``, plus numpy references.

Every builder writes one model to ``path`` and returns it as a ``Path``. Models are pinned to
opset 17 and IR version 8 (onnx 1.23 defaults are newer than onnxruntime accepts) and pass
``onnx.checker.check_model(full_check=True)``. Weights come from ``np.random.default_rng(seed)``,
so the same arguments always give the same file. Batch dimensions are symbolic (``"batch"`` or
``"N"``).

The ``*_reference`` functions recompute a model in numpy (float64, returned as the model's
dtype). Runtimes are not bit-equal to them: compare with ``np.allclose``, never bytes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper, numpy_helper

StrPath = str | os.PathLike[str]
Dim = int | str
FloatArray = npt.NDArray[np.float32]

OPSET = 17
IR_VERSION = 8
POISON_TABLE_ROWS = 10
INT_OFFSET = np.array([1, 2, 3, 4], dtype=np.int32)

__all__ = [
    "batch_centered",
    "cnn",
    "cnn_reference",
    "convnet",
    "convnet_reference",
    "demo_model",
    "demo_reference",
    "identity",
    "int_model",
    "int_reference",
    "mlp",
    "mlp_reference",
    "multi_io",
    "multi_io_reference",
    "nonzero",
    "payload",
    "poison",
    "poison_reference",
    "slow",
    "slow_reference",
    "static_shape",
]


# --------------------------------------------------------------------------------------------
# helpers


def _value(name: str, elem_type: int, shape: list[Dim]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


def _float(name: str, shape: list[Dim]) -> onnx.ValueInfoProto:
    return _value(name, TensorProto.FLOAT, shape)


def _init(name: str, array: npt.NDArray[np.generic]) -> onnx.TensorProto:
    return numpy_helper.from_array(np.ascontiguousarray(array), name)


def _save(graph: onnx.GraphProto, path: StrPath) -> Path:
    """Wrap ``graph`` in an opset-17 / IR-8 model, check it fully and write it."""
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="slabpool-tests",
    )
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(out))
    return out


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> FloatArray:
    return (rng.standard_normal(shape) * std).astype(np.float32)


def _softmax(z: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)  # type: ignore[no-any-return]


def _relu(z: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    return np.maximum(z, 0.0)


# --------------------------------------------------------------------------------------------
# mlp


@dataclass(frozen=True)
class _MlpWeights:
    w1: FloatArray  # [in_dim, hidden]
    b1: FloatArray
    w2: FloatArray  # [hidden, out_dim]
    b2: FloatArray


def _mlp_weights(in_dim: int, hidden: int, out_dim: int, seed: int) -> _MlpWeights:
    rng = np.random.default_rng(seed)
    return _MlpWeights(
        w1=_normal(rng, (in_dim, hidden), (2.0 / in_dim) ** 0.5),
        b1=_normal(rng, (hidden,), 0.1),
        w2=_normal(rng, (hidden, out_dim), (1.0 / hidden) ** 0.5),
        b2=_normal(rng, (out_dim,), 0.1),
    )


def mlp(path: StrPath, in_dim: int = 16, hidden: int = 32, out_dim: int = 8, seed: int = 0) -> Path:
    """x[batch,in_dim] -> MatMul+Add+Relu -> MatMul+Add = logits -> Softmax = probs.

    Outputs are ``probs`` then ``logits``, both ``[batch, out_dim]`` float32.
    """
    w = _mlp_weights(in_dim, hidden, out_dim, seed)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h_mm"]),
        helper.make_node("Add", ["h_mm", "b1"], ["h_pre"]),
        helper.make_node("Relu", ["h_pre"], ["h"]),
        helper.make_node("MatMul", ["h", "w2"], ["l_mm"]),
        helper.make_node("Add", ["l_mm", "b2"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [_float("x", ["batch", in_dim])],
        [_float("probs", ["batch", out_dim]), _float("logits", ["batch", out_dim])],
        [_init("w1", w.w1), _init("b1", w.b1), _init("w2", w.w2), _init("b2", w.b2)],
    )
    return _save(graph, path)


def mlp_reference(
    x: npt.ArrayLike, in_dim: int = 16, hidden: int = 32, out_dim: int = 8, seed: int = 0
) -> dict[str, FloatArray]:
    """Numpy ``{"probs", "logits"}`` of :func:`mlp` built with the same arguments."""
    w = _mlp_weights(in_dim, hidden, out_dim, seed)
    h = _relu(np.asarray(x, np.float64) @ w.w1 + w.b1)
    logits = h @ w.w2 + w.b2
    return {
        "probs": _softmax(logits).astype(np.float32),
        "logits": logits.astype(np.float32),
    }


# --------------------------------------------------------------------------------------------
# conv nets: convnet (tiny), cnn (benchmark-sized), demo_model (bundled with the engine)


@dataclass(frozen=True)
class _ConvLayer:
    weight: FloatArray  # [out_ch, in_ch, 3, 3]
    bias: FloatArray
    stride: int


@dataclass(frozen=True)
class _CnnWeights:
    convs: tuple[_ConvLayer, ...]
    fc_w: FloatArray  # [channels, classes]
    fc_b: FloatArray


def _cnn_weights(width: int, depth: int, classes: int, seed: int) -> _CnnWeights:
    """He-initialised conv stack; every odd layer has stride 2."""
    rng = np.random.default_rng(seed)
    convs = []
    in_ch = 3
    for i in range(depth):
        std = (2.0 / (in_ch * 9)) ** 0.5
        weight = _normal(rng, (width, in_ch, 3, 3), std)
        convs.append(_ConvLayer(weight, _normal(rng, (width,), 0.05), 2 if i % 2 else 1))
        in_ch = width
    fc_w = _normal(rng, (width, classes), (1.0 / width) ** 0.5)
    return _CnnWeights(tuple(convs), fc_w, _normal(rng, (classes,), 0.05))


def _cnn_graph(name: str, w: _CnnWeights, size: int, classes: int) -> onnx.GraphProto:
    """image[N,3,S,S] -> (Conv3x3 pad 1 + Relu) x depth -> GAP -> Flatten -> Gemm -> Softmax."""
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    prev = "image"
    for i, layer in enumerate(w.convs):
        wn, bn, cn, rn = f"conv{i}_w", f"conv{i}_b", f"conv{i}", f"relu{i}"
        inits += [_init(wn, layer.weight), _init(bn, layer.bias)]
        conv = helper.make_node(
            "Conv",
            [prev, wn, bn],
            [cn],
            kernel_shape=[3, 3],
            pads=[1, 1, 1, 1],
            strides=[layer.stride, layer.stride],
        )
        nodes += [conv, helper.make_node("Relu", [cn], [rn])]
        prev = rn
    inits += [_init("fc_w", w.fc_w), _init("fc_b", w.fc_b)]
    nodes += [
        helper.make_node("GlobalAveragePool", [prev], ["gap"]),
        helper.make_node("Flatten", ["gap"], ["flat"], axis=1),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
    ]
    return helper.make_graph(
        nodes,
        name,
        [_float("image", ["N", 3, size, size])],
        [_float("probs", ["N", classes])],
        inits,
    )


def _conv2d(x: npt.NDArray[np.float64], layer: _ConvLayer) -> npt.NDArray[np.float64]:
    """3x3 convolution with zero padding 1 and the layer's stride (NCHW), one tap at a time."""
    n, _, h, w = x.shape
    s = layer.stride
    h_out, w_out = (h - 1) // s + 1, (w - 1) // s + 1
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    weight = layer.weight.astype(np.float64)
    out = np.zeros((weight.shape[0], n, h_out, w_out))
    for i in range(3):
        for j in range(3):
            tap = padded[:, :, i : i + s * h_out : s, j : j + s * w_out : s]
            out += np.tensordot(weight[:, :, i, j], tap, axes=([1], [1]))
    return out.transpose(1, 0, 2, 3) + layer.bias[None, :, None, None]


def _cnn_forward(image: npt.ArrayLike, w: _CnnWeights) -> FloatArray:
    h = np.asarray(image, np.float64)
    for layer in w.convs:
        h = _relu(_conv2d(h, layer))
    logits = h.mean(axis=(2, 3)) @ w.fc_w + w.fc_b
    return _softmax(logits).astype(np.float32)


def convnet(
    path: StrPath, channels: int = 8, size: int = 16, classes: int = 10, seed: int = 0
) -> Path:
    """image[N,3,size,size] -> Conv3x3 pad 1 + Relu -> GlobalAveragePool -> Flatten -> Gemm
    -> Softmax = probs[N,classes]."""
    w = _cnn_weights(channels, 1, classes, seed)
    return _save(_cnn_graph("convnet", w, size, classes), path)


def convnet_reference(
    image: npt.ArrayLike, channels: int = 8, classes: int = 10, seed: int = 0
) -> dict[str, FloatArray]:
    """Numpy ``{"probs"}`` of :func:`convnet` (any image size)."""
    return {"probs": _cnn_forward(image, _cnn_weights(channels, 1, classes, seed))}


def cnn(
    path: StrPath,
    width: int = 64,
    depth: int = 4,
    size: int = 128,
    classes: int = 10,
    seed: int = 0,
) -> Path:
    """Mid-size CPU-bound CNN for benchmarks.

    image[N,3,size,size] -> ``depth`` x (Conv3x3 pad 1, ``width`` channels, + Relu), every odd
    layer with stride 2 -> GlobalAveragePool -> Flatten -> Gemm -> Softmax = probs[N,classes].

    Measured with onnxruntime 1.32 CPU, intra_op_num_threads=1, ENABLE_ALL, on the 2-vCPU
    development VM (AVX-512): median 4.4 ms per item at batch 1, 4.6-4.9 ms/item at batch 8.
    The file is about 450 KB.
    """
    w = _cnn_weights(width, depth, classes, seed)
    return _save(_cnn_graph("cnn", w, size, classes), path)


def cnn_reference(
    image: npt.ArrayLike, width: int = 64, depth: int = 4, classes: int = 10, seed: int = 0
) -> dict[str, FloatArray]:
    """Numpy ``{"probs"}`` of :func:`cnn` (any image size)."""
    return {"probs": _cnn_forward(image, _cnn_weights(width, depth, classes, seed))}


DEMO_SIZE = 112
DEMO_WIDTH = 48
DEMO_DEPTH = 4
DEMO_CLASSES = 10


def demo_model(path: StrPath) -> Path:
    """The model slabpool bundles as its demo (``engine/data/demo.onnx``).

    The :func:`cnn` graph with width 48, depth 4, 112x112 images, 10 classes, seed 0.
    Measured (onnxruntime 1.32, 1 intra-op thread, 2-vCPU AVX-512 VM): median 2.0 ms per item
    at batch 1, 2.1-2.2 ms/item at batch 8; the file is about 258 KB.
    """
    return cnn(path, width=DEMO_WIDTH, depth=DEMO_DEPTH, size=DEMO_SIZE, classes=DEMO_CLASSES)


def demo_reference(image: npt.ArrayLike) -> dict[str, FloatArray]:
    """Numpy ``{"probs"}`` of :func:`demo_model`."""
    return cnn_reference(image, width=DEMO_WIDTH, depth=DEMO_DEPTH, classes=DEMO_CLASSES)


# --------------------------------------------------------------------------------------------
# names, dtypes and failure paths


def multi_io(path: StrPath) -> Path:
    """Two inputs of mixed dtype, two outputs.

    Inputs ``feats`` float32 [batch,4] and ``ids`` int64 [batch]. Outputs:
    ``sum`` float32 [batch] = feats.sum(axis=1) + float(ids), and
    ``total`` float32 [1] = sum(sum) (ReduceSum, keepdims), i.e. a whole-batch value that is
    *not* per item.
    """
    nodes = [
        helper.make_node("ReduceSum", ["feats", "axis1"], ["feat_sum"], keepdims=0),
        helper.make_node("Cast", ["ids"], ["ids_f"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["feat_sum", "ids_f"], ["sum"]),
        helper.make_node("ReduceSum", ["sum"], ["total"], keepdims=1),
    ]
    graph = helper.make_graph(
        nodes,
        "multi_io",
        [_float("feats", ["batch", 4]), _value("ids", TensorProto.INT64, ["batch"])],
        [_float("sum", ["batch"]), _float("total", [1])],
        [_init("axis1", np.array([1], dtype=np.int64))],
    )
    return _save(graph, path)


def two_lengths(path: StrPath, first: str = "N", second: str = "M") -> Path:
    """Inputs ``a`` float32 [first,4] and ``b`` float32 [second,4], output ``y`` = the two
    stacked (Concat on axis 0): with two names, sizes that may differ (ONNX's dim_params)."""
    graph = helper.make_graph(
        [helper.make_node("Concat", ["a", "b"], ["y"], axis=0)],
        "two_lengths",
        [_float("a", [first, 4]), _float("b", [second, 4])],
        [_float("y", ["total", 4])],
    )
    return _save(graph, path)


def multi_io_reference(feats: npt.ArrayLike, ids: npt.ArrayLike) -> dict[str, FloatArray]:
    """Numpy ``{"sum", "total"}`` of :func:`multi_io`."""
    s = np.asarray(feats, np.float64).sum(axis=1) + np.asarray(ids, np.float64)
    return {"sum": s.astype(np.float32), "total": np.array([s.sum()], dtype=np.float32)}


def _poison_table() -> FloatArray:
    return (np.arange(POISON_TABLE_ROWS * 4, dtype=np.float32) / 8.0).reshape(-1, 4)


def poison(path: StrPath) -> Path:
    """y[batch,4] = Gather(table[10,4], idx[batch]) + x[batch,4].

    Any ``idx`` outside [-10, 9] makes onnxruntime raise ``InvalidArgument`` at run time: a
    deterministic per-item runtime error that leaves the session usable.
    """
    nodes = [
        helper.make_node("Gather", ["table", "idx"], ["rows"], axis=0),
        helper.make_node("Add", ["rows", "x"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "poison",
        [_value("idx", TensorProto.INT64, ["batch"]), _float("x", ["batch", 4])],
        [_float("y", ["batch", 4])],
        [_init("table", _poison_table())],
    )
    return _save(graph, path)


def poison_reference(idx: npt.ArrayLike, x: npt.ArrayLike) -> dict[str, FloatArray]:
    """Numpy ``{"y"}`` of :func:`poison`; raises ``IndexError`` where the model would fail."""
    y = _poison_table()[np.asarray(idx, np.int64)] + np.asarray(x, np.float32)
    return {"y": y.astype(np.float32)}


def _slow_weights(k: int, dim: int, seed: int) -> list[FloatArray]:
    rng = np.random.default_rng(seed)
    return [_normal(rng, (dim, dim), (1.0 / dim) ** 0.5) for _ in range(k)]


def slow(path: StrPath, k: int = 8, dim: int = 512, seed: int = 0) -> Path:
    """x[batch,dim] -> k x (MatMul [dim,dim] + Tanh) -> y[batch,dim]: a CPU-time knob.

    Cheap per item on AVX-512 (tenths of a ms at k=8): scale ``k`` and the batch to make runs
    long. The file holds k*dim*dim float32 weights (8 MiB by default).
    """
    nodes: list[onnx.NodeProto] = []
    prev = "x"
    for i in range(k):
        out = "y" if i == k - 1 else f"t{i}"
        nodes += [
            helper.make_node("MatMul", [prev, f"w{i}"], [f"mm{i}"]),
            helper.make_node("Tanh", [f"mm{i}"], [out]),
        ]
        prev = out
    inits = [_init(f"w{i}", w) for i, w in enumerate(_slow_weights(k, dim, seed))]
    graph = helper.make_graph(
        nodes, "slow", [_float("x", ["batch", dim])], [_float("y", ["batch", dim])], inits
    )
    return _save(graph, path)


def slow_reference(
    x: npt.ArrayLike, k: int = 8, dim: int = 512, seed: int = 0
) -> dict[str, FloatArray]:
    """Numpy ``{"y"}`` of :func:`slow`."""
    h = np.asarray(x, np.float64)
    for w in _slow_weights(k, dim, seed):
        h = np.tanh(h @ w)
    return {"y": h.astype(np.float32)}


# --------------------------------------------------------------------------------------------
# weightless models: dispatch overhead, large payloads, static shapes, integer outputs


def identity(path: StrPath, dim: int = 1) -> Path:
    """x[batch,dim] -> Identity -> y: a no-op model for dispatch-overhead benchmarks."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "identity",
        [_float("x", ["batch", dim])],
        [_float("y", ["batch", dim])],
    )
    return _save(graph, path)


def row_sum(path: StrPath, dim: int = 4) -> Path:
    """x[batch,dim] -> ReduceSum over axis 1 -> y[batch]: one number a row (a scorer's shape)."""
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["x", "axis1"], ["y"], keepdims=0)],
        "row_sum",
        [_float("x", ["batch", dim])],
        [_float("y", ["batch"])],
        [_init("axis1", np.array([1], dtype=np.int64))],
    )
    return _save(graph, path)


def batch_centered(path: StrPath, dim: int = 16, poison: bool = False) -> Path:
    """x[batch,dim] -> x - ReduceMean(x, axis 0) -> y: every row's output depends on the other
    rows of its session call, so it tells which rows were run together (block composition).

    `poison`: a second input idx[batch] picks a row of a table of 10 added to y; an ``idx``
    outside [-10, 9] makes the call raise ``InvalidArgument`` (as :func:`poison`)."""
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], axes=[0], keepdims=1),
             helper.make_node("Sub", ["x", "m"], ["c" if poison else "y"])]
    inputs, inits = [_float("x", ["batch", dim])], []
    if poison:
        nodes += [helper.make_node("Gather", ["table", "idx"], ["rows"], axis=0),
                  helper.make_node("Add", ["c", "rows"], ["y"])]
        inputs.insert(0, _value("idx", TensorProto.INT64, ["batch"]))
        inits.append(_init("table", np.random.default_rng(3).standard_normal((10, dim)).astype(np.float32)))
    graph = helper.make_graph(nodes, "batch_centered", inputs, [_float("y", ["batch", dim])], inits)
    return _save(graph, path)


def payload(path: StrPath, elements: int = 2 * 1024 * 1024) -> Path:
    """x[batch,elements] -> Mul 2.0 -> y: 8 MiB in and 8 MiB out per item by default."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["y"])],
        "payload",
        [_float("x", ["batch", elements])],
        [_float("y", ["batch", elements])],
        [_init("two", np.array(2.0, dtype=np.float32))],
    )
    return _save(graph, path)


def static_shape(path: StrPath) -> Path:
    """x[2,16] (no dynamic dim at all) -> Relu -> y[2,16]."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "static_shape",
        [_float("x", [2, 16])],
        [_float("y", [2, 16])],
    )
    return _save(graph, path)


def nonzero(path: StrPath, dim: int = 8) -> Path:
    """x float32[batch,dim] -> NonZero -> idx int64[2, nnz]: an output whose shape depends on
    the data, not only on the input's shape."""
    graph = helper.make_graph(
        [helper.make_node("NonZero", ["x"], ["idx"])],
        "nonzero",
        [_float("x", ["batch", dim])],
        [_value("idx", TensorProto.INT64, [2, "nnz"])],
    )
    return _save(graph, path)


def int_model(path: StrPath) -> Path:
    """x int32[batch,4] -> Add INT_OFFSET ([1, 2, 3, 4]) -> y int32[batch,4]."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "offset"], ["y"])],
        "int_model",
        [_value("x", TensorProto.INT32, ["batch", 4])],
        [_value("y", TensorProto.INT32, ["batch", 4])],
        [_init("offset", INT_OFFSET)],
    )
    return _save(graph, path)


def int_reference(x: npt.ArrayLike) -> dict[str, npt.NDArray[np.int32]]:
    """Numpy ``{"y"}`` of :func:`int_model` (exact: integer arithmetic)."""
    return {"y": (np.asarray(x, np.int32) + INT_OFFSET).astype(np.int32)}
