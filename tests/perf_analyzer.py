"""Triton's C++ load generator, ``perf_analyzer``, for tests that need a real C++ Triton client.

It ships as a binary inside the ``tritonclient`` 2.41.0 manylinux1 wheel (its ``bin/``). On Debian 12 it
needs ``libb64-0d`` (install.sh installs it) and ``libcudart.so.12``, which the
``nvidia-cuda-runtime-cu12`` wheel provides (no GPU is needed for HTTP or gRPC over CPU
memory). :func:`get` returns a ready-to-run command, or raises :class:`UnavailableError` with the
reason a test skips with.
"""

from __future__ import annotations

import ctypes.util
import os
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.wheel_cache import UnavailableError, fetch_wheel

__all__ = ["PerfAnalyzer", "UnavailableError", "get"]

TRITONCLIENT = "tritonclient==2.41.0"
# "-s" value for tests: any three windows count as stable. perf_analyzer otherwise exits 2 when a busy
# machine keeps the latency from settling, and tests check behaviour, not speed.
ANY_STABILITY = "100000"
CUDART = "nvidia-cuda-runtime-cu12==12.9.79"  # pinned: a test fetches the same bytes every time


@dataclass(frozen=True)
class PerfAnalyzer:
    binary: Path
    env: dict[str, str]

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run it with ``args``; the caller checks the return code and output."""
        return subprocess.run([str(self.binary), *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout, check=False)


def get() -> PerfAnalyzer:
    if os.uname().machine != "x86_64":
        raise UnavailableError(f"perf_analyzer ships for x86_64 only (this is {os.uname().machine})")
    if ctypes.util.find_library("b64") is None and not Path("/usr/lib/x86_64-linux-gnu/libb64.so.0d").exists():
        raise UnavailableError("perf_analyzer needs libb64 (Debian: apt-get install libb64-0d)")
    triton = fetch_wheel(TRITONCLIENT, platform="manylinux1_x86_64")
    cudart = fetch_wheel(CUDART, platform="manylinux2014_x86_64")
    found = sorted(triton.glob("*.data/data/bin/perf_analyzer")) + sorted(triton.glob("tritonclient/bin/perf_analyzer"))
    if not found:
        raise UnavailableError(f"{TRITONCLIENT} has no bin/perf_analyzer")
    binary = found[0]
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    libdirs = [str(p.parent) for p in cudart.glob("nvidia/cuda_runtime/lib/libcudart.so.12*")]
    if not libdirs:
        raise UnavailableError(f"{CUDART} has no libcudart.so.12")
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join([libdirs[0], *filter(None, [env.get("LD_LIBRARY_PATH")])])
    pa = PerfAnalyzer(binary, env)
    probe = pa.run("--help", timeout=30)
    if "Usage" not in probe.stdout + probe.stderr and probe.returncode != 0:
        raise UnavailableError(f"perf_analyzer does not start here: {(probe.stderr or probe.stdout).strip()[-300:]}")
    return pa
