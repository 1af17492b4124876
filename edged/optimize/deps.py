"""Optional libraries the optimizer needs, imported only when a variant asks for them.

A missing library is an :class:`~edged.errors.EngineUnavailableError` naming
the extra to install, never an ``ImportError`` from deep inside a quantizer.
"""

from __future__ import annotations

import contextlib
import importlib
import io
from typing import Any

from edged.errors import EngineUnavailableError

OPTIMIZE_EXTRA = "pip install 'edged[optimize]'"


def _need(module: str, what: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise EngineUnavailableError(f"{what} needs the {module.split('.', maxsplit=1)[0]!r} package, which is not "
                                     f"installed ({e}); install it with: {OPTIMIZE_EXTRA}") from None


def onnx() -> Any:
    return _need("onnx", "ONNX model conversion")


def onnx_quantization() -> Any:
    """``onnxruntime.quantization`` (it needs the ``onnx`` package as well)."""
    _need("onnx", "ONNX Runtime static INT8 quantization")
    return _need("onnxruntime.quantization", "ONNX Runtime static INT8 quantization")


def openvino() -> Any:
    return _need("openvino", "OpenVINO IR conversion")


def nncf() -> Any:
    """NNCF, whose import may print a banner on stdout: that is swallowed so the summary stays clean."""
    with contextlib.redirect_stdout(io.StringIO()):
        return _need("nncf", "OpenVINO INT8 post-training quantization (NNCF)")


def tensorrt_unavailable_reason() -> str | None:
    """Why TensorRT engines cannot be built here, or None when the library and a CUDA GPU are present."""
    try:
        trt = importlib.import_module("tensorrt")
    except ImportError:
        return "TensorRT is not installed here (no 'tensorrt' Python package)"
    except Exception as e:  # a broken CUDA install fails inside the import
        return f"TensorRT cannot be imported: {e}"
    try:
        builder = trt.Builder(trt.Logger(trt.Logger.ERROR))
    except Exception as e:
        return f"TensorRT finds no usable NVIDIA GPU: {e}"
    if builder is None:
        return "TensorRT finds no usable NVIDIA GPU"
    return None
