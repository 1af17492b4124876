"""Output steps (softmax, top-k, threshold, detection decoding + NMS, CTC, crop-every-box)
against direct numpy/OpenCV computations on the same arrays."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from edged.pipeline.contract import ANY, PipelineDefinitionError, Port, Step, StepInputError
from edged.pipeline.steps import builtin_step

cv2 = pytest.importorskip("cv2", reason="the pipeline extra (opencv-python-headless) is not installed")


def make_step(kind: str, params: dict[str, object], folder: Path = Path(".")) -> Step:
    return builtin_step(kind)(params, folder)


def test_softmax_matches_float64_and_survives_large_logits() -> None:
    x = np.random.default_rng(0).normal(0, 30, (4, 7)).astype(np.float32)
    x[0, 0] = 1e4
    out = make_step("softmax", {}).run({"logits": x})["probabilities"]
    e = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(out, e / e.sum(axis=1, keepdims=True), atol=1e-6)


@pytest.mark.parametrize("fmt", ["txt", "json"])
def test_topk_with_labels(tmp_path: Path, fmt: str) -> None:
    names = [f"class {i}" for i in range(10)]
    (tmp_path / f"labels.{fmt}").write_text(json.dumps(names) if fmt == "json" else "\n".join(names))
    scores = np.random.default_rng(1).random((3, 10)).astype(np.float32)
    step = make_step("topk", {"k": 3, "labels": f"labels.{fmt}"}, tmp_path)
    out = step.run({"scores": scores})
    expect = np.argsort(-scores, axis=1)[:, :3]
    np.testing.assert_array_equal(out["indices"], expect)
    np.testing.assert_array_equal(out["scores"], np.take_along_axis(scores, expect, axis=1))
    assert out["labels"][1].tolist() == [names[i].encode() for i in expect[1]]
    doc = json.loads(out["json"][2])
    assert [d["index"] for d in doc] == expect[2].tolist()
    assert doc[0]["label"] == names[expect[2, 0]] and doc[0]["score"] == pytest.approx(scores[2, expect[2, 0]])


def test_topk_load_checks(tmp_path: Path) -> None:
    (tmp_path / "labels.txt").write_text("a\nb\n")
    with pytest.raises(PipelineDefinitionError, match="k=5 but input 'scores' has 3 classes"):
        make_step("topk", {"k": 5}).bind({"scores": Port("FP32", (ANY, 3))})
    with pytest.raises(PipelineDefinitionError, match="has 2 labels for 3 classes"):
        make_step("topk", {"k": 1, "labels": "labels.txt"}, tmp_path).bind({"scores": Port("FP32", (ANY, 3))})
    with pytest.raises(PipelineDefinitionError, match="must be inside the version folder"):
        make_step("topk", {"labels": "../labels.txt"}, tmp_path)
    with pytest.raises(PipelineDefinitionError, match="cannot read labels file"):
        make_step("topk", {"labels": "nope.txt"}, tmp_path)


def test_threshold() -> None:
    x = np.array([[0.1, 0.5, 0.9]], dtype=np.float32)
    np.testing.assert_array_equal(make_step("threshold", {"threshold": 0.5}).run({"scores": x})["mask"],
                                  [[False, True, True]])
    np.testing.assert_array_equal(make_step("threshold", {"threshold": 0.5, "above": False}).run(
        {"scores": x})["mask"], [[True, False, False]])


def random_detections(rng: np.random.Generator, anchors: int, classes: int) -> tuple[np.ndarray, np.ndarray]:
    """cxcywh boxes clustered so that NMS has work to do, and class scores."""
    centres = rng.uniform(50, 590, (8, 2))
    pick = rng.integers(0, 8, anchors)
    cxcy = centres[pick] + rng.normal(0, 6, (anchors, 2))
    wh = rng.uniform(20, 120, (anchors, 2))
    scores = rng.random((anchors, classes)) ** 3
    return np.concatenate([cxcy, wh], axis=1).astype(np.float32), scores.astype(np.float32)


def opencv_reference(boxes: np.ndarray, scores: np.ndarray, score_t: float, iou_t: float) -> set[tuple[int, int]]:
    """(anchor, class) pairs kept by OpenCV's class-aware NMS on the best class of each anchor."""
    cls = scores.argmax(axis=1)
    conf = scores.max(axis=1)
    xywh = np.concatenate([boxes[:, :2] - boxes[:, 2:] / 2, boxes[:, 2:]], axis=1)
    keep = cv2.dnn.NMSBoxesBatched(xywh.tolist(), conf.tolist(), cls.tolist(), score_t, iou_t)
    return {(int(a), int(cls[a])) for a in np.asarray(keep).reshape(-1)}


