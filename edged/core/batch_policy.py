"""Does batching pay for this model here? Decided from the scheduler's own timings.

On a small CPU a batch of eight can cost eight times a batch of one: then waiting
for batches to form, concatenating and splitting only add latency. The policy keeps
a moving average of the per-sample compute time of single runs and of batched runs
(made while requests overlapped; inline and lone runs on a quiet model are not comparable),
turns batching off when batched samples are not cheaper, and keeps probing the
other mode now and then so that the decision follows the load and the hardware.
"""

from __future__ import annotations

import threading
from typing import Any

# Batching is switched off when a batched sample costs at least OFF_RATIO of a single one,
# and on again when it costs less than ON_RATIO (the gap keeps the decision from flapping).
OFF_RATIO = 0.95
ON_RATIO = 0.85
# Every PROBE_EVERY engine runs, one run goes the other way to keep both averages current.
PROBE_EVERY = 64
# Weight of a new sample in the moving averages.
_ALPHA = 0.1
# Samples each side needs before the policy decides anything.
_MIN_SAMPLES = 8


class _Ewma:
    __slots__ = ("n", "value")

    def __init__(self) -> None:
        self.n = 0
        self.value = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        self.value = x if self.n == 1 else self.value + _ALPHA * (x - self.value)


class BatchPolicy:
    """Per model version; ``record`` is called after every engine run, ``batch_now`` under the scheduler lock."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled  # the model batches at all (max_batch_size > 0, not [batching] dynamic = false)
        self._lock = threading.Lock()
        self._single = _Ewma()
        self._batched = _Ewma()
        self._pays = True
        self._since_probe = 0
        self._switches = 0

    @property
    def pays(self) -> bool:
        return self.enabled and self._pays

    def record(self, samples: int, requests: int, compute_ns: int) -> None:
        """One engine run: ``samples`` batch elements from ``requests`` requests took ``compute_ns``."""
        if not self.enabled or samples <= 0:
            return
        per_sample = compute_ns / samples
        with self._lock:
            (self._batched if requests > 1 else self._single).add(per_sample)
            self._since_probe += 1
            if self._single.n < _MIN_SAMPLES or self._batched.n < _MIN_SAMPLES:
                return
            ratio = self._batched.value / self._single.value if self._single.value else 1.0
            pays = ratio < (ON_RATIO if not self._pays else OFF_RATIO)
            if pays != self._pays:
                self._pays = pays
                self._switches += 1

    def batch_now(self) -> bool:
        """Whether the next run may combine requests: the current decision, inverted on a probe."""
        if not self.enabled:
            return False
        with self._lock:
            if self._since_probe >= PROBE_EVERY:
                self._since_probe = 0
                return not self._pays
            return self._pays

    def to_json(self) -> dict[str, Any]:
        with self._lock:
            single = self._single.value if self._single.n else None
            batched = self._batched.value if self._batched.n else None
            if not self.enabled:
                mode, reason = "off", "the model does not batch (max_batch_size 0, or [batching] dynamic = false)"
            elif single is None or batched is None or min(self._single.n, self._batched.n) < _MIN_SAMPLES:
                mode, reason = "on", "measuring: not enough single and batched runs yet"
            elif self._pays:
                mode, reason = "on", f"a batched sample costs {batched / single:.2f}x a single one"
            else:
                mode, reason = "single", (f"a batched sample costs {batched / single:.2f}x a single one: "
                                          "requests run one at a time without waiting")
            return {
                "mode": mode,
                "reason": reason,
                "single_sample_us": None if single is None else round(single / 1e3, 2),
                "batched_sample_us": None if batched is None else round(batched / 1e3, 2),
                "single_runs": self._single.n,
                "batched_runs": self._batched.n,
                "switches": self._switches,
            }
