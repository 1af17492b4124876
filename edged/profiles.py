"""Device profiles: which engines to try, in what order, on which hardware.

A profile is one TOML file. Profiles are tried in ``priority`` order (lower
first, ties by name) and the first whose ``[match]`` holds for the probed facts
wins; the bundled ``generic`` profile has no rules and the highest priority
number, so something always matches. Users add or replace profiles from extra
directories: a profile whose ``name`` matches one loaded earlier replaces it.

Match rules test the flat facts (keys listed in :mod:`edged.hardware.facts`)::

    [match]
    all  = [ { fact = "jetson.present", equals = true } ]        # every rule holds
    any  = [ { fact = "jetson.soc", equals = "tegra234" },         # at least one holds (if given)
             { fact = "jetson.module", in = ["orin-nano", "agx-orin"] } ]
    none = [ { fact = "intel_gpu.present", equals = true } ]      # no rule holds

Each rule names one ``fact`` and exactly one operator:

``equals``    the fact equals the value (string, number or boolean).
``in``        the fact is one of the listed values (list facts: any element is).
``contains``  case-insensitive substring of the fact (list facts: of any element).
``has``       a list fact holds the value, or all of a list of values.
``exists``    ``true``: the fact is known and not empty; ``false``: the opposite.
``gte``/``lte`` numeric comparison; strings compare as versions (``"36.3.0" >= "36"``).
``matches``   a regular expression found in the fact (list facts: in any element).

A fact that is unknown (``None``) fails every operator except ``exists = false``.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    ValidationError,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

import edged
from edged.backends.options import BackendOptions
from edged.backends.specs import SPECS
from edged.errors import ConfigError, format_validation_error
from edged.hardware.facts import FactValue, HardwareFacts, fact_keys, facts_as_dict
from edged.hardware.jetpack import ReleaseRow, row_for

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "BackendPreference",
    "CacheSpec",
    "DeviceProfile",
    "MatchRule",
    "MatchSpec",
    "ProfileMatch",
    "bundled_profiles_dir",
    "cpu_tail",
    "host_cpu_engines",
    "load_profiles",
    "match_profile",
    "resolve_profile",
]

# With no explicit budget a profile may use this share of RAM for models, leaving room for the OS,
# the daemon itself and (on Jetson, where the GPU shares DRAM) CUDA's own allocations.
DEFAULT_MEMORY_FRACTION = 0.6
# Where the engine worker finds the system Python that JetPack's TensorRT bindings were built for.
SYSTEM_PYTHON = "/usr/bin/python3"
# Budget when the probe could not read the memory size at all: small enough for any edge board.
UNKNOWN_MEMORY_BUDGET_MB = 1024.0

_OPERATORS = ("equals", "in_", "contains", "has", "exists", "gte", "lte", "matches")
_NAME_RE = r"^[a-z0-9][a-z0-9._-]{0,63}$"

Scalar = bool | int | float | str


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _version_key(value: object) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", str(value)))


def _compare(fact: FactValue, bound: float | str) -> int | None:
    """-1/0/1 comparing *fact* with *bound*; ``None`` when they cannot be compared."""
    if fact is None or isinstance(fact, bool | list):
        return None
    if isinstance(fact, int | float) and isinstance(bound, int | float):
        return (fact > bound) - (fact < bound)
    left, right = _version_key(fact), _version_key(bound)
    if not left or not right:
        return None
    # Compare only as many components as the bound gives: "36.3.0" equals "36" at that precision.
    left = left[: len(right)]
    return (left > right) - (left < right)


class MatchRule(_Strict):
    """One test of one fact; exactly one operator field is set."""

    fact: str
    equals: Scalar | None = None
    in_: list[Scalar] | None = Field(default=None, alias="in")
    contains: str | None = None
    has: str | list[str] | None = None
    exists: bool | None = None
    gte: float | str | None = None
    lte: float | str | None = None
    matches: str | None = None

    # Checked before pydantic tries each union member, so a bad value gives one clear error, not four.
    @field_validator("equals", mode="before")
    @classmethod
    def _scalar(cls, v: object) -> object:
        if v is not None and not isinstance(v, bool | int | float | str):
            raise ValueError("must be a string, number or boolean")
        return v

    @field_validator("in_", mode="before")
    @classmethod
    def _scalars(cls, v: object) -> object:
        if v is not None and not (isinstance(v, list) and all(isinstance(x, bool | int | float | str) for x in v)):
            raise ValueError("must be a list of strings, numbers or booleans")
        return v

    @field_validator("has", mode="before")
    @classmethod
    def _strings(cls, v: object) -> object:
        if v is not None and not (isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))):
            raise ValueError("must be a string or a list of strings")
        return v

    @field_validator("gte", "lte", mode="before")
    @classmethod
    def _bound(cls, v: object) -> object:
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float | str)):
            raise ValueError("must be a number or a version string")
        return v

    @field_validator("fact")
    @classmethod
    def _known_fact(cls, v: str) -> str:
        if v not in fact_keys():
            raise ValueError(f"unknown fact {v!r} (see `edged detect --json` for the keys)")
        return v

    @field_validator("matches")
    @classmethod
    def _regex(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as exc:
                raise ValueError(f"bad regular expression: {exc}") from None
        return v

    @model_validator(mode="after")
    def _one_operator(self) -> MatchRule:
        given = [op for op in _OPERATORS if getattr(self, op) is not None]
        if len(given) != 1:
            names = ", ".join(op.rstrip("_") for op in _OPERATORS)
            raise ValueError(f"a rule needs exactly one operator ({names}); got {len(given)}")
        return self

    @property
    def operator(self) -> str:
        return next(op for op in _OPERATORS if getattr(self, op) is not None).rstrip("_")

    @property
    def operand(self) -> Any:
        return getattr(self, "in_" if self.operator == "in" else self.operator)

    def holds(self, value: FactValue) -> bool:
        """Whether the rule holds for the fact's *value* (``None`` = unknown)."""
        if self.exists is not None:
            return (value is not None and value != []) is self.exists
        if value is None:
            return False
        items: list[Scalar] = list(value) if isinstance(value, list) else [value]
        if self.equals is not None:
            return not isinstance(value, list) and _same(value, self.equals)
        if self.in_ is not None:
            return any(_same(item, choice) for item in items for choice in self.in_)
        if self.contains is not None:
            needle = self.contains.lower()
            return any(needle in str(item).lower() for item in items)
        if self.has is not None:
            needed = [self.has] if isinstance(self.has, str) else self.has
            return isinstance(value, list) and all(n in value for n in needed)
        if self.matches is not None:
            pattern = self.matches
            return any(re.search(pattern, str(item)) for item in items)
        return _within(value, self.gte, self.lte)

    def describe(self, value: FactValue = None, *, with_value: bool = False) -> str:
        """``jetson.soc equals "tegra234" (is "tegra234")``, in the TOML/JSON spelling users write."""
        text = f"{self.fact} {self.operator} {json.dumps(self.operand)}"
        return f"{text} (is {json.dumps(value)})" if with_value else text