@pytest.mark.parametrize("layout", ["yolov8", "yolov5"])
def test_detection_nms_matches_opencv(layout: str) -> None:
    rng = np.random.default_rng(2)
    boxes, scores = random_detections(rng, 400, 5)
    if layout == "yolov8":
        pred = np.concatenate([boxes, scores], axis=1).T[None]
        model_scores = scores
    else:  # objectness times class probability is the score
        obj = rng.uniform(0.5, 1.0, (400, 1)).astype(np.float32)
        pred = np.concatenate([boxes, obj, scores], axis=1)[None]
        model_scores = scores * obj
    step = make_step("detect_decode", {"layout": layout, "score_threshold": 0.3, "iou_threshold": 0.5})
    out = step.run({"predictions": pred})
    expect = opencv_reference(boxes, model_scores, 0.3, 0.5)
    k = int(out["count"][0])
    assert k == len(expect) > 10
    # each kept box is the expected anchor's box
    xyxy = np.concatenate([boxes[:, :2] - boxes[:, 2:] / 2, boxes[:, :2] + boxes[:, 2:] / 2], axis=1)
    got = set()
    for b, c in zip(out["boxes"][0, :k], out["classes"][0, :k], strict=True):
        anchor = int(np.argmin(np.abs(xyxy - b).sum(axis=1)))
        np.testing.assert_allclose(xyxy[anchor], b, atol=1e-4)
        got.add((anchor, int(c)))
    assert got == expect


def test_detection_maps_boxes_back_and_pads_the_request() -> None:
    # two images; the second has no detection
    pred = np.zeros((2, 6, 2), dtype=np.float32)
    pred[0, :, 0] = [100, 60, 40, 20, 0.9, 0.1]  # cx cy w h, class 0
    pred[0, :, 1] = [300, 300, 50, 50, 0.2, 0.8]  # class 1, runs past the original image
    transform = np.array([[0.5, 0.5, 10, 20], [1, 1, 0, 0]], dtype=np.float32)
    sizes = np.array([[600, 560], [10, 10]], dtype=np.int32)
    out = make_step("detect_decode", {"layout": "yolov8"}).run(
        {"predictions": pred, "transform": transform, "sizes": sizes})
    np.testing.assert_array_equal(out["count"], [2, 0])
    np.testing.assert_allclose(out["boxes"][0, 0], [(80 - 10) / 0.5, (50 - 20) / 0.5, (120 - 10) / 0.5, 100])
    np.testing.assert_allclose(out["boxes"][0, 1], [(275 - 10) / 0.5, (275 - 20) / 0.5, 560, 600])  # clipped
    assert out["classes"].tolist() == [[0, 1], [-1, -1]]
    assert out["labels"].tolist() == [[b"0", b"1"], [b"", b""]]
    assert json.loads(out["json"][1]) == []
    assert json.loads(out["json"][0])[1]["label"] == "1"


def test_detection_load_checks() -> None:
    with pytest.raises(ValueError, match="input_size"):
        make_step("detect_decode", {"layout": "picodet"})
    step = make_step("detect_decode", {"layout": "picodet", "input_size": [64, 64], "strides": [8, 16]})
    with pytest.raises(PipelineDefinitionError, match="input 'scores_0' is not wired"):
        step.bind({"predictions": Port("FP32", (ANY, 84, ANY))})
    with pytest.raises(PipelineDefinitionError, match="no room for a box"):
        make_step("detect_decode", {"layout": "yolov8"}).bind({"predictions": Port("FP32", (ANY, 4, ANY))})


def test_picodet_heads_decode_distributions() -> None:
    # one 16x16 input, stride 8 and 16: 4 + 1 anchors; one confident anchor at cell (1, 0) of stride 8
    bins = 8
    scores_0 = np.zeros((1, 4, 2), np.float32)
    scores_0[0, 1, 1] = 0.9
    boxes_0 = np.full((1, 4, 4 * bins), -20.0, np.float32)
    for side, dist in enumerate([1, 2, 3, 4]):  # l t r b, in stride units, as one-hot distributions
        boxes_0[0, 1, side * bins + dist] = 20.0
    step = make_step("detect_decode", {"layout": "picodet", "input_size": [16, 16], "strides": [8, 16],
                                       "score_threshold": 0.5, "multi_label": True})
    out = step.run({"scores_0": scores_0, "boxes_0": boxes_0,
                    "scores_1": np.zeros((1, 1, 2), np.float32), "boxes_1": np.zeros((1, 1, 4 * bins), np.float32)})
    centre = (8 + 4, 4)  # cell (col 1, row 0) of stride 8
    np.testing.assert_allclose(out["boxes"][0, 0], [centre[0] - 8, centre[1] - 16, centre[0] + 24, centre[1] + 32],
                               atol=1e-3)
    assert out["classes"].tolist() == [[1]]


