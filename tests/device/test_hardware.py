"""Hardware probing against sysroots copied from real devices, garbage, and this machine."""

from __future__ import annotations

import importlib
import os
import platform
import sys
import types
from pathlib import Path
from typing import Any

import pytest

import edged.hardware.facts as facts_module
from edged.hardware import HardwareFacts, fact_keys, facts_as_dict, probe
from edged.hardware.probe import compute_capability_for, jetpack_for_l4t
from tests.fresh import imported_by

SYSROOTS = Path(__file__).parent.parent / "fixtures" / "sysroots"
ALL_FIXTURES = sorted(p.name for p in SYSROOTS.iterdir() if p.is_dir())


def probe_fixture(name: str) -> HardwareFacts:
    return probe(SYSROOTS / name, engines=False)


# Expected flat facts per fixture; only keys listed are checked.
EXPECTED: dict[str, dict[str, Any]] = {
    "jetson-orin-nano": {
        "cpu.arch": "aarch64", "cpu.vendor": "ARM", "cpu.model": "Cortex-A78AE", "cpu.cores": 6,
        "memory.total_mb": 7619, "jetson.present": True, "jetson.module": "orin-nano",
        "jetson.soc": "tegra234", "jetson.l4t": "36.3.0", "jetson.jetpack": "6.0", "jetson.cuda": "12.2.140",
        "jetson.tensorrt": "8.6.2.3",
        "jetson.dla_cores": 0, "jetson.gpu_sysfs": "/sys/class/devfreq/17000000.gpu",
        "jetson.gpu_max_freq_mhz": 625, "jetson.shared_memory": True, "nvidia_gpu.present": False,
        "intel_gpu.present": False, "os.kernel": "5.15.136-tegra", "os.name": "Ubuntu 22.04.4 LTS",
    },
    "jetson-agx-orin": {
        "cpu.arch": "aarch64", "cpu.cores": 12, "jetson.module": "agx-orin", "jetson.soc": "tegra234",
        "jetson.l4t": "35.4.1", "jetson.jetpack": "5.1.2", "jetson.cuda": "11.4.315",
        "jetson.tensorrt": "8.5.2", "jetson.dla_cores": 2, "jetson.gpu_max_freq_mhz": 1300,
        "board.model": "Jetson AGX Orin Developer Kit",
    },
    "jetson-xavier-nx": {
        "cpu.arch": "aarch64", "cpu.vendor": "NVIDIA", "cpu.model": "Carmel", "jetson.module": "xavier-nx",
        "jetson.soc": "tegra194", "jetson.l4t": "35.3.1", "jetson.jetpack": "5.1.1", "jetson.dla_cores": 2,
        "jetson.tensorrt": "8.5.2.2", "jetson.gpu_sysfs": "/sys/devices/17000000.gv11b",
    },
    "jetson-xavier-nx-jp4": {  # the same module on JetPack 4: what loads follows the release
        "jetson.module": "xavier-nx", "jetson.soc": "tegra194", "jetson.l4t": "32.7.4",
        "jetson.jetpack": "4.6.4", "jetson.tensorrt": "8.2.1.8", "jetson.cuda": "10.2.300",
        "os.kernel": "4.9.337-tegra", "os.version_id": "18.04",
    },
    "jetson-nano": {
        "cpu.arch": "aarch64", "cpu.model": "Cortex-A57", "cpu.cores": 4, "jetson.module": "nano",
        "jetson.soc": "tegra210", "jetson.l4t": "32.7.1", "jetson.jetpack": "4.6.1",
        "jetson.cuda": "10.2.300", "jetson.tensorrt": "8.2.1.8", "jetson.dla_cores": 0,
        "jetson.gpu_sysfs": "/sys/devices/57000000.gpu",
        "os.kernel": "4.9.253-tegra",
    },
    "intel-core-ultra-npu": {
        "cpu.arch": "x86_64", "cpu.vendor": "GenuineIntel", "cpu.model": "Intel(R) Core(TM) Ultra 7 155H",
        "cpu.cores": 22, "intel_npu.present": True, "intel_npu.driver": "intel_vpu",
        "intel_npu.device_id": "0x7d1d", "intel_npu.dev_node": "/dev/accel/accel0", "intel_gpu.present": True,
        "intel_gpu.device_id": "0x7d55", "intel_gpu.integrated": True, "jetson.present": False,
    },
    "intel-core-igpu": {
        "cpu.arch": "x86_64", "cpu.cores": 8, "intel_gpu.present": True, "intel_gpu.driver": "i915",
        "intel_gpu.device_id": "0x9a49", "intel_gpu.render_node": "/dev/dri/renderD128",
        "intel_npu.present": False,
    },
    "intel-atom-celeron": {
        "cpu.arch": "x86_64", "cpu.vendor": "GenuineIntel", "cpu.cores": 4, "cpu.flags": ["sse4_1", "sse4_2"],
        "intel_gpu.present": False, "intel_npu.present": False, "nvidia_gpu.present": False,
        "os.name": "Debian GNU/Linux 12 (bookworm)",
    },
    "amd-x86-64": {
        "cpu.arch": "x86_64", "cpu.vendor": "AuthenticAMD", "cpu.cores": 16, "intel_gpu.present": False,
        "nvidia_gpu.present": False, "os.id": "fedora",
    },
    "raspberry-pi-5": {
        "cpu.arch": "aarch64", "cpu.vendor": "ARM", "cpu.model": "Cortex-A76", "cpu.cores": 4,
        "board.model": "Raspberry Pi 5 Model B Rev 1.0",
        "board.compatible": ["raspberrypi,5-model-b", "brcm,bcm2712"],
        "jetson.present": False, "intel_gpu.present": False, "memory.total_mb": 8052,
    },
    "x86-64-nvidia-dgpu": {
        "cpu.arch": "x86_64", "nvidia_gpu.present": True, "nvidia_gpu.count": 1,
        "nvidia_gpu.name": "NVIDIA GeForce RTX 3090", "nvidia_gpu.compute_capability": "8.6",
        "nvidia_gpu.driver_version": "550.107.02", "nvidia_gpu.cuda": "12.4.131",
        "nvidia_gpu.tensorrt": "10.3.0.26", "intel_gpu.present": True, "jetson.present": False,
    },
}

