"""Task metrics for the accuracy gate: one score per evaluation set, chosen with ``--metric``.

``top1``
    classification: arg-max over the last axis equals the integer label (or FP32's arg-max).
``map50``
    detection: mean average precision at IoU 0.5 over classes. Boxes are read from the metric
    output, either rows ``[x1, y1, x2, y2, score, class]`` (``[N, K, 6]``, already filtered) or
    a YOLOv8-style head ``[N, 4 + classes, anchors]`` (centre, size, class scores), decoded here
    with a score threshold and per-class non-maximum suppression. Labels: ``[N, K, 5]`` floats
    ``[x1, y1, x2, y2, class]``, rows with a negative class are padding; without labels FP32's
    detections are the ground truth.
``ctc-exact``
    sequence recognition: greedy CTC decoding (arg-max per step, repeats merged, blanks dropped)
    of a ``[N, T, classes]`` output must equal the label sequence exactly. Labels: ``[N, L]``
    integers padded with -1; without labels FP32's decoding.
``max-abs-error``
    regression: the largest absolute difference to the float targets (labels shaped like the
    metric output) or to FP32's outputs. Lower is better; every other metric is a fraction where
    higher is better.

Scores are plain floats so that NNCF's accuracy control can call them on any subset.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from edged.optimize.errors import OptimizeInputError
from edged.pipeline.steps.detect import iou_one, nms

METRICS = ("top1", "map50", "ctc-exact", "max-abs-error")
IOU_THRESHOLD = 0.5
NMS_IOU = 0.45
MAX_DETECTIONS = 300


@dataclass(frozen=True)
class MetricSpec:
    name: str = "top1"
    output: str = ""
    ctc_blank: int = 0
    score_threshold: float = 0.25

    @property
    def higher_is_better(self) -> bool:
        return self.name != "max-abs-error"

    @property
    def is_fraction(self) -> bool:
        return self.higher_is_better

    def describe(self, with_labels: bool) -> str:
        return {
            "top1": "top-1 accuracy" if with_labels else "top-1 agreement with FP32",
            "map50": "mAP@0.5" if with_labels else "mAP@0.5 against FP32's detections",
            "ctc-exact": "exact-match text" if with_labels else "exact-match text agreement with FP32",
            "max-abs-error": "max abs error to the targets" if with_labels else "max abs error to FP32",
        }[self.name]


# ---- labels -------------------------------------------------------------------------------------
def check_labels(spec: MetricSpec, labels: np.ndarray, reference: Mapping[str, np.ndarray]) -> np.ndarray:
    """Labels in the form ``score`` expects, or an error that says what was wrong with them."""
    out = reference[spec.output]
    if spec.name == "top1":
        if labels.dtype.kind not in "iu":
            raise OptimizeInputError(f"--labels: top1 labels must be integer class indices, not {labels.dtype}")
        classes = np.argmax(out, axis=-1)
        if labels.size != classes.size:
            raise OptimizeInputError(
                f"--labels: {labels.size} labels but output {spec.output!r} gives {classes.size} class "
                f"predictions (arg-max shape {list(classes.shape)}); give one label per prediction")
        n_classes = out.shape[-1]
        if labels.size and (labels.min() < 0 or labels.max() >= n_classes):
            raise OptimizeInputError(f"--labels: class indices must be in [0, {n_classes - 1}] for output "
                                     f"{spec.output!r}; found {int(labels.min())}..{int(labels.max())}")
        return np.asarray(labels.astype(np.int64).reshape(classes.shape))
    if spec.name == "ctc-exact":
        if labels.dtype.kind not in "iu" or labels.ndim != 2:
            raise OptimizeInputError(f"--labels: ctc-exact labels are integer sequences [N, L] padded with -1, "
                                     f"not {labels.dtype} {list(labels.shape)}")
        return labels.astype(np.int64)
    if spec.name == "map50":
        if labels.dtype.kind not in "fiu" or labels.ndim != 3 or labels.shape[2] != 5:
            raise OptimizeInputError(f"--labels: map50 labels are boxes [N, K, 5] (x1, y1, x2, y2, class; "
                                     f"class < 0 pads), not {labels.dtype} {list(labels.shape)}")
        return labels.astype(np.float64)
    if labels.shape != out.shape:
        raise OptimizeInputError(f"--labels: max-abs-error targets have shape {list(labels.shape)}, output "
                                 f"{spec.output!r} has {list(out.shape)}")
    return labels.astype(np.float64)


# ---- scores -------------------------------------------------------------------------------------
def score(spec: MetricSpec, outputs: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray],
          labels: np.ndarray | None) -> float:
    """The metric of ``outputs`` against ``labels`` (checked) or, without labels, the FP32 ``reference``."""
    got, ref = np.asarray(outputs[spec.output]), np.asarray(reference[spec.output])
    if spec.name == "top1":
        target = labels if labels is not None else np.argmax(ref, axis=-1)
        return float(np.mean(np.argmax(got, axis=-1) == target)) if got.size else 0.0
    if spec.name == "ctc-exact":
        want = [_unpad(r) for r in labels] if labels is not None else ctc_decode(ref, spec.ctc_blank)
        have = ctc_decode(got, spec.ctc_blank)
        return float(np.mean([a == b for a, b in zip(have, want, strict=True)])) if have else 0.0
    if spec.name == "map50":
        dets = decode_boxes(got, spec.score_threshold)
        if labels is not None:
            truth = [lab[lab[:, 4] >= 0] for lab in labels]
        else:
            truth = [d[:, [0, 1, 2, 3, 5]] for d in decode_boxes(ref, spec.score_threshold)]
        return mean_average_precision(dets, truth)
    target = labels if labels is not None else ref.astype(np.float64)
    if got.shape != target.shape:
        return float("inf")
    diff = np.abs(got.astype(np.float64) - target)
    return float(diff.max()) if diff.size else 0.0


def _unpad(row: np.ndarray) -> tuple[int, ...]:
    return tuple(int(x) for x in row if x >= 0)


def ctc_decode(probs: np.ndarray, blank: int) -> list[tuple[int, ...]]:
    """Greedy CTC: arg-max per time step, merge repeats, drop blanks; one tuple of ids per sample."""
    if probs.ndim != 3:
        raise OptimizeInputError(f"ctc-exact needs an output [N, T, classes], got shape {list(probs.shape)}")
    best = np.argmax(probs, axis=-1)
    out = []
    for seq in best:
        keep = np.ones(len(seq), dtype=bool)
        keep[1:] = seq[1:] != seq[:-1]
        out.append(tuple(int(c) for c in seq[keep] if c != blank))
    return out


def decode_boxes(out: np.ndarray, threshold: float) -> list[np.ndarray]:
    """Per sample ``[K, 6]`` detections ``x1, y1, x2, y2, score, class`` from either supported layout."""
    if out.ndim != 3:
        raise OptimizeInputError(f"map50 needs a box output [N, K, 6] or [N, 4 + classes, anchors], "
                                 f"got shape {list(out.shape)}")
    result = []
    for sample in out.astype(np.float64):
        if sample.shape[-1] == 6:
            dets = sample[sample[:, 4] >= threshold]
        else:
            if sample.shape[0] < 5:
                raise OptimizeInputError(f"map50: output rows {sample.shape[0]} < 5: not a YOLO-style head")
            cx, cy, w, h = sample[:4]
            cls_scores = sample[4:]
            cls, conf = np.argmax(cls_scores, axis=0), np.max(cls_scores, axis=0)
            m = conf >= threshold
            boxes = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1)[m]
            conf, cls = conf[m], cls[m]
            rows = []
            for c in np.unique(cls):
                idx = np.nonzero(cls == c)[0]
                for k in nms(boxes[idx], conf[idx], NMS_IOU, MAX_DETECTIONS):
                    rows.append([*boxes[idx[k]], conf[idx[k]], float(c)])
            dets = np.asarray(rows, dtype=np.float64).reshape(-1, 6)
        result.append(dets)
    return result


def mean_average_precision(dets: list[np.ndarray], truth: list[np.ndarray]) -> float:
    """VOC-style all-point AP at IoU 0.5 per class, averaged over classes that have ground truth.

    With no ground-truth boxes at all the score is 1.0 when nothing was detected either, else 0.0.
    """
    classes = sorted({int(c) for t in truth for c in t[:, 4]})
    if not classes:
        return 1.0 if all(len(d) == 0 for d in dets) else 0.0
    aps = []
    for c in classes:
        gts = [t[t[:, 4] == c, :4] for t in truth]
        n_gt = sum(len(g) for g in gts)
        found = [(float(d[4]), i, d[:4]) for i, ds in enumerate(dets) for d in ds if int(d[5]) == c]
        found.sort(key=lambda x: -x[0])
        used = [np.zeros(len(g), dtype=bool) for g in gts]
        tp = np.zeros(len(found))
        for k, (_, i, box) in enumerate(found):
            if len(gts[i]):
                ious = iou_one(box, gts[i])
                j = int(np.argmax(ious))
                if ious[j] >= IOU_THRESHOLD and not used[i][j]:
                    used[i][j] = True
                    tp[k] = 1
        if not found:
            aps.append(0.0)
            continue
        ctp = np.cumsum(tp)
        recall = ctp / n_gt
        precision = ctp / np.arange(1, len(found) + 1)
        mrec = np.concatenate([[0.0], recall, [1.0]])
        mpre = np.concatenate([[1.0], precision, [0.0]])
        mpre = np.maximum.accumulate(mpre[::-1])[::-1]
        steps = np.nonzero(mrec[1:] != mrec[:-1])[0]
        aps.append(float(np.sum((mrec[steps + 1] - mrec[steps]) * mpre[steps + 1])))
    return float(np.mean(aps))
