"""The step vocabulary of a rollout, one parser for the CLI (``--steps``) and the dashboard's form.

``1%`` (a share of the target, stable hashing), ``label:ring=canary`` or ``label:site=a+hw=orin`` (an
explicit group), ``devices:cam-1+cam-2``; each may end with ``/min=N``, ``/soak=DURATION``, and the
step's own gate thresholds ``/failure=RATE`` (``0.05`` or ``5%``) and ``/reporting=N``. Also the
start time (``--start-at``, the form's field): ISO-8601 (UTC unless it says otherwise) or ``+2h``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from edged.errors import ConfigError
from edged.registry.rollout_wire import StepSpec
from edged.registry.targets import RolloutTarget

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw]?)$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def duration_s(text: str) -> float:
    """``90``, ``15m``, ``2h``, ``7d`` -> seconds."""
    m = _DURATION.fullmatch(text.strip())
    if not m:
        raise ConfigError(f"{text!r}: expected a number with s, m, h, d or w (e.g. 15m)")
    return float(m.group(1)) * _UNITS[m.group(2)]


def start_time(text: str, now: float | None = None) -> float | None:
    """``+2h`` / ``+90s`` (from now), ``2026-12-24T18:00`` (UTC unless an offset or ``Z`` says otherwise),
    ``now`` or empty (None: at once) -> Unix seconds."""
    raw = text.strip()
    if not raw or raw.lower() == "now":
        return None
    t0 = time.time() if now is None else now
    if raw.startswith("+"):
        return t0 + duration_s(raw[1:])
    try:
        when = datetime.fromisoformat(raw[:-1] + "+00:00" if raw.endswith(("Z", "z")) else raw)
    except ValueError:
        raise ConfigError(f"start at {raw!r}: expected +DURATION (e.g. +2h) or an ISO-8601 time "
                          "(e.g. 2026-12-24T18:00Z)") from None
    return (when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)).timestamp()


def _rate(value: str, raw: str) -> float:
    try:
        rate = float(value[:-1]) / 100 if value.endswith("%") else float(value)
    except ValueError:
        rate = -1.0
    if not 0 <= rate <= 1:
        raise ConfigError(f"step {raw!r}: /failure= takes a rate between 0 and 1 or a percentage (0.05 or 5%)")
    return rate


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{what} {item!r}: expected key=value")
        out[key] = value
    return out


def parse_steps(text: str, *, soak_s: float, min_devices: int, duration: Callable[[str], float]) -> list[StepSpec]:
    steps = []
    for raw in (s.strip() for s in text.split(",")):
        if not raw:
            continue
        head, *opts = raw.split("/")
        kw: dict[str, Any] = {"soak_s": soak_s, "min_devices": min_devices}
        for opt in opts:
            key, _, value = opt.partition("=")
            if key == "min" and value.isdigit():
                kw["min_devices"] = int(value)
            elif key == "soak":
                kw["soak_s"] = duration(value)
            elif key == "failure":
                kw["max_failure_rate"] = _rate(value, raw)
            elif key == "reporting" and value.isdigit() and int(value) >= 1:
                kw["min_reporting"] = int(value)
            else:
                raise ConfigError(f"step {raw!r}: options are /min=N, /soak=DURATION, /failure=RATE and "
                                  "/reporting=N")
        if head.endswith("%"):
            try:
                kw["percent"] = float(head[:-1])
            except ValueError:
                raise ConfigError(f"step {raw!r}: {head!r} is not a percentage") from None
        elif head.startswith("label:"):
            kw["group"] = RolloutTarget(labels=_pairs(head[6:].split("+"), f"step {raw!r}"))
        elif head.startswith("devices:"):
            kw["group"] = RolloutTarget(devices=[d for d in head[8:].split("+") if d])
        else:
            raise ConfigError(f"step {raw!r}: expected N%, label:key=value[+key=value] or devices:id[+id]")
        steps.append(StepSpec(**kw))
    if not steps:
        raise ConfigError("--steps: at least one step")
    return steps
