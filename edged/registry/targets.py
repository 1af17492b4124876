"""Which devices a rollout is for, and which of them each step includes.

A target matches on the labels operators gave a device (a device never labels itself),
on the facts it reports (its device profile and hardware facts, dotted keys such as
``jetson.module``), on profile names, and on explicit device ids; values may be shell
globs (``Orin Nano*``). Step membership comes from a stable hash of the rollout's salt and
the device id: a device's rank in [0, 1) never changes, a percent step admits every
device ranked at or below its cutoff, and cutoffs only grow, so a device never flips out
of a rollout it joined, and a device that enrolls later is placed the same way.

A percent step may let its new members in at a rate (:class:`Ramp`): its cutoff then rises
from the previous step's to its own over time, in rank order, so a step of 5,000 devices
becomes a stream of downloads instead of one wave; the ramp is a function of the clock, so
every registry process admits the same devices without writing anything per device.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from edged.protocol.fleet.release import TargetSelector

PROFILE_FACT = "profile"


def fact_text(value: Any) -> str | None:
    """How a fact compares: booleans as ``true``/``false``, None as absent, the rest as text."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _match(pattern: str, value: Any) -> bool:
    text = fact_text(value)
    if text is None:
        return False
    if any(c in pattern for c in "*?["):
        return fnmatchcase(text, pattern)
    return text == pattern


