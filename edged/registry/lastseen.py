"""Last-seen times, batched: polls only note them in memory, a background thread writes them together.

A fleet polling every 30 s would otherwise turn every poll into a write transaction (on
SQLite, one global lock). The time is kept at ``resolution_s`` granularity (the settings'
``last_seen_resolution_s``) and written every ``flush_s``; a process that dies loses at
most that much of it.
"""

from __future__ import annotations

import logging
import threading
import time

from sqlalchemy import Engine, bindparam, or_, update

from edged.registry.db import DeviceRow
from edged.registry.settings import LAST_SEEN_MAX_RESOLUTION_S

log = logging.getLogger(__name__)


class LastSeen:
    def __init__(self, engine: Engine, *, flush_s: float = 5.0,
                 resolution_s: float = LAST_SEEN_MAX_RESOLUTION_S) -> None:
        self.engine, self.flush_s, self.resolution_s = engine, flush_s, resolution_s
        self._pending: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.written = 0

    def note(self, device_id: str, stored: float | None, now: float | None = None) -> None:
        """Remember that the device was seen, unless the stored time is recent enough already."""
        t = time.time() if now is None else now
        if stored is not None and t - stored < self.resolution_s:
            return
        with self._lock:
            self._pending[device_id] = t

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="registry-last-seen", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self.flush()

    def _loop(self) -> None:
        while not self._stop.wait(self.flush_s):
            try:
                self.flush()
            except Exception:
                log.exception("writing last-seen times failed; keeping them for the next try")

    def flush(self) -> int:
        with self._lock:
            batch, self._pending = self._pending, {}
        if not batch:
            return 0
        stmt = (update(DeviceRow).where(DeviceRow.id == bindparam("d"))
                .where(or_(DeviceRow.last_seen_at.is_(None), DeviceRow.last_seen_at < bindparam("t")))
                .values(last_seen_at=bindparam("t")))
        try:
            with self.engine.begin() as conn:
                conn.execute(stmt, [{"d": d, "t": t} for d, t in batch.items()])
        except Exception:
            with self._lock:
                for d, t in batch.items():
                    self._pending.setdefault(d, t)
            raise
        self.written += len(batch)
        return len(batch)
