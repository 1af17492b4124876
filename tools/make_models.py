"""Regenerate the example models bundled under ``models/``.

The models are built from code rather than downloaded so that anyone can audit
and rebuild them offline, and so that their manifests (hashes, held-out
accuracies) are always in step with the files.  Everything is seeded; running
the script twice on the same machine and library versions gives identical files.

Usage::

    python tools/make_models.py [--out models] [--only digits|mobilenet]

``digits``
    A small MLP trained on scikit-learn's bundled 8x8 handwritten digits, with
    the ONNX graph written by hand from the learned weights (input scaling is
    inside the graph, so callers send raw 0-16 pixel values).  Variants: FP32
    ONNX, OpenVINO IR, and statically quantised INT8 ONNX (QDQ).
``mobilenet``
    A MobileNet-style CNN with random weights (37 classes, 48x192 images).  It
    predicts nothing useful; it exists to exercise the daemon with a realistic
    graph (strided/depthwise convolutions, ~850 kB of weights, about half a
    millisecond of ONNX Runtime CPU time at batch 1).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
import openvino as ov
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import (
    CalibrationDataReader,
    QuantFormat,
    QuantType,
    quantize_static,
)
from sklearn.datasets import load_digits
from sklearn.exceptions import ConvergenceWarning
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier

from edged.fsutil import publish_dir, sha256_file
from edged.optimize.writer import to_toml
from edged.repository.manifest import parse_manifest

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]

REPO = Path(__file__).resolve().parents[1]
OPSET = 17
IR_VERSION = 8  # readable by every onnxruntime >= 1.17 (which goes up to IR 9)
PRODUCER = "edged tools/make_models.py"
SPLIT_DOC = "sklearn.datasets.load_digits; train_test_split(test_size=0.25, random_state=0, stratify=y)"
DIGITS_SEED = 0
MOBILENET_SEED = 20240601
MIN_FP32_ACCURACY = 0.95
MAX_ACCURACY_GAP = 0.01


class BuildError(RuntimeError):
    """A generated model misses its quality bar; nothing is written."""


# --------------------------------------------------------------------------- helpers


def digits_split() -> tuple[F32, F32, I64, I64]:
    """The fixed train/test split of the digits data, shared with the tests.

    Returns ``(x_train, x_test, y_train, y_test)``; pixels are the raw 0-16
    values as float32, exactly what the model's ``pixels`` input expects.
    """
    data = load_digits()
    x = np.asarray(data.data, dtype=np.float32)
    y = np.asarray(data.target, dtype=np.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    return x_train, x_test, y_train, y_test


def ort_run(path: Path, feeds: dict[str, F32]) -> F32:
    """First output of an ONNX model on CPU (one thread: the numbers must not depend on the host)."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(None, feeds)[0], dtype=np.float32)


def ov_run(xml: Path, x: F32) -> F32:
    """First output of an OpenVINO IR on CPU, forced to f32 (CPUs with bf16/AMX would default to bf16)."""
    core = ov.Core()
    compiled = core.compile_model(str(xml), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    result = compiled.infer_new_request({0: x})
    return np.asarray(result[compiled.output(0)], dtype=np.float32)


def save_onnx(model: onnx.ModelProto, path: Path) -> None:
    """Check the graph and write it; fixed producer fields keep the bytes stable."""
    model.ir_version = IR_VERSION
    model.producer_name = PRODUCER
    model.producer_version = "1"
    onnx.checker.check_model(model, full_check=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())


def accuracy(probs: F32, y: I64) -> float:
    return float(np.mean(np.argmax(probs, axis=1) == y))


# --------------------------------------------------------------------------- files


_OV_AUTO_NAME = re.compile(r"([A-Za-z]+)_[0-9]+")  # our ONNX graphs never use such names


def save_openvino(onnx_path: Path, xml: Path, *, compress_to_fp16: bool) -> None:
    """ONNX -> OpenVINO IR with a dynamic batch dimension.

    OpenVINO records the source as ``DIR/<file name>`` in the IR's ``rt_info``, so
    converting from the temporary build folder still gives a stable XML.  Nodes
    the converter adds or folds are named from a process-wide counter
    (``Reshape_8101``); they are renumbered by graph position so the XML does not
    depend on what the process converted before.
    """
    ov_model = ov.convert_model(str(onnx_path))
    for inp in ov_model.inputs:
        shape = inp.get_partial_shape()
        if not shape[0].is_dynamic:
            shape[0] = ov.Dimension.dynamic()
            ov_model.reshape({inp.get_any_name(): shape})
    for i, op in enumerate(ov_model.get_ordered_ops()):
        auto = _OV_AUTO_NAME.fullmatch(op.get_friendly_name())
        if auto:
            op.set_friendly_name(f"{auto[1]}_{i}")
    xml.parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(ov_model, str(xml), compress_to_fp16=compress_to_fp16)


def save_npz(path: Path, **arrays: F32) -> None:
    """Like ``np.savez`` but with fixed zip timestamps, so the bytes do not depend on the clock."""
    import io
    import zipfile

    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for key, arr in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(arr), allow_pickle=False)
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


