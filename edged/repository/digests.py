"""sha256 of artifact files, cached by (size, mtime, inode) so a restart does not re-hash gigabytes."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

from edged.fsutil import atomic_write_bytes, sha256_file

log = logging.getLogger(__name__)
_CHUNK = 1 << 20


class DigestCache:
    """A small JSON map kept in the state dir; a stale or corrupt cache only costs a re-hash."""

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._entries: dict[str, list[object]] = {}
        self._dirty = False
        if path is not None:
            try:
                data = json.loads(path.read_text())
                if isinstance(data, dict):
                    self._entries = data
            except (OSError, ValueError):
                pass

    def digest(self, path: Path) -> str:
        st = path.stat()
        key = str(path.resolve())
        stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None and hit[:3] == stamp and isinstance(hit[3], str):
                return hit[3]
        value = sha256_file(path)
        with self._lock:
            self._entries[key] = [*stamp, value]
            self._dirty = True
        return value

    def save(self) -> None:
        if self._path is None or not self._dirty:
            return
        with self._lock:
            payload = json.dumps(self._entries, separators=(",", ":")).encode()
            self._dirty = False
        try:
            atomic_write_bytes(self._path, payload)
        except OSError as e:
            log.warning("cannot save digest cache %s: %s", self._path, e)
