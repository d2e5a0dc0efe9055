"""Deterministic test models built in code: ONNX, TFLite and a fake TFLite delegate.

``onnx_models`` and ``tflite_models`` write small real models (no TensorFlow or PyTorch
needed); ``delegates`` compiles a fake external delegate that covers every delegate
failure path. Each builder takes an output path and returns it as a ``pathlib.Path``.
"""
