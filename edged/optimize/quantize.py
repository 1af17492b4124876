"""Making the variants: ONNX Runtime static INT8 (QDQ), OpenVINO IR FP16, OpenVINO INT8 (NNCF).

Each function writes one artifact from the FP32 ONNX file; none touches the
version folder's other files. The quantizers' own chatter (ORT's logging
warnings, NNCF's progress bars on stdout) is kept off the terminal: progress is
shown by the caller's :class:`~edged.optimize.progress.Progress`.
"""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from edged.optimize import deps
from edged.optimize.data import SampleSet
from edged.optimize.modelio import ModelIO
from edged.optimize.progress import Progress
from edged.optimize.recipes import CALIBRATION_METHODS

CALIBRATION_BATCH = 32


def calibration_batch(method: str) -> int:
    """Samples per calibration feed. ONNX Runtime's histogram calibrators stack every feed's
    activations into one array, so they need equal-sized feeds: one sample each."""
    return CALIBRATION_BATCH if method == "minmax" else 1


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence library warnings and stdout while a quantizer runs (restored afterwards)."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logging.disable(previous)


class _Reader:
    """ONNX Runtime's CalibrationDataReader protocol (``get_next``), counting batches into a progress line."""

    def __init__(self, calib: SampleSet, model_io: ModelIO, batch: int, progress: Progress) -> None:
        self._feeds = calib.feeds(model_io, batch)
        self._progress = progress

    def get_next(self) -> dict[str, np.ndarray] | None:
        feed = next(self._feeds, None)
        if feed is not None:
            self._progress.advance()
        return feed


def onnx_int8(fp32: Path, out: Path, calib: SampleSet, model_io: ModelIO, *, method: str,
              per_channel: bool = True, reduce_range: bool = True, progress: Progress) -> list[str]:
    """Static QDQ quantization: int8 weights (per channel), uint8 activations calibrated on ``calib``.

    ``reduce_range`` keeps weights to 7 bits so that CPUs without VNNI cannot saturate
    their u8 x s8 products: the accuracy measured here then holds on other hosts too.
    Returns notes for the report (e.g. a pre-processing step that had to be skipped).
    """
    q = deps.onnx_quantization()
    if method not in CALIBRATION_METHODS:
        raise ValueError(f"unknown calibration method {method!r}")
    notes: list[str] = []
    calibrate = {"minmax": q.CalibrationMethod.MinMax, "entropy": q.CalibrationMethod.Entropy,
                 "percentile": q.CalibrationMethod.Percentile}[method]
    with tempfile.TemporaryDirectory(prefix="edged-quant-") as scratch:
        source = fp32
        pre = Path(scratch) / "pre.onnx"
        try:
            with _quiet():
                q.quant_pre_process(str(fp32), str(pre), skip_symbolic_shape=True)
            source = pre
        except Exception as e:  # shape inference fails on some exotic graphs; quantizing still works
            notes.append(f"ONNX pre-processing skipped ({type(e).__name__}: {e})")
        with _quiet():
            q.quantize_static(
                str(source), str(out), _Reader(calib, model_io, calibration_batch(method), progress),
                quant_format=q.QuantFormat.QDQ, per_channel=per_channel, reduce_range=reduce_range,
                activation_type=q.QuantType.QUInt8, weight_type=q.QuantType.QInt8,
                calibrate_method=calibrate,
            )
    return notes


def openvino_ir(fp32: Path, xml: Path, *, fp16: bool) -> None:
    """ONNX -> OpenVINO IR; with ``fp16`` the weights are stored as FP16 (the device picks compute precision)."""
    ov = deps.openvino()
    model = ov.convert_model(str(fp32))
    xml.parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(model, str(xml), compress_to_fp16=fp16)


def openvino_int8(fp32: Path, xml: Path, calib: SampleSet, model_io: ModelIO, *, progress: Progress) -> None:
    """NNCF post-training quantization of the OpenVINO model, one calibration sample per item.

    NNCF collects statistics per item; single samples keep them independent of how
    the data happened to be batched.
    """
    ov = deps.openvino()
    nncf = deps.nncf()
    items = list(calib.feeds(model_io, 1))

    def transform(item: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        progress.advance()
        return item

    model = ov.convert_model(str(fp32))
    dataset = nncf.Dataset(items, transform)
    nncf_logger: Any = logging.getLogger("nncf")
    level = nncf_logger.level
    nncf.set_log_level(logging.ERROR)
    try:
        with _quiet():
            quantized = nncf.quantize(model, dataset, subset_size=len(items))
    finally:
        nncf.set_log_level(level)
    xml.parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(quantized, str(xml), compress_to_fp16=False)
