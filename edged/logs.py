"""Standard-library logging, one line per event."""

from __future__ import annotations

import logging
import sys

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str = "info", *, stream: object = None) -> None:
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_edged", False):
            root.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)  # type: ignore[arg-type]
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%Y-%m-%dT%H:%M:%S"))
    handler._edged = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level.upper())