class RolloutTarget(BaseModel):
    """All given conditions must hold; an empty target is every device."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    labels: dict[str, str] = Field(default_factory=dict, description="label = value (globs allowed)")
    facts: dict[str, str] = Field(default_factory=dict,
                                  description="reported fact (dotted key, e.g. jetson.module) = value or glob")
    profiles: list[str] = Field(default_factory=list, description="device profile names (globs); any of them")
    devices: list[str] = Field(default_factory=list, description="only these device ids, when given")

    @field_validator("devices", "profiles")
    @classmethod
    def _bounded(cls, v: list[str]) -> list[str]:
        if len(v) > 100_000:
            raise ValueError("at most 100000 entries")
        return v

    def matches(self, device_id: str, labels: Mapping[str, Any], facts: Mapping[str, Any]) -> bool:
        if self.devices and device_id not in self.devices:
            return False
        if not all(_match(v, labels.get(k)) for k, v in self.labels.items()):
            return False
        if not all(_match(v, facts.get(k)) for k, v in self.facts.items()):
            return False
        return not self.profiles or any(_match(p, facts.get(PROFILE_FACT)) for p in self.profiles)

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in sorted(self.labels.items())]
        parts += [f"{k}={v}" for k, v in sorted(self.facts.items())]
        if self.profiles:
            parts.append("profile in " + "|".join(self.profiles))
        if self.devices:
            parts.append(f"{len(self.devices)} listed device(s)" if len(self.devices) > 3 else
                         "devices " + ",".join(self.devices))
        return ", ".join(parts) or "all devices"


def rank(salt: str, device_id: str) -> float:
    """The device's stable place in [0, 1) for one rollout (sha256, so evenly spread and not steerable)."""
    digest = hashlib.sha256(f"{salt}\x00{device_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def selector_matches(selector: TargetSelector, device_id: str, labels: Mapping[str, Any]) -> bool:
    """The release's own signed selector (exact labels, listed devices)."""
    if selector.devices and device_id not in selector.devices:
        return False
    return all(labels.get(k) == v for k, v in selector.labels.items())


def percent_cutoff(ranks: list[float], percent: float, min_devices: int) -> float:
    """The rank under which ``percent`` of these devices fall, rounded down, but at least ``min_devices`` of them
    and at least one (34 % of 3 devices is 1: a step never takes more than it says, nor nothing).

    100 % is 1.0: every device, also those that enroll later.
    """
    if percent >= 100:
        return 1.0
    n = len(ranks)
    if n == 0:
        return percent / 100.0
    want = min(n, max(math.floor(round(percent * n / 100.0, 9)), min_devices, 1))
    if want <= 0:
        return -1.0
    return sorted(ranks)[want - 1]


@dataclass(frozen=True)
class Ramp:
    """A percent step's cutoff rising from ``start`` at wall-clock time ``at`` by ``per_s`` rank a second,
    up to ``to`` (the step's own cutoff). ``per_s`` is 0 while admission is held (paused rollout, busy
    registry); ``rate_s`` is the rank a second to go back to. Wall-clock, as processes compare it."""

    start: float
    at: float
    per_s: float
    rate_s: float
    to: float

    @classmethod
    def load(cls, data: Mapping[str, Any] | None) -> Ramp | None:
        if not data:
            return None
        return cls(float(data["start"]), float(data["at"]), float(data["per_s"]), float(data["rate_s"]),
                   float(data["to"]))

    def dump(self) -> dict[str, float]:
        return {"start": self.start, "at": self.at, "per_s": self.per_s, "rate_s": self.rate_s, "to": self.to}

    def cutoff(self, now: float) -> float:
        return min(self.to, self.start + self.per_s * max(0.0, now - self.at))

    def done(self, now: float) -> bool:
        return self.cutoff(now) >= self.to

    def held(self, now: float) -> Ramp:
        """Admission stands still from ``now`` (those already in stay in)."""
        return Ramp(self.cutoff(now), now, 0.0, self.rate_s, self.to)

    def resumed(self, now: float) -> Ramp:
        return Ramp(self.cutoff(now), now, self.rate_s, self.rate_s, self.to)

    def finish_at(self, now: float) -> float | None:
        """When the last member will be in at the current pace (None while held)."""
        if self.per_s <= 0:
            return None
        return now + max(0.0, self.to - self.cutoff(now)) / self.per_s


class Membership:
    """Who is in a rollout up to its current step: the target, then a rank cutoff (rising along a
    ramp while a step admits at a rate) or a group."""

    __slots__ = ("cutoff", "groups", "ramp", "salt", "target")

    def __init__(self, target: RolloutTarget, salt: str, cutoff: float, groups: tuple[RolloutTarget, ...],
                 ramp: Ramp | None = None) -> None:
        self.target, self.salt, self.cutoff, self.groups, self.ramp = target, salt, cutoff, groups, ramp

    @classmethod
    def of(cls, target: RolloutTarget, salt: str, steps: list[dict[str, Any]], cutoffs: list[Any],
           step: int, *, ramp: Ramp | None = None) -> Membership:
        """``steps`` and ``cutoffs`` as stored; steps up to and including ``step`` count, the last one
        only up to ``ramp`` when it is still admitting."""
        cut = -1.0
        groups: list[RolloutTarget] = []
        last = min(step + 1, len(steps))
        for i in range(last):
            spec = steps[i]
            if spec.get("group") is not None:
                groups.append(RolloutTarget.model_validate(spec["group"]))
            elif i < len(cutoffs) and cutoffs[i] is not None and not (ramp is not None and i == last - 1):
                cut = max(cut, float(cutoffs[i]))
        return cls(target, salt, cut, tuple(groups), ramp)

    def current_cutoff(self, now: float | None = None) -> float:
        if self.ramp is None:
            return self.cutoff
        return max(self.cutoff, self.ramp.cutoff(time.time() if now is None else now))

    def targeted(self, device_id: str, labels: Mapping[str, Any], facts: Mapping[str, Any]) -> bool:
        return self.target.matches(device_id, labels, facts)

    def member(self, device_id: str, labels: Mapping[str, Any], facts: Mapping[str, Any]) -> bool:
        if not self.target.matches(device_id, labels, facts):
            return False
        cut = self.cutoff if self.ramp is None else self.current_cutoff()
        if cut >= 0 and rank(self.salt, device_id) <= cut:
            return True
        return any(g.matches(device_id, labels, facts) for g in self.groups)