def test_ctc_greedy_matches_a_direct_decode(tmp_path: Path) -> None:
    (tmp_path / "chars.txt").write_text("a\nb\nc\n")
    table = ["", "a", "b", "c", " "]
    rng = np.random.default_rng(3)
    logits = rng.random((6, 20, 5)).astype(np.float32)
    logits[5] = 0
    logits[5, :, 0] = 1  # all blank
    out = make_step("ctc_decode", {"characters": "chars.txt"}, tmp_path).run({"logits": logits})
    for i in range(6):
        best = logits[i].argmax(axis=1)
        collapsed = [k for k, _ in itertools.groupby(best) if k != 0]
        assert out["text"][i] == "".join(table[k] for k in collapsed).encode()
        kept = [t for t in range(20) if best[t] != 0 and (t == 0 or best[t] != best[t - 1])]
        expect = logits[i, kept, best[kept]].mean() if kept else 0.0
        assert out["confidence"][i] == pytest.approx(expect)
    assert json.loads(out["json"][5]) == {"text": "", "confidence": 0.0}
    with pytest.raises(PipelineDefinitionError, match="has 9 classes"):
        make_step("ctc_decode", {"characters": "chars.txt"}, tmp_path).bind({"logits": Port("FP32", (ANY, ANY, 9))})


def image(h: int = 60, w: int = 80) -> np.ndarray:
    return np.random.default_rng(4).integers(0, 255, (h, w, 3), dtype=np.uint8)


def test_crop_boxes_matches_slices() -> None:
    pixels = np.stack([image(), image()[::-1].copy()])
    boxes = np.array([[[10.2, 5.0, 30.0, 25.7], [0, 0, 0, 0]], [[-5, -5, 20, 10], [70, 50, 200, 200]]], np.float32)
    step = make_step("crop_boxes", {"width": 16, "height": 12})
    out = step.run({"pixels": pixels, "boxes": boxes, "count": np.array([1, 2], np.int32)})
    assert out["crop_index"].tolist() == [[0, 0], [1, 0], [1, 1]]
    regions = [pixels[0, 5:26, 10:30], pixels[1, 0:10, 0:20], pixels[1, 50:60, 70:80]]
    for crop, region in zip(out["crops"], regions, strict=True):
        np.testing.assert_array_equal(crop, cv2.resize(region, (16, 12), interpolation=cv2.INTER_LINEAR))


def test_crop_quads_upright_and_fit_height() -> None:
    pixels = image()[None]
    wide = [[10, 10], [50, 10], [50, 20], [10, 20]]
    tall = [[60, 5], [70, 5], [70, 55], [60, 55]]
    out = make_step("crop_boxes", {"width": 64, "height": 10, "mode": "fit_height"}).run(
        {"pixels": pixels, "boxes": np.array([[wide, tall]], np.float32)})
    np.testing.assert_array_equal(out["crops"][0, :, :40], pixels[0, 10:20, 10:50])  # same size: copied as is
    assert not out["crops"][0, :, 40:].any()
    turned = np.rot90(pixels[0, 5:55, 60:70])  # 50 tall, 10 wide: turned to 10 x 50
    np.testing.assert_array_equal(out["crops"][1, :, :50], turned)


def test_crop_limits() -> None:
    pixels = image()[None]
    boxes = np.tile(np.array([0, 0, 5, 5], np.float32), (1, 10, 1))
    with pytest.raises(StepInputError, match="more than max_crops=4"):
        make_step("crop_boxes", {"width": 4, "height": 4, "max_crops": 4}).run({"pixels": pixels, "boxes": boxes})
    boxes[0, 3, 0] = np.nan
    with pytest.raises(StepInputError, match="box 3 of image 0 is not finite"):
        make_step("crop_boxes", {"width": 4, "height": 4}).run({"pixels": pixels, "boxes": boxes})
