"""Every engine edged can run, as data: the one place a backend's identity is written down.

The factory, the profiles' validation, the inference service and the Triton model configuration all
read :data:`SPECS`; adding an engine is one :class:`BackendSpec` here plus its implementation module.
Importing this module imports no engine library and no backend implementation: each spec imports its
implementation only when the backend is first used.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from edged.backends.options import BackendOptions, OnnxRuntimeOptions, OpenVinoOptions, TensorRtOptions
from edged.errors import EngineUnavailableError

if TYPE_CHECKING:
    from edged.backends.base import Backend


@dataclass(frozen=True)
class BackendSpec:
    """One engine: its name in profiles, its options, where it runs, how it is named on the wire."""

    name: str  # as profiles and the API write it
    title: str  # as people read it
    options: type[BackendOptions]
    devices: tuple[str, ...]  # device names a profile may give it
    platform: str  # Triton's platform string, reported in model metadata and configuration
    formats: tuple[str, ...]  # variant formats it loads, its own first (OpenVINO and TensorRT also read ONNX)
    library: str  # the engine's Python module, imported only by the implementation
    distributions: tuple[str, ...]  # pip distributions that provide it (versions read from their metadata)
    install: str  # what to install when it is missing
    implementation: Callable[[], type[Backend]]  # imports the implementation module when first called
    # True: any device name of the library's own form is accepted too (OpenVINO names its plugins).
    open_devices: bool = False
    # True: it also builds an engine from an FP32 ONNX file at a lower precision (TensorRT).
    builds_lower_precision: bool = False
    # Devices on which its instances may run in engine worker processes ([limits] engine_processes):
    # CPU engines, whose throughput grows with the cores the daemon's interpreter would otherwise cap.
    process_devices: tuple[str, ...] = ()

    def device_problem(self, device: str) -> str | None:
        """Why a profile line may not give this engine ``device``, or None when it may."""
        if self.open_devices:
            if re.fullmatch(r"[A-Z][A-Z0-9_.:,()]*", device):
                return None
            return f"device {device!r} is not an {self.title} device name ({', '.join(self.devices)}...)"
        if device in self.devices:
            return None
        return f"device {device!r} is not one {self.name} offers ({', '.join(self.devices)})"

    def backend_class(self) -> type[Backend]:
        """The implementation, imported now; EngineUnavailableError saying what to install if it cannot be."""
        try:
            return self.implementation()
        except ImportError as e:
            raise EngineUnavailableError(f"the {self.title} backend cannot be imported ({e}); "
                                         f"install {self.install}") from None


def _tensorrt() -> type[Backend]:
    from edged.backends.tensorrt import TensorRtBackend

    return TensorRtBackend


def _openvino() -> type[Backend]:
    from edged.backends.openvino import OpenVinoBackend

    return OpenVinoBackend


def _onnxruntime() -> type[Backend]:
    from edged.backends.onnxruntime import OnnxRuntimeBackend

    return OnnxRuntimeBackend


# In the order error messages list them.
SPECS: dict[str, BackendSpec] = {s.name: s for s in (
    BackendSpec(
        name="tensorrt", title="TensorRT", options=TensorRtOptions, devices=("GPU", "DLA"),
        platform="tensorrt_plan", formats=("tensorrt", "onnx"), library="tensorrt",
        distributions=("tensorrt", "tensorrt-cu12", "tensorrt-cu11"),
        install="tensorrt (JetPack ships it; pip install tensorrt on x86 with CUDA)",
        implementation=_tensorrt, builds_lower_precision=True),
    BackendSpec(
        name="openvino", title="OpenVINO", options=OpenVinoOptions, devices=("CPU", "GPU", "NPU", "AUTO"),
        platform="openvino", formats=("openvino", "onnx"), library="openvino", distributions=("openvino",),
        install="the 'openvino' package", implementation=_openvino, open_devices=True, process_devices=("CPU",)),
    BackendSpec(
        name="onnxruntime", title="ONNX Runtime", options=OnnxRuntimeOptions, devices=("CPU", "GPU"),
        platform="onnxruntime_onnx", formats=("onnx",), library="onnxruntime",
        distributions=("onnxruntime", "onnxruntime-gpu", "onnxruntime-openvino", "onnxruntime-directml"),
        install="the 'onnxruntime' package (or 'onnxruntime-gpu' on CUDA machines)", implementation=_onnxruntime,
        process_devices=("CPU",)),
)}


def spec_for(name: str) -> BackendSpec:
    """The spec of backend ``name``; EngineUnavailableError naming the known ones otherwise."""
    spec = SPECS.get(name)
    if spec is None:
        raise EngineUnavailableError(f"unknown backend {name!r}; known: {', '.join(SPECS)}")
    return spec


def platform_of(backend: str | None) -> str | None:
    """Triton's platform string for a backend name, None for none or an unknown one."""
    spec = SPECS.get(backend or "")
    return spec.platform if spec is not None else None


def native_backend(fmt: str) -> str | None:
    """The backend whose own format ``fmt`` is (``onnx``: ONNX Runtime), None when none owns it."""
    return next((s.name for s in SPECS.values() if s.formats[0] == fmt), None)
