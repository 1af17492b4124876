"""Which devices a rollout is for, and which of them each step includes.

A target matches on the labels operators gave a device (a device never labels itself),
on the facts it reports (its device profile and hardware facts, dotted keys such as
``jetson.module``), on profile names, and on explicit device ids; values may be shell
globs (``Orin Nano*``). Step membership comes from a stable hash of the rollout's salt and
the device id: a device's rank in [0, 1) never changes, a percent step admits every
device ranked at or below its cutoff, and cutoffs only grow, so a device never flips out
of a rollout it joined, and a device that enrolls later is placed the same way.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
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
    """The rank under which ``percent`` of these devices fall, but at least ``min_devices`` of them.

    100 % is 1.0: every device, also those that enroll later.
    """
    if percent >= 100:
        return 1.0
    n = len(ranks)
    if n == 0:
        return percent / 100.0
    want = min(n, max(math.ceil(round(percent * n / 100.0, 9)), min_devices))
    if want <= 0:
        return -1.0
    return sorted(ranks)[want - 1]


class Membership:
    """Who is in a rollout up to its current step: the target, then a rank cutoff or a group."""

    __slots__ = ("cutoff", "groups", "salt", "target")

    def __init__(self, target: RolloutTarget, salt: str, cutoff: float, groups: tuple[RolloutTarget, ...]) -> None:
        self.target, self.salt, self.cutoff, self.groups = target, salt, cutoff, groups

    @classmethod
    def of(cls, target: RolloutTarget, salt: str, steps: list[dict[str, Any]], cutoffs: list[Any],
           step: int) -> Membership:
        """``steps`` and ``cutoffs`` as stored; steps up to and including ``step`` count."""
        cut = -1.0
        groups: list[RolloutTarget] = []
        for i in range(min(step + 1, len(steps))):
            spec = steps[i]
            if spec.get("group") is not None:
                groups.append(RolloutTarget.model_validate(spec["group"]))
            elif i < len(cutoffs) and cutoffs[i] is not None:
                cut = max(cut, float(cutoffs[i]))
        return cls(target, salt, cut, tuple(groups))

    def targeted(self, device_id: str, labels: Mapping[str, Any], facts: Mapping[str, Any]) -> bool:
        return self.target.matches(device_id, labels, facts)

    def member(self, device_id: str, labels: Mapping[str, Any], facts: Mapping[str, Any]) -> bool:
        if not self.target.matches(device_id, labels, facts):
            return False
        if self.cutoff >= 0 and rank(self.salt, device_id) <= self.cutoff:
            return True
        return any(g.matches(device_id, labels, facts) for g in self.groups)
