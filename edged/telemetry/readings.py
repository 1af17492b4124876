"""Plain data for one device sample: what the readers return and the exporters consume.

Every field that a device may not have is optional: None means "not measured here",
never zero, so dashboards do not draw a flat line for a sensor that does not exist.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AcceleratorReading:
    """One GPU-like device: a Jetson's integrated GPU, an NVIDIA discrete GPU, an Intel GPU."""

    name: str  # stable id, e.g. "gpu0", "17000000.ga10b", "card0"
    kind: str  # "jetson-gpu" | "nvidia-gpu" | "intel-gpu"
    utilization: float | None = None  # 0..1
    freq_hz: float | None = None
    min_freq_hz: float | None = None
    max_freq_hz: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    power_w: float | None = None
    temperature_c: float | None = None
    idle_s: float | None = None  # cumulative idle (RC6) seconds, where the driver counts it


@dataclass
class RailReading:
    """One power-monitor channel (INA3221 on Jetson modules)."""

    name: str
    voltage_v: float | None = None
    current_a: float | None = None
    power_w: float | None = None


@dataclass
class EmcReading:
    """The external memory controller: its clock and how busy it is (Jetson)."""

    freq_hz: float | None = None
    utilization: float | None = None  # 0..1


@dataclass
class DeviceReading:
    """Everything sampled about the device at one instant (cumulative counters stay cumulative)."""

    wall_time: float
    monotonic: float
    cpu_count: int
    cpu_seconds: dict[str, float]  # system-wide, by mode, since boot
    load_average: tuple[float, float, float]
    memory_total: int
    memory_available: int
    memory_used: int
    swap_total: int
    swap_used: int
    disk_total: int | None
    disk_free: int | None
    process_rss: int
    process_threads: int
    process_cpu_seconds: float
    process_start_time: float
    temperatures_c: dict[str, float] = field(default_factory=dict)
    accelerators: list[AcceleratorReading] = field(default_factory=list)
    rails: list[RailReading] = field(default_factory=list)
    emc: EmcReading | None = None
    notes: list[str] = field(default_factory=list)  # why a source is not measured (shown by `edged status`)
