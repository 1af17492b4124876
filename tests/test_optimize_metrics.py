"""The gate's task metrics on hand-made outputs whose answers are known (edged/optimize/metrics.py)."""

from __future__ import annotations

import numpy as np
import pytest

from edged.optimize.errors import OptimizeInputError
from edged.optimize.metrics import MetricSpec, check_labels, ctc_decode, decode_boxes, mean_average_precision, score


def _onehot(ids: list[list[int]], classes: int) -> np.ndarray:
    out = np.zeros((len(ids), len(ids[0]), classes), np.float32)
    for i, seq in enumerate(ids):
        out[i, np.arange(len(seq)), seq] = 1.0
    return out


def test_ctc_greedy_decoding_merges_repeats_and_drops_blanks() -> None:
    probs = _onehot([[0, 3, 3, 0, 3, 5, 5, 0], [2, 2, 2, 0, 0, 0, 0, 0]], 6)
    assert ctc_decode(probs, 0) == [(3, 3, 5), (2,)]
    spec = MetricSpec("ctc-exact", "o")
    labels = check_labels(spec, np.array([[3, 3, 5], [2, -1, -1]]), {"o": probs})
    assert score(spec, {"o": probs}, {"o": probs}, labels) == 1.0
    wrong = np.array([[3, 5, -1], [2, -1, -1]])
    assert score(spec, {"o": probs}, {"o": probs}, wrong) == 0.5


def test_map50_of_boxes_rows_and_of_a_yolo_head() -> None:
    truth = np.array([[[0, 0, 10, 10, 1], [20, 20, 30, 30, 0], [-1, -1, -1, -1, -1]]], np.float64)
    rows = np.array([[[0, 0, 10, 10, 0.9, 1], [21, 21, 31, 31, 0.8, 0], [50, 50, 60, 60, 0.3, 0]]], np.float32)
    spec = MetricSpec("map50", "o")
    labels = check_labels(spec, truth, {"o": rows})
    # class 1: one hit (AP 1); class 0: hit at rank 1, a false positive after it (AP 1)
    assert score(spec, {"o": rows}, {"o": rows}, labels) == pytest.approx(1.0)
    shifted = rows.copy()
    shifted[0, 1, :4] += 8  # IoU of the class-0 box drops below 0.5
    assert score(spec, {"o": shifted}, {"o": rows}, labels) == pytest.approx(0.5)
    # the same two boxes as a YOLOv8 head: [4 + classes, anchors], centre/size, one anchor per box
    head = np.zeros((1, 6, 3), np.float32)
    head[0, :4, 0], head[0, 5, 0] = [5, 5, 10, 10], 0.9
    head[0, :4, 1], head[0, 4, 1] = [26, 26, 10, 10], 0.8
    head[0, :4, 2], head[0, 4, 2] = [25, 25, 10, 10], 0.7  # duplicate of box 1: suppressed by NMS
    dets = decode_boxes(head, 0.25)[0]
    assert len(dets) == 2 and sorted(dets[:, 5].tolist()) == [0.0, 1.0]
    assert score(spec, {"o": head}, {"o": head}, labels) == pytest.approx(1.0)
    assert mean_average_precision([np.zeros((0, 6))], [np.zeros((0, 5))]) == 1.0


def test_max_abs_error_metric_and_label_checks() -> None:
    spec = MetricSpec("max-abs-error", "o")
    out = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    target = check_labels(spec, np.array([[1.0, 2.5], [3.0, 4.0]]), {"o": out})
    assert score(spec, {"o": out}, {"o": out}, target) == pytest.approx(0.5)
    assert score(spec, {"o": out + 0.25}, {"o": out}, None) == pytest.approx(0.25)
    assert not spec.higher_is_better
    with pytest.raises(OptimizeInputError, match="targets have shape"):
        check_labels(spec, np.zeros((2, 3)), {"o": out})
    with pytest.raises(OptimizeInputError, match="boxes"):
        check_labels(MetricSpec("map50", "o"), np.zeros((2, 3)), {"o": out})
    with pytest.raises(OptimizeInputError, match="integer class"):
        check_labels(MetricSpec("top1", "o"), np.zeros(2), {"o": out})
