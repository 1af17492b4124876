"""Latency against throughput, one point per load level, as a PNG (see :mod:`edged.perf.png`)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from edged.perf.png import GLYPH_H, Canvas

W, H = 800, 520
LEFT, RIGHT, TOP, BOTTOM = 90, 30, 50, 70
INK, GRID, LINE, POINT = (30, 30, 30), (225, 225, 225), (31, 119, 180), (214, 39, 40)


def nice_step(span: float, ticks: int = 5) -> float:
    """A round tick step (1, 2, 2.5 or 5 times a power of ten) giving about ``ticks`` intervals."""
    if span <= 0 or not math.isfinite(span):
        return 1.0
    raw = span / ticks
    mag = 10.0 ** math.floor(math.log10(raw))
    step: float = next((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), 10 * mag)
    return step


def _fmt(v: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step))) if step < 1 else 0
    if step * 10 ** decimals % 1:
        decimals += 1
    return f"{v:.{decimals}f}"


def latency_throughput_png(points: Sequence[tuple[float, float, str]], *, title: str, x_label: str,
                           y_label: str) -> bytes:
    """``points``: (throughput, latency, label) in load order; axes start at zero."""
    c = Canvas(W, H)
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM
    good = [(x, y, lab) for x, y, lab in points if math.isfinite(x) and math.isfinite(y)]
    x_step = nice_step(max((p[0] for p in good), default=1.0))
    y_step = nice_step(max((p[1] for p in good), default=1.0))
    x_max = x_step * max(1, math.ceil(max((p[0] for p in good), default=1.0) / x_step))
    y_max = y_step * max(1, math.ceil(max((p[1] for p in good), default=1.0) / y_step))

    def px(x: float, y: float) -> tuple[int, int]:
        return LEFT + round(x / x_max * pw), TOP + ph - round(y / y_max * ph)

    for k in range(round(x_max / x_step) + 1):
        v = k * x_step
        x, _ = px(v, 0)
        c.line(x, TOP, x, TOP + ph, GRID)
        label = _fmt(v, x_step)
        c.text(x - c.text_width(label) // 2, TOP + ph + 8, label, INK)
    for k in range(round(y_max / y_step) + 1):
        v = k * y_step
        _, y = px(0, v)
        c.line(LEFT, y, LEFT + pw, y, GRID)
        label = _fmt(v, y_step)
        c.text(LEFT - 8 - c.text_width(label), y - GLYPH_H // 2, label, INK)
    c.line(LEFT, TOP, LEFT, TOP + ph, INK)
    c.line(LEFT, TOP + ph, LEFT + pw, TOP + ph, INK)
    c.text((W - c.text_width(title, 2)) // 2, 14, title, INK, 2)
    c.text(LEFT + (pw - c.text_width(x_label)) // 2, H - 28, x_label, INK)
    c.text(18, TOP + (ph + c.text_width(y_label)) // 2, y_label, INK, vertical=True)
    pts = [px(x, y) for x, y, _ in good]
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        c.line(x0, y0, x1, y1, LINE, width=2)
    for (x, y), (_, _, label) in zip(pts, good, strict=True):
        c.box(x - 3, y - 3, x + 3, y + 3, POINT)
        c.text(x + 6, y - GLYPH_H - 4, label, INK)
    return c.png()
