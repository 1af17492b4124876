"""The accuracy gate: each variant against the FP32 model on the evaluation set.

Metrics (:mod:`edged.optimize.metrics`, chosen with ``--metric``):

``score``
    the task metric: top-1 (default), mAP@0.5, CTC exact match (fractions in [0, 1], drops
    reported in points, x100) or max-abs-error to the targets (lower is better).
``max_abs_error`` / ``mean_abs_error``
    absolute difference to the FP32 outputs, over every element of every output.

A variant is left out when its fraction score is more than ``max_drop`` points below FP32's
(for ``max-abs-error``: when its error exceeds FP32's by more than ``--max-abs-error``), or,
when ``max_abs_error`` is set, when any output element differs from FP32's by more than it.
``max_drop = 0`` therefore refuses any loss and ``max_abs_error = 0`` any change at all; a
non-finite output always fails.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from edged.optimize.metrics import MetricSpec, score


@dataclass(frozen=True)
class Metrics:
    score: float
    max_abs_error: float
    mean_abs_error: float
    samples: int
    metric: str = "top1"

    @property
    def top1(self) -> float:
        return self.score

    def as_dict(self) -> dict[str, float | int | str]:
        d: dict[str, float | int | str] = {"metric": self.metric, "score": self.score,
                                           "max_abs_error": self.max_abs_error,
                                           "mean_abs_error": self.mean_abs_error, "samples": self.samples}
        if self.metric == "top1":
            d["top1"] = self.score
        return d


@dataclass(frozen=True)
class GatePolicy:
    max_drop_points: float = 1.0
    max_abs_error: float | None = None


def measure(outputs: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], spec: MetricSpec,
            labels: np.ndarray | None) -> Metrics:
    """Metrics of ``outputs`` against the FP32 ``reference`` (and ``labels`` when given)."""
    samples = len(next(iter(reference.values())))
    max_err, total, count = 0.0, 0.0, 0
    for name, ref in reference.items():
        got = np.asarray(outputs[name])
        if got.shape != ref.shape:
            return Metrics(float("nan"), float("inf"), float("inf"), samples, spec.name)
        if got.dtype.kind not in "fiub":
            continue
        diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
        if diff.size:
            finite = bool(np.all(np.isfinite(got)))
            max_err = max(max_err, float(diff.max()) if finite else float("inf"))
            total += float(diff.sum()) if finite else float("inf")
            count += diff.size
    value = score(spec, outputs, reference, labels)
    return Metrics(value, max_err, total / count if count else 0.0, samples, spec.name)


def drop(reference: Metrics, candidate: Metrics, spec: MetricSpec) -> float:
    """How much worse the candidate is: points for fractions, output units for max-abs-error."""
    if spec.higher_is_better:
        return (reference.score - candidate.score) * 100.0
    return candidate.score - reference.score


def judge(reference: Metrics, candidate: Metrics, policy: GatePolicy, spec: MetricSpec, *,
          with_labels: bool) -> list[str]:
    """Why the candidate is left out; empty when it passes."""
    reasons = []
    what = spec.describe(with_labels)
    lost = drop(reference, candidate, spec)
    if spec.higher_is_better:
        if not lost <= policy.max_drop_points + 1e-9:
            reasons.append(f"{what} {candidate.score * 100:.2f}% is {lost:.2f} points below FP32's "
                           f"{reference.score * 100:.2f}% (--max-drop {policy.max_drop_points:g})")
    else:
        allowed = policy.max_abs_error if policy.max_abs_error is not None else 0.0
        if not lost <= allowed:
            reasons.append(f"{what} {candidate.score:.3g} exceeds FP32's {reference.score:.3g} by {lost:.3g} "
                           f"(--max-abs-error {allowed:g})")
    if spec.higher_is_better and policy.max_abs_error is not None \
            and not candidate.max_abs_error <= policy.max_abs_error:
        reasons.append(f"max abs output error {candidate.max_abs_error:.3g} exceeds --max-abs-error "
                       f"{policy.max_abs_error:g}")
    elif not np.isfinite(candidate.max_abs_error):
        reasons.append("outputs are not finite or have the wrong shape")
    return reasons
