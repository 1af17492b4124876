"""JSON bodies of the rollout API (operators only; devices never see these)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from edged.protocol.fleet.messages import MAX_INT32, Version
from edged.protocol.fleet.release import SignedRelease, TargetSelector
from edged.registry.targets import RolloutTarget

RolloutState = Literal["scheduled", "running", "paused", "halted", "aborted", "rolled-back", "completed"]
# Not finished: one of these per model at a time. A scheduled rollout admits nobody until its start time.
ACTIVE_STATES: frozenset[str] = frozenset({"scheduled", "running", "paused"})
# Members of a rollout in these states are told to return to their last-known-good.
REVERT_STATES: frozenset[str] = frozenset({"halted", "rolled-back"})
# Per-device progress, from the device's last report for the rollout's release.
# not_started: a member that never reported the release before its rollout ended (it never will now).
PROGRESS = ("pending", "updating", "in_trial", "committed", "rolled_back", "failed", "not_started")
STEP_PROGRESS = {"downloading": "updating", "verifying": "updating", "prepared": "updating",
                 "active-trial": "in_trial", "committed": "committed", "rolled-back": "rolled_back",
                 "failed": "failed"}


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StepSpec(_Wire):
    """One step: a share of the target (stable hashing) or an explicit group within it."""

    percent: float | None = Field(default=None, gt=0, le=100, description="share of the targeted devices")
    group: RolloutTarget | None = Field(default=None, description="an explicit device group within the target")
    min_devices: int = Field(default=1, ge=0, le=1_000_000,
                             description="the step includes at least this many devices, and at least this many "
                                         "must have committed before its soak time starts")
    soak_s: float = Field(default=0.0, ge=0, le=30 * 86400,
                          description="how long the step runs healthy before the next one starts")
    max_failure_rate: float | None = Field(default=None, ge=0, le=1,
                                           description="this step's own failure-rate limit, instead of the "
                                                       "rollout's gate (None: the rollout's)")
    min_reporting: int | None = Field(default=None, ge=1, le=1_000_000,
                                      description="this step's own reporting minimum, instead of the rollout's "
                                                  "(None: the rollout's)")

    @model_validator(mode="after")
    def _one(self) -> StepSpec:
        if (self.percent is None) == (self.group is None):
            raise ValueError("a step has either percent or group")
        return self

    def describe(self) -> str:
        sel = f"{self.percent:g}%" if self.percent is not None else (
            self.group.describe() if self.group is not None else "?")
        own = ([f"min {self.min_devices}"] if self.min_devices > 1 else []) + (
            [f"failure rate <= {self.max_failure_rate:.0%}"] if self.max_failure_rate is not None else []) + (
            [f"min {self.min_reporting} reporting"] if self.min_reporting is not None else [])
        return sel + (f" ({', '.join(own)})" if own else "")

    def judged_by(self, rollout: Gates) -> Gates:
        """The gates this step is judged by: the rollout's, with the step's own thresholds where it sets them."""
        own = {k: v for k, v in (("max_failure_rate", self.max_failure_rate), ("min_reporting", self.min_reporting))
               if v is not None}
        return rollout.model_copy(update=own) if own else rollout


class Gates(_Wire):
    """Health gates, judged by the registry on every evaluation; crossing one halts the rollout."""

    max_failure_rate: float | None = Field(default=0.1, ge=0, le=1,
                                           description="(rolled back + failed) / devices that finished the update")
    max_error_rate: float | None = Field(default=None, ge=0, le=1,
                                         description="telemetry: allowed error-rate increase over the previous "
                                                     "version")
    max_p99_ratio: float | None = Field(default=None, gt=0,
                                        description="telemetry: allowed p99 latency as a multiple of the previous "
                                                    "version's")
    p99_floor_ms: float = Field(default=10.0, ge=0, description="a p99 below this never crosses the latency gate")
    min_reporting: int = Field(default=3, ge=1, description="devices that must have finished before the failure "
                                                           "rate is judged and before a step may complete")
    min_requests: int = Field(default=200, ge=1, description="requests each side needs before telemetry gates "
                                                            "are judged")
    max_quality_drop: float | None = Field(default=None, ge=0, le=1,
                                           description="evaluation set: allowed drop of the new version's score "
                                                       "below the last-known-good's on the same devices (0.02 = two "
                                                       "points of top-1 accuracy); needs [evaluation] in the "
                                                       "version's model.toml")
    min_quality: float | None = Field(default=None, ge=0, le=1,
                                      description="evaluation set: the new version's mean score must reach this")

    def describe(self) -> str:
        out = []
        if self.max_failure_rate is not None:
            out.append(f"failure rate <= {self.max_failure_rate:.0%}")
        if self.max_error_rate is not None:
            out.append(f"error rate <= previous + {self.max_error_rate:.1%}")
        if self.max_p99_ratio is not None:
            out.append(f"p99 <= {self.max_p99_ratio:g}x previous")
        if self.max_quality_drop is not None:
            out.append(f"quality >= previous - {self.max_quality_drop:g}")
        if self.min_quality is not None:
            out.append(f"quality >= {self.min_quality:g}")
        out.append(f"min {self.min_reporting} reporting")
        return ", ".join(out)


class RolloutCreate(_Wire):
    model: str = Field(max_length=128)
    release: Version | None = Field(default=None, description="an existing release of the model")
    signed: SignedRelease | None = Field(default=None, description="or a new signed release, created with the "
                                                                   "rollout so no device sees it ungated")
    target: RolloutTarget = Field(default_factory=RolloutTarget)
    steps: list[StepSpec] = Field(min_length=1, max_length=100)
    gates: Gates = Field(default_factory=Gates)
    salt: str | None = Field(default=None, max_length=64, description="stable-hash salt (default: the model name, "
                                                                      "so a model's canaries stay the same)")
    baseline_version: Version | None = Field(default=None, description="the version telemetry gates compare "
                                                                       "against (default: the release the fleet "
                                                                       "runs now)")
    notes: str = Field(default="", max_length=4096)
    admit_per_minute: float | None = Field(
        default=None, ge=0, le=10_000_000,
        description="a percent step lets its new members in at most this many a minute, in rank order "
                    "(0: all at once; default: the registry's rollout_admit_per_minute); a step's soak "
                    "starts once all its members are in")
    start_at: float | None = Field(default=None, ge=0, le=2**33,
                                   description="Unix time to start at: until then the rollout is scheduled and "
                                               "admits no device (None or a past time: now)")

    @model_validator(mode="after")
    def _check(self) -> RolloutCreate:
        if (self.release is None) == (self.signed is None):
            raise ValueError("give either release (an existing one) or signed (a new one)")
        last = 0.0
        for i, s in enumerate(self.steps):
            if s.percent is not None:
                if s.percent < last:
                    raise ValueError(f"steps[{i}]: percent steps must not shrink ({s.percent:g} after {last:g})")
                last = s.percent
        return self


class RolloutAction(_Wire):
    reason: str = Field(default="", max_length=1000)


class Admission(_Wire):
    """A percent step still letting its new members in (rank order, at the rollout's pace)."""

    cutoff: float = Field(description="rank under which devices are in now")
    to: float = Field(description="the step's own cutoff")
    held: bool = Field(description="nobody new is let in now (paused rollout, or the registry is shedding load)")
    done_at: float | None = Field(description="when the last member will be in at the current pace")
    reason: str | None = Field(default=None, description="why admission is held")


class RolloutInfo(_Wire):
    id: int
    model: str
    release: int
    version: int
    state: RolloutState
    step: int = Field(description="index of the current step (== len(steps) when completed)")
    steps: list[StepSpec]
    target: RolloutTarget
    gates: Gates
    salt: str
    baseline_version: int | None
    reason: str | None
    members: int = Field(description="devices in the rollout up to the current step, when it started")
    step_started_at: float
    step_ready_at: float | None
    created_at: float
    updated_at: float
    finished_at: float | None
    notes: str = ""
    admit_per_minute: float | None = Field(default=None, description="the pace of percent steps (None: at once)")
    admission: Admission | None = Field(default=None, description="the current step's admission, while it lasts")
    start_at: float | None = Field(default=None, description="when a scheduled rollout starts (or started)")


class StepProgress(_Wire):
    index: int
    select: str
    soak_s: float
    status: Literal["done", "current", "waiting", "halted", "aborted", "rolled-back", "not-reached"] = Field(
        description="a stopped rollout's step reads as how it stopped; the steps after it as not-reached")
    members: int = Field(description="devices this step added")
    counts: dict[str, int] = Field(description="pending, updating, in_trial, committed, rolled_back, failed")


class GateReading(_Wire):
    gate: str
    value: float | None
    limit: float | None
    judged: bool
    ok: bool
    detail: str = ""


class MemberProgress(_Wire):
    """One member: its progress from its last report about the rollout's release, with its trial figures."""

    device_id: str
    step: int = Field(description="index of the step that admitted it")
    progress: str = Field(description="one of PROGRESS")
    report: str | None = Field(description="its last reported step for the release")
    version: int | None = None
    reason: str | None = None
    at: float | None = Field(default=None, description="when the registry received that report")
    requests: int | None = Field(default=None, description="trial requests (committed or trial-failed reports)")
    errors: int | None = None
    p99_ms: float | None = None


class RolloutStatus(_Wire):
    rollout: RolloutInfo
    targeted: int = Field(description="enrolled devices the target matches")
    totals: dict[str, int]
    steps: list[StepProgress]
    gates: list[GateReading]
    soak_left_s: float | None
    not_admitted: int = Field(default=0, description="devices of the current step its ramp has not let in yet")
    members: list[MemberProgress] = Field(default_factory=list, description="per member, when asked for")


# ---- fleet rollback -------------------------------------------------------------------------------
class RollbackPlan(_Wire):
    """What ``rollback MODEL --to X`` would do: the operator signs a new release of ``version`` numbered
    ``next_release`` with ``selector`` and posts it back as a :class:`RollbackRequest`."""

    model: str
    current_release: int | None = Field(description="the release the fleet is meant to run now")
    current_version: int | None
    to_release: int = Field(description="the earlier release whose version comes back")
    version: int
    selector: TargetSelector = Field(description="the earlier release's signed selector, reused by default")
    next_release: int


class RollbackRequest(_Wire):
    to_release: int = Field(ge=1, le=MAX_INT32,
                            description="the release resolved by the plan; the signed version must be its")
    signed: SignedRelease
    reason: str = Field(default="", max_length=1000)


class RollbackResult(_Wire):
    model: str
    release: int = Field(description="the new release that carries the restored version")
    version: int
    restores: int
    stopped_rollouts: list[int] = Field(default_factory=list, description="running or paused rollouts of the model "
                                                                          "now rolled back (scheduled ones: aborted)")
