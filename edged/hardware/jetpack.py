"""The JetPack support matrix: per L4T release, which engines the daemon can use and how.

A Jetson's TensorRT Python bindings (and NVIDIA's ONNX Runtime GPU builds) exist
for the *system* Python of its JetPack release only, while the daemon runs on
Python >= 3.10. So what can load depends on the release, not on the module: an
Orin on JetPack 5 has the same limits as a Xavier. This table is the one place
that knowledge lives; profile resolution, ``edged detect`` and docs/packaging.md
all read it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from edged.hardware.facts import HardwareFacts

__all__ = ["ENGINE_KEYS", "MATRIX", "EngineSupport", "ReleaseRow", "engine_key", "row_for"]

# native: the daemon's own Python imports the engine. worker: edged runs it in its engine worker under
# the release's system Python (edged/backends/trt_worker). unavailable: nothing on this release loads it.
Status = Literal["native", "worker", "unavailable"]
ENGINE_KEYS = ("tensorrt", "onnxruntime-gpu", "onnxruntime-cpu")


@dataclass(frozen=True)
class EngineSupport:
    status: Status
    how: str  # one line an operator can act on: how it loads, or why it cannot


@dataclass(frozen=True)
class ReleaseRow:
    """One JetPack generation (an L4T major release)."""

    jetpack: str
    l4t: str
    ubuntu: str
    system_python: str
    tensorrt: str
    cuda: str
    engines: dict[str, EngineSupport]

    def support(self, backend: str, device: str) -> EngineSupport:
        return self.engines.get(engine_key(backend, device), EngineSupport("native", "not release-specific"))

    def as_dict(self) -> dict[str, object]:
        return {
            "jetpack": self.jetpack, "l4t": self.l4t, "ubuntu": self.ubuntu, "system_python": self.system_python,
            "tensorrt": self.tensorrt, "cuda": self.cuda,
            "engines": {k: {"status": v.status, "how": v.how} for k, v in self.engines.items()},
        }


def engine_key(backend: str, device: str) -> str:
    """The matrix column for a profile's engine line (TensorRT on the GPU or a DLA is one column)."""
    if backend == "onnxruntime":
        return f"onnxruntime-{'cpu' if device == 'CPU' else 'gpu'}"
    return backend


_CPU = EngineSupport("native", "onnxruntime from PyPI (aarch64 wheel) in the daemon's environment")

MATRIX: tuple[ReleaseRow, ...] = (
    ReleaseRow(
        jetpack="4.x", l4t="32", ubuntu="18.04", system_python="3.6", tensorrt="7.1-8.2", cuda="10.2",
        engines={
            "tensorrt": EngineSupport(
                "unavailable", "TensorRT bindings are for Python 3.6 (JetPack 4); the daemon needs Python "
                "3.10+ and the engine worker needs 3.8+: upgrade to JetPack 5 or 6 (not possible on Nano/TX1/TX2)"),
            "onnxruntime-gpu": EngineSupport(
                "unavailable", "no ONNX Runtime GPU build exists for JetPack 4 (CUDA 10.2) and Python 3.10+"),
            "onnxruntime-cpu": _CPU,
        }),
    ReleaseRow(
        jetpack="5.x", l4t="34-35", ubuntu="20.04", system_python="3.8", tensorrt="8.4-8.5", cuda="11.4",
        engines={
            "tensorrt": EngineSupport(
                "worker", "TensorRT bindings are for Python 3.8: served by edged's engine worker under "
                "/usr/bin/python3 (one extra local round trip per request)"),
            "onnxruntime-gpu": EngineSupport(
                "unavailable", "ONNX Runtime GPU builds for JetPack 5 exist for Python 3.8 only; the daemon "
                "runs on Python 3.10+"),
            "onnxruntime-cpu": _CPU,
        }),
    ReleaseRow(
        jetpack="6.x", l4t="36", ubuntu="22.04", system_python="3.10", tensorrt="8.6 (6.0), 10.3 (6.1+)",
        cuda="12.2-12.6",
        engines={
            "tensorrt": EngineSupport(
                "native", "TensorRT bindings are for Python 3.10: the daemon imports them (its venv sees the "
                "system site-packages)"),
            "onnxruntime-gpu": EngineSupport(
                "native", "when an ONNX Runtime GPU build for JetPack 6 (Python 3.10) is installed; none is on "
                "PyPI, so the engine line falls through to the next one otherwise"),
            "onnxruntime-cpu": _CPU,
        }),
    ReleaseRow(
        jetpack="7.x", l4t="38", ubuntu="24.04", system_python="3.12", tensorrt="10.x", cuda="13",
        engines={
            "tensorrt": EngineSupport(
                "native", "TensorRT bindings are for Python 3.12: the daemon imports them"),
            "onnxruntime-gpu": EngineSupport(
                "native", "when an ONNX Runtime GPU build for JetPack 7 is installed"),
            "onnxruntime-cpu": _CPU,
        }),
)

_BY_MAJOR = {"32": MATRIX[0], "34": MATRIX[1], "35": MATRIX[1], "36": MATRIX[2], "38": MATRIX[3]}


def row_for(facts: HardwareFacts) -> ReleaseRow | None:
    """The matrix row of a Jetson's release; ``None`` off Jetson or when the L4T release is unknown."""
    if not facts.jetson.present or not facts.jetson.l4t:
        return None
    m = re.match(r"^(\d+)", facts.jetson.l4t)
    return _BY_MAJOR.get(m.group(1)) if m else None
