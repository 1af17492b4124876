"""Backend lookup by name; each library is imported only when its backend is used."""

from __future__ import annotations

from edged.backends.base import Backend
from edged.errors import EngineUnavailableError

BACKEND_NAMES = ("tensorrt", "openvino", "onnxruntime")
_instances: dict[str, Backend] = {}


def get_backend(name: str) -> Backend:
    if name not in _instances:
        if name == "onnxruntime":
            from edged.backends.onnxruntime import OnnxRuntimeBackend
            _instances[name] = OnnxRuntimeBackend()
        elif name == "openvino":
            from edged.backends.openvino import OpenVinoBackend
            _instances[name] = OpenVinoBackend()
        elif name == "tensorrt":
            from edged.backends.tensorrt import TensorRtBackend
            _instances[name] = TensorRtBackend()
        else:
            raise EngineUnavailableError(f"unknown backend {name!r}; known: {', '.join(BACKEND_NAMES)}")
    return _instances[name]
