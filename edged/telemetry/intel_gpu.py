"""Intel GPU clocks and busy ratio from the i915 / xe drivers' sysfs files.

Three layouts exist; the first that has a current frequency wins:

* i915, one GT: ``/sys/class/drm/cardN/gt_{act,cur,min,max}_freq_mhz``, idle in
  ``cardN/power/rc6_residency_ms``;
* i915, per GT: ``cardN/gt/gt0/rps_{act,cur,min,max}_freq_mhz`` and ``gt/gt0/rc6_residency_ms``;
* xe: ``cardN/device/tile0/gt0/freq0/{act,cur,min,max}_freq`` and
  ``.../gt0/gtidle/idle_residency_ms``.

The busy ratio is 1 minus the share of wall time the GT spent in RC6 (its idle power
state) since the previous read: a coarse but driver-independent measure that needs no
perf counters or privileges.
"""

from __future__ import annotations

import re
import threading
import time

from edged.telemetry.readings import AcceleratorReading
from edged.telemetry.sysfs import SysRoot

INTEL_VENDOR = 0x8086
_CARD = re.compile(r"^card\d+$")
# (prefix, suffix, idle file) per layout, relative to /sys/class/drm/cardN
_LAYOUTS = (
    ("gt/gt0/rps_", "_freq_mhz", "gt/gt0/rc6_residency_ms"),
    ("gt_", "_freq_mhz", "power/rc6_residency_ms"),
    ("device/tile0/gt0/freq0/", "_freq", "device/tile0/gt0/gtidle/idle_residency_ms"),
)
MIN_WINDOW_S = 0.2  # shorter windows give noisy ratios: keep the previous one


class IntelGpuReader:
    def __init__(self, sr: SysRoot) -> None:
        self.sr = sr
        self._lock = threading.Lock()
        self._last_idle: dict[str, tuple[float, float]] = {}  # card -> (monotonic, idle seconds)
        self._last_util: dict[str, float] = {}

    def cards(self) -> list[str]:
        return [c for c in self.sr.listdir("sys/class/drm")
                if _CARD.fullmatch(c) and self.sr.read_int(f"sys/class/drm/{c}/device/vendor") == INTEL_VENDOR]

    def read(self) -> list[AcceleratorReading]:
        out = []
        for card in self.cards():
            for layout in _LAYOUTS:
                reading = self._read_layout(card, *layout)
                if reading is not None:
                    out.append(reading)
                    break
        return out

    def _read_layout(self, card: str, prefix: str, suffix: str, idle_file: str) -> AcceleratorReading | None:
        base = f"sys/class/drm/{card}"

        def mhz(which: str) -> float | None:
            v = self.sr.read_int(f"{base}/{prefix}{which}{suffix}")
            return v * 1e6 if v is not None else None

        cur = mhz("act")
        cur = cur if cur else mhz("cur")  # act reads 0 while the GT sleeps; cur is what it runs at
        if cur is None:
            return None
        idle_ms = self.sr.read_int(f"{base}/{idle_file}")
        idle_s = idle_ms / 1000.0 if idle_ms is not None else None
        return AcceleratorReading(name=card, kind="intel-gpu", freq_hz=cur, min_freq_hz=mhz("min"),
                                  max_freq_hz=mhz("max"), idle_s=idle_s, utilization=self._busy(card, idle_s))

    def _busy(self, card: str, idle_s: float | None) -> float | None:
        if idle_s is None:
            return None
        now = time.monotonic()
        with self._lock:
            prev = self._last_idle.get(card)
            if prev is None or now - prev[0] >= MIN_WINDOW_S or idle_s < prev[1]:
                self._last_idle[card] = (now, idle_s)
            if prev is None or idle_s < prev[1]:
                return None
            if now - prev[0] >= MIN_WINDOW_S:
                util = 1.0 - (idle_s - prev[1]) / (now - prev[0])
                self._last_util[card] = min(max(util, 0.0), 1.0)
            return self._last_util.get(card)
