"""Probe the hardware by reading files under a sysroot.

Everything is read relative to ``root`` so tests (and ``edged detect --root``)
can run against trees copied from real devices' ``/proc``, ``/sys`` and
``/etc``. Only the live root (``/``) may look further: ``platform.machine()``,
``sysconf``, NVML and importing the engine libraries. Nothing here needs root
privileges, and nothing raises on missing or garbled files: what cannot be read
stays ``None`` and is listed in ``HardwareFacts.unknown``.

Conventions worth knowing:

* DLA cores are device-tree nodes named ``nvdla<N>`` (with or without a unit
  address, e.g. ``host1x@13e00000/nvdla0@15880000``) up to three levels below
  the device-tree root, counted only when their ``status`` is ``okay`` or
  absent. Orin Nano carries the nodes but disabled, which is how it reports 0.
* The Jetson GPU node is the first devfreq device named like ``17000000.gpu``
  / ``.ga10b`` / ``.gv11b`` / ``.gp10b`` / ``.gm20b`` under
  ``/sys/class/devfreq``, else a known ``/sys/devices`` path.
* A driver is taken from a ``driver`` symlink's name or, in copied trees where
  symlinks are awkward, from ``DRIVER=`` in the device's ``uevent``.
* Copied trees should hold plain files: an absolute symlink inside one would
  point back into this machine's own filesystem.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from edged.hardware.facts import (
    BoardFacts,
    CpuFacts,
    EngineFacts,
    HardwareFacts,
    IntelGpu,
    IntelGpuFacts,
    IntelNpuFacts,
    JetsonFacts,
    MemoryFacts,
    NvidiaGpu,
    NvidiaGpuFacts,
    OnnxRuntimeStatus,
    OpenVinoStatus,
    OsFacts,
    TensorRtStatus,
)

log = logging.getLogger(__name__)

_T = TypeVar("_T")

_READ_LIMIT = 16 * 1024 * 1024

# ISA extensions that change which kernels an engine can use; the rest of cpuinfo's flags are noise here.
_RELEVANT_FLAGS = frozenset({
    # x86
    "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl",
    "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16", "amx_fp16",
    # Arm
    "neon", "vfpv4", "asimd", "asimddp", "asimdhp", "fphp", "i8mm", "bf16", "sve", "sve2", "svei8mm",
    "svebf16", "sme",
})

_ARM_IMPLEMENTERS = {
    0x41: "ARM", 0x42: "Broadcom", 0x43: "Cavium", 0x48: "HiSilicon", 0x4E: "NVIDIA", 0x51: "Qualcomm",
    0x53: "Samsung", 0x61: "Apple", 0x69: "Intel", 0xC0: "Ampere",
}
_ARM_PARTS = {
    (0x41, 0xD03): "Cortex-A53", (0x41, 0xD04): "Cortex-A35", (0x41, 0xD05): "Cortex-A55",
    (0x41, 0xD07): "Cortex-A57", (0x41, 0xD08): "Cortex-A72", (0x41, 0xD09): "Cortex-A73",
    (0x41, 0xD0A): "Cortex-A75", (0x41, 0xD0B): "Cortex-A76", (0x41, 0xD0C): "Neoverse-N1",
    (0x41, 0xD0D): "Cortex-A77", (0x41, 0xD40): "Neoverse-V1", (0x41, 0xD41): "Cortex-A78",
    (0x41, 0xD42): "Cortex-A78AE", (0x41, 0xD46): "Cortex-A510", (0x41, 0xD47): "Cortex-A710",
    (0x41, 0xD49): "Neoverse-N2", (0x41, 0xD4F): "Neoverse-V2", (0x4E, 0x003): "Denver 2",
    (0x4E, 0x004): "Carmel",
}

# Jetson module part numbers (the "+pNNNN-SSSS" after the carrier board in `compatible`).
_JETSON_MODULES: dict[str, str | dict[str, str]] = {
    "3767": {"0000": "orin-nx", "0001": "orin-nx", "0003": "orin-nano", "0004": "orin-nano",
             "0005": "orin-nano"},
    "3701": "agx-orin",
    "3668": "xavier-nx",
    "2888": "agx-xavier",
    "3636": "tx2-nx",
    "3310": "tx2",
    "3489": "tx2",
    "3448": "nano",
    "2180": "tx1",
}
_JETSON_MODEL_NAMES = [
    (re.compile(r"orin\s*nano", re.I), "orin-nano"),
    (re.compile(r"orin\s*nx", re.I), "orin-nx"),
    (re.compile(r"agx\s*orin|orin", re.I), "agx-orin"),
    (re.compile(r"xavier\s*nx", re.I), "xavier-nx"),
    (re.compile(r"agx\s*xavier|jetson-agx|xavier", re.I), "agx-xavier"),
    (re.compile(r"tx2\s*nx", re.I), "tx2-nx"),
    (re.compile(r"tx2|quill", re.I), "tx2"),
    (re.compile(r"nano", re.I), "nano"),
    (re.compile(r"tx1", re.I), "tx1"),
]
_MODULE_SOC = {
    "orin-nano": "tegra234", "orin-nx": "tegra234", "agx-orin": "tegra234", "xavier-nx": "tegra194",
    "agx-xavier": "tegra194", "tx2": "tegra186", "tx2-nx": "tegra186", "nano": "tegra210", "tx1": "tegra210",
}

# L4T release -> JetPack release (NVIDIA's JetPack archive); by major.minor when the patch is unlisted.
_JETPACK_EXACT = {
    "32.4.3": "4.4", "32.4.4": "4.4.1", "32.5.0": "4.5", "32.5.1": "4.5.1", "32.5.2": "4.5.1",
    "32.6.1": "4.6", "32.7.1": "4.6.1", "32.7.2": "4.6.2", "32.7.3": "4.6.3", "32.7.4": "4.6.4",
    "32.7.5": "4.6.5", "32.7.6": "4.6.6",
    "35.1.0": "5.0.2", "35.2.1": "5.1", "35.3.1": "5.1.1", "35.4.1": "5.1.2", "35.5.0": "5.1.3",
    "35.6.0": "5.1.4", "35.6.1": "5.1.5",
    "36.2.0": "6.0-dp", "36.3.0": "6.0", "36.4.0": "6.1", "36.4.3": "6.2", "36.4.4": "6.2.1",
}
_JETPACK_SERIES = {"32.4": "4.4.x", "32.5": "4.5.x", "32.6": "4.6", "32.7": "4.6.x", "35": "5.1.x",
                   "36": "6.x", "38": "7.x"}

_JETSON_GPU_DEVFREQ = re.compile(r"^[0-9a-f]+\.(gpu|ga10b|gv11b|gp10b|gm20b)$")
_JETSON_GPU_PATHS = (
    "sys/devices/platform/bus@0/17000000.gpu", "sys/devices/17000000.ga10b", "sys/devices/17000000.gv11b",
    "sys/devices/17000000.gp10b", "sys/devices/57000000.gpu", "sys/devices/gpu.0",
)
_DLA_NODE = re.compile(r"^nvdla\d+(@[0-9a-f]+)?$")

# Compute capability by marketing name, for when NVML is not there to ask. First match wins.
_COMPUTE_CAPABILITY = [
    (re.compile(r"\bB(100|200)\b|GB200"), "10.0"),
    (re.compile(r"RTX (PRO )?50\d\d|RTX PRO \d+ Blackwell"), "12.0"),
    (re.compile(r"\bH(100|200|800)\b|GH200"), "9.0"),
    (re.compile(r"\bL4\b|\bL40S?\b|\bL20\b|RTX 40\d\d|RTX \d+ Ada|\bRTX [2456]000 Ada"), "8.9"),
    (re.compile(r"\bA(100|30|800)\b"), "8.0"),
    (re.compile(r"\bA(2|10|10G|16|40)\b|RTX 30\d\d|RTX A\d+"), "8.6"),
    (re.compile(r"\bT4\b|RTX 20\d\d|GTX 16\d\d|TITAN RTX|Quadro RTX|Quadro T\d+"), "7.5"),
    (re.compile(r"\bV100\b|TITAN V\b"), "7.0"),
    (re.compile(r"\bP100\b"), "6.0"),
    (re.compile(r"GTX 10\d\d|\bP(4|40|6)\b|TITAN Xp"), "6.1"),
]


class _Sysroot:
    """File access relative to the probed root; every read swallows OS and decoding errors."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.live = _is_live(root)
        self._dpkg: dict[str, str] | None = None

    def path(self, rel: str) -> Path:
        return self.root / rel.lstrip("/")

    def read_bytes(self, rel: str, limit: int = _READ_LIMIT) -> bytes | None:
        # Regular files only: /proc and /sys attributes are, and opening a FIFO (or a device) that a copied
        # or hostile tree put in their place would block the probe, and the daemon's start, for ever.
        try:
            fd = os.open(self.path(rel), os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
        except (OSError, ValueError):
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            os.set_blocking(fd, True)
            with os.fdopen(fd, "rb", closefd=False) as f:
                return f.read(limit)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)

    def read(self, rel: str, limit: int = _READ_LIMIT) -> str | None:
        data = self.read_bytes(rel, limit)
        return None if data is None else data.decode("utf-8", errors="replace")

    def read_line(self, rel: str) -> str | None:
        text = self.read(rel, 4096)
        if text is None:
            return None
        text = text.replace("\0", "").strip()
        return text or None

    def is_dir(self, rel: str) -> bool:
        try:
            return self.path(rel).is_dir()
        except OSError:
            return False

    def exists(self, rel: str) -> bool:
        try:
            return self.path(rel).exists()
        except OSError:
            return False

    def listdir(self, rel: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(rel)))
        except OSError:
            return []

    def driver_of(self, device_rel: str) -> str | None:
        """Driver bound to a sysfs device: the ``driver`` link's name, else ``DRIVER=`` in ``uevent``."""
        try:
            link = os.readlink(self.path(f"{device_rel}/driver"))
            return os.path.basename(link.rstrip("/")) or None
        except OSError:
            pass
        return _uevent(self.read(f"{device_rel}/uevent", 65536)).get("DRIVER")

    def dpkg(self) -> dict[str, str]:
        """Installed Debian packages -> version, read once."""
        if self._dpkg is None:
            self._dpkg = _parse_dpkg_status(self.read("var/lib/dpkg/status") or "")
        return self._dpkg