def variant_entry(root: Path, file: str, fmt: str, precision: str, *, acc: float | None = None,
                  extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """One ``[[variants]]`` table, hashing the files as they are on disk now."""
    v: dict[str, Any] = {"file": file, "format": fmt, "precision": precision,
                         "sha256": sha256_file(root / file)}
    if acc is not None:
        v["accuracy"] = acc
    if extra:
        v["extra_files"] = [{"file": f, "sha256": sha256_file(root / f)} for f in extra]
    return v


def write_version(out: Path, name: str, build: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """Build ``out/name/1`` in a temporary sibling folder, validate it, then swap it in.

    A failed build (or a quality bar not met) leaves the previous version untouched;
    a daemon watching the repository never sees a half-written version folder.
    """
    model_dir = out / name
    model_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".1.new-", dir=model_dir))
    try:
        tmp.chmod(0o755)
        summary = build(tmp)
        parse_manifest(tmp / "model.toml", model=name, version=1)
        publish_dir(tmp, model_dir / "1")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return summary


def _common_manifest(description: str, max_batch_size: int) -> dict[str, Any]:
    return {"description": description, "max_batch_size": max_batch_size}


def _tail_manifest() -> dict[str, Any]:
    return {
        "batching": {"max_queue_delay_us": 500, "preferred_batch_sizes": [8, 16]},
        "instances": {"count": 1},
        "warmup": {"file": "warmup.npz", "expected": "expected.npz"},
    }


