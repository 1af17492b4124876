"""``edged optimize`` end to end: build variants, gate them on accuracy, time the survivors, publish.

Order of work (each step can only remove variants, never add them back):

1. inspect the FP32 ONNX model and read the calibration/evaluation data (fail fast on bad files);
2. build each requested variant in a staging folder next to the target version;
3. run the evaluation set through each variant on its native backend and drop the ones
   that fail the gate (:mod:`edged.optimize.gate`), deleting their files;
   (an INT8 variant that fails gets the engine's accuracy-aware mode first: :mod:`edged.optimize.accuracy`);
4. time FP32 and every kept variant on each backend that can run it, at batch 1 and the max batch;
5. write ``model.toml`` (sha256, accuracy, timings), warm-up files and ``optimize-report.json``,
   then rename the staging folder into place.
"""

from __future__ import annotations

import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from edged.backends.base import Engine
from edged.backends.selection import unavailable_reason
from edged.errors import EdgedError, EngineUnavailableError
from edged.fsutil import sha256_file
from edged.optimize import accuracy, deps, metrics, opset, quantize
from edged.optimize.data import SampleSet, load_labels, load_samples
from edged.optimize.engines import (
    BACKENDS_FOR_FORMAT,
    NATIVE_BACKEND,
    EngineSpec,
    execution_precision,
    load_engine,
    run_outputs,
)
from edged.optimize.errors import OptimizeInputError
from edged.optimize.gate import GatePolicy, Metrics, judge, measure
from edged.optimize.metrics import MetricSpec
from edged.optimize.modelio import ModelIO, inspect_onnx
from edged.optimize.progress import Progress
from edged.optimize.recipes import FP32, RECIPES, Recipe
from edged.optimize.results import OptimizeOptions, OptimizeResult, Outcome
from edged.optimize.timing import bf16_unavailable_reason, cpu_flags, host_label, time_engine
from edged.optimize.writer import check_target, parse_target, publish, stage
from edged.repository.manifest import ArtifactFile, Variant, VariantTiming

WARMUP_SAMPLES = 4
ORT_BF16_NOTE = ("timed on OpenVINO only: ONNX Runtime's CPU provider has no BF16 execution path on x86-64 "
                 "(its bf16 fast-math GEMM option is for arm64)")


