"""Crop every detected box into one batch for the next model step (the per-detection fan-out).

Boxes are in the coordinates of ``pixels`` (detect_decode maps them back to the decoded,
original image, so wire the decode step's pixels here, not the detector's resized input).
Axis-aligned boxes ``[N, D, 4]`` (x1, y1, x2, y2) are cut out; quadrilaterals
``[N, D, 4, 2]`` (text boxes, clockwise from top-left) are warped upright, and turned a
quarter when the result is much taller than wide (``upright``). Each crop is then resized to
``width`` x ``height``: ``stretch``, or ``fit_height`` (height fixed, the width following the
aspect up to ``width``, padded on the right, as text recognizers want). ``crop_index`` [M, 2]
says which image and which detection each crop came from, so results can be grouped back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import ModuleType
from typing import Literal

import numpy as np
from pydantic import Field

from edged.pipeline.contract import ANY, PipelineDefinitionError, Port, StepInputError
from edged.pipeline.steps._base import BuiltinStep, StepParams, opencv
from edged.pipeline.steps.image import Interpolation, ResizeParams, resize_one


class CropBoxesParams(StepParams):
    width: int = Field(gt=0, le=8192)
    height: int = Field(gt=0, le=8192)
    mode: Literal["stretch", "fit_height"] = "stretch"
    interpolation: Interpolation = "linear"
    pad_value: int = Field(default=0, ge=0, le=255)
    upright: bool = True
    max_crops: int = Field(default=256, gt=0, le=65536)


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
        return {"crops": Port("UINT8", (ANY, self.params.height, self.params.width, pixels.shape[3])),
                "crop_index": Port("INT32", (ANY, 2))}

    def _fit(self, crop: np.ndarray) -> np.ndarray:
        p = self.params
        if p.mode == "stretch":
            out, _ = resize_one(crop, ResizeParams(width=p.width, height=p.height, interpolation=p.interpolation))
            return out
        h, w = crop.shape[:2]
        new_w = min(p.width, math.ceil(p.height * w / h))
        out, _ = resize_one(crop, ResizeParams(width=new_w, height=p.height, interpolation=p.interpolation))
        canvas = np.full((p.height, p.width, crop.shape[2]), p.pad_value, dtype=crop.dtype)
        canvas[:, :new_w] = out
        return canvas

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
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
                crops.append(self._fit(crop))
                index.append((i, j))
        out = np.stack(crops) if crops else np.zeros((0, p.height, p.width, pixels.shape[3]), dtype=pixels.dtype)
        return {"crops": out, "crop_index": np.array(index, dtype=np.int32).reshape(-1, 2)}
