"""Capped exponential back-off with "equal jitter" (half fixed, half random).

Every retry loop that talks to a shared server (the MQTT broker, the registry)
uses it, so a fleet that lost that server does not come back in lockstep.
"""

from __future__ import annotations

import random


class Backoff:
    """``next_delay()`` doubles from ``min_s`` up to ``max_s``; ``reset()`` after a success."""

    def __init__(self, min_s: float, max_s: float, rng: random.Random | None = None) -> None:
        self.min_s, self.max_s = min_s, max_s
        self.attempts = 0
        self._rng = rng or random.Random()

    def next_delay(self) -> float:
        base = min(self.max_s, self.min_s * float(2 ** min(self.attempts, 30)))
        self.attempts += 1
        return base / 2 + float(self._rng.uniform(0, base / 2))

    def reset(self) -> None:
        self.attempts = 0
