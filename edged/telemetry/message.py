"""Turn two consecutive readings into one window: the telemetry message and the status snapshot.

Counters are read cumulatively (CPU seconds, request counts, histogram buckets) and
differenced here, so every window is exact no matter how often anyone else reads.
"""

from __future__ import annotations

from edged.protocol.fleet.telemetry import Accelerator, Hist, HistCounts, ModelWindow, Rail, SystemWindow
from edged.telemetry.model_metrics import ModelCounters, ModelSnapshot
from edged.telemetry.readings import DeviceReading

_IDLE_MODES = ("idle", "iowait")


def hist(h: HistCounts) -> Hist:
    counts = list(h.counts)
    while counts and counts[-1] == 0:
        counts.pop()
    return Hist(counts=counts, sum_s=round(h.total, 9))


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def cpu_utilization(cur: DeviceReading, prev: DeviceReading | None) -> float | None:
    if prev is None:
        return None
    total = sum(cur.cpu_seconds.values()) - sum(prev.cpu_seconds.values())
    idle = sum(cur.cpu_seconds.get(m, 0.0) - prev.cpu_seconds.get(m, 0.0) for m in _IDLE_MODES)
    if total <= 0:
        return None
    return min(max(1.0 - idle / total, 0.0), 1.0)


def system_window(cur: DeviceReading, prev: DeviceReading | None) -> SystemWindow:
    dt = cur.monotonic - prev.monotonic if prev is not None else 0.0
    proc = (cur.process_cpu_seconds - prev.process_cpu_seconds) / dt if prev is not None and dt > 0 else None
    emc = cur.emc
    return SystemWindow(
        cpu_count=cur.cpu_count, cpu_utilization=_r(cpu_utilization(cur, prev)), load1=_r(cur.load_average[0], 2),
        memory_total=cur.memory_total, memory_used=cur.memory_used, swap_total=cur.swap_total, swap_used=cur.swap_used,
        disk_total=cur.disk_total, disk_free=cur.disk_free, process_rss=cur.process_rss,
        process_threads=cur.process_threads, process_cpu_cores=_r(proc),
        temperatures_c={k: round(v, 1) for k, v in cur.temperatures_c.items()},
        accelerators=[Accelerator(name=a.name, kind=a.kind, utilization=_r(a.utilization), freq_hz=a.freq_hz,
                                  max_freq_hz=a.max_freq_hz, memory_used_bytes=a.memory_used_bytes,
                                  memory_total_bytes=a.memory_total_bytes, power_w=_r(a.power_w, 3),
                                  temperature_c=a.temperature_c) for a in cur.accelerators],
        rails=[Rail(name=r.name, voltage_v=_r(r.voltage_v), current_a=_r(r.current_a), power_w=_r(r.power_w))
               for r in cur.rails],
        emc_freq_hz=emc.freq_hz if emc else None, emc_utilization=_r(emc.utilization) if emc else None,
    )


def model_window(snap: ModelSnapshot, prev: ModelCounters | None) -> ModelWindow:
    """``prev``: the same activation's counters at the previous reading; None when it began since (or never)."""
    w = snap.counters.minus(prev) if prev is not None else snap.counters
    return ModelWindow(
        model=snap.model, version=snap.version, backend=snap.backend, activation=snap.activation or None,
        activated_at=round(snap.activated_at, 3) if snap.activation else None, success=w.success,
        failures=dict(sorted(w.failures_by_code.items())), inferences=w.inferences, executions=w.executions,
        batch_sizes=dict(sorted(w.batches.items())), in_flight=snap.in_flight,
        internal=dict(sorted(w.internal.items())),
        latency=hist(w.latency), queue=hist(w.queue), compute=hist(w.compute),
        p50_s=_r(w.latency.quantile(0.5), 6), p99_s=_r(w.latency.quantile(0.99), 6),
    )


def model_windows(snaps: list[ModelSnapshot], prev: dict[tuple[str, int, str], ModelCounters]) -> list[ModelWindow]:
    return [model_window(s, prev.get(s.key)) for s in snaps]
