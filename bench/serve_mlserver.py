"""MLServer's side of bench/serve.py: a custom runtime running the same onnxruntime session.

MLServer imports it by name (`serve_mlserver.OnnxRuntime`, model-settings.json) in each of its
parallel workers; it runs in the benchmark's throwaway venv, never in the project's.
"""

from __future__ import annotations

from typing import Any

from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class OnnxRuntime(MLModel):  # type: ignore[misc]
    async def load(self) -> bool:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        so.inter_op_num_threads = 1
        self._sess = ort.InferenceSession(self.settings.parameters.uri, sess_options=so,
                                          providers=["CPUExecutionProvider"])
        self._names = [o.name for o in self._sess.get_outputs()]
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        feeds: dict[str, Any] = {t.name: NumpyCodec.decode_input(t) for t in payload.inputs}
        outs = self._sess.run(self._names, feeds)
        return InferenceResponse(model_name=self.name, outputs=[
            NumpyCodec.encode_output(name, out) for name, out in zip(self._names, outs, strict=True)])
