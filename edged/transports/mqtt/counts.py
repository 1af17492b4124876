"""The MQTT transport's counters and rate-limited warnings, shared by its parts.

Misbehaving clients can send thousands of bad requests a second: every event is counted (for
``/metrics``, telemetry and the stop summary) but logged at most once per 30 s per kind.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

log = logging.getLogger("edged.transports.mqtt.transport")
WARN_EVERY_S = 30.0


class Counts:
    """Event counts since start (``counters``) and one warning line per kind per ``WARN_EVERY_S``."""

    def __init__(self) -> None:
        self.counters: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()
        self._warned: dict[str, float] = {}

    def count(self, key: str) -> None:
        with self.lock:
            self.counters[key] += 1

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return dict(self.counters)

    def warn(self, key: str, msg: str) -> None:
        now = time.monotonic()
        if now - self._warned.get(key, -1e9) >= WARN_EVERY_S:
            self._warned[key] = now
            log.warning("MQTT: %s", msg)

    def summary(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(self.counters.items())) or "no traffic"
