"""The variants ``edged optimize`` can make: key, file layout in the version folder, format, precision."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Recipe:
    key: str
    file: str
    format: str
    precision: str
    extra: tuple[str, ...] = ()

    @property
    def files(self) -> tuple[str, ...]:
        return (self.file, *self.extra)


FP32 = Recipe("fp32", "model.onnx", "onnx", "fp32")
RECIPES: dict[str, Recipe] = {r.key: r for r in (
    Recipe("onnx-int8", "model.int8.onnx", "onnx", "int8"),
    Recipe("openvino-bf16", "openvino/model.bf16.xml", "openvino", "bf16", ("openvino/model.bf16.bin",)),
    Recipe("openvino-fp16", "openvino/model.fp16.xml", "openvino", "fp16", ("openvino/model.fp16.bin",)),
    Recipe("openvino-int8", "openvino/model.int8.xml", "openvino", "int8", ("openvino/model.int8.bin",)),
    Recipe("tensorrt-fp16", "tensorrt/model.fp16.plan", "tensorrt", "fp16"),
    Recipe("tensorrt-int8", "tensorrt/model.int8.plan", "tensorrt", "int8"),
)}
DEFAULT_VARIANTS = tuple(RECIPES)
CALIBRATION_METHODS = ("minmax", "entropy", "percentile")  # ONNX Runtime's static calibrators
