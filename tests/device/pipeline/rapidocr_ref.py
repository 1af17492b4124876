"""RapidOCR's own Python (rapidocr-onnxruntime 1.4.4, the reference for the ``ocr`` example) from wheels
in the test cache, with the two libraries its detector imports (pyclipper, shapely); nothing installed."""

from __future__ import annotations

import sys
from functools import cache
from typing import Any

from tests.wheel_cache import UnavailableError, fetch_wheel

__all__ = ["UnavailableError", "rapidocr"]

WHEELS = ("rapidocr-onnxruntime==1.4.4", "pyclipper==1.4.0", "shapely==2.2.0")


@cache
def rapidocr() -> Any:
    """A ``RapidOCR()`` with the package's default configuration; UnavailableError says why not."""
    for requirement in WHEELS:
        path = str(fetch_wheel(requirement))
        if path not in sys.path:
            sys.path.append(path)
    try:
        from rapidocr_onnxruntime import RapidOCR
    except ImportError as exc:  # e.g. no wheel of pyclipper/shapely for this Python or platform
        raise UnavailableError(f"rapidocr-onnxruntime cannot be imported here: {exc}") from None
    return RapidOCR()