# Flags that must (+) or must not (-) be reported.
FLAGS: dict[str, tuple[set[str], set[str]]] = {
    "intel-core-igpu": ({"avx2", "avx512f", "avx512_vnni", "fma"}, {"avx_vnni", "amx_tile", "neon"}),
    "intel-core-ultra-npu": ({"avx2", "avx_vnni"}, {"avx512f"}),
    "intel-atom-celeron": ({"sse4_2"}, {"avx", "avx2"}),
    "amd-x86-64": ({"avx2", "fma", "f16c"}, {"avx512f", "lm", "sse4a"}),
    "raspberry-pi-5": ({"neon", "asimd", "asimddp", "asimdhp"}, {"sve", "avx2"}),
    "jetson-orin-nano": ({"asimddp", "asimdhp"}, {"sve"}),
    "jetson-xavier-nx": ({"asimdhp"}, {"asimddp"}),
    "jetson-nano": ({"neon", "asimd"}, {"asimddp", "asimdhp"}),
}


def test_every_fixture_has_expectations() -> None:
    assert set(ALL_FIXTURES) == set(EXPECTED)


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_fixture_facts(name: str) -> None:
    facts = probe_fixture(name)
    flat = facts.flat()
    for key, want in EXPECTED[name].items():
        assert flat[key] == want, key
    assert facts.unknown == [], facts.unknown
    assert facts.engines.probed is False


@pytest.mark.parametrize("name", sorted(FLAGS))
def test_cpu_flags(name: str) -> None:
    flags = set(probe_fixture(name).cpu.flags)
    must, must_not = FLAGS[name]
    assert must <= flags
    assert not (must_not & flags)


def test_dgpu_details() -> None:
    facts = probe_fixture("x86-64-nvidia-dgpu")
    (gpu,) = facts.nvidia_gpu.devices
    assert gpu.pci_address == "0000:01:00.0"
    assert gpu.pci_device_id == "0x2204"
    assert gpu.uuid == "GPU-5f1c2a7e-9b0d-4c3e-8a61-2d7f0e4b9c13"
    # The HD audio function on the same card is not a GPU; the Intel iGPU is reported separately.
    assert facts.intel_gpu.devices[0].pci_address == "0000:00:02.0"


def test_flat_keys_are_documented() -> None:
    doc = facts_module.__doc__ or ""
    missing = [key for key in fact_keys() if f"``{key}``" not in doc]
    assert missing == []
    # Lists of per-device objects stay out of the flat view.
    assert "nvidia_gpu.devices" not in fact_keys()
    assert facts_as_dict(HardwareFacts()).keys() == fact_keys()


@pytest.mark.parametrize(("l4t", "jetpack"), [
    ("32.7.1", "4.6.1"), ("32.7.9", "4.6.x"), ("35.4.1", "5.1.2"), ("35.9.0", "5.1.x"), ("36.3.0", "6.0"),
    ("36.4.3", "6.2"), ("36.9.9", "6.x"), ("99.0.0", None),
])
def test_jetpack_table(l4t: str, jetpack: str | None) -> None:
    assert jetpack_for_l4t(l4t) == jetpack


