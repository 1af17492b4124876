"""`edged optimize` on the bundled digits model with its real data: variants, gate, timings, serving.

One optimize run (calibrated on the training split, gated on the held-out split with its
labels) is shared by most tests; the zero-threshold gate and the error cases run their own.
Timing budgets are tiny: the figures are checked for presence and consistency, never speed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edged.config import ModelsSection
from edged.core.manager import ModelManager
from edged.core.service import InferenceService
from edged.errors import ErrorCode
from edged.fsutil import sha256_file
from edged.optimize import command
from edged.optimize.data import load_samples
from edged.optimize.errors import OptimizeInputError
from edged.optimize.modelio import inspect_onnx
from edged.optimize.timing import bf16_unavailable_reason, cpu_flags
from edged.profiles import BackendPreference
from edged.protocol.types import InferRequest
from edged.repository.manifest import ModelManifest, parse_manifest
from tests.conftest import MODELS, load_make_models

DIGITS_ONNX = MODELS / "digits" / "1" / "model.onnx"
HAVE_NNCF = importlib.util.find_spec("nncf") is not None
ONE_POINT = 0.01


@dataclass
class Data:
    calibration: Path
    eval_dir: Path
    labels: Path
    x_test: np.ndarray
    y_test: np.ndarray


@dataclass
class Run:
    rc: int
    stdout: str
    stderr: str
    out: Path

    @property
    def report(self) -> dict[str, Any]:
        return dict(json.loads((self.out / "optimize-report.json").read_text()))

    def variant(self, key: str) -> dict[str, Any]:
        return next(v for v in self.report["variants"] if v["key"] == key)

    @property
    def manifest(self) -> ModelManifest:
        return parse_manifest(self.out / "model.toml", model=self.out.parent.name, version=int(self.out.name))


def parse(argv: list[str]) -> argparse.Namespace:
    """Through ``register`` as the ``edged`` CLI does, so the subparser itself is exercised."""
    parser = argparse.ArgumentParser(prog="edged")
    command.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["optimize", *argv])


def optimize(argv: list[str], out: Path) -> Run:
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = command.run(parse([*argv, "--out", str(out)]))
    return Run(rc, stdout.getvalue(), stderr.getvalue(), out)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Data:
    """Training split as one .npz; held-out split as a folder of .npy batches; labels as .npy."""
    x_train, x_test, _, y_test = load_make_models().digits_split()
    root = tmp_path_factory.mktemp("digits-data")
    np.savez(root / "calibration.npz", pixels=x_train)
    eval_dir = root / "eval"
    eval_dir.mkdir()
    for i in range(0, len(x_test), 100):
        np.save(eval_dir / f"part{i:04d}.npy", x_test[i:i + 100])
    np.save(root / "labels.npy", y_test)
    return Data(root / "calibration.npz", eval_dir, root / "labels.npy", x_test, y_test)


def gated_args(d: Data) -> list[str]:
    return [str(DIGITS_ONNX), "--calibration", str(d.calibration), "--eval", str(d.eval_dir),
            "--labels", str(d.labels), "--timing-budget-s", "0.05"]


@pytest.fixture(scope="module")
def optimized(data: Data, tmp_path_factory: pytest.TempPathFactory) -> Run:
    repo = tmp_path_factory.mktemp("repo")
    run = optimize(gated_args(data), repo / "digits" / "1")
    assert run.rc == 0, run.stderr
    return run


def test_int8_onnx_and_openvino_fp16_are_within_one_point(optimized: Run) -> None:
    fp32 = optimized.variant("fp32")["metrics"]["top1"]
    assert fp32 > 0.95
    for key in ("onnx-int8", "openvino-fp16"):
        v = optimized.variant(key)
        assert v["status"] == "kept", v
        assert v["metrics"]["top1"] >= fp32 - ONE_POINT
        assert 0 < v["metrics"]["max_abs_error"] < 0.5  # really quantized, still close
    assert (optimized.out / "model.int8.onnx").is_file()
    assert (optimized.out / "openvino" / "model.fp16.xml").is_file()


@pytest.mark.skipif(not HAVE_NNCF, reason="NNCF is not installed (pip install 'edged[optimize]')")
def test_openvino_int8_is_within_one_point(optimized: Run) -> None:
    fp32 = optimized.variant("fp32")["metrics"]["top1"]
    v = optimized.variant("openvino-int8")
    assert v["status"] == "kept", v
    assert v["metrics"]["top1"] >= fp32 - ONE_POINT
    assert (optimized.out / "openvino" / "model.int8.xml").is_file()
    assert (optimized.out / "openvino" / "model.int8.bin").is_file()


@pytest.mark.skipif(HAVE_NNCF, reason="NNCF is installed")
def test_missing_nncf_is_explained(optimized: Run) -> None:
    v = optimized.variant("openvino-int8")
    assert v["status"] == "skipped"
    assert "edged[optimize]" in v["reasons"][0]


def test_manifest_has_hashes_accuracy_and_timings(optimized: Run) -> None:
    m = optimized.manifest
    assert m.max_batch_size == 64
    assert m.inputs is not None and [(t.name, t.datatype, t.shape) for t in m.inputs] == [("pixels", "FP32", [64])]
    assert m.outputs is not None and [(t.name, t.shape) for t in m.outputs] == [("probabilities", [10])]
    kept = {v["file"] for v in optimized.report["variants"] if v["status"] in ("kept", "reference")}
    assert {v.file for v in m.variants} == kept
    for v in m.variants:
        assert sha256_file(optimized.out / v.file) == v.sha256
        for extra in v.extra_files:
            assert sha256_file(optimized.out / extra.file) == extra.sha256
        assert v.accuracy is not None and v.accuracy > 0.95
        backends = {t.device.split("/")[0] for t in v.timings}
        assert backends == ({"onnxruntime", "openvino"} if v.format == "onnx" else {"openvino"})
        for backend in backends:
            sizes = sorted(t.batch_size for t in v.timings if t.device.startswith(backend + "/"))
            assert sizes == [1, 64]
        assert all(t.throughput_per_s > 0 and t.latency_ms > 0 for t in v.timings)
    assert m.variants[0].file == "model.onnx" and m.variants[0].precision == "fp32"
    assert sha256_file(optimized.out / "model.onnx") == sha256_file(DIGITS_ONNX)
    leftovers = [p.name for p in optimized.out.parent.iterdir() if p.name != "1"]
    assert leftovers == []  # the staging folder was renamed into place


def test_table_and_progress_are_printed(optimized: Run) -> None:
    out = optimized.stdout
    assert "VARIANT" in out and "TOP-1" in out and "B1 ms" in out and "B64 /s" in out
    for key in ("fp32", "onnx-int8", "openvino-fp16", "openvino-int8"):
        assert key in out
    assert "tensorrt-int8" in out and "TensorRT is not installed here" in out
    assert "calibrating onnx-int8 (minmax)" in optimized.stderr
    assert "timing onnx-int8 on onnxruntime" in optimized.stderr
    slower = optimized.report["slower_int8"]
    for line in slower:  # every such measurement is said plainly in the summary
        assert f"INT8 is slower than FP32 here: {line}" in out


def test_zero_thresholds_leave_every_variant_out_with_reasons(data: Data, tmp_path: Path) -> None:
    run = optimize([*gated_args(data), "--variants", "onnx-int8,openvino-fp16",
                    "--max-drop", "0", "--max-abs-error", "0"], tmp_path / "digits" / "3")
    assert run.rc == 0, run.stderr
    for key in ("onnx-int8", "openvino-fp16"):
        v = run.variant(key)
        assert v["status"] == "left out"
        assert any("exceeds --max-abs-error 0" in r for r in v["reasons"])
        assert f"{key}: left out: max abs output error" in run.stderr
        assert "left out: max abs output error" in run.stdout
    assert [v.file for v in run.manifest.variants] == ["model.onnx"]
    assert not (run.out / "model.int8.onnx").exists()
    assert not (run.out / "openvino").exists()


def test_drop_gate_leaves_out_int8_calibrated_on_wrongly_scaled_data(data: Data, tmp_path: Path) -> None:
    """A classic mistake: calibration images scaled to [0, 1] while the model takes raw 0-16 pixels.
    The INT8 ranges then clip real inputs, accuracy collapses and the default 1-point gate refuses it."""
    wrong = tmp_path / "scaled.npz"
    x_train = load_make_models().digits_split()[0]
    np.savez(wrong, pixels=x_train / np.float32(16.0))
    run = optimize([str(DIGITS_ONNX), "--calibration", str(wrong), "--eval", str(data.eval_dir),
                    "--labels", str(data.labels), "--variants", "onnx-int8", "--timing-budget-s", "0.05"],
                   tmp_path / "digits" / "4")
    assert run.rc == 0, run.stderr
    v = run.variant("onnx-int8")
    assert v["status"] == "left out"
    assert "points below FP32's" in v["reasons"][0] and "(--max-drop 1)" in v["reasons"][0]
    assert "onnx-int8: left out: top-1 accuracy" in run.stderr
    assert [x.file for x in run.manifest.variants] == ["model.onnx"]


def _holdout_accuracy(svc: InferenceService, x: np.ndarray, y: np.ndarray) -> float:
    correct = 0
    for i in range(0, len(x), 50):
        resp = svc.infer(InferRequest(model="digits", inputs={"pixels": x[i:i + 50]}), timeout=30)
        correct += int(np.sum(np.argmax(resp.outputs["probabilities"], axis=1) == y[i:i + 50]))
    return correct / len(x)


@contextlib.contextmanager
def serving(repo: Path, prefs: list[BackendPreference], select: str = "first") -> Iterator[InferenceService]:
    manager = ModelManager(repo, ModelsSection(), prefs, select=select)
    try:
        manager.load_all()
        yield InferenceService(manager)
    finally:
        manager.shutdown()


@pytest.mark.parametrize(("backend", "variant_file"), [
    ("onnxruntime", "model.int8.onnx"),
    pytest.param("openvino", "openvino/model.int8.xml",
                 marks=pytest.mark.skipif(not HAVE_NNCF, reason="NNCF is not installed")),
])
def test_produced_version_serves_holdout_digits(optimized: Run, data: Data, backend: str, variant_file: str) -> None:
    prefs = [BackendPreference(backend=backend, device="CPU", precisions=["int8"])]
    with serving(optimized.out.parent.parent, prefs) as svc:
        mv = svc.ready_model("digits")
        assert mv.candidate is not None and mv.candidate.variant.file == variant_file
        acc = _holdout_accuracy(svc, data.x_test, data.y_test)
    assert acc >= optimized.variant("fp32")["metrics"]["top1"] - ONE_POINT


@pytest.mark.skipif(bf16_unavailable_reason(cpu_flags()) is not None, reason="this CPU has no BF16 instructions")
def test_bf16_variant_is_a_candidate_and_the_engine_runs_bf16(optimized: Run, data: Data) -> None:
    """On a CPU with AVX512-BF16/AMX: the bf16 variant is kept, the daemon's selection takes it as a
    candidate when the profile lists bf16, and OpenVINO reports computing in bf16 (read back)."""
    v = optimized.variant("openvino-bf16")
    assert v["status"] == "kept", v
    assert v["execution_precision"] == {"openvino": "bf16"}
    assert optimized.variant("fp32")["execution_precision"]["openvino"] == "fp32"  # pinned to f32
    prefs = [BackendPreference(backend="openvino", device="CPU", precisions=["bf16"])]
    with serving(optimized.out.parent.parent, prefs) as svc:
        mv = svc.ready_model("digits")
        assert mv.candidate is not None and mv.candidate.variant.file == "openvino/model.bf16.xml"
        assert mv.engine is not None and mv.engine.describe()["execution_precision"] == "bf16"
        acc = _holdout_accuracy(svc, data.x_test, data.y_test)
    assert acc >= optimized.variant("fp32")["metrics"]["top1"] - ONE_POINT


@pytest.mark.skipif(bf16_unavailable_reason(cpu_flags()) is not None, reason="this CPU has no BF16 instructions")
@pytest.mark.skipif(not HAVE_NNCF, reason="NNCF is not installed")
def test_variant_inference_precision_sets_the_float_layers_precision(optimized: Run, tmp_path: Path) -> None:
    """An INT8 IR's float layers run in bf16 on this CPU by default; ``inference_precision = "f32"`` in
    the manifest (what accuracy control validated at) makes OpenVINO run them in f32."""
    repo = tmp_path / "repo"
    shutil.copytree(optimized.out, repo / "digits" / "1")
    prefs = [BackendPreference(backend="openvino", device="CPU", precisions=["int8"])]
    with serving(repo, prefs) as svc:
        engine = svc.ready_model("digits").engine
        assert engine is not None and engine.describe()["execution_precision"] == "bf16"
    toml = repo / "digits" / "1" / "model.toml"
    text = toml.read_text()
    marker = 'file = "openvino/model.int8.xml"\n'
    assert marker in text
    toml.write_text(text.replace(marker, marker + 'inference_precision = "f32"\n'))
    with serving(repo, prefs) as svc:
        mv = svc.ready_model("digits")
        assert mv.candidate is not None and mv.candidate.variant.inference_precision == "f32"
        assert mv.engine is not None and mv.engine.describe()["execution_precision"] == "f32"


def test_benchmark_selection_agrees_with_the_recorded_timings(optimized: Run, data: Data) -> None:
    """The daemon's own measurement picks the backend the optimize timings favour (on digits ONNX Runtime's
    per-call cost is a fraction of OpenVINO's, so both measurements agree by a wide margin)."""
    prefs = [BackendPreference(backend="onnxruntime", device="CPU", precisions=["fp32", "int8"]),
             BackendPreference(backend="openvino", device="CPU", precisions=["fp32", "int8"])]
    best = max((t.throughput_per_s, t.device.split("/")[0]) for v in optimized.manifest.variants
               for t in v.timings if t.batch_size == 1)
    with serving(optimized.out.parent.parent, prefs, select="benchmark") as svc:
        mv = svc.ready_model("digits")
        assert mv.candidate is not None
        assert mv.candidate.backend == best[1]
        acc = _holdout_accuracy(svc, data.x_test, data.y_test)
    assert acc >= optimized.variant("fp32")["metrics"]["top1"] - ONE_POINT


