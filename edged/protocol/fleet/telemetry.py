"""The telemetry message and the upload contract between a device and the registry (pydantic only).

One :class:`TelemetrySample` is published on ``<prefix>/<device>/telemetry`` every
``[telemetry] interval_s`` and kept in the device's buffer; the uploader POSTs them in
order as an :class:`UploadBatch`. Counts in a sample cover its window (``window_s``
seconds since the previous sample of the same ``run``), so the registry sums windows
instead of differencing counters that restart with the daemon.

Unknown fields are ignored rather than refused: a device newer than its registry must
still get its telemetry stored, or the samples would sit in its buffer until dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

# The bounds every device counts into: part of this contract, defined in a leaf the core reads too.
from edged.latency_buckets import LATENCY_BUCKETS_S

SCHEMA_VERSION = 1
INGEST_PATH = "/api/v1/device/telemetry"
MAX_BATCH_ITEMS = 1000
# Model windows in one upload (samples x models): each is validated on the registry's event loop and stored as a
# database row, so a batch is bounded in windows as well as in bytes. A device's own batch (at most ~2 MB, a window
# with its histograms 300+ bytes) stays below it; one over it gets 413 and halves the batch (docs/telemetry.md).
MAX_BATCH_WINDOWS = 10_000
MAX_COUNT = 2**53  # every count fits a JSON number (a double) exactly; larger ones are refused



class Outcomes:
    """Successful and failed requests of a window: what the device's trial and the registry's gates judge."""

    ok: int
    errors: int

    @property
    def total(self) -> int:
        return self.ok + self.errors

    @property
    def error_rate(self) -> float:
        return self.errors / self.total if self.total else 0.0


class _Counted(Protocol):
    @property
    def counts(self) -> Sequence[int]: ...
    @property
    def total(self) -> float: ...


@dataclass
class HistCounts:
    """Per-bucket counts (not cumulative; the last is +Inf) and the sum of observed values."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    total: float = 0.0

    @classmethod
    def of(cls, h: _Counted) -> HistCounts:
        return cls(list(h.counts), h.total)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def plus(self, o: HistCounts) -> HistCounts:
        return HistCounts([a + b for a, b in zip(self.counts, o.counts, strict=True)], self.total + o.total)

    def minus(self, o: HistCounts) -> HistCounts:
        return HistCounts([a - b for a, b in zip(self.counts, o.counts, strict=True)], self.total - o.total)

    def cumulative(self) -> list[tuple[float, int]]:
        out, acc = [], 0
        for bound, c in zip([*LATENCY_BUCKETS_S, float("inf")], self.counts, strict=True):
            acc += c
            out.append((bound, acc))
        return out

    def quantile(self, q: float) -> float | None:
        """Linear interpolation inside the bucket holding the q-quantile (as Prometheus does); None when empty."""
        n = self.count
        if n == 0:
            return None
        target = q * n
        lower, below = 0.0, 0
        for bound, acc in self.cumulative():
            if acc >= target and acc > below:
                if bound == float("inf"):
                    return LATENCY_BUCKETS_S[-1]
                return lower + (bound - lower) * (target - below) / (acc - below)
            lower, below = bound, acc
        return LATENCY_BUCKETS_S[-1]



Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Code = Annotated[str, StringConstraints(max_length=64)]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class Hist(_Wire):
    """A latency histogram over ``latency_buckets_s`` (counts per bucket, the last one +Inf)."""

    counts: list[Count] = Field(default_factory=list, max_length=64,
                                description="per bucket, not cumulative; trailing empty buckets left out")
    sum_s: float = 0.0

    @property
    def count(self) -> int:
        return sum(self.counts)


class ModelWindow(_Wire):
    model: str = Field(max_length=128)
    version: int = Field(ge=0, le=2**31 - 1)
    backend: str = Field(default="", max_length=64)
    activation: str | None = Field(default=None, max_length=64,
                                   description="this activation of the version: a version loaded again starts "
                                               "a new one, whose first window counts from zero")
    activated_at: float | None = Field(default=None, description="when the activation began, Unix seconds")
    success: Count = 0
    failures: dict[Code, Count] = Field(default_factory=dict, max_length=64,
                                        description="failed requests by error code")
    inferences: Count = Field(default=0, description="batch elements computed")
    executions: Count = Field(default=0, description="engine runs")
    batch_sizes: dict[Annotated[int, Field(ge=0, le=1 << 20)], Count] = Field(
        default_factory=dict, max_length=1024, description="engine runs per batch size")
    in_flight: Count = Field(default=0, description="queued or running at the end of the window")
    internal: dict[str, Count] = Field(default_factory=dict, max_length=16,
                                       description="requests the daemon sent itself (self-test, watchdog probe) "
                                                   "by source: served, but not counted in success or failures")
    latency: Hist = Field(default_factory=Hist, description="end to end, successful requests")
    queue: Hist = Field(default_factory=Hist)
    compute: Hist = Field(default_factory=Hist, description="per engine run")
    p50_s: float | None = None
    p99_s: float | None = None

    @property
    def failure_count(self) -> int:
        return sum(self.failures.values())


class Accelerator(_Wire):
    name: str = Field(max_length=128)
    kind: str = Field(max_length=32)
    utilization: float | None = None
    freq_hz: float | None = None
    max_freq_hz: float | None = None
    memory_used_bytes: Count | None = None
    memory_total_bytes: Count | None = None
    power_w: float | None = None
    temperature_c: float | None = None


class Rail(_Wire):
    name: str = Field(max_length=128)
    voltage_v: float | None = None
    current_a: float | None = None
    power_w: float | None = None