def _within(value: FactValue, gte: float | str | None, lte: float | str | None) -> bool:
    """A ``gte`` (else ``lte``) rule: False when the value cannot be compared with the bound."""
    bound = gte if gte is not None else lte
    cmp = None if bound is None else _compare(value, bound)
    if cmp is None:
        return False
    return cmp >= 0 if gte is not None else cmp <= 0

def _same(a: Scalar, b: Scalar) -> bool:
    # true == 1 in Python; a rule about a flag should not match a count.
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    return a == b


class MatchSpec(_Strict):
    """``all`` must all hold, at least one of ``any`` (when given), none of ``none``; empty = catch-all."""

    all: list[MatchRule] = []
    any: list[MatchRule] = []
    none: list[MatchRule] = []

    def evaluate(self, flat: dict[str, FactValue]) -> tuple[bool, list[str], str]:
        """(matched, reasons it matched, the first reason it did not)."""
        reasons: list[str] = []
        for rule in self.all:
            value = flat.get(rule.fact)
            if not rule.holds(value):
                return False, reasons, rule.describe(value, with_value=True)
            reasons.append(rule.describe(value, with_value=True))
        if self.any:
            hit = next((r for r in self.any if r.holds(flat.get(r.fact))), None)
            if hit is None:
                tried = "; ".join(r.describe(flat.get(r.fact), with_value=True) for r in self.any)
                return False, reasons, f"none of `any` held: {tried}"
            reasons.append(hit.describe(flat.get(hit.fact), with_value=True))
        for rule in self.none:
            value = flat.get(rule.fact)
            if rule.holds(value):
                return False, reasons, f"not {rule.describe(value, with_value=True)}"
            reasons.append(f"not {rule.describe(value, with_value=True)}")
        if not reasons:
            reasons.append("catch-all: no match rules")
        return True, reasons, ""


Precision = Literal["fp32", "bf16", "fp16", "int8"]


