"""Recognise QoS 1 redeliveries so that each request is answered at most once.

QoS 1 is at-least-once: after a reconnect the broker (or a client resending
without a PUBACK) delivers the same request again. A request is identified by
its topic, reply topic and correlation data; keys are remembered for a bounded
time and count, so memory stays flat however many requests pass.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Hashable


class RecentKeys:
    def __init__(self, ttl_s: float = 60.0, max_entries: int = 8192) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._seen: collections.OrderedDict[Hashable, float] = collections.OrderedDict()
        self._lock = threading.Lock()

    def seen(self, key: Hashable) -> bool:
        """True when ``key`` was recorded within the TTL; otherwise record it and return False."""
        now = time.monotonic()
        with self._lock:
            seen = self._seen
            # Entries are in insertion order and share one TTL, so the expired ones are at the front.
            while seen:
                first = next(iter(seen.values()))
                if first > now and len(seen) < self.max_entries:
                    break
                seen.popitem(last=False)
            if key in seen:
                return True
            seen[key] = now + self.ttl_s
            return False

    def known(self, key: Hashable) -> bool:
        """Whether ``key`` is remembered (within the TTL), without recording it: a request refused at
        admission must not be remembered, but a repeat of one already in work is still a repeat."""
        with self._lock:
            until = self._seen.get(key)
            return until is not None and until > time.monotonic()

    def forget(self, key: Hashable) -> None:
        """Forget ``key``: its request was refused after it was recorded, so a retry deserves an answer."""
        with self._lock:
            self._seen.pop(key, None)

    def __len__(self) -> int:
        return len(self._seen)
