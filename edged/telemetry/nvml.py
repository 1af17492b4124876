"""NVIDIA discrete GPU metrics through NVML (``pynvml``, from the nvidia-ml-py package), imported lazily.

NVML is only tried when the NVIDIA kernel driver is loaded (``/proc/driver/nvidia/version``):
a machine without an NVIDIA GPU pays nothing. When the driver is there but NVML cannot be
used, the reason is kept in :attr:`NvmlReader.note` (shown by ``edged status``) and logged
once, instead of silently reporting nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from edged.telemetry.readings import AcceleratorReading
from edged.telemetry.sysfs import SysRoot

log = logging.getLogger(__name__)
T = TypeVar("T")


class NvmlReader:
    def __init__(self, sr: SysRoot) -> None:
        self.sr = sr
        self.note: str | None = None
        self._lock = threading.Lock()
        self._nvml: Any = None
        self._handles: list[Any] = []
        self._tried = False

    def wanted(self) -> bool:
        return self.sr.exists("proc/driver/nvidia/version")

    def _init(self) -> None:
        self._tried = True
        if not self.wanted():
            return
        try:
            import pynvml
        except ImportError:
            self.note = "NVIDIA GPU metrics: pynvml is not installed (install the nvidia-ml-py package)"
            log.warning("%s", self.note)
            return
        try:
            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(int(pynvml.nvmlDeviceGetCount()))]
        except Exception as e:  # pynvml raises NVMLError subclasses for a missing libnvidia-ml, a driver mismatch...
            self.note = f"NVIDIA GPU metrics: NVML unavailable ({type(e).__name__}: {e})"
            log.warning("%s", self.note)
            return
        self._nvml = pynvml

    def read(self) -> list[AcceleratorReading]:
        with self._lock:
            if not self._tried:
                self._init()
            nv = self._nvml
            if nv is None:
                return []
            return [self._read_one(nv, i, h) for i, h in enumerate(self._handles)]

    @staticmethod
    def _read_one(nv: Any, index: int, h: Any) -> AcceleratorReading:
        def get(fn: Callable[[], T]) -> T | None:
            try:
                return fn()
            except Exception:  # NVMLError_NotSupported and friends: that one value is not measured
                return None

        util = get(lambda: nv.nvmlDeviceGetUtilizationRates(h))
        mem = get(lambda: nv.nvmlDeviceGetMemoryInfo(h))
        power_mw = get(lambda: nv.nvmlDeviceGetPowerUsage(h))
        temp = get(lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
        sm = get(lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
        sm_max = get(lambda: nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM))
        return AcceleratorReading(
            name=f"gpu{index}", kind="nvidia-gpu",
            utilization=float(util.gpu) / 100.0 if util is not None else None,
            freq_hz=float(sm) * 1e6 if sm is not None else None,
            max_freq_hz=float(sm_max) * 1e6 if sm_max is not None else None,
            memory_used_bytes=int(mem.used) if mem is not None else None,
            memory_total_bytes=int(mem.total) if mem is not None else None,
            power_w=float(power_mw) / 1000.0 if power_mw is not None else None,
            temperature_c=float(temp) if temp is not None else None,
        )

    def close(self) -> None:
        with self._lock:
            if self._nvml is not None:
                try:
                    self._nvml.nvmlShutdown()
                except Exception:
                    pass
                self._nvml = None
            self._handles = []
            self._tried = False
