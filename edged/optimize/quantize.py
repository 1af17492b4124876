"""Making the variants: ONNX Runtime static INT8 (QDQ), OpenVINO IR FP16, OpenVINO INT8 (NNCF).

Each function writes one artifact from the FP32 ONNX file; none touches the
version folder's other files. The quantizers' own chatter (ORT's logging
warnings, NNCF's progress bars on stdout) is kept off the terminal: progress is
shown by the caller's :class:`~edged.optimize.progress.Progress`.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
from collections.abc import Iterator, Sequence
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


def onnx_preprocess(source: Path, scratch: Path) -> tuple[Path, list[str]]:
    """ONNX Runtime's pre-quantization pass (shape inference, graph clean-up), once per run.

    Unnamed nodes (common in Paddle exports) get names: excluding a layer from quantization and
    reporting it both need one.
    """
    q = deps.onnx_quantization()
    onnx = deps.onnx()
    pre = scratch / "pre.onnx"
    notes: list[str] = []
    try:
        with _quiet():
            q.quant_pre_process(str(source), str(pre), skip_symbolic_shape=True)
    except Exception as e:  # shape inference fails on some exotic graphs; quantizing still works
        notes.append(f"ONNX pre-processing skipped ({type(e).__name__}: {e})")
        pre = source
    model = onnx.load(str(pre))
    taken = {n.name for n in model.graph.node}
    unnamed = [n for n in model.graph.node if not n.name]
    for i, node in enumerate(unnamed):
        name = f"{node.op_type}_{i}"
        while name in taken:
            name += "_"
        node.name = name
        taken.add(name)
    if unnamed:
        pre = scratch / "named.onnx"
        onnx.save(model, str(pre))
    return pre, notes


def onnx_int8(source: Path, out: Path, calib: SampleSet, model_io: ModelIO, *, method: str,  # noqa: PLR0913  keyword-only quantization options
              per_channel: bool = True, reduce_range: bool = True, progress: Progress,
              exclude: Sequence[str] = (), cache: Path | None = None) -> None:
    """Static QDQ quantization: int8 weights (per channel or per tensor), uint8 activations calibrated on ``calib``.

    ``source`` is the (pre-processed, opset-checked) FP32 model, see :mod:`edged.optimize.opset`.
    ``reduce_range`` keeps weights to 7 bits so that CPUs without VNNI cannot saturate
    their u8 x s8 products: the accuracy measured here then holds on other hosts too.
    ``exclude`` names nodes left in FP32 (the accuracy-aware search, :mod:`edged.optimize.accuracy`).
    ``cache``: a file for the calibrated ranges (ONNX Runtime >= 1.32 reads it back), so the
    search's re-quantizations do not calibrate again.
    """
    q = deps.onnx_quantization()
    if method not in CALIBRATION_METHODS:
        raise ValueError(f"unknown calibration method {method!r}")
    calibrate = {"minmax": q.CalibrationMethod.MinMax, "entropy": q.CalibrationMethod.Entropy,
                 "percentile": q.CalibrationMethod.Percentile}[method]
    extra: dict[str, Any] = {}
    if cache is not None and "calibration_cache_path" in inspect.signature(q.quantize_static).parameters:
        extra["calibration_cache_path"] = str(cache)
    with _quiet():
        q.quantize_static(
            str(source), str(out), _Reader(calib, model_io, calibration_batch(method), progress),
            quant_format=q.QuantFormat.QDQ, per_channel=per_channel, reduce_range=reduce_range,
            activation_type=q.QuantType.QUInt8, weight_type=q.QuantType.QInt8,
            calibrate_method=calibrate, nodes_to_exclude=list(exclude) or None, **extra,
        )


def openvino_ir(fp32: Path, xml: Path, *, fp16: bool) -> None:
    """ONNX -> OpenVINO IR; with ``fp16`` the weights are stored as FP16 (the device picks compute precision).

    A BF16 variant is an IR with FP32 weights: its precision is the backend's inference precision
    hint (``bf16`` on CPUs with AVX512-BF16/AMX), set from the variant's precision at load.
    """
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
