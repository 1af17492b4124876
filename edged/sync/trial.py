"""Judge a version in trial against the version it replaced, from the scheduler's statistics.

Counts come from the scheduler's statistics of the version (taken by
:meth:`edged.sync.engine_port.ServiceEngine.sample`); latency from the same statistics'
histogram (bucket upper bounds, hence the floor). The previous version is measured over
the minutes just before the switch (same load, same machine) when it served enough
requests then, else over its whole life. Errors the client caused
(invalid input) or that only say the queue was full are not the model's fault and are
not counted; an input that passed validation but that the engine refused
(``engine_refused_input``) is counted, since the version broke what its manifest promised
(a client that sends impossible shapes to both versions raises both rates alike).
Latency is judged once, at the end of the trial, over the requests after the switch
settled (the first fifth of the trial, at most :data:`SETTLE_MAX_S`, absorbs one-off
costs such as releasing the old engine) and only over at least :data:`P99_MIN_SAMPLES`
of them: a p99 of fewer is just the slowest one.
"""

from __future__ import annotations

from dataclasses import dataclass

from edged.latency_buckets import LATENCY_BUCKETS_S
from edged.protocol.fleet.telemetry import Outcomes
from edged.sync.settings import SyncSettings

NOT_MODEL_ERRORS = frozenset({"invalid_argument", "overloaded", "cancelled"})  # counted by ServiceEngine.sample
P99_MIN_SAMPLES = 100
SETTLE_FRACTION = 0.2
SETTLE_MAX_S = 5.0


@dataclass(frozen=True)
class Sample(Outcomes):
    ok: int
    errors: int
    latency_counts: tuple[int, ...] = ()  # per LATENCY_BUCKETS_S bucket, plus +Inf

    @property
    def p99_s(self) -> float:
        n = sum(self.latency_counts)
        if n == 0:
            return 0.0
        acc = 0
        for bound, c in zip((*LATENCY_BUCKETS_S, LATENCY_BUCKETS_S[-1]), self.latency_counts, strict=False):
            acc += c
            if acc >= 0.99 * n:
                return bound
        return LATENCY_BUCKETS_S[-1]

    def since(self, earlier: Sample) -> Sample:
        """What happened between ``earlier`` and this sample of the same version."""
        counts = tuple(a - b for a, b in zip(self.latency_counts, earlier.latency_counts, strict=False))
        return Sample(self.ok - earlier.ok, self.errors - earlier.errors, counts)


def baseline(before: Sample | None, at_switch: Sample | None, cfg: SyncSettings) -> Sample | None:
    """The previous version over the update's run-up when it served enough then, else over its life."""
    if at_switch is None:
        return None
    if before is not None:
        recent = at_switch.since(before)
        if recent.total >= cfg.trial_min_requests and recent.ok >= P99_MIN_SAMPLES:
            return recent
    return at_switch


def judge(new: Sample, base: Sample | None, cfg: SyncSettings, *, final: bool,
          latency: Sample | None = None) -> str | None:
    """A reason to roll back, or None while the new version looks at least as healthy.

    ``latency``: the part of the trial whose latency counts (after the switch settled), default all of it.
    """
    n = cfg.trial_min_requests
    if new.total >= n:
        base_rate = base.error_rate if base is not None and base.total >= n else 0.0
        if new.error_rate > base_rate + cfg.trial_max_error_rate:
            return (f"error rate {new.error_rate:.1%} over {new.total} requests in trial, previous version "
                    f"{base_rate:.1%} (allowed +{cfg.trial_max_error_rate:.1%})")
    lat = latency if latency is not None else new
    enough = max(n, P99_MIN_SAMPLES)
    if final and base is not None and lat.ok >= enough and base.ok >= enough:
        limit = max(base.p99_s * cfg.trial_max_p99_ratio, cfg.trial_p99_floor_ms / 1000)
        if lat.p99_s > limit:
            return (f"p99 latency {lat.p99_s * 1000:.1f} ms in trial over {lat.ok} requests, previous version "
                    f"{base.p99_s * 1000:.1f} ms (allowed {limit * 1000:.1f} ms)")
    return None