@pytest.mark.parametrize(("release", "l4t"), [
    ("# R36 (release), REVISION: 3.0, GCID: 36191598, BOARD: generic, EABI: aarch64, DATE: x", "36.3.0"),
    ("# R32 (release), REVISION: 7.1, GCID: 29818004, BOARD: t210ref, EABI: aarch64, DATE: x", "32.7.1"),
    ("# R35 (release), REVISION: 5\n", "35.5.0"),
    ("R36 garbage", None),
])
def test_l4t_parse(tmp_path: Path, release: str, l4t: str | None) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "nv_tegra_release").write_text(release)
    facts = probe(tmp_path, engines=False)
    assert facts.jetson.present
    assert facts.jetson.l4t == l4t
    if l4t is None:
        assert "jetson.l4t" in facts.unknown
        assert any("nv_tegra_release" in n for n in facts.notes)


@pytest.mark.parametrize(("name", "cc"), [
    ("NVIDIA GeForce RTX 4090", "8.9"), ("NVIDIA H100 80GB HBM3", "9.0"), ("Tesla T4", "7.5"),
    ("NVIDIA A100-SXM4-40GB", "8.0"), ("NVIDIA RTX A4000", "8.6"), ("NVIDIA L4", "8.9"),
    ("NVIDIA GeForce GTX 1080 Ti", "6.1"), ("Some Future GPU", None),
])
def test_compute_capability_table(name: str, cc: str | None) -> None:
    assert compute_capability_for(name) == cc


def test_missing_root_does_not_raise(tmp_path: Path) -> None:
    facts = probe(tmp_path / "does-not-exist")
    assert facts.cpu.arch is None
    assert facts.memory.total_mb is None
    assert not facts.jetson.present and not facts.nvidia_gpu.present
    assert {"cpu.arch", "memory.total_mb", "os.kernel"} <= set(facts.unknown)


def _write(root: Path, rel: str, data: bytes) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_garbage_files_do_not_raise(tmp_path: Path) -> None:
    junk = bytes(range(256)) * 4
    for rel in ("proc/meminfo", "proc/device-tree/model", "proc/device-tree/compatible",
                "etc/nv_tegra_release",
                "usr/local/cuda/version.json", "usr/include/aarch64-linux-gnu/NvInferVersion.h",
                "var/lib/dpkg/status", "proc/driver/nvidia/version", "etc/os-release",
                "sys/class/drm/renderD128/device/vendor", "sys/class/accel/accel0/device/uevent",
                "sys/bus/pci/devices/0000:01:00.0/vendor", "proc/driver/nvidia/gpus/0000:01:00.0/information",
                "sys/class/devfreq/17000000.gpu/max_freq"):
        _write(tmp_path, rel, junk)
    _write(tmp_path, "proc/cpuinfo", b"processor\t: 0\nCPU architecture: banana\nCPU part\t: 0xzz\n\n" + junk)
    (tmp_path / "proc" / "sys" / "kernel" / "osrelease").mkdir(parents=True)  # a directory, not a file
    _write(tmp_path, "proc/device-tree/nvdla0/status", junk)
    facts = probe(tmp_path, engines=False)
    assert facts.cpu.cores == 1
    assert facts.os.kernel is None
    assert facts.jetson.present  # the nv_tegra_release file exists, even if unreadable junk
    assert facts.jetson.dla_cores == 0
    assert not facts.intel_gpu.present and not facts.intel_npu.present
    assert facts.board.model is None and facts.board.compatible == []  # binary junk is not a name
    HardwareFacts.model_validate_json(facts.model_dump_json())


def test_half_written_files(tmp_path: Path) -> None:
    _write(tmp_path, "proc/meminfo", b"MemTotal:  notanumber kB\nMemAvailable:\n")
    _write(tmp_path, "usr/local/cuda/version.json", b'{"cuda": {"version": 12}}')
    _write(tmp_path, "etc/nv_tegra_release", b"# R36 (release), REVISION: 4.0\n")
    facts = probe(tmp_path, engines=False)
    assert facts.memory.total_mb is None
    assert facts.jetson.cuda is None
    assert facts.jetson.l4t == "36.4.0" and facts.jetson.jetpack == "6.1"


def test_npu_driver_from_symlink(tmp_path: Path) -> None:
    device = tmp_path / "sys/class/accel/accel0/device"
    device.mkdir(parents=True)
    # As sysfs has it: a relative link into /sys/bus/pci/drivers, dangling in a copied tree.
    os.symlink("../../../../bus/pci/drivers/intel_vpu", device / "driver")
    (device / "device").write_text("0x643e\n")
    facts = probe(tmp_path, engines=False)
    assert facts.intel_npu.present
    assert facts.intel_npu.device_id == "0x643e"
    assert facts.intel_npu.dev_node is None


