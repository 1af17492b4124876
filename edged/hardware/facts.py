"""What the probe learned about this machine, as frozen pydantic models.

The nested models are the full record (``HardwareFacts.model_dump()``). Device
profiles match against a *flat* view instead (:func:`facts_as_dict`): every
scalar or list-of-scalars field under its dotted path. Lists of objects (the
per-GPU ``devices`` lists) are left out of the flat view; their first entry is
summarised in the section's own fields. A value of ``None`` means "unknown":
the file was missing, unreadable or did not parse.

Flat keys (rules in device profiles may use exactly these):

``root``
    the sysroot probed (``"/"`` for this machine).
``unknown``
    dotted keys of important facts that could not be determined.
``notes``
    human-readable remarks (unparsable files, skipped probes).
``cpu.arch``
    ``x86_64``, ``i686``, ``aarch64``, ``armv7l``, ``riscv64``...
``cpu.vendor``
    ``GenuineIntel``, ``AuthenticAMD``, or the Arm implementer (``ARM``, ``NVIDIA``, ...).
``cpu.model``
    model name; on Arm the core name from the ``CPU part`` table (``Cortex-A78AE``).
``cpu.cores``
    logical processors listed in ``/proc/cpuinfo`` (online ones).
``cpu.flags``
    inference-relevant ISA flags only, kernel spelling (``avx2``, ``avx512_vnni``,
    ``amx_int8``, ``asimd``, ``asimddp``, ``asimdhp``, ``sve``...); ``neon`` is
    added on aarch64 whenever ``asimd`` is present, since that is the same unit.
``memory.total_mb``, ``memory.available_mb``
    from ``/proc/meminfo`` (MiB).
``board.model``, ``board.compatible``
    device-tree ``model`` and ``compatible`` strings (Arm boards).
``jetson.present``, ``jetson.module``, ``jetson.soc``, ``jetson.l4t``, ``jetson.jetpack``,
``jetson.cuda``, ``jetson.tensorrt``, ``jetson.dla_cores``, ``jetson.gpu_sysfs``,
``jetson.gpu_max_freq_mhz``, ``jetson.shared_memory``
    NVIDIA Jetson: normalised module (``orin-nano``, ``orin-nx``, ``agx-orin``,
    ``xavier-nx``, ``agx-xavier``, ``tx2``, ``tx2-nx``, ``nano``, ``tx1``), SoC
    (``tegra234``...), L4T and derived JetPack version, CUDA and TensorRT
    versions installed, enabled DLA cores, GPU sysfs node.
``nvidia_gpu.present``, ``nvidia_gpu.count``, ``nvidia_gpu.name``, ``nvidia_gpu.names``,
``nvidia_gpu.compute_capability``, ``nvidia_gpu.memory_mb``, ``nvidia_gpu.driver_version``,
``nvidia_gpu.cuda``, ``nvidia_gpu.tensorrt``
    discrete NVIDIA GPUs (PCI vendor 0x10de); per-GPU fields describe the first one.
``intel_gpu.present``, ``intel_gpu.count``, ``intel_gpu.device_id``, ``intel_gpu.driver``,
``intel_gpu.render_node``, ``intel_gpu.integrated``
    Intel GPUs with a DRM render node (so a driver is bound); first one summarised.
``intel_npu.present``, ``intel_npu.device_id``, ``intel_npu.driver``, ``intel_npu.sysfs``,
``intel_npu.dev_node``
    Intel NPU: an accel device bound to ``intel_vpu``.
``engines.probed``
    whether engine libraries were imported (only for the live root with ``engines=True``).
``engines.onnxruntime.available``, ``engines.onnxruntime.version``,
``engines.onnxruntime.error``, ``engines.onnxruntime.providers``
    whether ``import onnxruntime`` works, and its execution providers.
``engines.openvino.available``, ``engines.openvino.version``, ``engines.openvino.error``,
``engines.openvino.devices``
    whether OpenVINO imports, and ``Core().available_devices`` (``CPU``, ``GPU``, ``NPU``...).
``engines.tensorrt.available``, ``engines.tensorrt.version``, ``engines.tensorrt.error``
    whether the ``tensorrt`` Python module imports.
``os.kernel``, ``os.name``, ``os.id``, ``os.version_id``
    kernel release and ``/etc/os-release`` ``PRETTY_NAME``/``ID``/``VERSION_ID``.
"""

from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel, ConfigDict

