"""Image steps on ``[N, H, W, C]`` (or ``[N, C, H, W]``) batches: resize, crop, colour order,
normalize, layout, dtype.

Geometry steps keep a ``transform`` ``[N, 4]`` FP32 per image, ``(sx, sy, px, py)`` with
``model = original * s + p``, so detection decoding can map boxes back to the original
image whatever resizing, letterboxing and cropping came before.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from edged.datatypes import DataType, to_numpy
from edged.membudget import charge
from edged.pipeline.contract import ANY, PipelineDefinitionError, Port, StepInputError
from edged.pipeline.steps._base import FLOATS, PIXELS, BuiltinStep, StepParams, opencv

Interpolation = Literal["nearest", "linear", "area", "cubic", "lanczos"]


class ResizeParams(StepParams):
    """``stretch`` to width x height; ``letterbox`` keeps the aspect and pads; ``short_side``
    scales the shorter side to ``short`` keeping the aspect (the output size follows the input);
    ``limit`` keeps the aspect and scales only when a side breaks ``limit_side``: with
    ``limit_type = "min"`` the shorter side is raised to it, with ``"max"`` the longer one lowered
    to it (DB-net text detectors). ``multiple_of`` (short_side, limit) then rounds each side to
    the nearest multiple, at least one multiple: ``int(round(int(side * ratio) / m) * m)``, as
    PaddleOCR's detectors do (sides that are multiples of 32). In those two modes the output size
    follows the image: ``max_pixels`` (width x height of one output image) refuses, before resizing,
    an image that would become larger (a 2000x20 image raised to a shorter side of 736 is 54 M pixels)."""

    mode: Literal["stretch", "letterbox", "short_side", "limit"] = "stretch"
    width: int | None = Field(default=None, gt=0, le=16384)
    height: int | None = Field(default=None, gt=0, le=16384)
    short: int | None = Field(default=None, gt=0, le=16384)
    limit_side: int | None = Field(default=None, gt=0, le=16384)
    limit_type: Literal["min", "max"] = "min"
    multiple_of: int | None = Field(default=None, gt=0, le=1024)
    interpolation: Interpolation = "linear"
    pad_value: int = Field(default=114, ge=0, le=255)
    align: Literal["center", "top_left"] = "center"
    max_pixels: int = Field(default=40_000_000, gt=0)  # short_side, limit

    @model_validator(mode="after")
    def _sizes(self) -> ResizeParams:
        if self.mode == "short_side":
            if self.short is None:
                raise ValueError("mode 'short_side' needs 'short'")
        elif self.mode == "limit":
            if self.limit_side is None:
                raise ValueError("mode 'limit' needs 'limit_side'")
        elif self.width is None or self.height is None:
            raise ValueError(f"mode {self.mode!r} needs 'width' and 'height'")
        if self.multiple_of is not None and self.mode not in ("short_side", "limit"):
            raise ValueError("'multiple_of' applies to modes 'short_side' and 'limit'")
        return self

    def out_hw(self) -> tuple[int, int]:
        if self.mode in ("short_side", "limit"):
            return ANY, ANY
        assert self.width is not None and self.height is not None
        return self.height, self.width


def identity_transform(n: int) -> np.ndarray:
    out = np.zeros((n, 4), dtype=np.float32)
    out[:, :2] = 1.0
    return out


def compose(first: np.ndarray, then: np.ndarray) -> np.ndarray:
    """The transform of applying ``first`` and then ``then`` (both ``[N, 4]``)."""
    out = np.empty_like(first)
    out[:, :2] = first[:, :2] * then[:, :2]
    out[:, 2:] = first[:, 2:] * then[:, :2] + then[:, 2:]
    return out


def _multiple(side: int, m: int) -> int:
    """``side`` rounded to the nearest multiple of ``m`` (Python's round: halves to even), at least ``m``."""
    return max(m, int(round(side / m) * m))


def resize_one(img: np.ndarray, p: ResizeParams, source: str = "pixels"
               ) -> tuple[np.ndarray, tuple[float, float, float, float]]:
    """One HWC image resized as ``p`` says, and its transform ``(sx, sy, px, py)``.

    Where the output size follows the image (``short_side``, ``limit``), one over ``p.max_pixels`` is a
    StepInputError naming ``source``; what is allocated (the output, and its copy in the stacked batch)
    is charged to the request before it is."""
    cv2 = opencv()
    flag = {"nearest": cv2.INTER_NEAREST, "linear": cv2.INTER_LINEAR, "area": cv2.INTER_AREA,
            "cubic": cv2.INTER_CUBIC, "lanczos": cv2.INTER_LANCZOS4}[p.interpolation]
    h, w = img.shape[:2]
    if p.mode == "short_side":
        assert p.short is not None
        ratio = p.short / min(w, h)
        nw, nh = max(1, round(w * ratio)), max(1, round(h * ratio))
        if p.multiple_of:
            nw, nh = _multiple(nw, p.multiple_of), _multiple(nh, p.multiple_of)
    elif p.mode == "limit":
        assert p.limit_side is not None
        side = min(h, w) if p.limit_type == "min" else max(h, w)
        breaks = side < p.limit_side if p.limit_type == "min" else side > p.limit_side
        ratio = p.limit_side / side if breaks else 1.0
        nw, nh = max(1, int(w * ratio)), max(1, int(h * ratio))
        if p.multiple_of:
            nw, nh = _multiple(nw, p.multiple_of), _multiple(nh, p.multiple_of)
    elif p.mode == "stretch":
        assert p.width is not None and p.height is not None
        nw, nh = p.width, p.height
    else:
        assert p.width is not None and p.height is not None
        ratio = min(p.width / w, p.height / h)
        nw, nh = max(1, round(w * ratio)), max(1, round(h * ratio))
    if p.mode in ("short_side", "limit") and nw * nh > p.max_pixels:
        raise StepInputError(f"input {source!r}: a {w}x{h} image resized ({p.mode}) would be {nw}x{nh}, over "
                             f"the {p.max_pixels}-pixel limit", input=source)
    if (nw, nh) != (w, h) or p.mode == "letterbox":
        out_w, out_h = (p.width, p.height) if p.mode == "letterbox" else (nw, nh)
        assert out_w is not None and out_h is not None
        channels = img.shape[2] if img.ndim == 3 else 1
        charge(2 * out_w * out_h * channels * img.itemsize, f"resizing a {w}x{h} image to {out_w}x{out_h}")
    out = img if (nw, nh) == (w, h) else cv2.resize(img, (nw, nh), interpolation=flag)
    if out.ndim == 2:
        out = out[:, :, None]
    sx, sy = nw / w, nh / h
    if p.mode != "letterbox":
        return out, (sx, sy, 0.0, 0.0)
    assert p.width is not None and p.height is not None
    left, top = ((p.width - nw) // 2, (p.height - nh) // 2) if p.align == "center" else (0, 0)
    canvas = np.full((p.height, p.width, out.shape[2]), p.pad_value, dtype=out.dtype)
    canvas[top:top + nh, left:left + nw] = out
    return canvas, (sx, sy, float(left), float(top))


def stack(images: list[np.ndarray], kind: str, name: str) -> np.ndarray:
    """One batch from per-image arrays, which must share a shape."""
    shapes = {im.shape for im in images}
    if len(shapes) > 1:
        raise StepInputError(f"step {kind!r}: the images of one request differ in size "
                             f"({sorted(shapes)[:3]}); resize them to one size in this step", input=name)
    return np.stack(images) if images else np.zeros((0, 0, 0, 3), dtype=np.uint8)


def _pixels_port(step: BuiltinStep, inputs: Mapping[str, Port]) -> Port:
    return step.port(inputs, "pixels", PIXELS, rank=4)


def _transform_in(step: BuiltinStep, inputs: Mapping[str, Port]) -> None:
    if "transform" in inputs:
        port = step.port(inputs, "transform", ("FP32",), rank=2)
        if port.shape[1] not in (4, ANY):
            raise PipelineDefinitionError(f"step {step.kind!r}: input 'transform' must be [N, 4]")


def _transform_of(inputs: Mapping[str, np.ndarray], n: int) -> np.ndarray:
    t = inputs.get("transform")
    if t is None:
        return identity_transform(n)
    if t.shape != (n, 4):
        raise StepInputError(f"input 'transform' has shape {list(t.shape)}, expected [{n}, 4]", input="transform")
    return t.astype(np.float32, copy=False)


class Resize(BuiltinStep):
    """pixels [N,H,W,C] (+ transform) -> pixels, transform."""

    kind = "resize"
    Params = ResizeParams
    params: ResizeParams

    def bind(self, inputs: Mapping[str, Port]) -> dict[str, Port]:
        opencv()  # a missing pipeline extra fails the load, explained, not the first request
        port = _pixels_port(self, inputs)
        _transform_in(self, inputs)
        h, w = self.params.out_hw()
        return {"pixels": Port(port.datatype, (port.shape[0], h, w, port.shape[3])),
                "transform": Port("FP32", (port.shape[0], 4))}

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        pixels = self.array(inputs, "pixels", ndim=4)
        done = [resize_one(im, self.params, "pixels") for im in pixels]
        out = stack([d[0] for d in done], self.kind, "pixels")
        t = np.array([d[1] for d in done], dtype=np.float32).reshape(-1, 4)
        return {"pixels": out, "transform": compose(_transform_of(inputs, len(pixels)), t)}


class CropParams(StepParams):
    """A fixed region (``x``, ``y``) or the centre (``center = true``) of ``width`` x ``height``."""

    width: int = Field(gt=0, le=16384)
    height: int = Field(gt=0, le=16384)
    center: bool = False
    x: int = Field(default=0, ge=0)
    y: int = Field(default=0, ge=0)


class Crop(BuiltinStep):
    """pixels [N,H,W,C] (+ transform) -> pixels [N,height,width,C], transform."""

    kind = "crop"
    Params = CropParams
    params: CropParams

    def bind(self, inputs: Mapping[str, Port]) -> dict[str, Port]:
        port = _pixels_port(self, inputs)
        _transform_in(self, inputs)
        return {"pixels": Port(port.datatype, (port.shape[0], self.params.height, self.params.width, port.shape[3])),
                "transform": Port("FP32", (port.shape[0], 4))}

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        pixels = self.array(inputs, "pixels", ndim=4)
        p = self.params
        h, w = pixels.shape[1:3]
        x, y = ((w - p.width) // 2, (h - p.height) // 2) if p.center else (p.x, p.y)
        if x < 0 or y < 0 or x + p.width > w or y + p.height > h:
            raise StepInputError(f"step 'crop': a {p.width}x{p.height} region at ({x}, {y}) does not fit "
                                 f"a {w}x{h} image", input="pixels")
        t = identity_transform(len(pixels))
        t[:, 2], t[:, 3] = -x, -y
        return {"pixels": np.ascontiguousarray(pixels[:, y:y + p.height, x:x + p.width]),
                "transform": compose(_transform_of(inputs, len(pixels)), t)}


class ColorOrderParams(StepParams):
    source: Literal["RGB", "BGR"] = "BGR"
    target: Literal["RGB", "BGR"] = "RGB"
    layout: Literal["HWC", "CHW"] = "HWC"


class ColorOrder(BuiltinStep):
    """pixels -> pixels with the colour channels reordered (RGB <-> BGR)."""

    kind = "color_order"
    Params = ColorOrderParams
    params: ColorOrderParams

    def bind(self, inputs: Mapping[str, Port]) -> dict[str, Port]:
        port = self.port(inputs, "pixels", (*PIXELS, *FLOATS), rank=4)
        axis = 3 if self.params.layout == "HWC" else 1
        if port.shape[axis] not in (3, ANY):
            raise PipelineDefinitionError(f"step 'color_order': input 'pixels' {list(port.shape)} has no "
                                          f"3-channel {self.params.layout} axis")
        return {"pixels": port}

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        pixels = self.array(inputs, "pixels", ndim=4)
        if self.params.source == self.params.target:
            return {"pixels": pixels}
        axis = 3 if self.params.layout == "HWC" else 1
        if pixels.shape[axis] != 3:
            raise StepInputError(f"step 'color_order': input 'pixels' has {pixels.shape[axis]} channels, "
                                 "expected 3", input="pixels")
        return {"pixels": np.ascontiguousarray(np.flip(pixels, axis=axis))}


class NormalizeParams(StepParams):
    """``(pixels * scale - mean) / std`` per channel, in FP32."""

    scale: float = 1.0 / 255.0
    mean: list[float] = Field(default_factory=lambda: [0.0, 0.0, 0.0])
    std: list[float] = Field(default_factory=lambda: [1.0, 1.0, 1.0])
    layout: Literal["HWC", "CHW"] = "HWC"
    pad: float = 0.0  # with a ``widths`` input: the value of every column right of an image's width

    @model_validator(mode="after")
    def _same_length(self) -> NormalizeParams:
        if len(self.mean) != len(self.std) or not self.mean:
            raise ValueError("'mean' and 'std' need one value per channel")
        if any(s == 0 for s in self.std):
            raise ValueError("'std' values must not be 0")
        return self


class Normalize(BuiltinStep):
    """pixels (UINT8 or FP32) -> tensor FP32."""

    kind = "normalize"
    Params = NormalizeParams
    params: NormalizeParams

    def __init__(self, params: Any, folder: Path) -> None:
        super().__init__(params, folder)
        p = self.params
        # x * scale / std - mean / std: one multiply-add per value
        self._mul = (np.float32(p.scale) / np.asarray(p.std, dtype=np.float32)).astype(np.float32)
        self._add = (-np.asarray(p.mean, dtype=np.float32) / np.asarray(p.std, dtype=np.float32)).astype(np.float32)

    def bind(self, inputs: Mapping[str, Port]) -> dict[str, Port]:
        port = self.port(inputs, "pixels", (*PIXELS, *FLOATS), rank=4)
        axis = 3 if self.params.layout == "HWC" else 1
        if port.shape[axis] not in (len(self.params.mean), ANY):
            raise PipelineDefinitionError(f"step 'normalize': input 'pixels' {list(port.shape)} has not "
                                          f"{len(self.params.mean)} channels on its {self.params.layout} axis")
        if "widths" in inputs:
            self.port(inputs, "widths", ("INT32", "INT64"), rank=1)
        return {"tensor": Port("FP32", port.shape)}

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        pixels = self.array(inputs, "pixels", ndim=4)
        axis = 3 if self.params.layout == "HWC" else 1
        if pixels.shape[axis] != len(self._mul):
            raise StepInputError(f"step 'normalize': input 'pixels' has {pixels.shape[axis]} channels, "
                                 f"expected {len(self._mul)}", input="pixels")
        bshape = (1, 1, 1, -1) if axis == 3 else (1, -1, 1, 1)
        out = pixels.astype(np.float32)
        out *= self._mul.reshape(bshape)
        out += self._add.reshape(bshape)
        widths = inputs.get("widths")
        if widths is not None:  # padding in normalised space (PP-OCR pads with 0 after normalising)
            if widths.shape != (len(out),):
                raise StepInputError(f"step 'normalize': input 'widths' has shape {list(widths.shape)}, "
                                     f"expected [{len(out)}]", input="widths")
            for i, width in enumerate(widths.tolist()):
                if axis == 3:
                    out[i, :, max(0, width):, :] = self.params.pad
                else:
                    out[i, :, :, max(0, width):] = self.params.pad
        return {"tensor": out}


class LayoutParams(StepParams):
    target: Literal["CHW", "HWC"] = "CHW"


class Layout(BuiltinStep):
    """tensor [N,H,W,C] -> [N,C,H,W] (target CHW) or back (target HWC)."""

    kind = "layout"
    Params = LayoutParams
    params: LayoutParams

    def _axes(self) -> tuple[int, int, int, int]:
        return (0, 3, 1, 2) if self.params.target == "CHW" else (0, 2, 3, 1)

    def bind(self, inputs: Mapping[str, Port]) -> dict[str, Port]:
        port = self.port(inputs, "tensor", (*PIXELS, *FLOATS, "INT8", "INT32", "INT64"), rank=4)
        return {"tensor": Port(port.datatype, tuple(port.shape[a] for a in self._axes()))}

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        tensor = self.array(inputs, "tensor", ndim=4)
        return {"tensor": np.ascontiguousarray(tensor.transpose(self._axes()))}


class CastParams(StepParams):
    datatype: DataType

    @model_validator(mode="after")
    def _numeric(self) -> CastParams:
        if self.datatype == "BYTES":
            raise ValueError("cast to BYTES is not supported")
        return self


class Cast(BuiltinStep):
    """tensor -> tensor of another numeric datatype (values converted as numpy's astype does)."""

    kind = "cast"
    Params = CastParams
    params: CastParams

    def bind(self, inputs: Mapping[str, Port]) -> dict[str, Port]:
        port = inputs.get("tensor")
        if port is None or port.datatype == "BYTES":
            raise PipelineDefinitionError("step 'cast': input 'tensor' must be wired to a numeric tensor")
        return {"tensor": Port(self.params.datatype, port.shape)}

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"tensor": self.array(inputs, "tensor").astype(to_numpy(self.params.datatype))}