class SystemWindow(_Wire):
    cpu_count: Count = 1
    cpu_utilization: float | None = Field(default=None, description="0..1, all cores, over the window")
    load1: float | None = None
    memory_total: Count | None = None
    memory_used: Count | None = None
    swap_total: Count | None = None
    swap_used: Count | None = None
    disk_total: Count | None = Field(default=None, description="the filesystem of the state dir")
    disk_free: Count | None = None
    process_rss: Count | None = None
    process_threads: Count | None = None
    process_cpu_cores: float | None = Field(default=None, description="cores the daemon used over the window")
    temperatures_c: dict[Annotated[str, StringConstraints(max_length=128)], float] = Field(
        default_factory=dict, max_length=256)
    accelerators: list[Accelerator] = Field(default_factory=list, max_length=64)
    rails: list[Rail] = Field(default_factory=list, max_length=64)
    emc_freq_hz: float | None = None
    emc_utilization: float | None = None


class StreamWindow(_Wire):
    """One MQTT stream binding (a camera topic into a model or pipeline): counts since start, and its real
    answer rate and latency (arrival to result published) over its last seconds."""

    topic: str = Field(max_length=256, description="the binding's input topic filter")
    model: str = Field(max_length=128)
    received: Count = 0
    processed: Count = Field(default=0, description="answered (results published)")
    dropped: Count = Field(default=0, description="dropped by the binding's policy (and at shutdown)")
    errors: Count = 0
    fps: float = Field(default=0.0, ge=0, description="answers per second over the binding's recent window")
    latency_ms_p50: float = Field(default=0.0, ge=0)
    latency_ms_p99: float = Field(default=0.0, ge=0)


class MqttWindow(_Wire):
    """The MQTT transport's request/reply counts (over the window in a sample, since start in the status file)."""

    requests: Count = 0
    replies: Count = Field(default=0, description="answers")
    error_replies: Count = Field(default=0, description="error replies, overloaded ones included")
    overloaded: Count = Field(default=0, description="requests refused with 'overloaded'")
    replies_dropped: Count = Field(default=0, description="replies that could not be handed to the broker")
    requests_dropped: Count = Field(default=0, description="requests without a usable reply address")
    replies_refused: Count = Field(default=0, description="requests whose response topic lay outside the reply "
                                                          "namespace (answered on the daemon's error topic)")
    backlog: Count = Field(default=0, description="at the end: requests computing plus replies not yet taken")
    broker_stall: str | None = Field(default=None, max_length=2000,
                                     description="the broker's delayed-ACK stall, once recognised, with the fix")
    streams: list[StreamWindow] = Field(default_factory=list, max_length=256,
                                        description="per stream binding (its counts stay since start)")

    def minus(self, prev: MqttWindow | None) -> MqttWindow:
        if prev is None:
            return self
        counts = {k: max(0, getattr(self, k) - getattr(prev, k)) for k in _MQTT_COUNTS}
        return MqttWindow(**counts, backlog=self.backlog, broker_stall=self.broker_stall, streams=self.streams)


_MQTT_COUNTS = ("requests", "replies", "error_replies", "overloaded", "replies_dropped", "requests_dropped",
               "replies_refused")


class TelemetrySample(_Wire):
    v: int = SCHEMA_VERSION
    device: str = Field(max_length=128)
    seq: int = Field(default=0, ge=0, le=MAX_COUNT, description="the device buffer's sequence number (0: not "
                                                                  "buffered)")
    run: str = Field(max_length=64, description="random per daemon start: windows never span two runs")
    t: float = Field(description="device wall clock at the end of the window, Unix seconds")
    window_s: float = Field(ge=0, description="monotonic seconds this sample covers")
    uptime_s: float = Field(ge=0, description="seconds since the daemon started")
    profile: str | None = None
    latency_buckets_s: list[float] = Field(default_factory=lambda: list(LATENCY_BUCKETS_S), max_length=64)
    system: SystemWindow = Field(default_factory=SystemWindow)
    models: list[ModelWindow] = Field(default_factory=list, max_length=1000)
    mqtt: MqttWindow | None = None


class UploadBatch(_Wire):
    buffer_id: str = Field(min_length=1, max_length=64,
                           description="identity of the device's buffer file: seq restarts with a new one")
    dropped: Count = Field(default=0, description="samples the device dropped (buffer full) since its last "
                                                  "acknowledged batch")
    dropped_total: Count = Field(default=0, description="all samples ever dropped from this buffer")
    items: list[TelemetrySample] = Field(default_factory=list, max_length=MAX_BATCH_ITEMS)

    @model_validator(mode="before")
    @classmethod
    def _windows(cls, data: Any) -> Any:
        """Counted on the raw body, before a single window is validated: a batch of 300,000 tiny windows
        fits the body limit, and validating them would hold the registry's event loop for seconds."""
        items = data.get("items") if isinstance(data, dict) else None
        if isinstance(items, list):
            n = sum(len(it["models"]) for it in items if isinstance(it, dict) and isinstance(it.get("models"), list))
            if n > MAX_BATCH_WINDOWS:
                raise BatchTooLargeError(f"items: {n} model windows in one batch, at most {MAX_BATCH_WINDOWS}: "
                                         "send fewer samples per batch")
        return data


class BatchTooLargeError(ValueError):
    """An upload holds more model windows than one batch may (answered 413)."""


class UploadAck(_Wire):
    accepted: Count
    duplicates: Count = 0
    last_seq: int = 0
