"""The accuracy gate: each variant against the FP32 model on the evaluation set.

Metrics:

``top1``
    with labels, top-1 accuracy (arg-max over the last axis of the metric
    output equals the label); without labels, top-1 agreement with the FP32
    model's own arg-max. A fraction in [0, 1]; drops are reported in points (x100).
``max_abs_error`` / ``mean_abs_error``
    absolute difference to the FP32 outputs, over every element of every output.

A variant is left out when its top-1 is more than ``max_drop`` points below
FP32's, or (when ``max_abs_error`` is set) when any output element differs from
FP32's by more than it. ``max_drop = 0`` therefore refuses any top-1 loss and
``max_abs_error = 0`` any change at all; a non-finite output always fails.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from edged.optimize.errors import OptimizeInputError


@dataclass(frozen=True)
class Metrics:
    top1: float
    max_abs_error: float
    mean_abs_error: float
    samples: int

    def as_dict(self) -> dict[str, float | int]:
        return {"top1": self.top1, "max_abs_error": self.max_abs_error, "mean_abs_error": self.mean_abs_error,
                "samples": self.samples}


@dataclass(frozen=True)
class GatePolicy:
    max_drop_points: float = 1.0
    max_abs_error: float | None = None


def top1_classes(outputs: Mapping[str, np.ndarray], metric_output: str) -> np.ndarray:
    return np.asarray(np.argmax(outputs[metric_output], axis=-1))


def check_labels(labels: np.ndarray, reference: Mapping[str, np.ndarray], metric_output: str) -> np.ndarray:
    """Labels reshaped like the arg-max of the metric output, or a clear error."""
    classes = top1_classes(reference, metric_output)
    if labels.size != classes.size:
        raise OptimizeInputError(
            f"--labels: {labels.size} labels but output {metric_output!r} gives {classes.size} class "
            f"predictions (arg-max shape {list(classes.shape)}); give one label per prediction")
    n_classes = reference[metric_output].shape[-1]
    if labels.size and (labels.min() < 0 or labels.max() >= n_classes):
        raise OptimizeInputError(f"--labels: class indices must be in [0, {n_classes - 1}] for output "
                                 f"{metric_output!r}; found {int(labels.min())}..{int(labels.max())}")
    return labels.reshape(classes.shape)


def measure(outputs: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], metric_output: str,
            labels: np.ndarray | None) -> Metrics:
    """Metrics of ``outputs`` against the FP32 ``reference`` (and ``labels`` when given)."""
    target = labels if labels is not None else top1_classes(reference, metric_output)
    top1 = float(np.mean(top1_classes(outputs, metric_output) == target))
    max_err, total, count = 0.0, 0.0, 0
    for name, ref in reference.items():
        got = np.asarray(outputs[name])
        if got.shape != ref.shape:
            return Metrics(top1, float("inf"), float("inf"), len(target))
        if got.dtype.kind not in "fiub":
            continue
        diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
        if diff.size:
            finite = bool(np.all(np.isfinite(got)))
            max_err = max(max_err, float(diff.max()) if finite else float("inf"))
            total += float(diff.sum()) if finite else float("inf")
            count += diff.size
    return Metrics(top1, max_err, total / count if count else 0.0, len(target))


def judge(reference: Metrics, candidate: Metrics, policy: GatePolicy, *, with_labels: bool) -> list[str]:
    """Why the candidate is left out; empty when it passes."""
    reasons = []
    what = "top-1 accuracy" if with_labels else "top-1 agreement with FP32"
    drop = (reference.top1 - candidate.top1) * 100.0
    if not drop <= policy.max_drop_points + 1e-9:
        reasons.append(f"{what} {candidate.top1 * 100:.2f}% is {drop:.2f} points below FP32's "
                       f"{reference.top1 * 100:.2f}% (--max-drop {policy.max_drop_points:g})")
    if policy.max_abs_error is not None and not candidate.max_abs_error <= policy.max_abs_error:
        reasons.append(f"max abs output error {candidate.max_abs_error:.3g} exceeds --max-abs-error "
                       f"{policy.max_abs_error:g}")
    elif not np.isfinite(candidate.max_abs_error):
        reasons.append("outputs are not finite or have the wrong shape")
    return reasons
