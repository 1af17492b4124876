"""Speed of a loaded engine at batch 1 and at the model's max batch: median of a bounded number of runs."""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edged.backends.base import Engine
from edged.optimize.data import SampleSet
from edged.optimize.modelio import ModelIO
from edged.optimize.progress import Progress

WARMUP_RUNS = 2
MIN_RUNS = 3
MAX_RUNS = 2000


@dataclass(frozen=True)
class Timing:
    batch_size: int
    latency_ms: float  # median
    p90_ms: float
    throughput_per_s: float  # samples per second at the median latency
    runs: int


def host_label(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """``x86_64, AMD EPYC``: where figures were taken (they do not transfer to other hardware)."""
    model = ""
    try:
        for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                model = value.strip()
                break
    except OSError:
        pass
    model = model or platform.processor()
    return f"{platform.machine()}, {model}" if model else platform.machine()


BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``); empty when unreadable."""
    try:
        for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def bf16_unavailable_reason(flags: frozenset[str]) -> str | None:
    """Why BF16 compute is not worth a variant here, or None when the CPU has BF16 instructions."""
    if any(f in flags for f in BF16_FLAGS) or "bf16" in flags:  # x86 AVX512-BF16/AMX; Arm's "bf16"
        return None
    return ("this CPU has no BF16 instructions (no avx512_bf16, amx_bf16 or Arm bf16 flag): "
            "BF16 would be emulated, slower than FP32")


def batch_sizes(model_io: ModelIO) -> list[int]:
    return [1] if model_io.max_batch_size <= 1 else [1, model_io.max_batch_size]


def _feed(samples: SampleSet, model_io: ModelIO, batch: int) -> dict[str, np.ndarray]:
    if not model_io.batched:
        return {k: v[0] for k, v in samples.arrays.items()}
    idx = np.arange(batch) % len(samples)
    return {k: np.ascontiguousarray(v[idx]) for k, v in samples.arrays.items()}


def time_engine(engine: Engine, samples: SampleSet, model_io: ModelIO, *, budget_s: float,
                progress: Progress) -> list[Timing]:
    """Time each batch size for about ``budget_s`` (at least ``MIN_RUNS``, at most ``MAX_RUNS`` runs).

    Real samples are fed (tiled up to the batch size): some engines' speed depends
    on the data (sparsity, denormals), so random inputs could mislead.
    """
    results = []
    sizes = batch_sizes(model_io)
    progress.total = budget_s * len(sizes)
    for i, batch in enumerate(sizes):
        feed = _feed(samples, model_io, batch)
        for _ in range(WARMUP_RUNS):
            engine.infer(feed)
        times: list[float] = []
        spent = 0.0
        while len(times) < MIN_RUNS or (spent < budget_s and len(times) < MAX_RUNS):
            t0 = time.perf_counter()
            engine.infer(feed)
            dt = time.perf_counter() - t0
            times.append(dt)
            spent += dt
            progress.set(round(i * budget_s + min(spent, budget_s), 2))
        progress.set((i + 1) * budget_s)
        median = float(np.median(times))
        results.append(Timing(batch, median * 1e3, float(np.percentile(times, 90)) * 1e3,
                              batch / median if median > 0 else 0.0, len(times)))
    return results
