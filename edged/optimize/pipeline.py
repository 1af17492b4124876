"""``edged optimize`` end to end: build variants, gate them on accuracy, time the survivors, publish.

Order of work (each step can only remove variants, never add them back):

1. inspect the FP32 ONNX model and read the calibration/evaluation data (fail fast on bad files);
2. build each requested variant in a staging folder next to the target version;
3. run the evaluation set through each variant on its native backend and drop the ones
   that fail the gate (:mod:`edged.optimize.gate`), deleting their files;
4. time FP32 and every kept variant on each backend that can run it, at batch 1 and the max batch;
5. write ``model.toml`` (sha256, accuracy, timings), warm-up files and ``optimize-report.json``,
   then rename the staging folder into place.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from edged.backends.base import Engine
from edged.backends.selection import unavailable_reason
from edged.errors import EdgedError, EngineUnavailableError
from edged.fsutil import sha256_file
from edged.optimize import deps, quantize
from edged.optimize.data import SampleSet, load_labels, load_samples
from edged.optimize.engines import BACKENDS_FOR_FORMAT, NATIVE_BACKEND, EngineSpec, load_engine, run_outputs
from edged.optimize.errors import OptimizeInputError
from edged.optimize.gate import GatePolicy, check_labels, judge, measure
from edged.optimize.modelio import ModelIO, inspect_onnx
from edged.optimize.progress import Progress
from edged.optimize.recipes import FP32, RECIPES, Recipe
from edged.optimize.results import OptimizeOptions, OptimizeResult, Outcome
from edged.optimize.timing import host_label, time_engine
from edged.optimize.writer import check_target, parse_target, publish, stage
from edged.repository.manifest import ArtifactFile, Variant, VariantTiming

WARMUP_SAMPLES = 4


class _Run:
    """State of one optimize run; ``err`` gets progress and per-step messages."""

    def __init__(self, opts: OptimizeOptions, err: TextIO) -> None:
        self.opts = opts
        self.err = err
        _, self.name, self.version = parse_target(opts.out)
        self.host = host_label()
        self.notes: list[str] = []

    def say(self, text: str) -> None:
        if self.opts.progress:
            print(text, file=self.err, flush=True)

    def progress(self, label: str, total: float | None = None, unit: str = "") -> Progress:
        return Progress(label, total, stream=self.err, enabled=self.opts.progress, unit=unit)

    # ---- inputs -------------------------------------------------------------------------------
    def read_inputs(self) -> tuple[ModelIO, SampleSet, SampleSet, np.ndarray | None, str]:
        o = self.opts
        if not o.model.is_file():
            raise OptimizeInputError(f"{o.model}: no such model file")
        model_io = inspect_onnx(o.model, o.max_batch_size)
        metric_output = o.metric_output or model_io.outputs[0].name
        if metric_output not in [t.name for t in model_io.outputs]:
            raise OptimizeInputError(f"--metric-output {metric_output!r}: the model's outputs are "
                                     f"{[t.name for t in model_io.outputs]}")
        if o.labels is not None and o.eval is None:
            raise OptimizeInputError("--labels needs --eval: labels describe the evaluation samples")
        full_calib = load_samples(o.calibration, model_io, what="--calibration")
        calib = full_calib.take(o.calibration_samples)
        if o.eval is not None:
            evalset = load_samples(o.eval, model_io, what="--eval")
        else:
            evalset = full_calib
            self.notes.append("no --eval set: the gate compared against FP32 on the calibration data, "
                              "which flatters quantized variants")
        labels = load_labels(o.labels, len(evalset)) if o.labels is not None else None
        return model_io, calib, evalset, labels, metric_output

    # ---- building -----------------------------------------------------------------------------
    def build(self, recipe: Recipe, root: Path, calib: SampleSet, model_io: ModelIO) -> Outcome:
        outcome = Outcome(recipe)
        t0 = time.monotonic()
        fp32 = root / FP32.file
        target = root / recipe.file
        try:
            if recipe.format == "tensorrt":
                why = deps.tensorrt_unavailable_reason()
                raise EngineUnavailableError(
                    why or "TensorRT is present, but this edged version does not build TensorRT engines yet")
            if recipe.key == "onnx-int8":
                method = self.opts.calibration_method
                feeds = calib.count_feeds(model_io, quantize.calibration_batch(method))
                with self.progress(f"calibrating {recipe.key} ({method})", feeds, " feeds") as p:
                    outcome.notes += quantize.onnx_int8(
                        fp32, target, calib, model_io, method=self.opts.calibration_method,
                        reduce_range=self.opts.reduce_range, progress=p)
            elif recipe.key == "openvino-fp16":
                quantize.openvino_ir(fp32, target, fp16=True)
            elif recipe.key == "openvino-int8":
                with self.progress(f"calibrating {recipe.key} (NNCF)", len(calib), " samples") as p:
                    quantize.openvino_int8(fp32, target, calib, model_io, progress=p)
            else:  # pragma: no cover - the command validates keys
                raise OptimizeInputError(f"unknown variant {recipe.key!r}")
        except EngineUnavailableError as e:
            outcome.status, outcome.reasons = "skipped", [str(e)]
        except EdgedError:
            raise
        except Exception as e:  # a quantizer failing on one graph must not lose the other variants
            outcome.status, outcome.reasons = "failed", [f"could not build it: {type(e).__name__}: {e}"]
        outcome.build_s = time.monotonic() - t0
        if outcome.status != "built":
            _remove(root, recipe)
            self.say(f"{recipe.key}: {outcome.status}: {outcome.reasons[0]}")
        return outcome

    # ---- gate ---------------------------------------------------------------------------------
    def engine(self, spec: EngineSpec, root: Path, model_io: ModelIO) -> Engine:
        return load_engine(spec, root, model_io, name=self.name, version=self.version, threads=self.opts.threads)

    def gate(self, outcomes: list[Outcome], root: Path, model_io: ModelIO, *, evalset: SampleSet,
             labels: np.ndarray | None, metric_output: str) -> dict[tuple[str, str], Engine]:
        """Measure every built variant; returns the loaded native engines of the kept ones (FP32 first)."""
        feeds = list(evalset.feeds(model_io, model_io.max_batch_size or 1))
        engines: dict[tuple[str, str], Engine] = {}
        ref_outcome = outcomes[0]
        ref_engine = self.engine(EngineSpec(_variant(root, FP32), "onnxruntime"), root, model_io)
        with self.progress("evaluating fp32", len(feeds), " batches") as p:
            reference = _outputs_with_progress(ref_engine, feeds, model_io, p.advance)
        if labels is not None:
            labels = check_labels(labels, reference, metric_output)
        ref_outcome.metrics = measure(reference, reference, metric_output, labels)
        engines[(FP32.key, "onnxruntime")] = ref_engine
        policy = GatePolicy(self.opts.max_drop, self.opts.max_abs_error)
        for outcome in outcomes[1:]:
            if outcome.status != "built":
                continue
            backend = NATIVE_BACKEND[outcome.recipe.format]
            try:
                engine = self.engine(EngineSpec(_variant(root, outcome.recipe), backend), root, model_io)
                with self.progress(f"evaluating {outcome.recipe.key}", len(feeds), " batches") as p:
                    outputs = _outputs_with_progress(engine, feeds, model_io, p.advance)
            except EdgedError as e:
                outcome.status, outcome.reasons = "failed", [f"{backend} could not run it: {e}"]
                _remove(root, outcome.recipe)
                self.say(f"{outcome.recipe.key}: failed: {outcome.reasons[0]}")
                continue
            outcome.metrics = measure(outputs, reference, metric_output, labels)
            reasons = judge(ref_outcome.metrics, outcome.metrics, policy, with_labels=labels is not None)
            if reasons:
                outcome.status, outcome.reasons = "left out", reasons
                engine.unload()
                _remove(root, outcome.recipe)
                self.say(f"{outcome.recipe.key}: left out: " + "; ".join(reasons))
            else:
                outcome.status = "kept"
                engines[(outcome.recipe.key, backend)] = engine
        return engines

    # ---- timing -------------------------------------------------------------------------------
    def time_all(self, outcomes: list[Outcome], engines: dict[tuple[str, str], Engine], root: Path,
                 model_io: ModelIO, *, evalset: SampleSet, warm: dict[str, np.ndarray],
                 expected: dict[str, np.ndarray]) -> float:
        """Time kept variants on every requested backend; returns the worst warm-up error seen."""
        worst = 0.0
        for outcome in outcomes:
            if not outcome.kept:
                continue
            for backend in BACKENDS_FOR_FORMAT.get(outcome.recipe.format, (NATIVE_BACKEND[outcome.recipe.format],)):
                if backend not in self.opts.backends:
                    continue
                why = unavailable_reason(backend)
                if why is not None:
                    outcome.notes.append(f"not timed on {backend}: {why}")
                    continue
                key = (outcome.recipe.key, backend)
                try:
                    engine = engines.pop(key, None) or self.engine(
                        EngineSpec(_variant(root, outcome.recipe), backend), root, model_io)
                except EdgedError as e:
                    outcome.notes.append(f"not timed on {backend}: {e}")
                    continue
                try:
                    got = engine.infer(warm)
                    for name, want in expected.items():
                        worst = max(worst, float(np.max(np.abs(got[name].astype(np.float64) - want))))
                    with self.progress(f"timing {outcome.recipe.key} on {backend}", unit="s") as p:
                        outcome.timings[backend] = time_engine(engine, evalset, model_io,
                                                               budget_s=self.opts.timing_budget_s, progress=p)
                finally:
                    engine.unload()
        for engine in engines.values():
            engine.unload()
        return worst


def _remove(root: Path, recipe: Recipe) -> None:
    for rel in recipe.files:
        path = root / rel
        path.unlink(missing_ok=True)
        if path.parent != root and path.parent.is_dir() and not any(path.parent.iterdir()):
            path.parent.rmdir()


def _variant(root: Path, recipe: Recipe) -> Variant:
    """The manifest entry for a recipe's files as they are on disk now."""
    extra = [ArtifactFile(file=f, sha256=sha256_file(root / f)) for f in recipe.extra]
    return Variant.model_validate({"file": recipe.file, "sha256": sha256_file(root / recipe.file),
                                   "format": recipe.format, "precision": recipe.precision, "extra_files": extra})