def test_existing_version_is_refused_without_force(data: Data, optimized: Run) -> None:
    before = sha256_file(optimized.out / "model.toml")
    run = optimize(gated_args(data), optimized.out)
    assert run.rc == 1 and "already exists" in run.stderr and "--force" in run.stderr
    assert sha256_file(optimized.out / "model.toml") == before


def test_force_replaces_the_version(data: Data, tmp_path: Path) -> None:
    out = tmp_path / "digits" / "2"
    first = optimize([*gated_args(data), "--variants", "onnx-int8"], out)
    assert first.rc == 0
    second = optimize([*gated_args(data), "--variants", "openvino-fp16", "--force"], out)
    assert second.rc == 0, second.stderr
    assert {v.file for v in second.manifest.variants} == {"model.onnx", "openvino/model.fp16.xml"}
    assert not (out / "model.int8.onnx").exists()
    assert sorted(p.name for p in out.parent.iterdir()) == ["2"]


def test_data_errors_name_the_file(data: Data, tmp_path: Path) -> None:
    io_ = inspect_onnx(DIGITS_ONNX, None)
    assert io_.max_batch_size == 64
    cases: list[tuple[str, Any, str]] = [
        ("narrow.npz", {"pixels": np.zeros((5, 63), np.float32)}, "dimension 0 is 63, the model needs 64"),
        ("two.npz", {"a": np.zeros((5, 64), np.float32), "b": np.zeros((5, 64), np.float32)},
         "no array for input(s) ['pixels']"),
        ("text.npy", np.array(["x"] * 64), "holds <U1 data"),
        ("complex.npy", np.zeros((2, 64), np.complex64), "is complex64 but the model takes FP32"),
        ("rank.npy", np.zeros((2, 8, 8), np.float32), "has shape [2, 8, 8]"),
    ]
    for name, arrays, message in cases:
        path = tmp_path / name
        if isinstance(arrays, dict):
            np.savez(path, **arrays)
        else:
            np.save(path, arrays)
        with pytest.raises(OptimizeInputError) as e:
            load_samples(path, io_, what="--calibration")
        assert name in str(e.value) and message in str(e.value)
        assert e.value.code is ErrorCode.INVALID_ARGUMENT
    one = load_samples(data.eval_dir / "part0000.npy", io_, what="--eval")
    assert len(one) == 100
    (tmp_path / "empty").mkdir()
    with pytest.raises(OptimizeInputError, match=r"no \.npy or \.npz files"):
        load_samples(tmp_path / "empty", io_, what="--eval")


