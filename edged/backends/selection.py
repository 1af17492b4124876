"""Which engine runs a model: the profile's preferences intersected with the model's variants."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from edged.backends.factory import get_backend
from edged.backends.options import BackendOptions
from edged.backends.specs import SPECS
from edged.errors import EdgedError
from edged.repository.manifest import Variant


class Preference(Protocol):
    """One engine/device line of a profile (``edged.profiles.BackendPreference``), read only."""

    @property
    def backend(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def precisions(self) -> Sequence[str]: ...
    @property
    def options(self) -> BackendOptions: ...


@dataclass(frozen=True)
class Candidate:
    variant: Variant
    backend: str
    device: str
    precision: str
    options: BackendOptions = field(default_factory=BackendOptions)  # the backend's own model, from the profile

    @property
    def label(self) -> str:
        return f"{self.backend}/{self.device}/{self.precision} ({self.variant.file})"


def can_run_at(backend: str, variant: Variant, precision: str) -> bool:
    """Whether ``backend`` can run ``variant`` at ``precision``.

    Every backend runs a variant at its own precision. One whose spec ``builds_lower_precision``
    (TensorRT) also builds an engine from an FP32 ONNX file at a lower one: FP16 always, INT8 only with
    the calibration cache that ships with the variant (an INT8 ONNX file carries
    its own quantization and builds as INT8 directly).
    """
    if variant.precision == precision:
        return True
    spec = SPECS.get(backend)
    if spec is not None and spec.builds_lower_precision and variant.format == "onnx" and variant.precision == "fp32":
        return precision == "fp16" or (precision == "int8" and variant.calibration_cache is not None)
    return False


def candidates(variants: Sequence[Variant], preferences: Sequence[Preference]) -> list[Candidate]:
    """Ordered candidates: by preference, then precision order, then native format, then a file's own precision."""
    out: list[Candidate] = []
    seen: set[tuple[str, str, str, str]] = set()
    for pref in preferences:
        for precision in pref.precisions:
            spec = SPECS.get(pref.backend)
            for fmt in spec.formats if spec is not None else ():
                matching = [v for v in variants if v.format == fmt and can_run_at(pref.backend, v, precision)]
                # A file made at the wanted precision beats one converted on the device.
                matching.sort(key=lambda v: v.precision != precision)
                for v in matching:
                    key = (pref.backend, pref.device, v.file, precision)
                    if key in seen:
                        continue
                    seen.add(key)
                    out.append(Candidate(v, pref.backend, pref.device, precision, pref.options))
    return out


def unavailable_reason(backend: str, options: BackendOptions | None = None) -> str | None:
    """Why a backend (with a profile line's options) cannot be used on this machine, or None when it can."""
    try:
        get_backend(backend).check_available_for(options or BackendOptions())
    except EdgedError as e:
        return str(e)
    return None