FactValue = str | int | float | bool | list[str] | None


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class CpuFacts(_Frozen):
    arch: str | None = None
    vendor: str | None = None
    model: str | None = None
    cores: int | None = None
    flags: list[str] = []


class MemoryFacts(_Frozen):
    total_mb: int | None = None
    available_mb: int | None = None


class BoardFacts(_Frozen):
    model: str | None = None
    compatible: list[str] = []


class JetsonFacts(_Frozen):
    present: bool = False
    module: str | None = None
    soc: str | None = None
    l4t: str | None = None
    jetpack: str | None = None
    cuda: str | None = None
    tensorrt: str | None = None
    dla_cores: int = 0
    gpu_sysfs: str | None = None
    gpu_max_freq_mhz: int | None = None
    # CPU and GPU share one DRAM, so a model's GPU memory comes out of the host budget.
    shared_memory: bool = False


class NvidiaGpu(_Frozen):
    name: str | None = None
    pci_address: str | None = None
    pci_device_id: str | None = None
    compute_capability: str | None = None
    memory_mb: int | None = None
    uuid: str | None = None


class NvidiaGpuFacts(_Frozen):
    present: bool = False
    count: int = 0
    name: str | None = None
    names: list[str] = []
    compute_capability: str | None = None
    memory_mb: int | None = None
    driver_version: str | None = None
    cuda: str | None = None
    tensorrt: str | None = None
    devices: list[NvidiaGpu] = []


class IntelGpu(_Frozen):
    render_node: str
    device_id: str | None = None
    driver: str | None = None
    pci_address: str | None = None
    integrated: bool = False


class IntelGpuFacts(_Frozen):
    present: bool = False
    count: int = 0
    device_id: str | None = None
    driver: str | None = None
    render_node: str | None = None
    integrated: bool = False
    devices: list[IntelGpu] = []


class IntelNpuFacts(_Frozen):
    present: bool = False
    device_id: str | None = None
    driver: str | None = None
    sysfs: str | None = None
    dev_node: str | None = None


class EngineStatus(_Frozen):
    available: bool = False
    version: str | None = None
    error: str | None = None


class OnnxRuntimeStatus(EngineStatus):
    providers: list[str] = []


class OpenVinoStatus(EngineStatus):
    devices: list[str] = []


class TensorRtStatus(EngineStatus):
    pass


class EngineFacts(_Frozen):
    probed: bool = False
    onnxruntime: OnnxRuntimeStatus = OnnxRuntimeStatus()
    openvino: OpenVinoStatus = OpenVinoStatus()
    tensorrt: TensorRtStatus = TensorRtStatus()


class OsFacts(_Frozen):
    kernel: str | None = None
    name: str | None = None
    id: str | None = None
    version_id: str | None = None


class HardwareFacts(_Frozen):
    """Everything :func:`edged.hardware.probe` found; ``None`` fields are unknown."""

    root: str = "/"
    cpu: CpuFacts = CpuFacts()
    memory: MemoryFacts = MemoryFacts()
    board: BoardFacts = BoardFacts()
    jetson: JetsonFacts = JetsonFacts()
    nvidia_gpu: NvidiaGpuFacts = NvidiaGpuFacts()
    intel_gpu: IntelGpuFacts = IntelGpuFacts()
    intel_npu: IntelNpuFacts = IntelNpuFacts()
    engines: EngineFacts = EngineFacts()
    os: OsFacts = OsFacts()
    unknown: list[str] = []
    notes: list[str] = []

    def flat(self) -> dict[str, FactValue]:
        """The dotted-key view that profile rules match against."""
        return facts_as_dict(self)


# Per-device detail lists: summarised by their section's own fields in the flat view.
_NOT_FLAT: dict[str, Any] = {"nvidia_gpu": {"devices"}, "intel_gpu": {"devices"}}


def _flatten(prefix: str, value: Any, out: dict[str, FactValue]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), item, out)
    elif isinstance(value, list):
        out[prefix] = [str(item) for item in value]
    else:
        out[prefix] = value


def facts_as_dict(facts: HardwareFacts) -> dict[str, FactValue]:
    """Flatten *facts* to ``{"cpu.arch": "aarch64", ...}`` (see the module docstring for keys)."""
    out: dict[str, FactValue] = {}
    _flatten("", facts.model_dump(mode="json", exclude=_NOT_FLAT), out)
    return out


@functools.cache
def fact_keys() -> frozenset[str]:
    """Every key the flat view can contain, so profile rules can be checked for typos."""
    return frozenset(facts_as_dict(HardwareFacts()))