class BackendPreference(_Strict):
    """One engine/device to try; ``precisions`` in order of preference; ``options`` typed per engine."""

    backend: str
    device: str = "CPU"
    precisions: list[Precision] = Field(min_length=1)
    options: BackendOptions = Field(default_factory=dict, validate_default=True)

    @field_validator("backend")
    @classmethod
    def _known(cls, v: str) -> str:
        """The names are the spec registry's (edged.backends.specs), in the words a Literal would use."""
        if v not in SPECS:
            expected = ", ".join(repr(n) for n in SPECS)
            expected = " or ".join(expected.rsplit(", ", 1))
            raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": expected})
        return v

    @field_validator("options", mode="before")
    @classmethod
    def _typed_options(cls, v: object, info: ValidationInfo) -> BackendOptions:
        """Each backend's options are its own model: a typo such as ``dla_cor`` is refused."""
        spec = SPECS.get(str(info.data.get("backend")))
        if spec is None:  # the backend's own error says why
            return BackendOptions()
        if isinstance(v, spec.options):
            return v
        try:
            return spec.options.model_validate(v.model_dump(exclude_unset=True) if isinstance(v, BackendOptions) else v)
        except ValidationError as e:
            raise ValueError("; ".join(format_validation_error(e))) from None

    @field_serializer("options")
    def _given_options(self, v: BackendOptions, info: SerializationInfo) -> dict[str, Any]:
        """The options the profile gave (``edged detect --json`` shows those, not every default)."""
        return v.model_dump(mode=info.mode, exclude_unset=True)

    @field_validator("precisions")
    @classmethod
    def _unique(cls, v: list[Precision]) -> list[Precision]:
        if len(set(v)) != len(v):
            raise ValueError("precisions must not repeat")
        return v

    @model_validator(mode="after")
    def _device_for_backend(self) -> BackendPreference:
        problem = SPECS[self.backend].device_problem(self.device)
        if problem is not None:
            raise ValueError(problem)
        return self


class CacheSpec(_Strict):
    """Where compiled engines (TensorRT plans, OpenVINO blobs) are kept, relative to the state dir."""

    dir: str = "cache"

    @field_validator("dir")
    @classmethod
    def _relative(cls, v: str) -> str:
        p = Path(v)
        if not v or p.is_absolute() or ".." in p.parts:
            raise ValueError("must be a relative path inside the state dir")
        return v


class DeviceProfile(_Strict):
    """A named engine plan for a class of hardware."""

    name: str = Field(pattern=_NAME_RE)
    description: str = ""
    priority: int
    select: Literal["first", "benchmark"] = "first"
    threads: int = Field(default=0, ge=0)
    memory_budget_mb: float = Field(default=0, ge=0)
    match: MatchSpec
    backends: list[BackendPreference] = Field(min_length=1)
    cache: CacheSpec = CacheSpec()
    source: Path | None = Field(default=None, exclude=True)

    def effective_memory_budget_mb(self, facts: HardwareFacts) -> float:
        """The configured budget, or ``DEFAULT_MEMORY_FRACTION`` of total RAM when it is 0."""
        if self.memory_budget_mb > 0:
            return self.memory_budget_mb
        total = facts.memory.total_mb
        if not total:
            return UNKNOWN_MEMORY_BUDGET_MB
        return round(total * DEFAULT_MEMORY_FRACTION, 1)


@dataclass(frozen=True)
class ProfileMatch:
    """The chosen profile with the rules that chose it, and why each earlier profile did not match."""

    profile: DeviceProfile
    reasons: list[str] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)
    # The JetPack matrix row applied (None off Jetson) and the engine lines it took out, with why.
    release: ReleaseRow | None = None
    unavailable: list[tuple[BackendPreference, str]] = field(default_factory=list)
    # CPU engine lines appended because the profile did not end in the host's CPU engines (cpu_tail).
    added: list[BackendPreference] = field(default_factory=list)


def host_cpu_engines(facts: HardwareFacts) -> list[BackendPreference]:
    """The CPU engines this host's architecture offers, in the order that usually wins here.

    On x86-64 OpenVINO's CPU plugin and ONNX Runtime trade places model by model (OpenVINO tends to
    lead on Intel cores, ONNX Runtime elsewhere); both are offered and the loader measures them
    (edged.core.chooser). Elsewhere ONNX Runtime is the CPU engine edged ships for.
    """
    ort = BackendPreference(backend="onnxruntime", device="CPU", precisions=["fp32", "int8"])
    if facts.cpu.arch in ("x86_64", "amd64"):
        ov = BackendPreference(backend="openvino", device="CPU", precisions=["fp32", "int8"])
        return [ov, ort] if facts.cpu.vendor == "GenuineIntel" else [ort, ov]
    return [ort]


