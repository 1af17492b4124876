"""Crop every detected box into one batch for the next model step (the per-detection fan-out).

Boxes are in the coordinates of ``pixels`` (detect_decode maps them back to the decoded,
original image, so wire the decode step's pixels here, not the detector's resized input).
Axis-aligned boxes ``[N, D, 4]`` (x1, y1, x2, y2) are cut out; quadrilaterals
``[N, D, 4, 2]`` (text boxes, clockwise from top-left) are warped upright, and turned a
quarter when the result is much taller than wide (``upright``), then turned by ``turns``
(quarter turns per box, e.g. from ``rotate_by_class``). Each crop is then resized:

- ``stretch``: to ``width`` x ``height``;
- ``fit_height``: height fixed, width ``min(width, ceil(height * (w / h)))``, padded on the right
  to ``width`` (a text classifier's fixed input);
- ``batch_width``: height fixed, the crops sorted by aspect ratio (``sort = "aspect"``) and taken
  in groups of ``group``; a group's width is ``min(max_width, int(height * max(min_width / height,
  widest w / h of the group)))`` and each crop of it is ``min(group width, ceil(height * (w / h)))``
  wide, padded on the right: a long line pads only the crops of its own group, never twenty short
  ones (PaddleOCR's recognizer batching). The tensor is as wide as the widest group; ``batch_widths``
  says each row's group width, so a model step given ``widths = "<that tensor>"`` runs each group
  cut to its own width.

``crop_index`` [M, 2] says which image and which detection each crop came from (rows are in
sorted order when sorted), so results can be grouped back; ``widths`` [M] is each crop's own
width before padding (``normalize`` pads beyond it in normalised space).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import ModuleType
from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from edged.pipeline.contract import ANY, PipelineDefinitionError, Port, StepInputError
from edged.pipeline.steps._base import BuiltinStep, StepParams, opencv
from edged.pipeline.steps.image import Interpolation, ResizeParams, resize_one


class CropBoxesParams(StepParams):
    width: int | None = Field(default=None, gt=0, le=8192)
    height: int = Field(gt=0, le=8192)
    mode: Literal["stretch", "fit_height", "batch_width"] = "stretch"
    interpolation: Interpolation = "linear"
    pad_value: int = Field(default=0, ge=0, le=255)
    upright: bool = True
    max_crops: int = Field(default=256, gt=0, le=65536)
    min_width: int = Field(default=1, gt=0, le=8192)  # batch_width
    max_width: int = Field(default=4096, gt=0, le=16384)  # batch_width
    group: int = Field(default=6, gt=0, le=4096)  # batch_width: crops per width group
    sort: Literal["none", "aspect"] = "aspect"  # batch_width: order of the crops before grouping

    @model_validator(mode="after")
    def _width(self) -> CropBoxesParams:
        if self.mode != "batch_width" and self.width is None:
            raise ValueError(f"mode {self.mode!r} needs 'width'")
        if self.min_width > self.max_width:
            raise ValueError("'min_width' is larger than 'max_width'")
        return self


def quad_upright(cv2: ModuleType, image: np.ndarray, quad: np.ndarray, turn: bool) -> np.ndarray:
    """The quadrilateral ``quad`` [4, 2] of ``image`` warped to an upright rectangle."""
    pts = quad.astype(np.float32)
    width = int(max(np.linalg.norm(pts[0] - pts[1]), np.linalg.norm(pts[2] - pts[3])))
    height = int(max(np.linalg.norm(pts[0] - pts[3]), np.linalg.norm(pts[1] - pts[2])))
    width, height = max(width, 1), max(height, 1)
    target = np.array([[0, 0], [width, 0], [width, height], [0, height]], dtype=np.float32)
    m = cv2.getPerspectiveTransform(pts, target)
    out: np.ndarray = cv2.warpPerspective(image, m, (width, height),
                                          borderMode=cv2.BORDER_REPLICATE,
                                          flags=cv2.INTER_CUBIC)
    if turn and height / width >= 1.5:
        out = np.rot90(out)
    return out


class CropBoxes(BuiltinStep):
    """pixels [N,H,W,C], boxes [N,D,4] or [N,D,4,2] (+ count [N]) -> crops [M,height,width,C], crop_index [M,2]."""

    kind = "crop_boxes"
    Params = CropBoxesParams
    params: CropBoxesParams

    @property
    def fan_out(self) -> int:
        """The most crops one request may make (the graph says so at load when a model's batch is smaller)."""
        return self.params.max_crops

    def bind(self, inputs: Mapping[str, Port]) -> dict[str, Port]:
        opencv()  # a missing pipeline extra fails the load, explained, not the first request
        pixels = self.port(inputs, "pixels", ("UINT8",), rank=4)
        boxes = self.port(inputs, "boxes", ("FP32",), rank=(3, 4))
        tail = boxes.shape[2:]
        if tail not in ((4,), (4, 2), (ANY,), (4, ANY), (ANY, 2), (ANY, ANY)):
            raise PipelineDefinitionError(f"step 'crop_boxes': input 'boxes' {list(boxes.shape)} is neither "
                                          "[N, D, 4] boxes nor [N, D, 4, 2] quadrilaterals")
        if "count" in inputs:
            self.port(inputs, "count", ("INT32", "INT64"), rank=1)
        if "turns" in inputs:
            self.port(inputs, "turns", ("INT32", "INT64"), rank=2)
        width = ANY if self.params.mode == "batch_width" else self.params.width
        assert width is not None
        return {"crops": Port("UINT8", (ANY, self.params.height, width, pixels.shape[3])),
                "crop_index": Port("INT32", (ANY, 2)), "widths": Port("INT32", (ANY,)),
                "batch_widths": Port("INT32", (ANY,))}

    def _fit(self, crop: np.ndarray, width: int) -> tuple[np.ndarray, int]:
        """``crop`` at the step's height, ``width`` wide: stretched, or its aspect kept up to ``width``
        and padded on the right; and the width of its content."""
        p = self.params
        if p.mode == "stretch":
            out, _ = resize_one(crop, ResizeParams(width=width, height=p.height, interpolation=p.interpolation))
            return out, width
        h, w = crop.shape[:2]
        new_w = min(width, math.ceil(p.height * (w / h)))
        out, _ = resize_one(crop, ResizeParams(width=new_w, height=p.height, interpolation=p.interpolation))
        if new_w == width:
            return out, new_w
        canvas = np.full((p.height, width, crop.shape[2]), p.pad_value, dtype=crop.dtype)
        canvas[:, :new_w] = out
        return canvas, new_w

    def _cut(self, inputs: Mapping[str, np.ndarray]) -> tuple[list[np.ndarray], list[tuple[int, int]]]:
        """Every box cut out of its image (upright, turned), unresized, with its (image, detection)."""
        p = self.params
        pixels = self.array(inputs, "pixels", ndim=4)
        boxes = self.array(inputs, "boxes")
        quads = boxes.ndim == 4
        if boxes.ndim not in (3, 4) or len(boxes) != len(pixels) or boxes.shape[2:] not in ((4,), (4, 2)):
            raise StepInputError(f"step 'crop_boxes': input 'boxes' {list(boxes.shape)} does not fit "
                                 f"{len(pixels)} images", input="boxes")
        count = inputs.get("count")
        counts = [boxes.shape[1]] * len(boxes) if count is None else [int(c) for c in count.reshape(-1)]
        if len(counts) != len(boxes) or any(c < 0 or c > boxes.shape[1] for c in counts):
            raise StepInputError("step 'crop_boxes': input 'count' does not match 'boxes'", input="count")
        if sum(counts) > p.max_crops:
            raise StepInputError(f"step 'crop_boxes': {sum(counts)} boxes, more than max_crops={p.max_crops}",
                                 input="boxes")
        turns = inputs.get("turns")
        if turns is not None and turns.shape != boxes.shape[:2]:
            raise StepInputError(f"step 'crop_boxes': input 'turns' has shape {list(turns.shape)}, expected "
                                 f"{list(boxes.shape[:2])}", input="turns")
        cv2 = opencv()
        crops, index = [], []
        height, width = pixels.shape[1:3]
        for i, image in enumerate(pixels):
            for j in range(counts[i]):
                box = boxes[i, j]
                if not np.isfinite(box).all():
                    raise StepInputError(f"step 'crop_boxes': box {j} of image {i} is not finite", input="boxes")
                if quads:
                    crop = quad_upright(cv2, image, box, p.upright)
                else:
                    x1, y1 = max(0, math.floor(box[0])), max(0, math.floor(box[1]))
                    x2, y2 = min(width, math.ceil(box[2])), min(height, math.ceil(box[3]))
                    if x2 <= x1 or y2 <= y1:
                        continue  # nothing of the box is inside the image
                    crop = image[y1:y2, x1:x2]
                if turns is not None and int(turns[i, j]) % 4:
                    crop = np.ascontiguousarray(np.rot90(crop, int(turns[i, j]) % 4))
                crops.append(crop)
                index.append((i, j))
        return crops, index

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        p = self.params
        channels = self.array(inputs, "pixels", ndim=4).shape[3]
        crops, index = self._cut(inputs)
        if p.mode == "batch_width":
            return self._batch_width(crops, index, channels)
        assert p.width is not None
        fitted = [self._fit(c, p.width) for c in crops]
        out = (np.stack([f[0] for f in fitted]) if fitted
               else np.zeros((0, p.height, p.width, channels), dtype=np.uint8))
        widths = np.array([f[1] for f in fitted], dtype=np.int32)
        return {"crops": out, "crop_index": np.array(index, dtype=np.int32).reshape(-1, 2), "widths": widths,
                "batch_widths": np.full(len(fitted), p.width, dtype=np.int32)}

    def _batch_width(self, crops: list[np.ndarray], index: list[tuple[int, int]], channels: int
                     ) -> dict[str, np.ndarray]:
        p = self.params
        ratios = np.array([c.shape[1] / float(c.shape[0]) for c in crops], dtype=np.float64)
        order = np.argsort(ratios) if p.sort == "aspect" else np.arange(len(crops))
        group_width = np.zeros(len(crops), dtype=np.int32)  # per position in ``order``
        for start in range(0, len(crops), p.group):
            part = ratios[order[start:start + p.group]]
            widest = max(p.min_width / p.height, float(part.max()))
            group_width[start:start + p.group] = min(p.max_width, int(p.height * widest))
        full = int(group_width.max()) if len(crops) else p.min_width
        out = np.full((len(crops), p.height, full, channels), p.pad_value, dtype=np.uint8)
        widths = np.zeros(len(crops), dtype=np.int32)
        for row, k in enumerate(order.tolist()):
            fitted, widths[row] = self._fit(crops[k], int(group_width[row]))
            out[row, :, :fitted.shape[1]] = fitted
        sorted_index = np.array([index[k] for k in order.tolist()], dtype=np.int32).reshape(-1, 2)
        return {"crops": out, "crop_index": sorted_index, "widths": widths, "batch_widths": group_width}