def test_unbound_nvidia_gpu_has_no_driver(tmp_path: Path) -> None:
    base = tmp_path / "sys/bus/pci/devices/0000:65:00.0"
    base.mkdir(parents=True)
    (base / "vendor").write_text("0x10de\n")
    (base / "class").write_text("0x030200\n")
    (base / "device").write_text("0x20b5\n")
    facts = probe(tmp_path, engines=False)
    assert facts.nvidia_gpu.present and facts.nvidia_gpu.count == 1
    assert facts.nvidia_gpu.driver_version is None
    assert "nvidia_gpu.driver_version" in facts.unknown


def test_nvml_used_on_live_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """With NVML importable on the live root, its answers win over procfs and the name table."""
    calls: list[str] = []
    fake: Any = types.ModuleType("pynvml")
    fake.nvmlInit = lambda: calls.append("init")
    fake.nvmlShutdown = lambda: calls.append("shutdown")
    fake.nvmlSystemGetDriverVersion = lambda: "550.107.02"
    fake.nvmlDeviceGetCount = lambda: 1
    fake.nvmlDeviceGetHandleByIndex = lambda i: object()
    fake.nvmlDeviceGetName = lambda h: b"NVIDIA GeForce RTX 3090"
    fake.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=b"00000000:01:00.0")
    fake.nvmlDeviceGetCudaComputeCapability = lambda h: (8, 6)
    fake.nvmlDeviceGetUUID = lambda h: "GPU-abc"
    fake.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=24 * 2**30)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    # `edged.hardware.probe` the attribute is the function; fetch the module itself.
    monkeypatch.setattr(importlib.import_module("edged.hardware.probe"), "_is_live", lambda root: True)
    facts = probe(SYSROOTS / "x86-64-nvidia-dgpu", engines=False)
    assert calls == ["init", "shutdown"]
    assert facts.nvidia_gpu.memory_mb == 24576
    assert facts.nvidia_gpu.devices[0].pci_device_id == "0x2204"
    assert facts.nvidia_gpu.devices[0].uuid == "GPU-abc"


def test_live_machine() -> None:
    facts = probe(Path("/"), engines=False)
    if sys.platform.startswith("linux"):
        assert facts.cpu.arch == platform.machine()
        assert facts.cpu.cores and facts.cpu.cores >= 1
        assert facts.memory.total_mb and facts.memory.total_mb > 0
        assert facts.os.kernel == platform.release()
    assert facts.engines.probed is False


def test_live_engines() -> None:
    facts = probe(Path("/"))
    assert facts.engines.probed
    ort = facts.engines.onnxruntime
    assert ort.available and "CPUExecutionProvider" in ort.providers  # a hard dependency of edged
    for engine in (facts.engines.openvino, facts.engines.tensorrt):
        assert engine.available == (engine.error is None)


def test_engines_false_imports_no_engine() -> None:
    """Importing edged.hardware and probing without engines must not load any engine library."""
    code = "from pathlib import Path; from edged.hardware import probe; probe(Path('/'), engines=False)"
    assert imported_by(code, ["onnxruntime", "openvino", "tensorrt", "pynvml"]) == []


def test_arm_variants(tmp_path: Path) -> None:
    """A 32-bit kernel on a v8 core reports architecture 7; big.LITTLE lists both core types."""
    armv7 = tmp_path / "armv7"
    _write(armv7, "proc/cpuinfo", b"processor\t: 0\nmodel name\t: ARMv7 Processor rev 3 (v7l)\n"
                                  b"Features\t: half thumb fastmult vfp edsp neon vfpv3 tls vfpv4 idiva idivt\n"
                                  b"CPU implementer\t: 0x41\nCPU architecture: 7\nCPU part\t: 0xd08\n\n")
    facts = probe(armv7, engines=False)
    assert (facts.cpu.arch, facts.cpu.model) == ("armv7l", "Cortex-A72")
    assert facts.cpu.flags == ["neon", "vfpv4"]
    big_little = tmp_path / "rk3588"
    stanza = "processor\t: {i}\nFeatures\t: fp asimd asimddp\nCPU implementer\t: 0x41\nCPU architecture: 8\n" \
             "CPU part\t: {part}\n\n"
    text = "".join(stanza.format(i=i, part="0xd05" if i < 4 else "0xd0b") for i in range(8))
    _write(big_little, "proc/cpuinfo", text.encode())
    facts = probe(big_little, engines=False)
    assert (facts.cpu.arch, facts.cpu.cores, facts.cpu.model) == ("aarch64", 8, "Cortex-A55 + Cortex-A76")