class _Run:
    """State of one optimize run; ``err`` gets progress and per-step messages."""

    def __init__(self, opts: OptimizeOptions, err: TextIO) -> None:
        self.opts = opts
        self.err = err
        _, self.name, self.version = parse_target(opts.out)
        self.host = host_label()
        self.notes: list[str] = []
        self._scratch: Path | None = None
        self.onnx_plan: opset.OpsetPlan | None = None
        self.onnx_source: Path | None = None
        self.spec = MetricSpec()
        self.hints: dict[str, str] = {}  # recipe key -> OpenVINO inference precision for its float layers

    @property
    def scratch(self) -> Path:
        """A private folder for intermediate models (converted opsets, pre-processed graphs)."""
        if self._scratch is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="edged-optimize-"))
        return self._scratch

    @property
    def calibration_cache(self) -> Path:
        return self.scratch / f"ranges-{self.opts.calibration_method}.json"

    def cleanup(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)

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
        self.spec = MetricSpec(o.metric, metric_output, o.ctc_blank, o.score_threshold)
        return model_io, calib, evalset, labels, metric_output

    def onnx_prepare(self, root: Path, calib: SampleSet, model_io: ModelIO) -> tuple[opset.OpsetPlan, Path, list[str]]:
        """The opset plan and the pre-processed FP32 model ONNX Runtime quantizes (made once per run)."""
        notes: list[str] = []
        if self.onnx_plan is None or self.onnx_source is None:
            self.onnx_plan = opset.plan(root / FP32.file, self.scratch, calib, model_io)
            self.onnx_source, notes = quantize.onnx_preprocess(self.onnx_plan.source, self.scratch)
        return self.onnx_plan, self.onnx_source, notes

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
                plan, source, pre_notes = self.onnx_prepare(root, calib, model_io)
                outcome.details["quantization"] = plan.as_dict()
                outcome.notes += plan.notes + pre_notes
                feeds = calib.count_feeds(model_io, quantize.calibration_batch(method))
                with self.progress(f"calibrating {recipe.key} ({method})", feeds, " feeds") as p:
                    quantize.onnx_int8(source, target, calib, model_io, method=method, per_channel=plan.per_channel,
                                       reduce_range=self.opts.reduce_range, progress=p, cache=self.calibration_cache)
            elif recipe.key == "openvino-bf16":
                why = bf16_unavailable_reason(cpu_flags())
                if why is not None:
                    raise EngineUnavailableError(why)
                quantize.openvino_ir(fp32, target, fp16=False)
                if platform.machine().lower() in ("x86_64", "amd64"):
                    outcome.notes.append(ORT_BF16_NOTE)
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
    def variant(self, root: Path, recipe: Recipe) -> Variant:
        return _variant(root, recipe, self.hints.get(recipe.key))

    def engine(self, spec: EngineSpec, root: Path, model_io: ModelIO) -> Engine:
        return load_engine(spec, root, model_io, name=self.name, version=self.version, threads=self.opts.threads)

    def evaluate(self, recipe: Recipe, root: Path, model_io: ModelIO, feeds: list[dict[str, np.ndarray]],
                 show: bool = True) -> tuple[Engine, dict[str, np.ndarray]]:
        backend = NATIVE_BACKEND[recipe.format]
        engine = self.engine(EngineSpec(self.variant(root, recipe), backend), root, model_io)
        with self.progress(f"evaluating {recipe.key}", len(feeds) if show else None, " batches") as p:
            return engine, _outputs_with_progress(engine, feeds, model_io, p.advance)

    def gate(self, outcomes: list[Outcome], root: Path, model_io: ModelIO, *, calib: SampleSet,
             evalset: SampleSet, labels: np.ndarray | None) -> dict[tuple[str, str], Engine]:
        """Measure every built variant; returns the loaded native engines of the kept ones (FP32 first)."""
        feeds = list(evalset.feeds(model_io, model_io.max_batch_size or 1))
        engines: dict[tuple[str, str], Engine] = {}
        ref_outcome = outcomes[0]
        ref_engine, reference = self.evaluate(FP32, root, model_io, feeds)
        if labels is not None:
            labels = metrics.check_labels(self.spec, labels, reference)
        ref_outcome.metrics = measure(reference, reference, self.spec, labels)
        engines[(FP32.key, "onnxruntime")] = ref_engine
        policy = GatePolicy(self.opts.max_drop, self.opts.max_abs_error)
        for outcome in outcomes[1:]:
            if outcome.status != "built":
                continue
            backend = NATIVE_BACKEND[outcome.recipe.format]
            try:
                engine, outputs = self.evaluate(outcome.recipe, root, model_io, feeds)
            except EdgedError as e:
                outcome.status, outcome.reasons = "failed", [f"{backend} could not run it: {e}"]
                _remove(root, outcome.recipe)
                self.say(f"{outcome.recipe.key}: failed: {outcome.reasons[0]}")
                continue
            outcome.metrics = measure(outputs, reference, self.spec, labels)
            reasons = judge(ref_outcome.metrics, outcome.metrics, policy, self.spec, with_labels=labels is not None)
            if reasons and outcome.recipe.precision == "int8" and self.opts.accuracy_aware:
                engine.unload()
                self.say(f"{outcome.recipe.key}: plain INT8 fails the gate (" + "; ".join(reasons)
                         + "): trying the accuracy-aware mode")
                reasons, recovered = self.recover(outcome, root, model_io, calib=calib, evalset=evalset,
                                                  feeds=feeds, reference=reference, labels=labels, plain=reasons)
                engine = recovered or engine
            if reasons:
                outcome.status, outcome.reasons = "left out", reasons
                engine.unload()
                _remove(root, outcome.recipe)
                self.say(f"{outcome.recipe.key}: left out: " + "; ".join(reasons))
            else:
                outcome.status = "kept"
                engines[(outcome.recipe.key, backend)] = engine
        return engines

    def _passes_in_f32(self, key: str, outcome: Outcome, passes: Callable[[], tuple[bool, float]],
                       served: Metrics) -> bool:
        """NNCF validated its float layers at f32; this CPU's default runs them in bf16: whether the gate
        holds with them in f32 (then kept as the recipe's hint, and said in the outcome's notes)."""
        self.hints[key] = "f32"
        if not passes()[0]:
            del self.hints[key]
            return False
        value = (f"{served.score * 100:.2f}%" if self.spec.is_fraction else f"{served.score:.3g}")
        outcome.notes.append(
            f"served with its float layers in f32 (inference_precision = \"f32\" in model.toml), "
            f"the precision NNCF validated it at; with this CPU's default bf16 it measured {value}")
        return True

    def recover(self, outcome: Outcome, root: Path, model_io: ModelIO, *, calib: SampleSet, evalset: SampleSet,  # noqa: PLR0913  the run's evaluation data, keyword-only
                feeds: list[dict[str, np.ndarray]], reference: dict[str, np.ndarray], labels: np.ndarray | None,
                plain: list[str]) -> tuple[list[str], Engine | None]:
        """The engine's accuracy-aware INT8; returns the gate's reasons (empty: passed) and the loaded engine."""
        recipe, target = outcome.recipe, root / outcome.recipe.file
        policy = GatePolicy(self.opts.max_drop, self.opts.max_abs_error)
        state: dict[str, Metrics] = {}

        # Each try is screened on the first quarter of the evaluation set; only one that passes there
        # is measured on all of it (the gate's verdict), which keeps a long search affordable.
        screen = feeds[:max(1, len(feeds) // 4)]
        n_screen = sum(len(next(iter(f.values()))) for f in screen) if model_io.batched else len(screen)

        def passes() -> tuple[bool, float]:
            parts = [screen, feeds] if len(screen) < len(feeds) else [feeds]
            for part in parts:
                engine, outputs = self.evaluate(recipe, root, model_io, part, show=False)
                engine.unload()
                n = n_screen if part is screen else len(next(iter(reference.values())))
                ref = {k: v[:n] for k, v in reference.items()}
                lab = labels[:n] if labels is not None else None
                m = measure(outputs, ref, self.spec, lab)
                base = measure(ref, ref, self.spec, lab)
                state["m"] = m
                if judge(base, m, policy, self.spec, with_labels=labels is not None):
                    return False, m.score
            return True, state["m"].score

        t0 = time.monotonic()
        try:
            if recipe.key == "onnx-int8":
                plan, source, _ = self.onnx_prepare(root, calib, model_io)

                def build(exclude: Sequence[str]) -> None:
                    with Progress(f"requantizing {recipe.key}", enabled=False) as p:
                        quantize.onnx_int8(source, target, calib, model_io, method=self.opts.calibration_method,
                                           per_channel=plan.per_channel, reduce_range=self.opts.reduce_range,
                                           progress=p, exclude=exclude, cache=self.calibration_cache)

                rec = accuracy.onnx_accuracy_aware(source, target, calib, model_io, build=build, passes=passes,
                                                   budget_s=self.opts.accuracy_budget_s, say=self.say)
            elif recipe.key == "openvino-int8":
                spec = self.spec

                def score(idx: list[int], outputs: dict[str, np.ndarray]) -> float:
                    ref = {k: v[idx] for k, v in reference.items()}
                    value = metrics.score(spec, outputs, ref, labels[idx] if labels is not None else None)
                    return value if spec.higher_is_better else -value

                max_drop = self.opts.max_drop / 100.0 if spec.higher_is_better else (self.opts.max_abs_error or 0.0)
                with self.progress(f"{recipe.key}: NNCF accuracy control (budget {self.opts.accuracy_budget_s:g} s)"):
                    rec = accuracy.openvino_accuracy_control(
                        root / FP32.file, target, calib, evalset, model_io, score=score, max_drop=max_drop,
                        budget_s=self.opts.accuracy_budget_s)
                if not rec.stopped:
                    rec.passed = passes()[0]
                    if not rec.passed and bf16_unavailable_reason(cpu_flags()) is None:
                        rec.passed = self._passes_in_f32(recipe.key, outcome, passes, state["m"])
            else:
                return plain, None
        except EdgedError:
            raise
        except Exception as e:  # the search failing must not lose the other variants
            outcome.details["accuracy_aware"] = {"error": f"{type(e).__name__}: {e}"}
            return [*plain, f"accuracy-aware mode failed: {type(e).__name__}: {e}"], None
        outcome.build_s += time.monotonic() - t0
        outcome.details["accuracy_aware"] = rec.as_dict()
        outcome_metrics = state.get("m")
        if not rec.passed or outcome_metrics is None:
            why = rec.stopped or "no variant passed"
            if not rec.stopped and outcome_metrics is not None:
                value = (f"{outcome_metrics.score * 100:.2f}%" if self.spec.is_fraction
                         else f"{outcome_metrics.score:.3g}")
                why = (f"its best measures {self.spec.describe(labels is not None)} {value} as served here "
                       f"({len(rec.kept_float)} layers in float)")
                outcome.details["accuracy_aware"]["measured"] = outcome_metrics.as_dict()
            return [*plain, f"accuracy-aware mode ({rec.method}) found none within the gate: {why}"], None
        outcome.metrics = outcome_metrics
        outcome.notes.append(f"accuracy-aware ({rec.method}): {len(rec.kept_float)} of {rec.quantized_layers or '?'} "
                             f"layers kept in float: {', '.join(rec.kept_float[:12])}"
                             + (" ..." if len(rec.kept_float) > 12 else ""))
        engine = self.engine(EngineSpec(self.variant(root, recipe), NATIVE_BACKEND[recipe.format]), root, model_io)
        return [], engine

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
                        EngineSpec(self.variant(root, outcome.recipe), backend), root, model_io)
                except EdgedError as e:
                    outcome.notes.append(f"not timed on {backend}: {e}")
                    continue
                outcome.execution[backend] = execution_precision(engine, outcome.recipe.precision)
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


def _variant(root: Path, recipe: Recipe, hint: str | None = None) -> Variant:
    """The manifest entry for a recipe's files as they are on disk now."""
    extra = [ArtifactFile(file=f, sha256=sha256_file(root / f)) for f in recipe.extra]
    return Variant.model_validate({"file": recipe.file, "sha256": sha256_file(root / recipe.file),
                                   "format": recipe.format, "precision": recipe.precision, "extra_files": extra,
                                   "inference_precision": hint})


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
    if opts.metric not in metrics.METRICS:
        raise OptimizeInputError(f"--metric {opts.metric!r}: choose from {', '.join(metrics.METRICS)}")
    if opts.metric == "max-abs-error" and opts.max_abs_error is None:
        raise OptimizeInputError("--metric max-abs-error needs --max-abs-error X: how much more error than "
                                 "FP32's a variant may have")
    if not opts.accuracy_budget_s >= 0:
        raise OptimizeInputError(f"--accuracy-budget-s must be >= 0, not {opts.accuracy_budget_s}")
    unknown = [v for v in opts.variants if v not in RECIPES]
    if unknown:
        raise OptimizeInputError(f"unknown variant(s) {unknown}; choose from {', '.join(RECIPES)}")
    run = _Run(opts, err if err is not None else sys.stderr)
    check_target(opts.out, force=opts.force)
    model_io, calib, evalset, labels, _ = run.read_inputs()
    root = stage(opts.out)
    try:
        shutil.copyfile(opts.model, root / FP32.file)
        outcomes = [Outcome(FP32, status="reference")]
        outcomes += [run.build(RECIPES[key], root, calib, model_io) for key in opts.variants]
        engines = run.gate(outcomes, root, model_io, calib=calib, evalset=evalset, labels=labels)
        warm = _warmup_feed(evalset, model_io)
        expected = run_outputs(engines[(FP32.key, "onnxruntime")], [warm], model_io)
        if not model_io.batched:
            expected = {k: v[0] for k, v in expected.items()}
        worst = run.time_all(outcomes, engines, root, model_io, evalset=evalset, warm=warm, expected=expected)
        result = OptimizeResult(opts.out, run.name, run.version, model_io, outcomes, labels is not None,
                                len(evalset), len(calib), run.host, run.notes,
                                warmup_atol=float(f"{max(1e-4, 1.5 * worst):.2g}"), metric=opts.metric)
        for outcome in outcomes:
            if outcome.kept:
                outcome.variant = run.variant(root, outcome.recipe).model_copy(update={
                    "accuracy": outcome.metrics.score
                    if labels is not None and outcome.metrics and run.spec.is_fraction else None,
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
    finally:
        run.cleanup()
    return result


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def _save_npz(path: Path, arrays: dict[str, Any]) -> None:
    with path.open("wb") as f:
        np.savez(f, **arrays)
