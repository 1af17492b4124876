"""The engine contract every backend implements.

An :class:`Engine` is one loaded model variant. ``infer`` must be safe to call
from several threads at once: the scheduler runs ``instances.count`` worker
threads over one engine, relying on the engines releasing the GIL.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from edged.backends.options import BackendOptions
from edged.cpus import DEFAULT_SPIN_US, constrained_cpus, usable_cpus
from edged.repository.manifest import InputShape, TensorSpec, Variant

if TYPE_CHECKING:
    from edged.hardware.facts import HardwareFacts


@dataclass(frozen=True)
class EngineTensor:
    """A tensor as the engine sees it: the full shape, batch dimension included, -1 for dynamic."""

    name: str
    datatype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class LoadRequest:
    model: str
    version: int
    version_dir: Path
    variant: Variant
    device: str = "CPU"
    options: BackendOptions = field(default_factory=BackendOptions)  # the engine's own model (or the defaults)
    precision: str = ""  # to run at; "": the variant's own (TensorRT builds an FP32 ONNX file lower)
    max_batch_size: int = 0
    inputs: Sequence[TensorSpec] | None = None
    shapes: Mapping[str, InputShape] = field(default_factory=dict)  # declared [warmup.shapes]: min/usual/max
    threads: int = 0
    # How long an engine's idle pool threads spin for work before they sleep (ONNX Runtime); -1: the library's own.
    spin_us: int = DEFAULT_SPIN_US
    instances: int = 1
    cache_dir: Path | None = None
    facts: HardwareFacts | None = None  # what the daemon probed at start; None: the backend probes once

    @property
    def file(self) -> Path:
        return self.version_dir / self.variant.file

    def shape_range(self, name: str) -> tuple[list[int], list[int], list[int]] | None:
        """(min, usual, max) of a declared input shape, batch dimension excluded when batched."""
        s = self.shapes.get(name)
        if s is None:
            return None
        return list(s.min or s.shape), list(s.shape), list(s.max or s.shape)

    @property
    def label(self) -> str:
        return f"model {self.model!r} version {self.version} ({self.variant.file})"

    def cpu_threads(self) -> int:
        """The engine's thread budget on a CPU: the profile's ``threads``, else the CPUs this process
        may run on (logical ones: what its affinity and its cgroup's CPU quota allow)."""
        return self.threads or usable_cpus()

    def pool_threads(self) -> int:
        """The pool size to ask an engine for; 0: the engine's own default (a thread per physical core),
        which is kept unless the process may use fewer CPUs than the machine has (affinity, quota)."""
        return self.threads or constrained_cpus()


class Engine(abc.ABC):
    backend: str
    device: str
    precision: str
    inputs: list[EngineTensor]
    outputs: list[EngineTensor]
    # How BYTES tensors reach the library. False: as they arrived (object arrays of bytes). True: as
    # UTF-8 text, for libraries whose string tensors hold text (ONNX Runtime's Python binding would
    # otherwise take ``str()`` of each bytes object, "b'0'"): validation then refuses a non-UTF-8
    # element naming its input and index, and the engine hands its string outputs back as bytes.
    takes_text: bool = False
    # Calls it can run at once to good effect: the scheduler runs at least this many batches together
    # (engine worker processes: one per process; an in-process engine shares one session's threads).
    parallel: int = 1

    @abc.abstractmethod
    def infer(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Run one (possibly batched) inference; returns arrays the caller owns."""

    def unload(self) -> None:  # noqa: B027 - optional hook
        """Release engine resources; the default relies on garbage collection."""

    def process_memory_mb(self) -> float:
        """Memory it holds in other processes (engine workers), counted against the model budget."""
        return 0.0

    def processes(self) -> dict[str, Any] | None:
        """Its worker processes, for status pages (``edged status``, ``models list``); None: in-process."""
        return None

    @property
    def restoring(self) -> bool:
        """True while the engine puts itself back in a clean state after a failed run (OpenVINO):
        calls wait for it meanwhile, and readiness says not ready."""
        return False

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "device": self.device,
            "precision": self.precision,
            "inputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in self.inputs],
            "outputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in self.outputs],
        }


class Backend(abc.ABC):
    """Factory for engines of one library; what it is (formats, devices, options) is its spec's
    (:mod:`edged.backends.specs`)."""

    name: ClassVar[str]

    @abc.abstractmethod
    def check_available(self) -> None:
        """Raise EngineUnavailableError, naming what to install, when the library cannot be used."""

    def check_available_for(self, options: BackendOptions) -> None:
        """Like ``check_available``, for one profile line's options (some change what is needed)."""
        self.check_available()

    @abc.abstractmethod
    def load(self, request: LoadRequest) -> Engine:
        """Load a variant; raise ModelLoadError naming the model, version and file on failure."""

    def library_version(self) -> str:
        return "unknown"

    def devices(self) -> list[str]:
        return ["CPU"]