def _is_live(root: Path) -> bool:
    try:
        return root.resolve() == Path("/").resolve()
    except (OSError, RuntimeError):
        return False


def _uevent(text: str | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in (text or "").splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out


def _parse_dpkg_status(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if line[:1].isspace():
                continue
            key, sep, value = line.partition(":")
            if sep and key in ("Package", "Status", "Version"):
                fields[key] = value.strip()
        if "Package" in fields and "Version" in fields and fields.get("Status", "").endswith(" installed"):
            out[fields["Package"]] = fields["Version"]
    return out


def _upstream_version(debian_version: str) -> str:
    """``1:8.6.2.3-1+cuda12.2`` -> ``8.6.2.3``."""
    version = debian_version.split(":", 1)[-1]
    return re.split(r"[-+~]", version, maxsplit=1)[0]


def _hex(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text.strip(), 16)
    except ValueError:
        return None


def _pci_id(text: str | None) -> str | None:
    value = _hex(text)
    return None if value is None else f"0x{value:04x}"


def _guard(notes: list[str], what: str, fn: Callable[[], _T], default: _T) -> _T:
    """Run one probe section; a bug or odd file in one section must not cost the others."""
    try:
        return fn()
    except Exception as exc:
        log.debug("probe %s failed", what, exc_info=True)
        notes.append(f"{what}: probe failed: {type(exc).__name__}: {exc}")
        return default


# --- CPU and memory -------------------------------------------------------------------------------


def _cpuinfo_stanzas(text: str) -> list[dict[str, str]]:
    stanzas: list[dict[str, str]] = []
    for block in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields.setdefault(key.strip(), value.strip())
        if fields:
            stanzas.append(fields)
    return stanzas


def _arm_arch(value: str, model_name: str) -> str | None:
    if value.lower() == "aarch64":
        return "aarch64"
    try:
        level = int(value)
    except ValueError:
        return None
    if level >= 8 and "(v7l)" not in model_name:
        return "aarch64"
    return f"armv{min(level, 7)}l"


def _probe_cpu(sr: _Sysroot, board: BoardFacts, notes: list[str]) -> CpuFacts:
    text = sr.read("proc/cpuinfo")
    stanzas = _cpuinfo_stanzas(text or "")
    processors = [s for s in stanzas if s.get("processor", "").isdigit()]
    first = processors[0] if processors else (stanzas[0] if stanzas else {})
    arch: str | None = None
    vendor: str | None = None
    model: str | None = None
    raw_flags: set[str] = set()

    if "vendor_id" in first or "flags" in first:
        raw_flags = set(first.get("flags", "").split())
        arch = "x86_64" if "lm" in raw_flags else "i686"
        vendor = first.get("vendor_id") or None
        model = first.get("model name") or None
    elif "CPU architecture" in first or "Features" in first:
        raw_flags = set(first.get("Features", "").split())
        model_name = first.get("model name", "")
        arch = _arm_arch(first.get("CPU architecture", ""), model_name)
        if arch is None and "asimd" in raw_flags:
            arch = "aarch64"
        implementer = _hex(first.get("CPU implementer"))
        if implementer is not None:
            vendor = _ARM_IMPLEMENTERS.get(implementer, f"0x{implementer:02x}")
        parts: list[str] = []
        for s in processors or [first]:
            key = (_hex(s.get("CPU implementer")) or 0, _hex(s.get("CPU part")) or -1)
            name = _ARM_PARTS.get(key)
            if name and name not in parts:
                parts.append(name)
        model = " + ".join(parts) or model_name or None
    elif first.get("isa", "").startswith("rv"):
        arch = "riscv64" if first["isa"].startswith("rv64") else "riscv32"
        model = first.get("uarch") or None

    if arch is None:
        # A 64-bit-only SoC in the device tree settles it even without a usable cpuinfo.
        socs = ("nvidia,tegra264", "nvidia,tegra234", "nvidia,tegra194", "brcm,bcm2712")
        if any(c in socs for c in board.compatible):
            arch = "aarch64"
        elif sr.live:
            arch = platform.machine() or None
    if arch == "aarch64" and "asimd" in raw_flags:
        raw_flags.add("neon")
    if text is None:
        notes.append("cpu: proc/cpuinfo unreadable")
    return CpuFacts(
        arch=arch,
        vendor=vendor,
        model=model,
        cores=len(processors) or None,
        flags=sorted(raw_flags & _RELEVANT_FLAGS),
    )


def _probe_memory(sr: _Sysroot) -> MemoryFacts:
    values: dict[str, int] = {}
    for line in (sr.read("proc/meminfo") or "").splitlines():
        m = re.match(r"^(\w+):\s+(\d+)\s*kB", line)
        if m:
            values[m.group(1)] = int(m.group(2)) // 1024
    total = values.get("MemTotal")
    available = values.get("MemAvailable")
    if total is None and sr.live:
        # No procfs (a container without it, a non-Linux host): sysconf still knows the page counts.
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            total = os.sysconf("SC_PHYS_PAGES") * page // 2**20
            available = os.sysconf("SC_AVPHYS_PAGES") * page // 2**20
        except (ValueError, OSError, AttributeError):
            pass
    return MemoryFacts(total_mb=total, available_mb=available)


# --- board / Jetson ---------------------------------------------------------------------------------


_DT_ROOTS = ("proc/device-tree", "sys/firmware/devicetree/base")


def _dt_root(sr: _Sysroot) -> str | None:
    return next((d for d in _DT_ROOTS if sr.is_dir(d)), None)


def _probe_board(sr: _Sysroot) -> BoardFacts:
    dt = _dt_root(sr)
    if dt is None:
        return BoardFacts()
    raw_model = sr.read_bytes(f"{dt}/model", 4096) or b""
    raw_compatible = sr.read_bytes(f"{dt}/compatible", 4096) or b""
    model = _dt_string(raw_model.rstrip(b"\0"))
    compatible = [_dt_string(c) for c in raw_compatible.split(b"\0") if c.strip()]
    return BoardFacts(model=model, compatible=[c for c in compatible if c])


def _dt_string(raw: bytes) -> str | None:
    """A device-tree string property, or ``None`` when the bytes are not printable text."""
    text = raw.decode("utf-8", "replace").strip()
    return text if text and text.isprintable() else None


def _parse_l4t(text: str | None) -> str | None:
    """``# R36 (release), REVISION: 3.0, ...`` -> ``36.3.0``."""
    if not text:
        return None
    m = re.search(r"#\s*R(\d+)\s*\([^)]*\)\s*,\s*REVISION:\s*(\d+)(?:\.(\d+))?", text)
    if not m:
        return None
    return f"{m.group(1)}.{m.group(2)}.{m.group(3) or 0}"


def jetpack_for_l4t(l4t: str) -> str | None:
    """JetPack release for an L4T release, exact where known, else the series (``6.x``)."""
    if l4t in _JETPACK_EXACT:
        return _JETPACK_EXACT[l4t]
    parts = l4t.split(".")
    return _JETPACK_SERIES.get(".".join(parts[:2])) or _JETPACK_SERIES.get(parts[0])


def _jetson_module(compatible: list[str], model: str | None) -> str | None:
    for entry in compatible:
        for number, sku in re.findall(r"p(\d{4})-(\d{4})", entry):
            known = _JETSON_MODULES.get(number)
            if isinstance(known, dict):
                if sku in known:
                    return known[sku]
            elif known is not None:
                return known
    for entry in compatible:
        if entry.startswith("nvidia,jetson-"):
            return entry.removeprefix("nvidia,jetson-")
    for pattern, module in _JETSON_MODEL_NAMES:
        if model and pattern.search(model):
            return module
    return None


def _cuda_version(sr: _Sysroot) -> str | None:
    dirs = ["usr/local/cuda"]
    dirs += sorted((f"usr/local/{d}" for d in sr.listdir("usr/local") if re.match(r"^cuda-\d", d)),
                   key=lambda d: [int(x) for x in re.findall(r"\d+", d)], reverse=True)
    for d in dirs:
        raw = sr.read(f"{d}/version.json", 1 << 20)
        if raw:
            try:
                version = json.loads(raw)["cuda"]["version"]
                if isinstance(version, str):
                    return version
            except (ValueError, KeyError, TypeError):
                pass
        m = re.search(r"CUDA Version\s+([\d.]+)", sr.read(f"{d}/version.txt", 4096) or "")
        if m:
            return m.group(1)
    for package, version in sr.dpkg().items():
        if re.fullmatch(r"cuda-cudart-\d+-\d+", package):
            return _upstream_version(version)
    return None


_TENSORRT_HEADERS = (
    "usr/include/aarch64-linux-gnu/NvInferVersion.h", "usr/include/x86_64-linux-gnu/NvInferVersion.h",
    "usr/include/NvInferVersion.h", "usr/local/tensorrt/include/NvInferVersion.h",
)


def _macro_value(defines: dict[str, str], name: str) -> str | None:
    value = defines.get(name)
    # TensorRT 10 defines NV_TENSORRT_MAJOR as another macro (TRT_MAJOR_ENTERPRISE); follow a few hops.
    for _ in range(4):
        if value is None or value.isdigit():
            break
        value = defines.get(value)
    return value if value is not None and value.isdigit() else None


def _tensorrt_version(sr: _Sysroot) -> str | None:
    for header in _TENSORRT_HEADERS:
        text = sr.read(header, 1 << 20)
        if not text:
            continue
        defines = dict(re.findall(r"^\s*#\s*define\s+(\w+)\s+(\w+)", text, re.M))
        fields = [_macro_value(defines, f"NV_TENSORRT_{p}") for p in ("MAJOR", "MINOR", "PATCH", "BUILD")]
        if fields[0] is not None and fields[1] is not None:
            return ".".join(f for f in fields if f is not None)
    dpkg = sr.dpkg()
    for package in sorted(dpkg, reverse=True):
        if re.fullmatch(r"libnvinfer\d+|tensorrt|libnvinfer-bin", package):
            return _upstream_version(dpkg[package])
    return None


def _dla_cores(sr: _Sysroot, dt: str | None) -> int:
    if dt is None:
        return 0
    count = 0
    frontier = [dt]
    for depth in range(3):
        nxt: list[str] = []
        for node in frontier:
            for child in sr.listdir(node):
                rel = f"{node}/{child}"
                if not sr.is_dir(rel):
                    continue
                if _DLA_NODE.fullmatch(child):
                    status = sr.read_line(f"{rel}/status")
                    if status in (None, "okay", "ok"):
                        count += 1
                elif depth < 2:
                    nxt.append(rel)
        frontier = nxt
    return count


def _jetson_gpu(sr: _Sysroot) -> tuple[str | None, int | None]:
    node: str | None = None
    for name in sr.listdir("sys/class/devfreq"):
        if _JETSON_GPU_DEVFREQ.fullmatch(name):
            node = f"sys/class/devfreq/{name}"
            break
    if node is None:
        node = next((p for p in _JETSON_GPU_PATHS if sr.is_dir(p)), None)
    if node is None:
        return None, None
    candidates = [f"{node}/max_freq"]
    candidates += [f"{node}/devfreq/{d}/max_freq" for d in sr.listdir(f"{node}/devfreq")]
    max_mhz: int | None = None
    for candidate in candidates:
        line = sr.read_line(candidate)
        if line and line.isascii() and line.isdigit():  # str.isdigit() alone takes '²', which int() refuses
            max_mhz = round(int(line) / 1_000_000)
            break
    return "/" + node, max_mhz


def _probe_jetson(sr: _Sysroot, board: BoardFacts, notes: list[str]) -> JetsonFacts:
    release = sr.read("etc/nv_tegra_release", 4096)
    is_tegra = any(c.startswith("nvidia,tegra") or re.match(r"nvidia,p\d{4}", c) for c in board.compatible)
    present = is_tegra or "jetson" in (board.model or "").lower() or release is not None
    if not present:
        return JetsonFacts()
    dpkg = sr.dpkg()
    l4t = _parse_l4t(release)
    if l4t is None and release is not None:
        notes.append("jetson: etc/nv_tegra_release did not parse")
    if l4t is None and "nvidia-l4t-core" in dpkg:
        l4t = _upstream_version(dpkg["nvidia-l4t-core"])
    jetpack = _upstream_version(dpkg["nvidia-jetpack"]) if "nvidia-jetpack" in dpkg else None
    if jetpack is None and l4t is not None:
        jetpack = jetpack_for_l4t(l4t)
    module = _jetson_module(board.compatible, board.model)
    soc = next((c.split(",", 1)[1] for c in board.compatible if re.fullmatch(r"nvidia,tegra\d+", c)), None)
    if soc is None and module is not None:
        soc = _MODULE_SOC.get(module)
    gpu_sysfs, gpu_mhz = _jetson_gpu(sr)
    return JetsonFacts(
        present=True,
        module=module,
        soc=soc,
        l4t=l4t,
        jetpack=jetpack,
        cuda=_cuda_version(sr),
        tensorrt=_tensorrt_version(sr),
        dla_cores=_dla_cores(sr, _dt_root(sr)),
        gpu_sysfs=gpu_sysfs,
        gpu_max_freq_mhz=gpu_mhz,
        shared_memory=True,
    )


# --- discrete NVIDIA ------------------------------------------------------------------------------


def compute_capability_for(name: str) -> str | None:
    """Compute capability of a GPU by its marketing name; ``None`` when the table has no entry."""
    for pattern, cc in _COMPUTE_CAPABILITY:
        if pattern.search(name):
            return cc
    return None


def _norm_bus_id(bus_id: str) -> str:
    """NVML's ``00000000:01:00.0`` and sysfs's ``0000:01:00.0`` -> ``0000:01:00.0``."""
    m = re.fullmatch(r"([0-9a-fA-F]+):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.(\d)", bus_id.strip())
    if not m:
        return bus_id.strip().lower()
    domain, bus, dev, fn = m.groups()
    return f"{int(domain, 16):04x}:{bus.lower()}:{dev.lower()}.{fn}"


def _nvml_devices() -> tuple[list[NvidiaGpu], str | None]:
    import pynvml

    pynvml.nvmlInit()
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        devices: list[NvidiaGpu] = []
        for i in range(int(pynvml.nvmlDeviceGetCount())):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            bus = pynvml.nvmlDeviceGetPciInfo(h).busId
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            devices.append(NvidiaGpu(
                name=name.decode() if isinstance(name, bytes) else str(name),
                pci_address=_norm_bus_id(bus.decode() if isinstance(bus, bytes) else str(bus)),
                compute_capability=f"{int(major)}.{int(minor)}",
                memory_mb=int(pynvml.nvmlDeviceGetMemoryInfo(h).total) // 2**20,
                uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
            ))
        return devices, driver.decode() if isinstance(driver, bytes) else str(driver)
    finally:
        pynvml.nvmlShutdown()


def _probe_nvidia_gpu(sr: _Sysroot, notes: list[str]) -> NvidiaGpuFacts:
    pci: dict[str, str | None] = {}
    for address in sr.listdir("sys/bus/pci/devices"):
        base = f"sys/bus/pci/devices/{address}"
        vendor, klass = _hex(sr.read_line(f"{base}/vendor")), _hex(sr.read_line(f"{base}/class"))
        if vendor == 0x10DE and klass is not None and klass >> 16 == 0x03:
            pci[_norm_bus_id(address)] = _pci_id(sr.read_line(f"{base}/device"))

    version_text = sr.read("proc/driver/nvidia/version", 8192) or ""
    m = re.search(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+\.\d+(?:\.\d+)?)", version_text)
    driver = m.group(1) if m else None
    procfs: dict[str, NvidiaGpu] = {}
    for bus in sr.listdir("proc/driver/nvidia/gpus"):
        info: dict[str, str] = {}
        for line in (sr.read(f"proc/driver/nvidia/gpus/{bus}/information", 65536) or "").splitlines():
            key, sep, value = line.partition(":")
            if sep:
                info[key.strip()] = value.strip()
        address = _norm_bus_id(info.get("Bus Location") or bus)
        procfs[address] = NvidiaGpu(name=info.get("Model") or None, pci_address=address,
                                    uuid=info.get("GPU UUID") or None)
    if not pci and not procfs:
        return NvidiaGpuFacts()

    devices: list[NvidiaGpu] = []
    if sr.live:
        try:
            devices, driver = _nvml_devices()
        except Exception as exc:
            notes.append(f"nvidia_gpu: NVML unavailable ({type(exc).__name__}: {exc}); using procfs")
            devices = []
    if not devices:
        for address in sorted(set(pci) | set(procfs)):
            gpu = procfs.get(address, NvidiaGpu(pci_address=address))
            cc = compute_capability_for(gpu.name) if gpu.name else None
            devices.append(gpu.model_copy(update={"compute_capability": cc}))
    devices = [d.model_copy(update={"pci_device_id": pci.get(d.pci_address or "")}) for d in devices]
    first = devices[0]
    return NvidiaGpuFacts(
        present=True,
        count=len(devices),
        name=first.name,
        names=[d.name for d in devices if d.name],
        compute_capability=first.compute_capability,
        memory_mb=first.memory_mb,
        driver_version=driver,
        cuda=_cuda_version(sr),
        tensorrt=_tensorrt_version(sr),
        devices=devices,
    )


# --- Intel GPU / NPU ------------------------------------------------------------------------------


def _probe_intel_gpu(sr: _Sysroot) -> IntelGpuFacts:
    gpus: list[IntelGpu] = []
    for name in sr.listdir("sys/class/drm"):
        if not re.fullmatch(r"renderD\d+", name):
            continue
        dev = f"sys/class/drm/{name}/device"
        if _hex(sr.read_line(f"{dev}/vendor")) != 0x8086:
            continue
        address = _uevent(sr.read(f"{dev}/uevent", 65536)).get("PCI_SLOT_NAME")
        if address is None:
            try:
                address = os.path.basename(os.path.realpath(sr.path(dev)))
            except OSError:
                address = None
        address = _norm_bus_id(address) if address else None
        gpus.append(IntelGpu(
            render_node=f"/dev/dri/{name}",
            device_id=_pci_id(sr.read_line(f"{dev}/device")),
            driver=sr.driver_of(dev),
            pci_address=address,
            # Intel integrated graphics always sits at PCI 00:02.0.
            integrated=bool(address and address.endswith("00:02.0")),
        ))
    if not gpus:
        return IntelGpuFacts()
    first = next((g for g in gpus if g.integrated), gpus[0])
    return IntelGpuFacts(present=True, count=len(gpus), device_id=first.device_id, driver=first.driver,
                         render_node=first.render_node, integrated=first.integrated, devices=gpus)


def _probe_intel_npu(sr: _Sysroot) -> IntelNpuFacts:
    for name in sr.listdir("sys/class/accel"):
        if not re.fullmatch(r"accel\d+", name):
            continue
        dev = f"sys/class/accel/{name}/device"
        driver = sr.driver_of(dev)
        if driver != "intel_vpu":
            continue
        node = f"/dev/accel/{name}"
        return IntelNpuFacts(
            present=True,
            device_id=_pci_id(sr.read_line(f"{dev}/device")),
            driver=driver,
            sysfs=f"/sys/class/accel/{name}",
            dev_node=node if sr.exists(node) else None,
        )
    return IntelNpuFacts()


# --- engines and OS -------------------------------------------------------------------------------


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _probe_onnxruntime() -> OnnxRuntimeStatus:
    try:
        import onnxruntime as ort

        return OnnxRuntimeStatus(available=True, version=str(ort.__version__),
                                 providers=[str(p) for p in ort.get_available_providers()])
    except Exception as exc:
        return OnnxRuntimeStatus(error=_error(exc))


def _probe_openvino() -> OpenVinoStatus:
    try:
        import openvino as ov

        devices = [str(d) for d in ov.Core().available_devices]
        return OpenVinoStatus(available=True, version=str(getattr(ov, "__version__", "")) or None,
                              devices=devices)
    except Exception as exc:
        return OpenVinoStatus(error=_error(exc))


def _probe_tensorrt() -> TensorRtStatus:
    try:
        import tensorrt as trt

        return TensorRtStatus(available=True, version=str(trt.__version__))
    except Exception as exc:
        return TensorRtStatus(error=_error(exc))


def _probe_engines(sr: _Sysroot, engines: bool, notes: list[str]) -> EngineFacts:
    if not engines:
        return EngineFacts()
    if not sr.live:
        notes.append("engines: not probed (libraries can only be tried on the live root)")
        return EngineFacts()
    return EngineFacts(probed=True, onnxruntime=_probe_onnxruntime(), openvino=_probe_openvino(),
                       tensorrt=_probe_tensorrt())


def _probe_os(sr: _Sysroot) -> OsFacts:
    kernel = sr.read_line("proc/sys/kernel/osrelease")
    if kernel is None:
        m = re.search(r"Linux version (\S+)", sr.read("proc/version", 4096) or "")
        kernel = m.group(1) if m else (platform.release() or None if sr.live else None)
    release: dict[str, str] = {}
    for rel in ("etc/os-release", "usr/lib/os-release"):
        text = sr.read(rel, 65536)
        if text is None:
            continue
        for key, raw in _uevent(text).items():
            quoted = len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "\"'"
            release[key] = raw[1:-1] if quoted else raw
        break
    return OsFacts(kernel=kernel, name=release.get("PRETTY_NAME") or release.get("NAME") or None,
                   id=release.get("ID") or None, version_id=release.get("VERSION_ID") or None)


_ALWAYS_KNOWN = ("cpu.arch", "cpu.vendor", "cpu.model", "cpu.cores", "memory.total_mb",
                 "memory.available_mb", "os.kernel", "os.name")
_JETSON_KNOWN = ("jetson.module", "jetson.soc", "jetson.l4t", "jetson.jetpack", "jetson.cuda",
                 "jetson.tensorrt")
_NVIDIA_KNOWN = ("nvidia_gpu.name", "nvidia_gpu.compute_capability", "nvidia_gpu.driver_version")


def probe(root: Path = Path("/"), *, engines: bool = True) -> HardwareFacts:
    """Describe the machine at *root*; never raises, unknown facts stay ``None``.

    ``engines=True`` also imports ONNX Runtime, OpenVINO and TensorRT to see
    what actually runs (live root only, and the slow part); ``engines=False``
    only reads files.
    """
    sr = _Sysroot(Path(root))
    notes: list[str] = []
    board = _guard(notes, "board", lambda: _probe_board(sr), BoardFacts())
    facts = HardwareFacts(
        root=str(root),
        cpu=_guard(notes, "cpu", lambda: _probe_cpu(sr, board, notes), CpuFacts()),
        memory=_guard(notes, "memory", lambda: _probe_memory(sr), MemoryFacts()),
        board=board,
        jetson=_guard(notes, "jetson", lambda: _probe_jetson(sr, board, notes), JetsonFacts()),
        nvidia_gpu=_guard(notes, "nvidia_gpu", lambda: _probe_nvidia_gpu(sr, notes), NvidiaGpuFacts()),
        intel_gpu=_guard(notes, "intel_gpu", lambda: _probe_intel_gpu(sr), IntelGpuFacts()),
        intel_npu=_guard(notes, "intel_npu", lambda: _probe_intel_npu(sr), IntelNpuFacts()),
        engines=_guard(notes, "engines", lambda: _probe_engines(sr, engines, notes), EngineFacts()),
        os=_guard(notes, "os", lambda: _probe_os(sr), OsFacts()),
    )
    flat = facts.flat()
    wanted = list(_ALWAYS_KNOWN)
    wanted += _JETSON_KNOWN if facts.jetson.present else ()
    wanted += _NVIDIA_KNOWN if facts.nvidia_gpu.present else ()
    unknown = [key for key in wanted if flat.get(key) is None]
    return facts.model_copy(update={"unknown": unknown, "notes": notes})
