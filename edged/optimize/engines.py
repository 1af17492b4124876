"""Loading a variant through the daemon's own backends, so measured figures are what it will serve."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edged.backends.base import Engine, LoadRequest
from edged.backends.factory import get_backend
from edged.optimize.modelio import ModelIO
from edged.repository.manifest import Variant

# Which backends can run each format on the CPU (OpenVINO reads ONNX as well).
BACKENDS_FOR_FORMAT = {"onnx": ("onnxruntime", "openvino"), "openvino": ("openvino",)}
NATIVE_BACKEND = {"onnx": "onnxruntime", "openvino": "openvino", "tensorrt": "tensorrt"}


@dataclass(frozen=True)
class EngineSpec:
    """One variant on one backend and device: the unit that is gated and timed."""

    variant: Variant
    backend: str
    device: str = "CPU"

    @property
    def label(self) -> str:
        return f"{self.backend}/{self.device}/{self.variant.precision} ({self.variant.file})"


def load_engine(spec: EngineSpec, version_dir: Path, model_io: ModelIO, *, name: str, version: int,
                threads: int = 0) -> Engine:
    """Load like the daemon does (same backend code and defaults), without a compile cache."""
    request = LoadRequest(
        model=name, version=version, version_dir=version_dir, variant=spec.variant, device=spec.device,
        max_batch_size=model_io.max_batch_size, inputs=model_io.specs(model_io.inputs), threads=threads,
        instances=1, cache_dir=None,
    )
    return get_backend(spec.backend).load(request)


def run_outputs(engine: Engine, feeds: list[dict[str, np.ndarray]], model_io: ModelIO) -> dict[str, np.ndarray]:
    """Every output over every feed, with a leading sample axis (stacked for a model without batching)."""
    names = [t.name for t in model_io.outputs]
    parts: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for feed in feeds:
        result = engine.infer(feed, names)
        for n in names:
            parts[n].append(np.asarray(result[n]))
    if model_io.batched:
        return {n: np.concatenate(p) for n, p in parts.items()}
    return {n: np.stack(p) for n, p in parts.items()}


_OV_NAMES = {"f32": "fp32", "f16": "fp16", "bf16": "bf16", "i8": "int8", "u8": "int8"}


def execution_precision(engine: Engine, variant_precision: str) -> str:
    """The precision the engine reports computing in (OpenVINO's inference precision, read back after
    compiling: ``bf16`` on AMX CPUs even for FP16 IR); the variant's own precision for engines that
    report none (ONNX Runtime runs a QDQ file's int8 kernels and the rest in FP32)."""
    reported = engine.describe().get("execution_precision")
    if not reported:
        return variant_precision
    reported = _OV_NAMES.get(str(reported), str(reported))
    if variant_precision == "int8":
        return f"int8+{reported}"  # quantized layers in int8, the layers left in float at this precision
    return str(reported)