def _sizes(root: Path) -> dict[str, int]:
    return {p.relative_to(root).as_posix(): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------- digits


def train_digits(x: F32, y: I64) -> MLPClassifier:
    """A one-hidden-layer MLP on pixels scaled to [0, 1] (the graph does the same scaling)."""
    clf = MLPClassifier(hidden_layer_sizes=(64,), activation="relu", alpha=1e-3, max_iter=400,
                        random_state=DIGITS_SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf.fit(x / np.float32(16.0), y)
    if clf.out_activation_ != "softmax":
        raise BuildError(f"expected a softmax output layer, got {clf.out_activation_}")
    return clf


def digits_graph(clf: MLPClassifier) -> onnx.ModelProto:
    """The trained MLP as ONNX: Mul(1/16) -> [Gemm -> Relu]* -> Gemm -> Softmax."""
    inits = [numpy_helper.from_array(np.array(1.0 / 16.0, dtype=np.float32), "pixel_scale")]
    nodes = [helper.make_node("Mul", ["pixels", "pixel_scale"], ["scaled"], name="scale")]
    h = "scaled"
    n_layers = len(clf.coefs_)
    for i, (w, b) in enumerate(zip(clf.coefs_, clf.intercepts_, strict=True)):
        wt = np.ascontiguousarray(np.asarray(w, dtype=np.float32).T)  # [out, in] for transB=1
        inits += [numpy_helper.from_array(wt, f"fc{i}.weight"),
                  numpy_helper.from_array(np.asarray(b, dtype=np.float32), f"fc{i}.bias")]
        z = f"fc{i}" if i < n_layers - 1 else "logits"
        nodes.append(helper.make_node("Gemm", [h, f"fc{i}.weight", f"fc{i}.bias"], [z], name=f"fc{i}",
                                      transB=1))
        if i < n_layers - 1:
            h = f"relu{i}"
            nodes.append(helper.make_node("Relu", [z], [h], name=h))
    nodes.append(helper.make_node("Softmax", ["logits"], ["probabilities"], name="softmax", axis=-1))
    graph = helper.make_graph(
        nodes, "digits",
        [helper.make_tensor_value_info("pixels", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", 10])],
        inits,
    )
    graph.doc_string = "8x8 digit classifier; pixels are raw 0-16 intensities, row-major"
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


class _DigitsCalibration(CalibrationDataReader):  # type: ignore[misc]
    """Feeds the training images to the INT8 calibrator in fixed batches."""

    def __init__(self, x: F32, batch: int = 64) -> None:
        self._batches = [x[i:i + batch] for i in range(0, len(x), batch)]
        self._next = 0

    def get_next(self) -> dict[str, F32] | None:
        if self._next >= len(self._batches):
            return None
        self._next += 1
        return {"pixels": self._batches[self._next - 1]}


def quantize_int8(fp32: Path, int8: Path, calibration: F32) -> None:
    """Static QDQ quantisation of the Gemm layers (per-channel int8 weights, uint8 activations).

    Only Gemm is quantised: the input scaling and the softmax stay in float, so
    the outputs remain proper probabilities.  Weights use 7 bits (``reduce_range``)
    so x86 CPUs without VNNI cannot saturate in their u8 x s8 dot products: the
    recorded INT8 accuracy then holds on any host, not just the one that built it.
    """
    with tempfile.TemporaryDirectory() as scratch:
        raw = Path(scratch) / "int8.onnx"
        logging.disable(logging.WARNING)  # quantize_static nags about optional pre-processing
        try:
            quantize_static(
                str(fp32), str(raw), _DigitsCalibration(calibration),
                quant_format=QuantFormat.QDQ, op_types_to_quantize=["Gemm"], per_channel=True,
                reduce_range=True, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
            )
        finally:
            logging.disable(logging.NOTSET)
        model = onnx.load(str(raw))
    save_onnx(model, int8)


def build_digits(root: Path) -> dict[str, Any]:
    x_train, x_test, y_train, y_test = digits_split()
    clf = train_digits(x_train, y_train)
    fp32, int8, xml = root / "model.onnx", root / "model.int8.onnx", root / "openvino" / "model.xml"
    save_onnx(digits_graph(clf), fp32)
    probs = ort_run(fp32, {"pixels": x_test})
    reference = np.asarray(clf.predict_proba(x_test / np.float32(16.0)), dtype=np.float32)
    if not np.allclose(probs, reference, atol=1e-5):
        raise BuildError("the hand-written ONNX graph disagrees with the trained classifier")
    quantize_int8(fp32, int8, x_train)
    save_openvino(fp32, xml, compress_to_fp16=False)

    accs = {
        "model.onnx": accuracy(probs, y_test),
        "openvino/model.xml": accuracy(ov_run(xml, x_test), y_test),
        "model.int8.onnx": accuracy(ort_run(int8, {"pixels": x_test}), y_test),
    }
    if accs["model.onnx"] < MIN_FP32_ACCURACY:
        raise BuildError(f"digits FP32 accuracy {accs['model.onnx']:.4f} < {MIN_FP32_ACCURACY}")
    if abs(accs["model.int8.onnx"] - accs["model.onnx"]) > MAX_ACCURACY_GAP:
        raise BuildError(f"digits INT8 accuracy {accs['model.int8.onnx']:.4f} is more than "
                         f"{MAX_ACCURACY_GAP} from FP32 {accs['model.onnx']:.4f}")
    if abs(accs["openvino/model.xml"] - accs["model.onnx"]) > MAX_ACCURACY_GAP:
        raise BuildError(f"digits OpenVINO accuracy {accs['openvino/model.xml']:.4f} differs from FP32")

    warm = np.ascontiguousarray(x_test[:4])
    save_npz(root / "warmup.npz", pixels=warm)
    save_npz(root / "expected.npz", probabilities=ort_run(fp32, {"pixels": warm}))
    (root / "labels.txt").write_text("".join(f"{d}\n" for d in range(10)), encoding="utf-8")
    (root / "accuracy.json").write_text(json.dumps({
        "metric": "top-1 accuracy on the held-out split",
        "split": SPLIT_DOC,
        "train_size": len(y_train),
        "test_size": len(y_test),
        "variants": accs,
    }, indent=2) + "\n", encoding="utf-8")

    manifest = _common_manifest(
        "Handwritten digit classifier (scikit-learn 8x8 digits, one-hidden-layer MLP). "
        "Input: 64 raw pixel intensities 0-16, row-major; output: softmax over digits 0-9.", 64)
    manifest["labels"] = "labels.txt"
    manifest["inputs"] = [{"name": "pixels", "datatype": "FP32", "shape": [64]}]
    manifest["outputs"] = [{"name": "probabilities", "datatype": "FP32", "shape": [10]}]
    manifest["variants"] = [
        variant_entry(root, "model.onnx", "onnx", "fp32", acc=accs["model.onnx"]),
        variant_entry(root, "openvino/model.xml", "openvino", "fp32", acc=accs["openvino/model.xml"],
                      extra=("openvino/model.bin",)),
        variant_entry(root, "model.int8.onnx", "onnx", "int8", acc=accs["model.int8.onnx"]),
    ]
    manifest |= _tail_manifest()
    (root / "model.toml").write_text(to_toml(manifest), encoding="utf-8")
    return {"accuracy": accs, "sizes": _sizes(root)}


# --------------------------------------------------------------------------- mobilenet

# (output channels, stride) of each depthwise-separable block after the stride-2 stem; the
# last feature map is 6x24.  Sized for roughly half a millisecond of ONNX Runtime CPU time.
MOBILENET_STEM = 16
MOBILENET_BLOCKS: tuple[tuple[int, int], ...] = (
    (32, 1), (64, 2), (128, 1), (128, 1), (256, 2), (256, 1), (256, 1),
)
# Pooled ReLU6 features of an untrained net are small (rms ~0.2); this gain on the
# classifier gives logits with a spread like a trained model's (std ~2), so the
# softmax is neither flat nor one-hot.
MOBILENET_CLASSIFIER_GAIN = 3.5
MOBILENET_CLASSES = 37  # 0-9, A-Z and a blank: a licence-plate style character classifier
MOBILENET_INPUT = (3, 48, 192)


def mobilenet_graph(seed: int = MOBILENET_SEED) -> onnx.ModelProto:
    """MobileNet-v1 style CNN with seeded He-normal weights (batch norm folded into conv biases)."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(np.array(0.0, dtype=np.float32), "relu6.min"),
             numpy_helper.from_array(np.array(6.0, dtype=np.float32), "relu6.max")]
    nodes: list[onnx.NodeProto] = []

    def conv_relu6(x: str, name: str, shape: tuple[int, int, int], *, stride: int, group: int) -> str:
        cin, cout, k = shape
        fan_in = k * k * cin // group
        w = rng.normal(0.0, np.sqrt(2.0 / fan_in), (cout, cin // group, k, k)).astype(np.float32)
        b = rng.normal(0.0, 0.05, cout).astype(np.float32)
        inits.extend([numpy_helper.from_array(w, f"{name}.weight"),
                      numpy_helper.from_array(b, f"{name}.bias")])
        nodes.append(helper.make_node("Conv", [x, f"{name}.weight", f"{name}.bias"], [f"{name}.conv"],
                                      name=name, kernel_shape=[k, k], strides=[stride, stride],
                                      pads=[k // 2] * 4, group=group))
        nodes.append(helper.make_node("Clip", [f"{name}.conv", "relu6.min", "relu6.max"], [f"{name}.out"],
                                      name=f"{name}.relu6"))
        return f"{name}.out"

    h = conv_relu6("image", "stem", (MOBILENET_INPUT[0], MOBILENET_STEM, 3), stride=2, group=1)
    c = MOBILENET_STEM
    for i, (cout, stride) in enumerate(MOBILENET_BLOCKS):
        h = conv_relu6(h, f"block{i}.dw", (c, c, 3), stride=stride, group=c)
        h = conv_relu6(h, f"block{i}.pw", (c, cout, 1), stride=1, group=1)
        c = cout
    w = rng.normal(0.0, MOBILENET_CLASSIFIER_GAIN / np.sqrt(c), (MOBILENET_CLASSES, c)).astype(np.float32)
    inits.extend([numpy_helper.from_array(w, "classifier.weight"),
                  numpy_helper.from_array(np.zeros(MOBILENET_CLASSES, np.float32), "classifier.bias")])
    nodes += [
        helper.make_node("GlobalAveragePool", [h], ["pooled"], name="pool"),
        helper.make_node("Flatten", ["pooled"], ["features"], name="flatten", axis=1),
        helper.make_node("Gemm", ["features", "classifier.weight", "classifier.bias"], ["logits"],
                         name="classifier", transB=1),
        helper.make_node("Softmax", ["logits"], ["probabilities"], name="softmax", axis=-1),
    ]
    graph = helper.make_graph(
        nodes, "mobilenet",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", *MOBILENET_INPUT])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", MOBILENET_CLASSES])],
        inits,
    )
    graph.doc_string = "random-weight MobileNet-style CNN; NCHW images in [0, 1]; not trained"
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


def latency_ms(path: Path, feeds: dict[str, F32], runs: int = 300) -> float:
    """Median wall time of one ONNX Runtime CPU inference with default session options."""
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for _ in range(30):
        sess.run(None, feeds)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def build_mobilenet(root: Path) -> dict[str, Any]:
    fp32, xml = root / "model.onnx", root / "openvino" / "model.xml"
    save_onnx(mobilenet_graph(), fp32)
    save_openvino(fp32, xml, compress_to_fp16=False)

    rng = np.random.default_rng(MOBILENET_SEED + 1)
    warm = rng.random((2, *MOBILENET_INPUT), dtype=np.float32)
    expected = ort_run(fp32, {"image": warm})
    if expected.shape != (2, MOBILENET_CLASSES) or float(expected.max()) > 0.99 or \
            float(np.ptp(expected, axis=1).min()) < 1e-3:
        raise BuildError(f"mobilenet softmax is degenerate: {expected}")
    if not np.allclose(ov_run(xml, warm), expected, rtol=1e-4, atol=1e-6):
        raise BuildError("mobilenet OpenVINO IR disagrees with the ONNX model")
    save_npz(root / "warmup.npz", image=warm)
    save_npz(root / "expected.npz", probabilities=expected)

    manifest = _common_manifest(
        "MobileNet-style character classifier with random (untrained) weights, for load and "
        "integration tests. Input: NCHW float image in [0, 1]; output: softmax over 37 classes.", 32)
    manifest["inputs"] = [{"name": "image", "datatype": "FP32", "shape": list(MOBILENET_INPUT)}]
    manifest["outputs"] = [{"name": "probabilities", "datatype": "FP32", "shape": [MOBILENET_CLASSES]}]
    manifest["variants"] = [
        variant_entry(root, "model.onnx", "onnx", "fp32"),
        variant_entry(root, "openvino/model.xml", "openvino", "fp32", extra=("openvino/model.bin",)),
    ]
    manifest |= _tail_manifest()
    (root / "model.toml").write_text(to_toml(manifest), encoding="utf-8")
    return {
        "latency_ms_batch1": latency_ms(fp32, {"image": warm[:1]}),
        "max_probability": float(expected.max()),
        "sizes": _sizes(root),
    }


# --------------------------------------------------------------------------- CLI

BUILDERS: dict[str, Callable[[Path], dict[str, Any]]] = {"digits": build_digits, "mobilenet": build_mobilenet}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--out", type=Path, default=REPO / "models",
                    help="model repository root (default: models/ at the repository root)")
    ap.add_argument("--only", choices=sorted(BUILDERS), help="build just one model")
    args = ap.parse_args(argv)
    names = [args.only] if args.only else list(BUILDERS)
    for name in names:
        t0 = time.perf_counter()
        try:
            summary = write_version(args.out, name, BUILDERS[name])
        except BuildError as e:
            print(f"error: {name}: {e}", file=sys.stderr)
            return 1
        print(f"{name}/1 built in {time.perf_counter() - t0:.1f} s")
        for key, value in summary.items():
            if key == "sizes":
                for file, size in value.items():
                    print(f"  {file:<24} {size:>10,d} bytes")
                print(f"  {'total':<24} {sum(value.values()):>10,d} bytes")
            elif key == "accuracy":
                for file, acc in value.items():
                    print(f"  accuracy {file:<24} {acc:.4f}")
            else:
                print(f"  {key} = {value:.4g}" if isinstance(value, float) else f"  {key} = {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
