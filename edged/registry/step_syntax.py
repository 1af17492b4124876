"""The step vocabulary of a rollout, one parser for the CLI (``--steps``) and the dashboard's form.

``1%`` (a share of the target, stable hashing), ``label:ring=canary`` or ``label:site=a+hw=orin`` (an
explicit group), ``devices:cam-1+cam-2``; each may end with ``/min=N`` and ``/soak=DURATION``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
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
            else:
                raise ConfigError(f"step {raw!r}: options are /min=N and /soak=DURATION")
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
