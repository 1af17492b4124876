"""What an optimize run leaves behind: ``model.toml``, ``optimize-report.json`` and the summary table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edged.optimize.metrics import MetricSpec
from edged.optimize.writer import manifest_toml
from edged.repository.manifest import ModelManifest, Warmup

if TYPE_CHECKING:
    from edged.optimize.results import OptimizeOptions, OptimizeResult, Outcome

# Differences smaller than this are within run-to-run timing noise on a busy small device.
SLOWER_MARGIN = 0.03


def build_manifest(result: OptimizeResult, opts: OptimizeOptions, root: Path) -> ModelManifest:
    io = result.model_io
    manifest = ModelManifest(
        description=opts.description or f"{result.name}: {opts.model.name} with variants made by edged optimize",
        max_batch_size=io.max_batch_size,
        inputs=io.specs(io.inputs),
        outputs=io.specs(io.outputs),
        variants=[o.variant for o in result.outcomes if o.kept and o.variant is not None],
        warmup=Warmup(file="warmup.npz", expected="expected.npz", atol=result.warmup_atol),
    )
    (root / "model.toml").write_text(manifest_toml(manifest), encoding="utf-8")
    return manifest


def _timings(o: Outcome) -> dict[str, list[dict[str, Any]]]:
    return {b: [{"batch_size": t.batch_size, "latency_ms": t.latency_ms, "p90_ms": t.p90_ms,
                 "throughput_per_s": t.throughput_per_s, "runs": t.runs} for t in ts]
            for b, ts in o.timings.items()}


def report_dict(result: OptimizeResult, opts: OptimizeOptions) -> dict[str, Any]:
    return {
        "model": result.name,
        "version": result.version,
        "source": opts.model.name,
        "host": result.host,
        "max_batch_size": result.model_io.max_batch_size,
        "calibration": {"source": str(opts.calibration), "samples": result.calibration_samples,
                        "method": opts.calibration_method, "reduce_range": opts.reduce_range},
        "evaluation": {"source": str(opts.eval or opts.calibration), "samples": result.eval_samples,
                       "metric": _spec(opts).describe(result.with_labels), "metric_key": opts.metric,
                       "max_drop_points": opts.max_drop, "max_abs_error": opts.max_abs_error,
                       "accuracy_aware": opts.accuracy_aware, "accuracy_budget_s": opts.accuracy_budget_s},
        "timing_budget_s": opts.timing_budget_s,
        "variants": [{
            "key": o.recipe.key, "file": o.recipe.file, "format": o.recipe.format,
            "precision": o.recipe.precision, "status": o.status, "reasons": o.reasons, "notes": o.notes,
            "metrics": o.metrics.as_dict() if o.metrics else None, "build_s": round(o.build_s, 3),
            "sha256": o.variant.sha256 if o.variant else None, "timings": _timings(o),
            "execution_precision": o.execution, **o.details,
        } for o in result.outcomes],
        "slower_int8": slower_int8(result),
        "fastest": fastest(result),
        "notes": result.notes,
    }


def write_report(result: OptimizeResult, opts: OptimizeOptions, root: Path) -> None:
    text = json.dumps(report_dict(result, opts), indent=2, allow_nan=False, default=str)
    (root / "optimize-report.json").write_text(text + "\n", encoding="utf-8")


def slower_int8(result: OptimizeResult) -> list[str]:
    """Every place an INT8 variant was measured slower than FP32 (same backend and batch size) beyond noise."""
    fp32 = result.outcome("fp32")
    out = []
    for o in result.outcomes:
        if o.recipe.precision != "int8" or not o.kept:
            continue
        for backend, ts in o.timings.items():
            ref = {t.batch_size: t for t in fp32.timings.get(backend, [])}
            for t in ts:
                r = ref.get(t.batch_size)
                if r is not None and t.throughput_per_s < r.throughput_per_s * (1 - SLOWER_MARGIN):
                    out.append(f"{o.recipe.key} on {backend} at batch {t.batch_size}: "
                               f"{t.throughput_per_s / r.throughput_per_s:.2f}x FP32's throughput "
                               f"({t.latency_ms:.3g} ms vs {r.latency_ms:.3g} ms per batch)")
    return out


def _spec(opts: OptimizeOptions) -> MetricSpec:
    return MetricSpec(opts.metric)


def fastest(result: OptimizeResult) -> list[str]:
    """Per batch size, the fastest kept variant and engine against the fastest FP32 one (what to serve)."""
    by_batch: dict[int, list[tuple[float, str, str, float]]] = {}
    for o in result.outcomes:
        if not o.kept:
            continue
        for backend, ts in o.timings.items():
            for t in ts:
                by_batch.setdefault(t.batch_size, []).append(
                    (t.throughput_per_s, o.recipe.key, f"{backend} ({o.execution.get(backend, o.recipe.precision)})",
                     t.latency_ms))
    out = []
    for b, rows in sorted(by_batch.items()):
        best = max(rows)
        ref = max((r for r in rows if r[1] == "fp32"), default=None)
        if ref is None or ref[0] <= 0:
            continue
        out.append(f"batch {b}: {best[1]} on {best[2]}, {best[0] / ref[0]:.2f}x the fastest FP32 "
                   f"({ref[1]} on {ref[2]}; {best[3]:.3g} ms vs {ref[3]:.3g} ms per batch)")
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.2f}%"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def render_table(result: OptimizeResult) -> str:
    """Accuracy and speed per variant and backend, then why anything was left out."""
    mbs = result.model_io.max_batch_size
    sizes = [1] if mbs <= 1 else [1, mbs]
    ref = result.outcome("fp32").metrics
    metric = result.metric
    head = ["VARIANT", "FILE", "BACKEND", {"top1": "TOP-1", "map50": "MAP50", "ctc-exact": "EXACT"}.get(metric, "ERR"),
            "DROP", "MAX|ERR|", "MEAN|ERR|"]
    for b in sizes:
        head += [f"B{b} ms", f"B{b} /s"]
    head.append("STATUS")
    rows = [head]
    for o in result.outcomes:
        m = o.metrics
        fraction = metric != "max-abs-error"
        scale = 100.0 if fraction else 1.0
        drop = "-" if m is None or ref is None or o.recipe.key == "fp32" else \
            f"{(ref.score - m.score) * scale if fraction else m.score - ref.score:.3g}"
        is_ref = o.recipe.key == "fp32"
        cells = [o.recipe.key, o.recipe.file if o.kept or o.status == "left out" else "-", "",
                 (_pct if fraction else _num)(m.score if m else None), drop,
                 _num(m.max_abs_error if m and not is_ref else None),
                 _num(m.mean_abs_error if m and not is_ref else None)]
        status = o.status if o.kept else f"{o.status}: {'; '.join(o.reasons)}"
        backends = list(o.timings) or [""]
        for i, backend in enumerate(backends):
            by_batch = {t.batch_size: t for t in o.timings.get(backend, [])}
            row = [*cells] if i == 0 else ["", "", "", "", "", "", ""]
            row[2] = f"{backend} ({o.execution[backend]})" if backend in o.execution else backend or "-"
            for b in sizes:
                t = by_batch.get(b)
                row += [f"{t.latency_ms:.3g}", f"{t.throughput_per_s:,.0f}"] if t else ["-", "-"]
            row.append(status if i == 0 else "")
            rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1] for r in rows]
    lines.insert(0, f"{result.name} version {result.version}: {MetricSpec(metric).describe(result.with_labels)} "
                    f"on {result.eval_samples} samples; "
                    f"speed on {result.host}")
    for o in result.outcomes:
        for note in o.notes:
            lines.append(f"note: {o.recipe.key}: {note}")
    for text in slower_int8(result):
        lines.append(f"INT8 is slower than FP32 here: {text}")
    for text in fastest(result):
        lines.append(f"fastest here at {text}")
    for note in result.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)
