"""Small, forgiving readers of sysfs-style files under a root folder.

Telemetry must never fail because one file is missing, unreadable or garbled (a driver
update renames things, a rail is absent on a carrier board): every reader returns None
instead of raising. The root argument lets tests point at the fixture sysroots.
"""

from __future__ import annotations

import os
from pathlib import Path

MAX_READ = 4096


class SysRoot:
    def __init__(self, root: Path | str = "/") -> None:
        self.root = Path(root)

    def path(self, rel: str) -> Path:
        return self.root / rel.lstrip("/")

    def read(self, rel: str) -> str | None:
        try:
            with open(self.path(rel), "rb") as f:
                return f.read(MAX_READ).decode("utf-8", "replace").strip()
        except (OSError, ValueError):
            return None

    def read_int(self, rel: str) -> int | None:
        text = self.read(rel)
        if text is None:
            return None
        if not text:
            return None
        token = text.split()[0]
        try:
            return int(token, 16) if token.lower().startswith("0x") else int(token)
        except ValueError:
            return None

    def read_float(self, rel: str) -> float | None:
        text = self.read(rel)
        if not text:
            return None
        try:
            return float(text.split()[0])
        except (ValueError, IndexError):
            return None

    def listdir(self, rel: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(rel)))
        except OSError:
            return []

    def is_dir(self, rel: str) -> bool:
        return self.path(rel).is_dir()

    def exists(self, rel: str) -> bool:
        return self.path(rel).exists()
