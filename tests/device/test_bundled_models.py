"""The example models committed under ``models/`` are what their manifests say they are.

Users copy these folders as templates and the daemon's own tests load them, so a
stale hash, a changed tensor name or an accuracy that no longer holds must fail
here rather than at a customer's device.  The accuracies are recomputed with the
engines directly (not through the daemon) so that a daemon bug cannot hide a bad model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt
import onnxruntime as ort
import openvino as ov
import pytest

from edged.repository.manifest import ModelManifest, parse_manifest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
DIGITS = MODELS / "digits" / "1"
MOBILENET = MODELS / "mobilenet" / "1"
VERSIONS = {"digits": DIGITS, "mobilenet": MOBILENET}

F32 = npt.NDArray[np.float32]


@pytest.fixture(scope="module")
def make_models() -> ModuleType:
    """``tools/make_models.py`` loaded from its path (``tools`` is not a package)."""
    spec = importlib.util.spec_from_file_location("make_models", ROOT / "tools" / "make_models.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _manifest(name: str) -> ModelManifest:
    return parse_manifest(VERSIONS[name] / "model.toml", model=name, version=1)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _ort(path: Path, feeds: dict[str, F32]) -> F32:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(["probabilities"], feeds)[0])


def _openvino(xml: Path, x: F32) -> F32:
    # f32 explicitly: on CPUs with bf16 support OpenVINO would otherwise pick bf16.
    compiled = ov.Core().compile_model(str(xml), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    return np.asarray(compiled.infer_new_request({0: x})[compiled.output(0)])


def _run_variant(root: Path, variant: str, x: F32, input_name: str) -> F32:
    if variant.endswith(".xml"):
        return _openvino(root / variant, x)
    return _ort(root / variant, {input_name: x})


@pytest.mark.parametrize("name", sorted(VERSIONS))
def test_manifest_parses_and_lists_variants_in_order(name: str) -> None:
    m = _manifest(name)
    assert [(v.file, v.format) for v in m.variants][:2] == [
        ("model.onnx", "onnx"), ("openvino/model.xml", "openvino")]
    assert m.variants[1].extra_files[0].file == "openvino/model.bin"
    assert m.warmup.file == "warmup.npz" and m.warmup.expected == "expected.npz"
    assert m.outputs is not None and [(o.name, o.datatype) for o in m.outputs] == [("probabilities", "FP32")]


@pytest.mark.parametrize("name", sorted(VERSIONS))
def test_variant_files_match_their_sha256(name: str) -> None:
    for variant in _manifest(name).variants:
        for artifact in [variant, *variant.extra_files]:
            path = VERSIONS[name] / artifact.file
            assert path.is_file(), artifact.file
            assert _sha256(path) == artifact.sha256, (
                f"{name}: {artifact.file} changed; rerun tools/make_models.py")


def test_digits_interface() -> None:
    m = _manifest("digits")
    assert m.max_batch_size == 64
    assert m.inputs is not None
    assert [(i.name, i.datatype, i.shape) for i in m.inputs] == [("pixels", "FP32", [64])]
    assert m.outputs is not None and m.outputs[0].shape == [10]
    assert [(v.file, v.precision) for v in m.variants] == [
        ("model.onnx", "fp32"), ("openvino/model.xml", "fp32"), ("model.int8.onnx", "int8")]
    assert (DIGITS / "labels.txt").read_text(encoding="utf-8").splitlines() == [str(d) for d in range(10)]
    for file in ("model.onnx", "model.int8.onnx"):
        sess = ort.InferenceSession(str(DIGITS / file), providers=["CPUExecutionProvider"])
        (inp,), (out,) = sess.get_inputs(), sess.get_outputs()
        assert (inp.name, inp.type, inp.shape) == ("pixels", "tensor(float)", ["batch", 64])
        assert (out.name, out.type, out.shape) == ("probabilities", "tensor(float)", ["batch", 10])
    ov_model = ov.Core().read_model(str(DIGITS / "openvino" / "model.xml"))
    assert ov_model.input(0).get_any_name() == "pixels"
    assert ov_model.input(0).get_partial_shape()[0].is_dynamic


def test_digits_accuracy_holds_and_matches_the_record(make_models: ModuleType) -> None:
    _, x_test, _, y_test = make_models.digits_split()
    assert x_test.dtype == np.float32 and x_test.shape == (450, 64) and float(x_test.max()) == 16.0
    record: dict[str, Any] = json.loads((DIGITS / "accuracy.json").read_text(encoding="utf-8"))
    assert record["test_size"] == len(y_test)
    manifest = {v.file: v.accuracy for v in _manifest("digits").variants}

    measured = {}
    for file in ("model.onnx", "openvino/model.xml", "model.int8.onnx"):
        probs = _run_variant(DIGITS, file, x_test, "pixels")
        assert probs.shape == (len(y_test), 10)
        np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-5)
        measured[file] = float(np.mean(probs.argmax(axis=1) == y_test))

    assert measured["model.onnx"] >= 0.95
    assert abs(measured["model.int8.onnx"] - measured["model.onnx"]) <= 0.01
    assert abs(measured["openvino/model.xml"] - measured["model.onnx"]) <= 0.01
    assert set(record["variants"]) == set(measured)
    for file, acc in measured.items():
        assert acc == pytest.approx(record["variants"][file], abs=1e-6), file
        assert manifest[file] == pytest.approx(acc, abs=1e-6), file


def test_mobilenet_interface_and_outputs() -> None:
    m = _manifest("mobilenet")
    assert m.max_batch_size == 32
    assert m.inputs is not None and [(i.name, i.datatype, i.shape) for i in m.inputs] == [
        ("image", "FP32", [3, 48, 192])]
    assert m.outputs is not None and m.outputs[0].shape == [37]
    assert (MOBILENET / "model.onnx").stat().st_size < 1_500_000

    sess = ort.InferenceSession(str(MOBILENET / "model.onnx"), providers=["CPUExecutionProvider"])
    assert sess.get_inputs()[0].shape == ["batch", 3, 48, 192]
    image = np.load(MOBILENET / "warmup.npz")["image"]
    assert image.shape == (2, 3, 48, 192) and image.dtype == np.float32
    probs = _ort(MOBILENET / "model.onnx", {"image": image})
    assert probs.shape == (2, 37)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-5)
    assert (np.ptp(probs, axis=1) > 1e-3).all(), "softmax is flat: the random weights are degenerate"
    assert float(probs.max()) < 0.99, "softmax is one-hot: the random weights are degenerate"
    ov_model = ov.Core().read_model(str(MOBILENET / "openvino" / "model.xml"))
    assert ov_model.input(0).get_partial_shape()[0].is_dynamic


@pytest.mark.parametrize(("name", "input_name"), [("digits", "pixels"), ("mobilenet", "image")])
def test_expected_outputs_match_a_fresh_run(name: str, input_name: str) -> None:
    root = VERSIONS[name]
    with np.load(root / "warmup.npz") as w, np.load(root / "expected.npz") as e:
        assert list(w.keys()) == [input_name] and list(e.keys()) == ["probabilities"]
        warm, expected = w[input_name], e["probabilities"]
    assert warm.dtype == np.float32 and expected.dtype == np.float32
    if name == "digits":
        assert warm.shape == (4, 64)
    np.testing.assert_allclose(_ort(root / "model.onnx", {input_name: warm}), expected, rtol=0, atol=1e-5)
    # The FP32 IR must pass the same golden check.
    np.testing.assert_allclose(_openvino(root / "openvino" / "model.xml", warm), expected, rtol=0, atol=1e-5)


def test_mobilenet_graph_is_reproducible(make_models: ModuleType, tmp_path: Path) -> None:
    """The random weights come from numpy's seeded generator only, so the file is platform-independent."""
    make_models.save_onnx(make_models.mobilenet_graph(), tmp_path / "model.onnx")
    assert _sha256(tmp_path / "model.onnx") == _sha256(MOBILENET / "model.onnx")


def test_toml_writer_round_trips(make_models: ModuleType) -> None:
    doc = {"a": 1, "s": 'quote " and \\ and é', "f": 0.1, "b": True, "l": [1, 2],
           "t": {"x": [0.5]}, "arr": [{"k": "v", "sub": [{"z": 1}]}, {"k": "w"}]}
    assert tomllib.loads(make_models.to_toml(doc)) == doc
