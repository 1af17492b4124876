"""Does batching pay for this model here? Decided from the scheduler's own timings.

On a small CPU a batch of eight can cost eight times a batch of one: then waiting
for batches to form, concatenating and splitting only add latency. The policy keeps
the per-sample compute time of the last runs each way, single and batched (their time
over their samples; made while requests overlapped: inline and lone runs on a quiet model
are not comparable),
turns batching off when batched samples are not cheaper, and keeps probing the
other mode now and then so that the decision follows the load and the hardware.

Weighted by samples and with stalls capped (issue 41): under eight closed-loop callers the
batches split into pairs such as 6 + 2, whose small halves cost nearly what single runs do, and
one run a shared host stalled can cost three times its time. A moving average of per-run costs
counted a batch of two as much as one of six and took the stall whole: it switched batching off
under loads that batching served 1.3-1.5x faster, for hundreds of single runs at a time.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

# Batching is switched off when a batched sample costs at least OFF_RATIO of a single one,
# and on again when it costs less than ON_RATIO (the gap keeps the decision from flapping).
OFF_RATIO = 0.95
ON_RATIO = 0.85
# Every PROBE_EVERY engine runs, one run goes the other way to keep both costs current.
PROBE_EVERY = 64
# Runs each way the per-sample cost is taken over.
_WINDOW = 16
# Samples each side needs before the policy decides anything.
_MIN_SAMPLES = 8
# A run counts as at most this many times the current per-sample cost: a stalled one (a preempted
# vCPU, another process's burst) moves the decision by little, a real change takes a window of runs.
_STALL_CAP = 1.5


class _Recent:
    """The per-sample cost of the last ``_WINDOW`` runs of one mode (their time over their samples), and
    how many runs were ever added."""

    __slots__ = ("_runs", "n", "value")

    def __init__(self) -> None:
        self.n = 0
        self.value = 0.0
        self._runs: deque[tuple[int, float]] = deque(maxlen=_WINDOW)

    def add(self, samples: int, ns: float) -> None:
        if self.n >= _MIN_SAMPLES:
            ns = min(ns, _STALL_CAP * self.value * samples)
        self._runs.append((samples, ns))
        self.n += 1
        self.value = sum(t for _, t in self._runs) / sum(k for k, _ in self._runs)


class BatchPolicy:
    """Per model version; ``record`` is called after every engine run, ``batch_now`` under the scheduler lock."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled  # the model batches at all (max_batch_size > 0, not [batching] dynamic = false)
        self._lock = threading.Lock()
        self._single = _Recent()
        self._batched = _Recent()
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
        with self._lock:
            (self._batched if requests > 1 else self._single).add(samples, compute_ns)
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
