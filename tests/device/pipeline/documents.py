"""Document images made on the spot for the OCR example's checks: printed text rendered with Pillow's
own font (no system fonts), then photographed-like: blurred, perspective-warped, upside-down, noisy,
a dense receipt, a page of 60 lines. Deterministic per seed; encoded as PNG or JPEG bytes."""

from __future__ import annotations

import io
from collections.abc import Callable

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

WORDS = (
    "invoice", "total", "amount", "paid", "order", "number", "date", "customer", "address", "street", "city",
    "service", "hours", "delivery", "payment", "account", "balance", "due", "item", "quantity", "price",
    "tax", "discount", "report", "summary", "annual", "revenue", "growth", "market", "share", "product",
    "quality", "office", "manager", "phone", "email", "meeting", "agenda", "project", "budget", "review",
    "schedule", "north", "south", "east", "west", "river", "station", "public", "library", "museum", "garden",
)


def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


def _sentence(rng: np.random.Generator, words: int) -> str:
    out = [str(rng.choice(WORDS)) for _ in range(words)]
    if rng.random() < 0.5:
        out.insert(int(rng.integers(0, len(out))), str(int(rng.integers(1, 9999))))
    out[0] = out[0].capitalize()
    return " ".join(out)


def _page(lines: list[tuple[str, int]], width: int, *, margin: int = 40, spacing: float = 1.6,
          ink: int = 20, paper: int = 250) -> Image.Image:
    height = margin * 2 + int(sum(size * spacing for _, size in lines))
    img = Image.new("RGB", (width, height), (paper, paper, paper))
    draw = ImageDraw.Draw(img)
    y = float(margin)
    for text, size in lines:
        draw.text((margin, y), text, fill=(ink, ink, ink), font=_font(size))
        y += size * spacing
    return img


def _encode(img: Image.Image, fmt: str = "PNG", quality: int = 90) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **({"quality": quality} if fmt == "JPEG" else {}))
    return buf.getvalue()


def _warp(img: Image.Image, rng: np.random.Generator, amount: float) -> Image.Image:
    import cv2
    arr = np.asarray(img)
    h, w = arr.shape[:2]
    src = np.float32([[0, 0], [w, 0], [w, h], [0, h]])
    jitter = rng.uniform(0, amount, (4, 2)).astype(np.float32) * np.float32([w, h])
    dst = np.float32([[0, 0], [w, 0], [w, h], [0, h]]) + jitter * np.float32([[1, 1], [-1, 1], [-1, -1], [1, -1]])
    m = cv2.getPerspectiveTransform(src, dst)
    out = cv2.warpPerspective(arr, m, (w, h), borderMode=cv2.BORDER_CONSTANT, borderValue=(235, 235, 235))
    return Image.fromarray(out)


def letter(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    lines = [(f"Report {seed} {rng.choice(WORDS).capitalize()}", 40)]
    lines += [(_sentence(rng, int(rng.integers(4, 9))), 26) for _ in range(12)]
    return _encode(_page(lines, 900))


def blurred(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    lines = [(_sentence(rng, int(rng.integers(3, 7))), 30) for _ in range(10)]
    return _encode(_page(lines, 860).filter(ImageFilter.GaussianBlur(1.2)), "JPEG", 85)


def photographed(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    lines = [(_sentence(rng, int(rng.integers(3, 7))), 30) for _ in range(10)]
    img = _warp(_page(lines, 900).filter(ImageFilter.GaussianBlur(0.7)), rng, 0.05)
    arr = np.asarray(img).astype(np.float32)
    arr *= np.linspace(0.85, 1.0, arr.shape[1], dtype=np.float32)[None, :, None]  # uneven light
    arr += rng.normal(0, 4, arr.shape).astype(np.float32)
    return _encode(Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)), "JPEG", 80)


def upside_down(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    lines = [(_sentence(rng, int(rng.integers(4, 8))), 28) for _ in range(9)]
    return _encode(_page(lines, 880).rotate(180))


def receipt(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    lines = [("STORE " + str(rng.choice(WORDS)).upper(), 30), (f"Order {int(rng.integers(1000, 9999))}", 22)]
    for _ in range(21):
        item = f"{rng.choice(WORDS)} {rng.choice(WORDS)}"
        lines.append((f"{item:<24} {rng.uniform(1, 99):7.2f}", 20))
    lines.append((f"TOTAL {rng.uniform(100, 900):.2f}", 26))
    return _encode(_page(lines, 520, margin=24, spacing=1.35))


def sixty_lines(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    lines = [(_sentence(rng, int(rng.integers(5, 10))), 20) for _ in range(60)]
    return _encode(_page(lines, 1000, spacing=1.5))


def tilted(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    lines = [(_sentence(rng, int(rng.integers(4, 8))), 28) for _ in range(10)]
    return _encode(_page(lines, 900).rotate(2.0, expand=True, fillcolor=(250, 250, 250)))


def mixed_sizes(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    lines = [(f"{rng.choice(WORDS).capitalize()} {rng.choice(WORDS)}", 48)]
    for k in range(10):
        lines.append((_sentence(rng, int(rng.integers(3, 8))), 18 if k % 3 else 32))
    return _encode(_page(lines, 840))


def low_contrast(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    lines = [(_sentence(rng, int(rng.integers(4, 8))), 28) for _ in range(10)]
    return _encode(_page(lines, 880, ink=110, paper=215), "JPEG", 90)


DOCUMENTS: dict[str, Callable[[int], bytes]] = {
    "letter": letter, "blurred": blurred, "photographed": photographed, "upside_down": upside_down,
    "receipt": receipt, "sixty_lines": sixty_lines, "tilted": tilted, "mixed_sizes": mixed_sizes,
    "low_contrast": low_contrast, "letter_2": lambda s: letter(s + 100),
}


def documents(seed: int = 0) -> dict[str, bytes]:
    """The ten documents, by name, encoded."""
    return {name: make(seed) for name, make in DOCUMENTS.items()}
