"""How ``edged-registry`` lays out answers for people: tables, relative times, reasons wrapped in full."""

from __future__ import annotations

import shutil
import textwrap
import time
from collections.abc import Sequence


def ago(t: float | None, now: float | None = None) -> str:
    """``42s ago``, ``5m ago``, ``3.2h ago``, ``4d ago``; ``never`` for None (a clock ahead reads ``now``)."""
    if t is None:
        return "never"
    return _span(max(0.0, (time.time() if now is None else now) - t)) + " ago"


def until(t: float | None, now: float | None = None) -> str:
    """``in 42s``, ``in 2.0h`` for a time ahead; ``now`` once it came; ``never`` for None."""
    if t is None:
        return "never"
    s = t - (time.time() if now is None else now)
    return "now" if s <= 0 else "in " + _span(s)


def _span(s: float) -> str:
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    if s < 172800:
        return f"{s / 3600:.1f}h"
    return f"{s / 86400:.0f}d"


def utc(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(t))


def table(rows: Sequence[Sequence[str]]) -> str:
    if not rows:
        return ""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def wrapped(label: str, text: str, indent: int = 2) -> list[str]:
    """``text`` in full, wrapped to the terminal under a ``label``, every line indented."""
    width = max(40, shutil.get_terminal_size((120, 24)).columns)
    head = " " * indent + label
    return textwrap.wrap(text, width=width, initial_indent=head, subsequent_indent=" " * len(head),
                         break_long_words=True, break_on_hyphens=False) or [head.rstrip()]


def version_ref(version: int | None, release: int | None) -> str:
    if version is None and release is None:
        return "-"
    return f"v{version if version is not None else '?'}" + (f" (r{release})" if release is not None else "")
