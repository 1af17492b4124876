"""JSON bodies of the registry API, shared by the server, the CLI and devices.

Devices import this module, so it depends on pydantic only.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from edged.protocol.fleet.release import FileEntry, SignedRelease, TargetSelector
from edged.protocol.names import valid_model_name

API_PREFIX = "/api/v1"
# Checked with fullmatch: ``$`` alone would accept a trailing newline ("victim-01\n" beside "victim-01").
DEVICE_ID_RE = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")
LABEL_KEY_RE = re.compile(r"[A-Za-z0-9_.\-/]{1,63}")
CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f]")
MAX_SERVING = 1024  # models a device reports serving: far above any device's repository
MAX_FACTS = 1024  # fact keys a device sends, at enrollment and after
# Models, reverts and release numbers in a device's desired state: far above any fleet's; a device refuses a
# longer answer whole (each entry costs it state and work).
MAX_DESIRED = 1024
MAX_REASON = 4096  # characters of a revert's reason a device keeps (an operator's rollout reason is at most 1000)
# Every count a device reports fits a JSON number exactly (2^53) and every id and number the database stores:
# larger ones are refused with a 400 instead of failing in the database.
MAX_COUNT = 2**53
MAX_INT32 = 2**31 - 1
# The device's own last log lines a failed-update report may carry (the registry answers 413 above these).
MAX_LOG_LINES = 50
MAX_LOG_LINE = 256  # characters
MAX_LOG_BYTES = 8192  # UTF-8, all lines together
Version = Annotated[int, Field(ge=0, le=MAX_INT32)]
# An enrollment token is a bearer secret: it lives a bounded time (finite: _Wire refuses inf and NaN), so one
# made carelessly (or with 1e300) cannot enroll devices for ever. A longer wait is a new token.
MAX_ENROLL_TTL_S = 30 * 86400
TokenTtl = Annotated[float, Field(gt=0, le=MAX_ENROLL_TTL_S)]

# Every step a device reports; the order is the happy path.
Step = Literal["downloading", "verifying", "prepared", "active-trial", "committed", "rolled-back", "failed"]
STEPS: tuple[str, ...] = ("downloading", "verifying", "prepared", "active-trial", "committed", "rolled-back", "failed")


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def has_control(text: str) -> bool:
    """Control characters (newline, NUL, escape, C1) never belong in an id, a name or a label."""
    return CONTROL_RE.search(text) is not None


def _check_labels(v: dict[str, str]) -> dict[str, str]:
    if len(v) > 64:
        raise ValueError("at most 64 labels")
    for k, val in v.items():
        if not LABEL_KEY_RE.fullmatch(k) or len(val) > 256 or has_control(val):
            raise ValueError(f"label {k!r}: keys are 1-63 of [A-Za-z0-9_.-/], values at most 256 characters "
                             "without control characters")
    return v


def _check_model(v: str) -> str:
    if not valid_model_name(v):
        raise ValueError("a model name is 1-128 of [A-Za-z0-9_.-], starting with a letter, digit or _")
    return v


class ErrorBody(_Wire):
    code: str
    message: str


# ---- devices ------------------------------------------------------------------------------------
class EnrollRequest(_Wire):
    token: str = Field(max_length=256)
    device_id: str
    labels: dict[str, str] = Field(default_factory=dict, description="refused unless the enrollment token "
                                                                     "carries the same labels (operator-owned)")
    facts: dict[str, Any] = Field(default_factory=dict)

    @field_validator("device_id")
    @classmethod
    def _id(cls, v: str) -> str:
        if not DEVICE_ID_RE.fullmatch(v):
            raise ValueError("must be 1-128 of [A-Za-z0-9_.:-]")
        return v

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_labels(v)


class EnrollResponse(_Wire):
    device_id: str
    credential: str = Field(description="per-device bearer token; shown once, stored hashed")


class DesiredModel(_Wire):
    model: str
    version: int = Field(description="unsigned copy for display; devices trust only the signed manifest")
    release: int
    signed: SignedRelease

    _model = field_validator("model")(_check_model)


class RevertModel(_Wire):
    """Releases of a model the device must not run: a rollout of them was halted or rolled back.

    A device running one returns to its last-known-good; one that never had it never
    installs it. Unsigned on purpose: it can only send a device back to a version that
    device committed itself, never to anything new.
    """

    model: str
    releases: list[int] = Field(max_length=MAX_DESIRED)
    reason: str = ""

    _model = field_validator("model")(_check_model)

    @field_validator("reason")
    @classmethod
    def _reason(cls, v: str) -> str:
        return v[:MAX_REASON]  # informative only: cut, not refused (the device keeps it in its state)


class DesiredState(_Wire):
    device_id: str
    models: list[DesiredModel] = Field(max_length=MAX_DESIRED)
    revert: list[RevertModel] = Field(default_factory=list, max_length=MAX_DESIRED)


class QualityReport(_Wire):
    """The version's score on its release's labelled evaluation set, measured by the device at trial start,
    and the score of the version it replaced (its last-known-good) on the same samples."""

    metric: Literal["top1"] = "top1"
    samples: int = Field(ge=1, le=MAX_INT32)
    score: float = Field(ge=0, le=1)
    baseline_version: Version | None = None
    baseline_score: float | None = Field(default=None, ge=0, le=1)


class ReportEvent(_Wire):
    seq: int = Field(ge=1, le=MAX_COUNT, description="per device, increasing; the registry ignores repeats")
    model: str = Field(max_length=128)
    step: Step
    version: Version | None = None
    release: Version | None = None
    reason: str | None = Field(default=None, max_length=4096)
    detail: dict[str, Any] = Field(default_factory=dict, max_length=64)
    quality: QualityReport | None = Field(default=None, description="with active-trial: the evaluation-set scores")
    logs: list[str] = Field(default_factory=list, max_length=MAX_LOG_LINES,
                            description="with failed or rolled-back: the device's own last log lines before it, "
                                        "oldest first (at most 50 lines of 256 characters, 8 KiB in all, no "
                                        "control characters)")
    at: float = Field(description="device wall clock, Unix seconds (informational: edge clocks jump)")

    _model = field_validator("model")(_check_model)

    @field_validator("logs")
    @classmethod
    def _logs(cls, v: list[str]) -> list[str]:
        if any(len(line) > MAX_LOG_LINE for line in v) or sum(len(line.encode()) for line in v) > MAX_LOG_BYTES:
            # "too_long", as a list over its bound: the registry answers 413 like for its other bounded fields
            raise PydanticCustomError("too_long", f"log lines are at most {MAX_LOG_LINE} characters and "
                                                  f"{MAX_LOG_BYTES} bytes in all")
        if any(has_control(line) for line in v):
            raise ValueError("log lines carry no control characters")
        return v


class ServingModel(_Wire):
    model: str
    version: Version | None = None
    release: Version | None = None
    state: str = Field(default="", max_length=32, description="committed | active-trial | local")

    _model = field_validator("model")(_check_model)

    @field_validator("state")
    @classmethod
    def _state(cls, v: str) -> str:
        if has_control(v):
            raise ValueError("no control characters")
        return v


class ReportBatch(_Wire):
    events: list[ReportEvent] = Field(default_factory=list, max_length=1000)


class DeviceFactsUpdate(_Wire):
    labels: dict[str, str] = Field(default_factory=dict, description="must be empty: a device never labels itself")
    facts: dict[str, Any] = Field(default_factory=dict, max_length=MAX_FACTS)
    serving: list[ServingModel] = Field(default_factory=list, max_length=MAX_SERVING)

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_labels(v)


class Accepted(_Wire):
    accepted: int


# ---- admin --------------------------------------------------------------------------------------
class MissingBlobsRequest(_Wire):
    sha256: list[str] = Field(max_length=10000)


class MissingBlobsResponse(_Wire):
    missing: list[str]


class PushVersionRequest(_Wire):
    files: list[FileEntry] = Field(min_length=1, max_length=10000)


class VersionInfo(_Wire):
    model: str
    version: int
    files: list[FileEntry]
    total_size: int
    created_at: float
    created: bool = Field(default=False, description="true when this call created it")


class ModelInfo(_Wire):
    name: str
    versions: list[int]
    latest_release: int | None


class ReleaseInfo(_Wire):
    model: str
    release: int
    version: int
    key_id: str
    selector: TargetSelector
    issued_at: int
    expires_at: int
    created_at: float
    revoked: bool
    notes: str = ""
    signed: SignedRelease | None = None
    restores: int | None = Field(default=None, description="a fleet rollback: the earlier release it brings back")
    state: str = Field(default="", description="what became of it: valid, superseded, halted, aborted, rolled back, "
                                               "scheduled, expired or revoked; a fleet rollback's adds 'restores rN'")


class NextRelease(_Wire):
    model: str
    release: int = Field(description="the lowest number the registry will accept next")


class EnrollmentTokenRequest(_Wire):
    uses: int = Field(default=1, ge=1, le=1_000_000)
    ttl_s: TokenTtl = 86400.0
    labels: dict[str, str] = Field(default_factory=dict, description="given to every device enrolling with it")

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_labels(v)


class ReenrollRequest(_Wire):
    ttl_s: TokenTtl = Field(default=86400.0, description="how long the device has to use the token (at most 30 days)")


class EnrollmentTokenResponse(_Wire):
    token: str
    uses: int
    expires_at: float


class DeviceModelInfo(_Wire):
    model: str
    state: str | None
    version: int | None
    release: int | None
    reason: str | None
    updated_at: float | None
    pinned_release: int | None = None


class EventInfo(_Wire):
    seq: int
    model: str
    step: str
    version: int | None
    release: int | None
    reason: str | None
    detail: dict[str, Any]
    at: float
    received_at: float
    logs: list[str] = Field(default_factory=list, description="the device's last log lines before a failure")


class ServingInfo(_Wire):
    """What a device serves now (its own word, engine from its telemetry) beside what the registry offers it."""

    model: str
    version: int | None
    release: int | None
    state: str = Field(description="committed | trial (the version on trial, already serving) | local | not serving")
    engine: str | None = None
    desired_release: int | None = None
    desired_version: int | None = None


class DeviceInfo(_Wire):
    device_id: str
    labels: dict[str, str]
    facts: dict[str, Any]
    enrolled_at: float
    last_seen_at: float | None
    models: list[DeviceModelInfo] = Field(description="per model, the device's last report")
    events: list[EventInfo] = Field(default_factory=list)
    serving: list[ServingInfo] = Field(default_factory=list)


class LabelsUpdate(_Wire):
    labels: dict[str, str | None] = Field(description="admin labels to set; null removes one")

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str | None]) -> dict[str, str | None]:
        _check_labels({k: val or "" for k, val in v.items()})
        return v


class PinRequest(_Wire):
    release: Version | None = Field(description="pin this device to a release of the model; null unpins")


class ReleaseStatus(_Wire):
    release: int
    version: int
    revoked: bool
    expires_at: int
    devices: dict[str, int] = Field(description="device count per last reported step for this release")
    committed_ever: int = Field(default=0, description="devices that ever committed this release (some may have "
                                                       "moved on since)")
    state: str = Field(default="", description="as ReleaseInfo.state")


class ModelStatus(_Wire):
    model: str
    releases: list[ReleaseStatus]


class RegistryStatus(_Wire):
    devices: int
    models: list[ModelStatus]
