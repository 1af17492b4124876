"""Measurement windows, the stability rule, and the numbers one load level ends up with.

A window counts the requests that completed inside it. Windows repeat until the
last three agree: each one's throughput and latency within ``stability`` percent
of the three's mean (perf_analyzer's rule), or until ``max_trials`` windows; the
result is then taken from the last three and marked unstable.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from edged.perf.load import Completion, Load
from edged.perf.server_stats import ServerSplit, Snapshot, StatsReader, split

STABLE_WINDOWS = 3
REPORTED_PERCENTILES = (50, 90, 95, 99)


@dataclass
class Window:
    seconds: float
    latencies_ns: list[int]
    errors: int
    stats: Snapshot | None  # the daemon's counters at the window's end

    @property
    def requests(self) -> int:
        return len(self.latencies_ns)


@dataclass(frozen=True)
class Settings:
    interval_s: float = 2.0
    stability_pct: float = 10.0
    max_trials: int = 10
    percentile: int | None = None  # the latency the stability rule and the plot use; None: the mean
    batch_size: int = 1


@dataclass
class LevelResult:
    mode: str
    level: float
    batch_size: int
    throughput: float  # inferences (samples) per second
    request_rate: float  # completed requests per second
    requests: int
    errors: int
    delayed: int
    percentiles_us: dict[int, float]
    avg_us: float
    latency_metric: str
    latency_us: float
    windows: int
    stable: bool
    server: ServerSplit | None
    first_error: str | None = None
    window_throughputs: list[float] = field(default_factory=list)


def percentile(sorted_values: list[int], p: float) -> float:
    """Nearest-rank percentile (what perf_analyzer reports)."""
    if not sorted_values:
        return math.nan
    k = max(0, min(len(sorted_values) - 1, math.ceil(p / 100 * len(sorted_values)) - 1))
    return float(sorted_values[k])


def _latency(lat: list[int], pct: int | None) -> float:
    if not lat:
        return math.nan
    return percentile(sorted(lat), pct) if pct is not None else statistics.fmean(lat)


def is_stable(windows: list[Window], settings: Settings) -> bool:
    if len(windows) < STABLE_WINDOWS:
        return False
    last = windows[-STABLE_WINDOWS:]
    if any(w.requests == 0 for w in last):
        return False
    tol = settings.stability_pct / 100

    def close(values: list[float]) -> bool:
        mean = statistics.fmean(values)
        return mean > 0 and all(abs(v - mean) <= tol * mean for v in values)

    return close([w.requests / w.seconds for w in last]) and \
        close([_latency(w.latencies_ns, settings.percentile) for w in last])


def measure_level(load: Load, settings: Settings, stats: StatsReader,
                  on_window: Callable[[int, Window], None] | None = None) -> LevelResult:
    """Run ``load`` (already started) through windows until stable or capped; the caller stops it."""
    clock = time.perf_counter_ns
    interval_ns = int(settings.interval_s * 1e9)
    load.recorder.drain()  # what finished during warm-up does not count
    load.reset_delayed()
    start_stats = stats.snapshot()
    boundary = clock()
    pending: list[Completion] = []
    windows: list[Window] = []
    delayed_at: list[int] = []
    while True:
        end = boundary + interval_ns
        remaining = end - clock()
        if remaining > 0:
            time.sleep(remaining / 1e9)
        snap = stats.snapshot()
        done = pending + load.recorder.drain()
        inside = [c for c in done if c[0] < end]
        pending = [c for c in done if c[0] >= end]
        w = Window((end - boundary) / 1e9, [lat for _, lat, ok in inside if ok],
                   sum(1 for c in inside if not c[2]), snap)
        windows.append(w)
        delayed_at.append(load.delayed)
        boundary = end
        if on_window is not None:
            on_window(len(windows), w)
        if is_stable(windows, settings) or len(windows) >= settings.max_trials:
            break
    last = windows[-STABLE_WINDOWS:]
    before = windows[-STABLE_WINDOWS - 1].stats if len(windows) > STABLE_WINDOWS else start_stats
    after = last[-1].stats
    server = split(before, after) if before is not None and after is not None else None
    lat = sorted(x for w in last for x in w.latencies_ns)
    seconds = sum(w.seconds for w in last)
    n = len(lat)
    delayed_before = delayed_at[-STABLE_WINDOWS - 1] if len(windows) > STABLE_WINDOWS else 0
    pct = settings.percentile
    return LevelResult(
        mode=load.mode, level=load.level, batch_size=settings.batch_size,
        throughput=n * settings.batch_size / seconds, request_rate=n / seconds, requests=n,
        errors=sum(w.errors for w in last), delayed=delayed_at[-1] - delayed_before,
        percentiles_us={p: percentile(lat, p) / 1e3 for p in REPORTED_PERCENTILES},
        avg_us=statistics.fmean(lat) / 1e3 if lat else math.nan,
        latency_metric=f"p{pct}" if pct is not None else "avg",
        latency_us=(percentile(lat, pct) if pct is not None else (statistics.fmean(lat) if lat else math.nan)) / 1e3,
        windows=len(windows), stable=is_stable(windows, settings), server=server,
        first_error=load.recorder.first_error,
        window_throughputs=[w.requests * settings.batch_size / w.seconds for w in windows])
