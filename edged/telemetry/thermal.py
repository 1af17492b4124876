"""Temperatures: psutil's hwmon sensors on the live system, plus the kernel's thermal zones.

psutil reads thermal zones only when no hwmon sensor exists; on a Jetson the zones
(``CPU-therm``, ``gpu-thermal``...) are the temperatures that matter while hwmon holds
only the power monitor, so the zones are always read here as well.
"""

from __future__ import annotations

import re
from typing import Any

from edged.telemetry.sysfs import SysRoot

_ZONE = re.compile(r"^thermal_zone\d+$")
MIN_C, MAX_C = -60.0, 150.0  # outside: an unconnected sensor or a driver's placeholder


def _plausible(c: float) -> bool:
    return MIN_C < c < MAX_C


def read_thermal_zones(sr: SysRoot) -> dict[str, float]:
    out: dict[str, float] = {}
    for zone in sr.listdir("sys/class/thermal"):
        if not _ZONE.fullmatch(zone):
            continue
        kind = sr.read(f"sys/class/thermal/{zone}/type")
        milli = sr.read_int(f"sys/class/thermal/{zone}/temp")
        # Jetson's PMIC-Die zone reports a fixed 100 C: a placeholder, not a measurement.
        if not kind or milli is None or kind.startswith("PMIC"):
            continue
        c = milli / 1000.0
        if not _plausible(c):
            continue
        name = kind if kind not in out else f"{kind}#{zone[len('thermal_zone'):]}"
        out[name] = c
    return out


def read_psutil_temperatures(psutil_mod: Any) -> dict[str, float]:
    fn = getattr(psutil_mod, "sensors_temperatures", None)
    if fn is None:
        return {}
    try:
        sensors: dict[str, list[Any]] = fn()
    except (OSError, RuntimeError, ValueError):
        return {}
    out: dict[str, float] = {}
    for chip, entries in sorted(sensors.items()):
        for i, e in enumerate(entries):
            if e.current is None or not _plausible(float(e.current)):
                continue
            name = chip if len(entries) == 1 and not e.label else f"{chip}/{e.label or i}"
            out.setdefault(name, float(e.current))
    return out


def read_temperatures(sr: SysRoot, psutil_mod: Any | None) -> dict[str, float]:
    """hwmon sensors (live system only) and thermal zones; a zone named like a sensor is kept once."""
    temps = read_psutil_temperatures(psutil_mod) if psutil_mod is not None else {}
    for name, c in read_thermal_zones(sr).items():
        temps.setdefault(name, c)
    return temps
