"""Sample the device: psutil for CPU, memory, swap, disk, the daemon process; sysfs and NVML for accelerators.

Every read here blocks (files, syscalls, NVML), so callers run :meth:`DeviceSampler.read`
in a thread, never on the event loop. Reads are cached for ``max_age_s`` so a burst of
``/metrics`` scrapes costs one sample. Counters stay cumulative (CPU seconds since boot,
RC6 idle seconds): rates are for the consumer to take, over whatever window it wants.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import psutil

from edged.telemetry import jetson
from edged.telemetry.intel_gpu import IntelGpuReader
from edged.telemetry.nvml import NvmlReader
from edged.telemetry.readings import DeviceReading
from edged.telemetry.sysfs import SysRoot
from edged.telemetry.thermal import read_temperatures


def _existing(path: Path) -> Path:
    """The path itself or its nearest existing parent (the state dir may not exist yet)."""
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


class DeviceSampler:
    def __init__(self, state_dir: Path | None = None, *, root: Path | str = "/", nvml: bool = True,
                 max_age_s: float = 1.0) -> None:
        self.state_dir = state_dir
        self.sr = SysRoot(root)
        self.live = Path(root).resolve() == Path("/")
        self.max_age_s = max_age_s
        self._intel = IntelGpuReader(self.sr)
        self._nvml = NvmlReader(self.sr) if nvml else None
        self._lock = threading.Lock()
        self._cached: DeviceReading | None = None
        self._process: psutil.Process | None = None

    def read(self, max_age_s: float | None = None) -> DeviceReading:
        """A reading at most ``max_age_s`` old (default: the sampler's); 0 forces a fresh one."""
        limit = self.max_age_s if max_age_s is None else max_age_s
        with self._lock:
            c = self._cached
            if c is not None and time.monotonic() - c.monotonic < limit:
                return c
            self._cached = self._sample()
            return self._cached

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.close()

    def _sample(self) -> DeviceReading:
        if self._process is None:
            self._process = psutil.Process(os.getpid())
        proc = self._process
        with proc.oneshot():
            rss = proc.memory_info().rss
            threads = proc.num_threads()
            pcpu = proc.cpu_times()
            started = proc.create_time()
        vm = psutil.virtual_memory()
        sw = psutil.swap_memory()
        disk_total = disk_free = None
        if self.state_dir is not None:
            try:
                du = psutil.disk_usage(str(_existing(self.state_dir)))
                disk_total, disk_free = int(du.total), int(du.free)
            except OSError:
                pass
        try:
            load = psutil.getloadavg()
        except OSError:
            load = (0.0, 0.0, 0.0)
        accelerators = jetson.read_gpus(self.sr) + self._intel.read()
        notes = []
        if self._nvml is not None:
            accelerators += self._nvml.read()
            if self._nvml.note:
                notes.append(self._nvml.note)
        return DeviceReading(
            wall_time=time.time(),
            monotonic=time.monotonic(),
            cpu_count=psutil.cpu_count() or 1,
            cpu_seconds={k: float(v) for k, v in psutil.cpu_times()._asdict().items()},
            load_average=(float(load[0]), float(load[1]), float(load[2])),
            memory_total=int(vm.total), memory_available=int(vm.available), memory_used=int(vm.total - vm.available),
            swap_total=int(sw.total), swap_used=int(sw.used),
            disk_total=disk_total, disk_free=disk_free,
            process_rss=int(rss), process_threads=int(threads),
            process_cpu_seconds=float(pcpu.user + pcpu.system), process_start_time=float(started),
            temperatures_c=read_temperatures(self.sr, psutil if self.live else None),
            accelerators=accelerators,
            rails=jetson.read_rails(self.sr),
            emc=jetson.read_emc(self.sr),
            notes=notes,
        )
