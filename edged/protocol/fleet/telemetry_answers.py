"""What the registry answers to telemetry queries: a device's system series, a model's series and summary.

Pydantic only, so that a client (``edged-registry telemetry``, a rollout gate, the web views) reads the
answers without importing the registry's server (FastAPI, SQLAlchemy: about half a second per call).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from edged.protocol.fleet.telemetry import SystemWindow


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DevicePoint(_Out):
    seq: int
    run: str
    t: float
    window_s: float
    received_at: float
    profile: str | None
    system: SystemWindow


class DeviceTelemetry(_Out):
    device_id: str
    samples_total: int
    dropped_total: int = Field(description="samples the device dropped before it could upload them")
    last_received_at: float | None
    points: list[DevicePoint]


class ModelPoint(_Out):
    t: float
    device_id: str
    version: int
    backend: str
    window_s: float
    success: int
    failures: int
    failures_by_code: dict[str, int]
    inferences: int
    in_flight: int
    p50_s: float | None
    p99_s: float | None


class ModelSeries(_Out):
    model: str
    points: list[ModelPoint]


class ModelSummary(_Out):
    model: str
    version: int | None
    since: float | None
    until: float | None
    devices: int
    samples: int
    success: int
    failures: int
    failures_by_code: dict[str, int]
    error_rate: float | None
    p50_s: float | None
    p90_s: float | None
    p99_s: float | None
    device_id: str | None = None
    span_s: float | None = Field(default=None, description="from the start of the first window to the end of the "
                                                          "last")
    rate_per_s: float | None = Field(default=None, description="requests per second over span_s, all devices")
    versions: list[int] = Field(default_factory=list)
    backends: list[str] = Field(default_factory=list)
