"""The status snapshot the telemetry agent writes to ``<runtime_dir>/status.json`` for ``edged status``.

Written atomically (temp file + rename) every few seconds while the daemon runs, and once
more with ``state = "stopped"`` when it stops, so a reader never sees half a file and can
tell a stopped daemon (state), a hung one (age) and a crashed one (pid gone) apart.

The age is measured on CLOCK_MONOTONIC, which every process of one boot shares, when the
reader runs in the boot that wrote the file (same kernel boot id); wall time, which NTP or
an RTC-less board's first sync can step by hours, is only the fallback.
"""

from __future__ import annotations

import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from edged.errors import EdgedError, ErrorCode
from edged.fsutil import atomic_write_bytes
from edged.protocol.fleet.telemetry import MqttWindow, SystemWindow

STATUS_FILE = "status.json"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


class StatusFileError(EdgedError):
    """The status file exists but is not a status snapshot (garbled, or another program's)."""

    code = ErrorCode.FAILED_PRECONDITION


def boot_id() -> str | None:
    """This boot's id (Linux), or None where the kernel does not offer one."""
    try:
        return BOOT_ID.read_text().strip() or None
    except OSError:
        return None


class _Snap(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ModelStatus(_Snap):
    model: str
    version: int
    state: str
    reason: str | None = None
    warmup: str | None = None
    note: str | None = None  # a declared output shape the engine's answers contradict
    choice: str | None = None  # how the engine was chosen and on what evidence
    backend: str = ""
    device: str = ""
    precision: str = ""
    requests_per_s: float | None = None  # successes + failures over the window
    errors_per_s: float | None = None
    p50_s: float | None = None  # over the window
    p99_s: float | None = None
    in_flight: int = 0
    success_total: int = 0  # since activated_at (this activation of the version), like /metrics
    failures_total: int = 0
    activation: str | None = None
    activated_at: float | None = None


class BufferStatus(_Snap):
    samples: int
    bytes: int
    capacity_bytes: int
    dropped_total: int
    oldest_t: float | None = None


class UploadStatus(_Snap):
    state: str
    uploaded_total: int
    failures_total: int
    rejected_total: int
    last_success_wall: float | None = None
    last_error: str | None = None


class TelemetryStatus(_Snap):
    enabled: bool
    interval_s: float
    samples_total: int = 0
    mqtt: bool = False
    buffer: BufferStatus | None = None
    upload: UploadStatus | None = None


class StatusSnapshot(_Snap):
    v: int = 1
    state: str = Field(description="running | stopped")
    pid: int
    device: str
    profile: str | None = None
    edged_version: str = ""
    started_at: float
    written_at: float = Field(description="wall time, for people; see written_mono for ages")
    written_mono: float | None = Field(default=None, description="time.monotonic() when written")
    boot_id: str | None = Field(default=None, description="the kernel boot id written_mono belongs to")
    interval_s: float = Field(description="how often the file is rewritten")
    window_s: float = 0.0
    system: SystemWindow = Field(default_factory=SystemWindow)
    models: list[ModelStatus] = Field(default_factory=list)
    telemetry: TelemetryStatus | None = None
    mqtt: MqttWindow | None = Field(default=None, description="MQTT transport counts since start")
    notes: list[str] = Field(default_factory=list)


def snapshot_age(snap: StatusSnapshot, now_wall: float) -> float:
    """Seconds since the snapshot was written: monotonic within the same boot, else by wall clocks."""
    if snap.written_mono is not None and snap.boot_id is not None and snap.boot_id == boot_id():
        return time.monotonic() - snap.written_mono
    return now_wall - snap.written_at


def write_snapshot(path: Path, snap: StatusSnapshot) -> None:
    atomic_write_bytes(path, snap.model_dump_json(exclude_none=True).encode(), mode=0o644)


def read_snapshot(path: Path) -> StatusSnapshot | None:
    """None when there is no file; a garbled one raises StatusFileError with the reason."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return StatusSnapshot.model_validate_json(data)
    except ValidationError as e:
        raise StatusFileError(f"{path.name} is not a status snapshot ({e.error_count()} problem(s))") from None
