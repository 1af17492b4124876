"""How many CPUs this process may really use: its affinity mask, capped by a cgroup CPU quota.

A container started with ``--cpus=2`` on a 16-core host sees 16 CPUs in its affinity mask and in
``os.cpu_count()``; engines that size their pools from those start 16 threads that share two CPUs'
worth of time, and every run waits for its slowest thread to be scheduled. The quota (cgroup v2
``cpu.max``, v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``) is the real budget, rounded up.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

# An idle engine pool's spin before it sleeps. ONNX Runtime's own spins ~24 ms after every run (a 2-vCPU VM,
# 2026-12-08): a 30 fps camera stream kept 0.75 of a core busy for 0.6 ms runs. 2 ms keeps back-to-back
# and batched runs as fast (their gaps are shorter) and gives that core back (0.15 busy); docs/benchmarks.md.
DEFAULT_SPIN_US = 2000


def usable_cpus(root: Path = Path("/")) -> int:
    """The affinity mask's size, capped by the process's cgroup CPU quota (under ``root``, for tests)."""
    cpus = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota(root)
    return max(1, min(cpus, quota)) if quota is not None else max(1, cpus)


def constrained_cpus(root: Path = Path("/")) -> int:
    """``usable_cpus`` when it is below the machine's CPU count (a mask or a quota applies), else 0."""
    usable = usable_cpus(root)
    return usable if usable < (os.cpu_count() or usable) else 0


def threads_per_process(threads: int, processes: int) -> int:
    """Each engine worker process's share of an engine's ``threads`` ([limits] engine_processes)."""
    return max(1, threads // processes)


def cgroup_cpu_quota(root: Path = Path("/")) -> int | None:
    """CPUs' worth of time the process's cgroup may use (rounded up), or None when unlimited or unknown."""
    for directory in _cgroup_dirs(root):
        quota = _v2_quota(directory / "cpu.max")
        if quota is None:
            quota = _v1_quota(directory / "cpu.cfs_quota_us", directory / "cpu.cfs_period_us")
        if quota is not None:
            return quota
    return None


def _cgroup_dirs(root: Path) -> list[Path]:
    """The process's own cgroup directory (v2, then v1's cpu controller), then the mount's root."""
    out: list[Path] = []
    base = root / "sys/fs/cgroup"
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = [*line.split(":", 2), "", ""][:3]
        rel = path.lstrip("/")
        if controllers == "":
            out.append(base / rel)
        elif "cpu" in controllers.split(","):
            out.extend([base / controllers / rel, base / "cpu" / rel, base / "cpu,cpuacct" / rel])
    out.append(base)
    return out


def _v2_quota(path: Path) -> int | None:
    try:
        quota, period = path.read_text().split()[:2]
        return None if quota == "max" else _ceil_ratio(int(quota), int(period))
    except (OSError, ValueError):
        return None


def _v1_quota(quota_file: Path, period_file: Path) -> int | None:
    try:
        quota, period = int(quota_file.read_text()), int(period_file.read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 else _ceil_ratio(quota, period)


def _ceil_ratio(quota: int, period: int) -> int | None:
    return max(1, math.ceil(quota / period)) if quota > 0 and period > 0 else None