def cpu_tail(profile: DeviceProfile, facts: HardwareFacts) -> tuple[DeviceProfile, list[BackendPreference]]:
    """The profile with the host's CPU engines it lacks appended (and which ones were added).

    A GPU profile on a host whose GPU engines are missing (no TensorRT, no onnxruntime-gpu) must
    still get the fastest CPU path, not whichever single CPU line its author thought of.
    """
    have = {(b.backend, b.device) for b in profile.backends}
    added = [b for b in host_cpu_engines(facts) if (b.backend, b.device) not in have]
    if not added:
        return profile, []
    return profile.model_copy(update={"backends": [*profile.backends, *added]}), added


def resolve_profile(profile: DeviceProfile, facts: HardwareFacts, reasons: list[str],
                    rejected: list[tuple[str, str]] | None = None) -> ProfileMatch:
    """Apply the JetPack matrix: drop engine lines that cannot load on this release, route worker ones.

    A profile is written per module, but what loads depends on the JetPack release; so an engine the
    release cannot load never comes first, and ``edged detect`` says why it is gone. Should every
    line be unavailable the profile is kept as written, so loading fails with each engine's own error.
    """
    profile, added = cpu_tail(profile, facts)
    row = row_for(facts)
    if row is None:
        return ProfileMatch(profile=profile, reasons=reasons, rejected=rejected or [], added=added)
    kept: list[BackendPreference] = []
    gone: list[tuple[BackendPreference, str]] = []
    for b in profile.backends:
        support = row.support(b.backend, b.device)
        if support.status == "unavailable":
            gone.append((b, support.how))
        elif support.status == "worker" and "engine_worker" not in b.options.model_fields_set:
            kept.append(b.model_copy(update={"options": b.options.model_copy(update={"engine_worker": SYSTEM_PYTHON})}))
        else:
            kept.append(b)
    if kept:
        profile = profile.model_copy(update={"backends": kept})
    return ProfileMatch(profile=profile, reasons=reasons, rejected=rejected or [], release=row, unavailable=gone,
                        added=added)


def bundled_profiles_dir() -> Path:
    """The profiles shipped with edged: the checkout's copy when running from source."""
    checkout = Path(edged.__file__).resolve().parent.parent / "device_profiles"
    if checkout.is_dir():
        return checkout
    return Path("/usr/share/edged/device_profiles")


def _load_file(path: Path) -> DeviceProfile:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read device profile: {exc}", file=str(path)) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}", file=str(path)) from exc
    if "source" in data:
        raise ConfigError(f"{path}: source: not a profile setting (it records the file itself)",
                          file=str(path), key="source")
    try:
        return DeviceProfile.model_validate({**data, "source": path})
    except ValidationError as exc:
        lines = format_validation_error(exc)
        problems = [f"{path}: {line.replace(': Value error, ', ': ', 1)}" for line in lines]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ConfigError(f"{problems[0]}{more}", problems=problems, file=str(path),
                          key=lines[0].split(": ", 1)[0]) from None


def load_profiles(extra_dirs: Sequence[Path] = ()) -> list[DeviceProfile]:
    """Bundled profiles, then each extra directory in turn (same name replaces), sorted for matching.

    A missing bundled directory is tolerated (extras may supply everything); a
    missing extra directory is a ``ConfigError`` because someone asked for it.
    """
    by_name: dict[str, DeviceProfile] = {}
    bundled = bundled_profiles_dir()
    for directory in [bundled, *extra_dirs]:
        if not directory.is_dir():
            if directory == bundled:
                continue
            raise ConfigError(f"{directory}: device profile directory does not exist", file=str(directory))
        here: dict[str, Path] = {}
        for path in sorted(directory.glob("*.toml")):
            profile = _load_file(path)
            if profile.name in here:
                raise ConfigError(f"{path}: name: profile {profile.name!r} is also defined in "
                                  f"{here[profile.name]}", file=str(path), key="name")
            here[profile.name] = path
            by_name[profile.name] = profile
    if not by_name:
        searched = ", ".join(str(d) for d in [bundled, *extra_dirs])
        raise ConfigError(f"no device profiles found (looked in {searched})")
    return sorted(by_name.values(), key=lambda p: (p.priority, p.name))


def match_profile(facts: HardwareFacts, profiles: Sequence[DeviceProfile]) -> ProfileMatch:
    """First profile, in the given order, whose rules hold for *facts*."""
    flat = facts_as_dict(facts)
    rejected: list[tuple[str, str]] = []
    for profile in profiles:
        matched, reasons, failure = profile.match.evaluate(flat)
        if matched:
            return resolve_profile(profile, facts, reasons, rejected)
        rejected.append((profile.name, failure))
    raise ConfigError("no device profile matches this machine; keep a catch-all profile (like the bundled "
                      "'generic') with an empty [match]", problems=[f"{n}: {why}" for n, why in rejected])
