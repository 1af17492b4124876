"""A dependency-free progress line on stderr for calibration and timing.

On a terminal the line redraws in place (at most ten times a second); into a
file or pipe only the finished line is written, so logs stay readable.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import TextIO

_WIDTH = 24
_REDRAW_S = 0.1


class Progress:
    """``with Progress("calibrating", total=22) as p: p.advance()``; ``total=None`` counts without a bar."""

    def __init__(self, label: str, total: float | None = None, *, stream: TextIO | None = None,
                 enabled: bool = True, unit: str = "") -> None:
        self.label = label
        self.total = total
        self.unit = unit
        self.done = 0.0
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = enabled
        self._tty = enabled and bool(getattr(self._stream, "isatty", lambda: False)())
        self._t0 = time.monotonic()
        self._last_draw = 0.0

    def __enter__(self) -> Progress:
        self._t0 = time.monotonic()
        self._draw(force=True)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.finish(failed=exc_type is not None)

    def advance(self, amount: float = 1.0) -> None:
        self.done += amount
        self._draw()

    def set(self, done: float) -> None:
        self.done = done
        self._draw()

    def _line(self, suffix: str = "") -> str:
        elapsed = time.monotonic() - self._t0
        if self.total:
            frac = min(1.0, max(0.0, self.done / self.total))
            filled = round(frac * _WIDTH)
            bar = "[" + "#" * filled + "." * (_WIDTH - filled) + "]"
            count = f"{self.done:g}/{self.total:g}{self.unit}"
            return f"{self.label} {bar} {count} {elapsed:.1f}s{suffix}"
        return f"{self.label} {self.done:g}{self.unit} {elapsed:.1f}s{suffix}"

    def _draw(self, *, force: bool = False) -> None:
        if not self._tty:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < _REDRAW_S:
            return
        self._last_draw = now
        self._stream.write("\r\x1b[2K" + self._line())
        self._stream.flush()

    def finish(self, *, failed: bool = False) -> None:
        if not self._enabled:
            return
        line = self._line(" (failed)" if failed else "")
        self._stream.write(("\r\x1b[2K" if self._tty else "") + line + "\n")
        self._stream.flush()
        self._enabled = False
