"""`edged optimize` on real public models with old and new opsets (tests/optimize_corpus.py).

Default run (the fast slice): PP-OCR's opset-11 direction classifier gets a loadable ONNX Runtime
INT8 variant (converted to opset 13, per-channel), the accuracy-aware search keeps sensitive layers
in FP32 until a tight gate holds, and a generated opset-11 graph the version converter gets wrong
falls back to per-tensor weights. Slow: every model end to end with NNCF accuracy control.
Models come from PyPI wheels (cached); the tests skip with the reason when they cannot be fetched.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from edged.optimize import command
from tests.optimize_corpus import MODELS, OptimizeModel, UnavailableError

HAVE_NNCF = importlib.util.find_spec("nncf") is not None
HAVE_ONNX = importlib.util.find_spec("onnx") is not None
pytestmark = pytest.mark.skipif(not HAVE_ONNX, reason="onnx is not installed (pip install 'edged[optimize]')")


def _model(name: str) -> tuple[OptimizeModel, Path]:
    m = MODELS[name]
    try:
        return m, m.fetch()
    except UnavailableError as e:
        pytest.skip(f"{m.requirement}: {e}")


def _data(tmp: Path, m: OptimizeModel, n_cal: int, n_eval: int) -> list[str]:
    xc, _ = m.data(n_cal, 7)
    xe, ye = m.data(n_eval, 11)
    np.save(tmp / "cal.npy", xc)
    np.save(tmp / "eval.npy", xe)
    np.save(tmp / "labels.npy", ye)
    return ["--calibration", str(tmp / "cal.npy"), "--eval", str(tmp / "eval.npy"),
            "--labels", str(tmp / "labels.npy"), "--metric", m.metric]


def _optimize(argv: list[str], out: Path) -> dict[str, Any]:
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = command.main([*argv, "--out", str(out), "--quiet", "--timing-budget-s", "0.05",
                           "--max-batch-size", "8"])
    assert rc == 0, stderr.getvalue()
    report: dict[str, Any] = json.loads((out / "optimize-report.json").read_text())
    report["stdout"] = stdout.getvalue()
    return report


def _variant(report: dict[str, Any], key: str) -> dict[str, Any]:
    return next(v for v in report["variants"] if v["key"] == key)


def _dq_axes(path: Path) -> tuple[int, list[bool]]:
    import onnx

    model = onnx.load(str(path))
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    return opset, [any(a.name == "axis" for a in n.attribute) for n in dq]


def test_opset11_ppocr_classifier_gets_a_loadable_per_channel_int8(tmp_path: Path) -> None:
    """The old quantizer wrote DequantizeLinear(axis) into an opset-11 graph: INVALID_GRAPH on load."""
    m, onnx_file = _model("ocr_cls")
    report = _optimize([str(onnx_file), *_data(tmp_path, m, 32, 64), "--variants", "onnx-int8",
                        "--backends", "onnxruntime"], tmp_path / "repo" / "ocr_cls" / "1")
    v = _variant(report, "onnx-int8")
    assert v["status"] == "kept", v
    assert v["quantization"] == {"weights": "per-channel", "opset_from": 11, "opset_to": 13}
    assert any("converted to 13" in n and "matched the original" in n for n in v["notes"])
    int8 = tmp_path / "repo" / "ocr_cls" / "1" / "model.int8.onnx"
    opset, axes = _dq_axes(int8)
    assert opset == 13 and any(axes)  # per-channel weights, expressible now
    sess = ort.InferenceSession(str(int8), providers=["CPUExecutionProvider"])
    x = np.load(tmp_path / "eval.npy")[:4]
    assert sess.run(None, {"x": x})[0].shape == (4, 2)
    assert v["execution_precision"] == {"onnxruntime": "int8"}
    assert v["timings"]["onnxruntime"] and report["fastest"]


def test_accuracy_aware_onnx_int8_keeps_the_sensitive_layers_in_fp32(tmp_path: Path) -> None:
    """A gate plain INT8 cannot meet (max abs error 0.008 on probabilities): layers ranked by the error
    they add are excluded until it holds, and the report names them."""
    m, onnx_file = _model("ocr_cls")
    out = tmp_path / "repo" / "ocr_cls" / "1"
    report = _optimize([str(onnx_file), *_data(tmp_path, m, 16, 32), "--variants", "onnx-int8",
                        "--backends", "onnxruntime", "--max-abs-error", "0.008"], out)
    v = _variant(report, "onnx-int8")
    aa = v["accuracy_aware"]
    assert aa["tries"], v  # plain INT8 failed the gate and the search ran
    assert v["status"] == "kept", v
    assert aa["passed"] and 0 < len(aa["kept_float"]) < aa["quantized_layers"]
    assert v["metrics"]["max_abs_error"] <= 0.008
    import onnx

    int8 = onnx.load(str(out / "model.int8.onnx"))
    floats = {t.name for t in int8.graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    kept = [n for n in int8.graph.node if n.name in set(aa["kept_float"]) and n.op_type == "Conv"]
    assert kept and all(n.input[1] in floats for n in kept)  # their weights really stay FP32
    quantized = [n for n in int8.graph.node if n.op_type == "Conv" and n.name not in set(aa["kept_float"])]
    assert quantized and all(n.input[1] not in floats for n in quantized)  # the others are int8
    assert any("layers kept in float" in n for n in v["notes"])


def _hardmax_opset11(path: Path) -> None:
    """MatMul then Hardmax(axis=0): ONNX's version converter moves it to opset 13 without the
    reshape that keeps opset 11's flattened semantics, so the converted model answers differently."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).normal(size=(8, 8)).astype(np.float32), "W")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("Hardmax", ["m"], ["y"], axis=0)],
        "hardmax", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)]), str(path))


