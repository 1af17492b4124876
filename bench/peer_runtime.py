"""The peer row's model: the bundled ONNX model behind a stock MLServer, as its docs show a custom
runtime (MLModel, NumpyCodec). Runs in a throwaway venv outside the repo, never inside edged.

bench/run_suite.py --peer-venv DIR copies this file next to the MLServer settings it writes.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class OnnxModel(MLModel):
    async def load(self) -> bool:
        uri = self.settings.parameters.uri if self.settings.parameters else None
        assert uri, "model-settings.json needs parameters.uri"
        self.session = ort.InferenceSession(uri, providers=["CPUExecutionProvider"])
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        feeds = {i.name: NumpyCodec.decode_input(i).astype(np.float32, copy=False) for i in payload.inputs}
        outs = self.session.run(self.output_names, feeds)
        return InferenceResponse(model_name=self.name, outputs=[
            NumpyCodec.encode_output(n, o) for n, o in zip(self.output_names, outs, strict=True)])