def test_bad_arguments_fail_before_writing(data: Data, tmp_path: Path) -> None:
    bad_labels = tmp_path / "labels.npy"
    np.save(bad_labels, np.zeros(10, np.int64))
    out = tmp_path / "digits" / "1"
    cases = [
        ([*gated_args(data)[:5], "--labels", str(bad_labels)], "10 labels for 450 evaluation samples"),
        ([str(DIGITS_ONNX), "--calibration", str(data.calibration), "--labels", str(data.labels)],
         "--labels needs --eval"),
        ([str(DIGITS_ONNX), "--calibration", str(tmp_path / "missing")], "no such file or folder"),
        ([str(tmp_path / "nope.onnx"), "--calibration", str(data.calibration)], "no such model file"),
        ([*gated_args(data), "--metric-output", "logits"], "--metric-output 'logits'"),
        ([*gated_args(data), "--max-drop", "-1"], "--max-drop must be >= 0"),
    ]
    for argv, message in cases:
        run = optimize(argv, out)
        assert run.rc == 1 and message in run.stderr, (argv, run.stderr)
        assert not out.parent.exists() or not any(out.parent.iterdir())
    run = optimize(gated_args(data), tmp_path / "digits" / "v1")
    assert run.rc == 1 and "must be a version number" in run.stderr