def test_converted_model_that_differs_is_refused_and_weights_go_per_tensor(tmp_path: Path) -> None:
    model = tmp_path / "hardmax.onnx"
    _hardmax_opset11(model)
    x = np.random.default_rng(1).normal(size=(64, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    report = _optimize([str(model), "--calibration", str(tmp_path / "x.npy"), "--variants", "onnx-int8",
                        "--backends", "onnxruntime", "--no-accuracy-aware", "--max-drop", "100"],
                       tmp_path / "repo" / "hardmax" / "1")
    v = _variant(report, "onnx-int8")
    assert v["quantization"] == {"weights": "per-tensor", "opset_from": 11, "opset_to": 11}
    assert any("conversion was refused" in n and "differ from the original" in n for n in v["notes"]), v["notes"]
    assert v["status"] == "kept", v
    opset, axes = _dq_axes(tmp_path / "repo" / "hardmax" / "1" / "model.int8.onnx")
    assert opset == 11 and axes and not any(axes)


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_NNCF, reason="NNCF is not installed (pip install 'edged[optimize]')")
@pytest.mark.parametrize("name", sorted(MODELS))
def test_real_model_end_to_end(name: str, tmp_path: Path) -> None:
    """Every engine's INT8 loads; where plain INT8 fails the gate the accuracy-aware mode runs; every
    kept variant is timed against FP32 and its execution precision read back."""
    m, onnx_file = _model(name)
    out = tmp_path / "repo" / name / "1"
    report = _optimize([str(onnx_file), *_data(tmp_path, m, 64, 96), "--variants",
                        "onnx-int8,openvino-bf16,openvino-int8", "--accuracy-budget-s", "240"], out)
    fp32 = _variant(report, "fp32")
    assert fp32["metrics"]["score"] > 0.8
    for key in ("onnx-int8", "openvino-int8"):
        v = _variant(report, key)
        assert v["status"] in ("kept", "left out"), v
        if v["status"] == "left out":  # only after the accuracy-aware mode had its try
            assert "accuracy_aware" in v and any("accuracy-aware mode" in r for r in v["reasons"]), v
        else:
            assert set(v["timings"]) and all(ts for ts in v["timings"].values())
    onnx_int8 = _variant(report, "onnx-int8")
    assert onnx_int8["quantization"]["opset_to"] >= 13 or onnx_int8["quantization"]["weights"] == "per-tensor"
    assert _variant(report, "fp32")["execution_precision"]["openvino"] == "fp32"
    bf16 = _variant(report, "openvino-bf16")
    if bf16["status"] == "kept":
        assert bf16["execution_precision"]["openvino"] == "bf16"
    assert report["fastest"]
