"""Bringing an ONNX model to an opset ONNX Runtime's QDQ quantizer can express, checked before use.

Per-channel weights need ``DequantizeLinear``'s ``axis`` attribute, which exists from opset 13;
quantizing an opset 10-12 model per channel writes a graph no runtime loads (PaddleOCR,
PaddleDetection and many exporters ship opset 10-12). So an older model is converted with ONNX's
version converter, and the converted FP32 model is run against the original on calibration
samples: only when every output matches is it used. Otherwise (or when the converter fails) the
weights are quantized per tensor on the original opset, which opset 10 already expresses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edged.optimize import deps
from edged.optimize.data import SampleSet
from edged.optimize.modelio import ModelIO

PER_CHANNEL_OPSET = 13  # DequantizeLinear gained `axis` here
MIN_QDQ_OPSET = 10  # QuantizeLinear/DequantizeLinear exist from here
CHECK_FEEDS = 4
CHECK_RTOL = 1e-4
CHECK_ATOL = 1e-5


class OpsetError(Exception):
    """The model cannot be expressed with Q/DQ at all; the message says why."""


@dataclass
class OpsetPlan:
    """Which model file to quantize and how; ``notes`` explain the choice for the report."""

    source: Path
    per_channel: bool
    opset_from: int
    opset_to: int
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"weights": "per-channel" if self.per_channel else "per-tensor",
                "opset_from": self.opset_from, "opset_to": self.opset_to}


def model_opset(model: Any) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return int(imp.version)
    return 1


def _session(path_or_bytes: Path | bytes) -> Any:
    import onnxruntime as ort

    from edged.backends.onnxruntime import session_options

    opts = session_options()
    opts.log_severity_level = 3
    src = str(path_or_bytes) if isinstance(path_or_bytes, Path) else path_or_bytes
    return ort.InferenceSession(src, sess_options=opts, providers=["CPUExecutionProvider"])


def compare_models(original: Path, converted: Path, calib: SampleSet, model_io: ModelIO) -> float | None:
    """The largest output difference beyond tolerance on a few calibration feeds, or None when they match."""
    a, b = _session(original), _session(converted)
    worst: float | None = None
    for i, feed in enumerate(calib.feeds(model_io, 8)):
        if i >= CHECK_FEEDS:
            break
        for xa, ya in zip(a.run(None, feed), b.run(None, feed), strict=True):
            x, y = np.asarray(xa), np.asarray(ya)
            if x.shape != y.shape:
                return float("inf")
            if x.dtype.kind in "fc" and not np.allclose(x, y, rtol=CHECK_RTOL, atol=CHECK_ATOL, equal_nan=True):
                diff = float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))
                worst = max(worst or 0.0, diff)
            elif x.dtype.kind not in "fc" and not np.array_equal(x, y):
                worst = float("inf")
    return worst


def plan(fp32: Path, scratch: Path, calib: SampleSet, model_io: ModelIO, *, per_channel: bool = True) -> OpsetPlan:
    """Pick the file and the weight granularity for QDQ quantization of ``fp32``."""
    onnx = deps.onnx()
    model = onnx.load(str(fp32))
    opset = model_opset(model)
    if not per_channel or opset >= PER_CHANNEL_OPSET:
        if opset < MIN_QDQ_OPSET:
            raise OpsetError(f"opset {opset} has no QuantizeLinear/DequantizeLinear (opset {MIN_QDQ_OPSET}+)")
        return OpsetPlan(fp32, per_channel, opset, opset)
    converted = scratch / f"opset{PER_CHANNEL_OPSET}.onnx"
    reason = ""
    try:
        from onnx import version_converter

        upgraded = version_converter.convert_version(model, PER_CHANNEL_OPSET)
        onnx.save(upgraded, str(converted))
        diff = compare_models(fp32, converted, calib, model_io)
        if diff is None:
            return OpsetPlan(converted, True, opset, PER_CHANNEL_OPSET, [
                f"opset {opset} converted to {PER_CHANNEL_OPSET} with ONNX's version converter for per-channel "
                f"weights; the converted FP32 model matched the original on {min(CHECK_FEEDS, len(calib))} "
                "calibration feeds"])
        reason = (f"the opset {PER_CHANNEL_OPSET} conversion was refused: its FP32 outputs differ from the "
                  f"original's by {diff:.3g} on calibration data")
    except Exception as e:  # the converter has no adapter for some ops; the original still quantizes
        reason = f"ONNX's version converter could not reach opset {PER_CHANNEL_OPSET} ({type(e).__name__}: {e})"
    if opset < MIN_QDQ_OPSET:
        raise OpsetError(f"opset {opset} has no QuantizeLinear/DequantizeLinear and {reason}")
    return OpsetPlan(fp32, False, opset, opset, [
        f"per-tensor weights on opset {opset}: per-channel needs opset {PER_CHANNEL_OPSET} and {reason}"])
