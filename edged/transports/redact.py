"""Redaction of the daemon's own directories from text that reaches clients.

Backends put file paths into their error messages ("Load model from
/var/lib/edged/models/x/1/model.onnx failed"); those end up in model status,
metadata and error replies on every transport. Clients must never learn the
device's internal layout, so each transport passes its client-facing text
through one :class:`Scrubber` built from the configuration.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edged.config import Config

PLACEHOLDER = "<internal>"


class Scrubber:
    """Replaces the given directories in outgoing text (longest first, so nested roots go whole)."""

    def __init__(self, paths: Iterable[Path | str | None] = ()) -> None:
        roots = {str(p) for p in paths if p is not None and str(p) not in ("", "/", ".")}
        self._roots = sorted(roots, key=len, reverse=True)
        self._broots = [r.encode() for r in self._roots]
        self._bplaceholder = PLACEHOLDER.encode()

    @classmethod
    def for_config(cls, cfg: Config) -> Scrubber:
        """The directories a daemon with this configuration reads or writes."""
        return cls([cfg.device.model_repository, cfg.device.state_dir, cfg.device.runtime_dir,
                    cfg.cache_dir, cfg.source.parent if cfg.source else None])

    def text(self, s: str) -> str:
        for r in self._roots:
            if r in s:
                s = s.replace(r, PLACEHOLDER)
        return s

    def data(self, b: bytes) -> bytes:
        """The same on encoded (UTF-8 JSON) bytes, without decoding them."""
        for r in self._broots:
            if r in b:
                b = b.replace(r, self._bplaceholder)
        return b