def _outputs_with_progress(engine: Engine, feeds: list[dict[str, np.ndarray]], model_io: ModelIO,
                           tick: Callable[[], None]) -> dict[str, np.ndarray]:
    parts = []
    for feed in feeds:
        parts.append(run_outputs(engine, [feed], model_io))
        tick()
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}  # parts have a sample axis


def _warmup_feed(evalset: SampleSet, model_io: ModelIO) -> dict[str, np.ndarray]:
    if not model_io.batched:
        return {k: np.ascontiguousarray(v[0]) for k, v in evalset.arrays.items()}
    return {k: np.ascontiguousarray(v[:WARMUP_SAMPLES]) for k, v in evalset.arrays.items()}


def optimize(opts: OptimizeOptions, *, err: TextIO | None = None) -> OptimizeResult:
    """Run the whole pipeline; raises EdgedError for bad arguments or data (nothing is written then)."""
    from edged.optimize.report import build_manifest, write_report

    for flag, value in (("--max-drop", opts.max_drop), ("--max-abs-error", opts.max_abs_error),
                        ("--timing-budget-s", opts.timing_budget_s)):
        if value is not None and not value >= 0:
            raise OptimizeInputError(f"{flag} must be >= 0, not {value}")
    unknown = [v for v in opts.variants if v not in RECIPES]
    if unknown:
        raise OptimizeInputError(f"unknown variant(s) {unknown}; choose from {', '.join(RECIPES)}")
    run = _Run(opts, err if err is not None else sys.stderr)
    check_target(opts.out, force=opts.force)
    model_io, calib, evalset, labels, metric_output = run.read_inputs()
    root = stage(opts.out)
    try:
        shutil.copyfile(opts.model, root / FP32.file)
        outcomes = [Outcome(FP32, status="reference")]
        outcomes += [run.build(RECIPES[key], root, calib, model_io) for key in opts.variants]
        engines = run.gate(outcomes, root, model_io, evalset=evalset, labels=labels, metric_output=metric_output)
        warm = _warmup_feed(evalset, model_io)
        expected = run_outputs(engines[(FP32.key, "onnxruntime")], [warm], model_io)
        if not model_io.batched:
            expected = {k: v[0] for k, v in expected.items()}
        worst = run.time_all(outcomes, engines, root, model_io, evalset=evalset, warm=warm, expected=expected)
        result = OptimizeResult(opts.out, run.name, run.version, model_io, outcomes, labels is not None,
                                len(evalset), len(calib), run.host, run.notes,
                                warmup_atol=float(f"{max(1e-4, 1.5 * worst):.2g}"))
        for outcome in outcomes:
            if outcome.kept:
                outcome.variant = _variant(root, outcome.recipe).model_copy(update={
                    "accuracy": outcome.metrics.top1 if labels is not None and outcome.metrics else None,
                    "timings": [VariantTiming(batch_size=t.batch_size, throughput_per_s=_sig(t.throughput_per_s),
                                              latency_ms=_sig(t.latency_ms), device=f"{backend}/CPU ({run.host})")
                                for backend, ts in outcome.timings.items() for t in ts],
                })
        _save_npz(root / "warmup.npz", warm)
        _save_npz(root / "expected.npz", expected)
        build_manifest(result, opts, root)
        write_report(result, opts, root)
        publish(root, opts.out, name=run.name, version=run.version, force=opts.force)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return result


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def _save_npz(path: Path, arrays: dict[str, Any]) -> None:
    with path.open("wb") as f:
        np.savez(f, **arrays)
