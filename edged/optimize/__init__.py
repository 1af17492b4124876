"""``edged optimize``: quantized variants of an FP32 ONNX model, an accuracy gate, speed measured here.

Modules: :mod:`~edged.optimize.data` (calibration/evaluation files), :mod:`~edged.optimize.quantize`
(ONNX Runtime static INT8, OpenVINO BF16/FP16/INT8 via NNCF), :mod:`~edged.optimize.opset` (opsets
the quantizer can express), :mod:`~edged.optimize.accuracy` (accuracy-aware INT8),
:mod:`~edged.optimize.metrics` (task metrics), :mod:`~edged.optimize.gate` (thresholds),
:mod:`~edged.optimize.timing`, :mod:`~edged.optimize.pipeline` (the run) and
:mod:`~edged.optimize.command` (the CLI). Optional libraries are imported only when used.
"""
