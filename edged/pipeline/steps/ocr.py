"""Text detection and reading steps: DB-net decoding, turning crops by a classifier, collecting answers.

- ``db_decode``: a DB-net probability map (PP-OCR det and the like) -> scored quadrilaterals in
  the original image, in reading order;
- ``rotate_by_class``: a classifier's answer per crop (PP-OCR cls: 0 or 180 degrees) -> quarter
  turns per box, for the next ``crop_boxes``;
- ``collect``: per-crop answers (after a fan-out) -> one JSON list per image, in detection order,
  with each box and a score filter.

The geometry is OpenCV's (contours, minimum-area rectangles, polygon fill for the box score) and
the round-join polygon offset of :func:`unclip`, so no polygon library is needed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import ModuleType
from typing import Any, Literal

import numpy as np
import orjson
from pydantic import Field

from edged.pipeline.contract import ANY, PipelineDefinitionError, Port, StepInputError
from edged.pipeline.steps._base import FLOATS, BuiltinStep, StepParams, opencv
from edged.pipeline.steps.classify import bytes_array


class DBDecodeParams(StepParams):
    threshold: float = Field(default=0.3, ge=0, le=1)  # a pixel is text above this probability
    box_threshold: float = Field(default=0.5, ge=0, le=1)  # a box is kept when its mean probability reaches this
    unclip_ratio: float = Field(default=1.6, gt=0, le=10)  # how far a box grows: area * ratio / perimeter
    dilation: bool = True  # dilate the text mask with a 2x2 kernel before finding contours
    min_size: float = Field(default=3, ge=0)  # boxes whose shorter side is below this (map pixels) are dropped
    min_side: int = Field(default=3, ge=0)  # after mapping: boxes whose width or height is <= this are dropped
    max_candidates: int = Field(default=1000, gt=0, le=100000)  # contours looked at per image
    order: Literal["reading", "none"] = "reading"  # top to bottom, left to right within line_tolerance
    line_tolerance: float = Field(default=10, ge=0)  # pixels of y within which boxes count as one line


def mini_box(cv2: ModuleType, points: np.ndarray) -> tuple[np.ndarray, float]:
    """The minimum-area rectangle around ``points``: its corners (top-left, top-right, bottom-right,
    bottom-left by x then y) and its shorter side."""
    rect = cv2.minAreaRect(points)
    corners = sorted(cv2.boxPoints(rect).tolist(), key=lambda p: p[0])
    left = (corners[0], corners[1]) if corners[1][1] > corners[0][1] else (corners[1], corners[0])
    right = (corners[2], corners[3]) if corners[3][1] > corners[2][1] else (corners[3], corners[2])
    box = np.array([left[0], right[0], right[1], left[1]], dtype=np.float32)
    return box, float(min(rect[1]))


def _round(v: float) -> int:
    """Half away from zero, as the Clipper library rounds offset vertices."""
    return int(v - 0.5) if v < 0 else int(v + 0.5)


def unclip(box: np.ndarray, ratio: float, arc_tolerance: float = 0.25) -> np.ndarray:
    """``box`` grown by ``area * ratio / perimeter``: its outline offset outward with round joins, the
    vertices on whole pixels (int32 [K, 2]).

    This is the polygon offset DB-net's post-processing asks of the Clipper library (round joins,
    the default arc tolerance of 0.25, coordinates truncated to integers on the way in and rounded
    on the way out), written for the convex quadrilaterals it is given, so that the boxes land on
    the same pixels as PaddleOCR's and RapidOCR's without a polygon library.
    """
    pts = box.astype(np.float64)
    x, y = pts[:, 0], pts[:, 1]
    area = abs(float(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1)))) / 2
    perimeter = float(np.linalg.norm(pts - np.roll(pts, -1, axis=0), axis=1).sum())
    src = [(int(a), int(b)) for a, b in box.tolist()]  # to integer coordinates, truncated
    dedup = [q for i, q in enumerate(src) if q != src[i - 1]] if len(set(src)) > 1 else src[:1]
    if perimeter == 0 or len(dedup) < 3:
        return np.array(src, dtype=np.int32)
    # orientation: positive area (Clipper's sign), else reversed, so that a positive delta grows it
    signed = sum((dedup[j][0] + dedup[i][0]) * (dedup[j][1] - dedup[i][1]) for i, j in
                 zip(range(len(dedup)), [len(dedup) - 1, *range(len(dedup) - 1)], strict=True)) * -0.5
    if signed < 0:
        dedup.reverse()
    delta = area * ratio / perimeter
    tol = min(arc_tolerance, abs(delta) * 0.25)
    steps = math.pi / math.acos(1 - tol / abs(delta)) if delta else 1.0
    steps = min(steps, abs(delta) * math.pi)
    sin_step, cos_step, per_rad = math.sin(2 * math.pi / steps), math.cos(2 * math.pi / steps), steps / (2 * math.pi)
    n = len(dedup)
    normals = []
    for j in range(n):
        (x1, y1), (x2, y2) = dedup[j], dedup[(j + 1) % n]
        dx, dy = x2 - x1, y2 - y1
        f = 1.0 / math.hypot(dx, dy) if (dx or dy) else 0.0
        normals.append((dy * f, -dx * f))
    out: list[tuple[int, int]] = []
    k = n - 1
    for j in range(n):
        (nkx, nky), (njx, njy) = normals[k], normals[j]
        px, py = dedup[j]
        sin_a = nkx * njy - njx * nky
        if abs(sin_a * delta) < 1.0 and nkx * njx + njy * nky > 0:
            out.append((_round(px + nkx * delta), _round(py + nky * delta)))
        elif max(-1.0, min(1.0, sin_a)) * delta < 0:
            out += [(_round(px + nkx * delta), _round(py + nky * delta)), (px, py),
                    (_round(px + njx * delta), _round(py + njy * delta))]
        else:
            sin_a = max(-1.0, min(1.0, sin_a))
            a = math.atan2(sin_a, nkx * njx + nky * njy)
            count = max(_round(per_rad * abs(a)), 1)
            vx, vy = nkx, nky
            for _ in range(count):
                out.append((_round(px + vx * delta), _round(py + vy * delta)))
                vx, vy = vx * cos_step - sin_step * vy, vx * sin_step + vy * cos_step
            out.append((_round(px + njx * delta), _round(py + njy * delta)))
        k = j
    return np.array(out, dtype=np.int32)


def box_score(cv2: ModuleType, prob: np.ndarray, box: np.ndarray) -> float:
    """Mean probability inside ``box`` (the polygon filled over its bounding rectangle)."""
    h, w = prob.shape
    xmin = int(np.clip(np.floor(box[:, 0].min()), 0, w - 1))
    xmax = int(np.clip(np.ceil(box[:, 0].max()), 0, w - 1))
    ymin = int(np.clip(np.floor(box[:, 1].min()), 0, h - 1))
    ymax = int(np.clip(np.ceil(box[:, 1].max()), 0, h - 1))
    mask = np.zeros((ymax - ymin + 1, xmax - xmin + 1), dtype=np.uint8)
    shifted = box - np.array([xmin, ymin], dtype=box.dtype)
    cv2.fillPoly(mask, shifted.reshape(1, -1, 2).astype(np.int32), 1)
    return float(cv2.mean(prob[ymin:ymax + 1, xmin:xmax + 1], mask)[0])


def clockwise(pts: np.ndarray) -> np.ndarray:
    """Corners ordered top-left, top-right, bottom-right, bottom-left (two leftmost by x, then by y)."""
    by_x = pts[np.argsort(pts[:, 0]), :]
    left, right = by_x[:2], by_x[2:]
    tl, bl = left[np.argsort(left[:, 1]), :]
    tr, br = right[np.argsort(right[:, 1]), :]
    return np.array([tl, tr, br, bl], dtype=np.float32)


def reading_order(boxes: list[np.ndarray], scores: list[float], tolerance: float
                  ) -> tuple[list[np.ndarray], list[float]]:
    """Top to bottom by the first corner, then left to right among boxes within ``tolerance`` of y."""
    order = sorted(range(len(boxes)), key=lambda k: (float(boxes[k][0][1]), float(boxes[k][0][0])))
    for i in range(len(order) - 1):
        for j in range(i, -1, -1):
            a, b = boxes[order[j]], boxes[order[j + 1]]
            if abs(float(b[0][1]) - float(a[0][1])) < tolerance and float(b[0][0]) < float(a[0][0]):
                order[j], order[j + 1] = order[j + 1], order[j]
            else:
                break
    return [boxes[k] for k in order], [scores[k] for k in order]


class DBDecode(BuiltinStep):
    """probability [N,1,H,W] or [N,H,W] FP32, sizes [N,2] (original height, width), optional transform [N,4]
    -> boxes FP32 [N,D,4,2] (quadrilaterals in the original image), scores [N,D], count INT32 [N], json [N]."""

    kind = "db_decode"
    Params = DBDecodeParams
    params: DBDecodeParams

    def bind(self, inputs: Mapping[str, Port]) -> dict[str, Port]:
        opencv()
        prob = self.port(inputs, "probability", FLOATS, rank=(3, 4))
        if len(prob.shape) == 4 and prob.shape[1] not in (1, ANY):
            raise PipelineDefinitionError(f"step 'db_decode': input 'probability' {list(prob.shape)} must have "
                                          "one channel")
        self.port(inputs, "sizes", ("INT32", "INT64"), rank=2)
        if "transform" in inputs:
            self.port(inputs, "transform", ("FP32",), rank=2)
        n = prob.shape[0]
        return {"boxes": Port("FP32", (n, ANY, 4, 2)), "scores": Port("FP32", (n, ANY)),
                "count": Port("INT32", (n,)), "json": Port("BYTES", (n,))}

    def _one(self, cv2: ModuleType, prob: np.ndarray, size: tuple[int, int], transform: np.ndarray | None
             ) -> tuple[list[np.ndarray], list[float]]:
        p = self.params
        height, width = prob.shape
        mask = (prob > p.threshold).astype(np.uint8)
        if p.dilation:
            mask = cv2.dilate(mask, np.ones((2, 2), dtype=np.uint8))
        contours, _ = cv2.findContours(mask * 255, cv2.RETR_LIST, cv2.CHAIN_APPROX_SIMPLE)
        dest_h, dest_w = size
        boxes, scores = [], []
        for contour in contours[:p.max_candidates]:
            points, side = mini_box(cv2, contour)
            if side < p.min_size:
                continue
            score = box_score(cv2, prob, points)
            if score < p.box_threshold:
                continue
            box, side = mini_box(cv2, unclip(points, p.unclip_ratio))
            if side < p.min_size + 2:
                continue
            if transform is None:  # the map covers the whole image, stretched
                x, y = box[:, 0] / width * dest_w, box[:, 1] / height * dest_h
            else:
                sx, sy, px, py = (float(v) for v in transform)
                x, y = (box[:, 0] - px) / sx, (box[:, 1] - py) / sy
            quad = np.stack([np.clip(np.round(x), 0, dest_w), np.clip(np.round(y), 0, dest_h)], axis=1)
            quad = clockwise(quad.astype(np.int32).astype(np.float32))
            quad[:, 0] = np.clip(quad[:, 0], 0, dest_w - 1).astype(np.int32)
            quad[:, 1] = np.clip(quad[:, 1], 0, dest_h - 1).astype(np.int32)
            too_small = min(int(np.linalg.norm(quad[0] - quad[1])), int(np.linalg.norm(quad[0] - quad[3])))
            if too_small <= p.min_side:
                continue
            boxes.append(quad)
            scores.append(score)
        if p.order == "reading":
            boxes, scores = reading_order(boxes, scores, p.line_tolerance)
        return boxes, scores

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        prob = self.array(inputs, "probability")
        if prob.ndim == 4:
            if prob.shape[1] != 1:
                raise StepInputError(f"step 'db_decode': input 'probability' {list(prob.shape)} has "
                                     f"{prob.shape[1]} channels, expected 1", input="probability")
            prob = prob[:, 0]
        if prob.ndim != 3:
            raise StepInputError(f"step 'db_decode': input 'probability' {list(prob.shape)} is not [N,1,H,W]",
                                 input="probability")
        sizes = self.array(inputs, "sizes", ndim=2)
        transform = inputs.get("transform")
        n = len(prob)
        if sizes.shape != (n, 2) or (transform is not None and transform.shape != (n, 4)):
            raise StepInputError(f"step 'db_decode': 'sizes' {list(sizes.shape)} (or 'transform') does not fit "
                                 f"{n} maps", input="sizes")
        cv2 = opencv()
        found = [self._one(cv2, prob[i].astype(np.float32, copy=False), (int(sizes[i, 0]), int(sizes[i, 1])),
                           None if transform is None else transform[i]) for i in range(n)]
        d = max((len(b) for b, _ in found), default=0)
        boxes = np.zeros((n, d, 4, 2), dtype=np.float32)
        scores = np.zeros((n, d), dtype=np.float32)
        count = np.zeros(n, dtype=np.int32)
        docs = []
        for i, (bs, ss) in enumerate(found):
            count[i] = len(bs)
            if bs:
                boxes[i, :len(bs)] = np.stack(bs)
                scores[i, :len(bs)] = ss
            docs.append(orjson.dumps([{"box": b.tolist(), "score": float(s)} for b, s in zip(bs, ss, strict=True)]))
        return {"boxes": boxes, "scores": scores, "count": count, "json": bytes_array(docs, (n,))}


class RotateByClassParams(StepParams):
    turns: list[int] = Field(min_length=1)  # quarter turns (counter-clockwise) per class, e.g. [0, 2] for 0/180
    threshold: float = Field(default=0.9, ge=0, le=1)  # turn only when the best class's score is above this


class RotateByClass(BuiltinStep):
    """scores [M,C] per crop, crop_index [M,2], boxes [N,D,...] -> turns INT32 [N,D] (quarter turns of each
    box's crop: the best class's entry of ``turns`` when its score is above ``threshold``, else 0), for the
    ``turns`` input of the next ``crop_boxes``."""

    kind = "rotate_by_class"
    Params = RotateByClassParams
    params: RotateByClassParams

    def bind(self, inputs: Mapping[str, Port]) -> dict[str, Port]:
        scores = self.port(inputs, "scores", FLOATS, rank=2)
        if scores.shape[1] not in (ANY, len(self.params.turns)):
            raise PipelineDefinitionError(f"step 'rotate_by_class': input 'scores' has {scores.shape[1]} classes, "
                                          f"'turns' gives {len(self.params.turns)}")
        self.port(inputs, "crop_index", ("INT32", "INT64"), rank=2)
        boxes = self.port(inputs, "boxes", FLOATS, rank=(3, 4))
        return {"turns": Port("INT32", (boxes.shape[0], boxes.shape[1]))}

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        scores = self.array(inputs, "scores", ndim=2)
        index = self.array(inputs, "crop_index", ndim=2)
        boxes = self.array(inputs, "boxes")
        if len(index) != len(scores) or scores.shape[1] != len(self.params.turns):
            raise StepInputError(f"step 'rotate_by_class': scores {list(scores.shape)} do not fit crop_index "
                                 f"{list(index.shape)} and {len(self.params.turns)} classes", input="scores")
        if boxes.ndim < 2:
            raise StepInputError(f"step 'rotate_by_class': input 'boxes' {list(boxes.shape)} is not [N, D, ...]",
                                 input="boxes")
        rows, cols = int(boxes.shape[0]), int(boxes.shape[1])
        out = np.zeros((rows, cols), dtype=np.int32)
        best = scores.argmax(axis=1)
        table = self.params.turns
        for (i, j), k, row in zip(index.tolist(), best.tolist(), scores, strict=True):
            if not (0 <= i < rows and 0 <= j < cols):
                raise StepInputError(f"step 'rotate_by_class': crop_index ({i}, {j}) is outside the boxes "
                                     f"{list(boxes.shape[:2])}", input="crop_index")
            if float(row[k]) > self.params.threshold:
                out[i, j] = table[k]
        return {"turns": out}


class CollectParams(StepParams):
    score: str | None = None  # the per-crop input whose value filters the answers (e.g. "confidence")
    min_score: float = 0.0  # answers whose score is below this are left out
    box_field: str = "box"


def _value(item: Any) -> Any:
    if isinstance(item, bytes):
        return item.decode("utf-8", "replace")
    if isinstance(item, np.ndarray):
        return [_value(x) for x in item]
    if isinstance(item, np.generic):
        return item.item()
    return item


class Collect(BuiltinStep):
    """crop_index [M,2] + any per-crop inputs ([M] or [M,k]: text, confidence, labels...) + optional
    boxes [N,D,...] and count [N] -> json BYTES [N]: per image, a list of objects (one per crop, by
    detection index; each per-crop input under its port name, the box under ``box_field``), those
    whose ``score`` input is below ``min_score`` left out; count INT32 [N] of the objects kept."""

    kind = "collect"
    Params = CollectParams
    params: CollectParams
    _fixed = ("crop_index", "boxes", "count")

    def bind(self, inputs: Mapping[str, Port]) -> dict[str, Port]:
        self.port(inputs, "crop_index", ("INT32", "INT64"), rank=2)
        fields = [k for k in inputs if k not in self._fixed]
        if not fields:
            raise PipelineDefinitionError("step 'collect': wire at least one per-crop input (text, confidence...)")
        if self.params.score is not None and self.params.score not in fields:
            raise PipelineDefinitionError(f"step 'collect': score {self.params.score!r} is not a wired input "
                                          f"(per-crop inputs: {sorted(fields)})")
        if "count" in inputs:
            self.port(inputs, "count", ("INT32", "INT64"), rank=1)
        n = inputs["boxes"].shape[0] if "boxes" in inputs else (inputs["count"].shape[0] if "count" in inputs
                                                                 else ANY)
        self._fields = fields
        return {"json": Port("BYTES", (n,)), "count": Port("INT32", (n,))}

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        p = self.params
        index = self.array(inputs, "crop_index", ndim=2)
        boxes, count = inputs.get("boxes"), inputs.get("count")
        n = len(boxes) if boxes is not None else (len(count) if count is not None
                                                 else int(index[:, 0].max()) + 1 if len(index) else 0)
        values = {}
        for name in self._fields:
            arr = self.array(inputs, name)
            if len(arr) != len(index):
                raise StepInputError(f"step 'collect': input {name!r} has {len(arr)} rows for {len(index)} crops",
                                     input=name)
            values[name] = arr
        rows: list[list[tuple[int, dict[str, Any]]]] = [[] for _ in range(n)]
        for m, (i, j) in enumerate(index.tolist()):
            if not 0 <= i < n or (boxes is not None and not 0 <= j < boxes.shape[1]):
                raise StepInputError(f"step 'collect': crop_index ({i}, {j}) is outside the images",
                                     input="crop_index")
            if p.score is not None and float(values[p.score][m]) < p.min_score:
                continue
            item = {name: _value(arr[m]) for name, arr in values.items()}
            if boxes is not None:
                item[p.box_field] = boxes[i, j].tolist()
            rows[i].append((j, item))
        docs = [orjson.dumps([item for _, item in sorted(row, key=lambda r: r[0])]) for row in rows]
        return {"json": bytes_array(docs, (n,)), "count": np.array([len(r) for r in rows], dtype=np.int32)}


__all__ = ["Collect", "DBDecode", "RotateByClass"]
