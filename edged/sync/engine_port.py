"""Everything a model update needs from the serving side, in one place.

The update steps (``edged.sync.update``) see the engines only through :class:`EnginePort`;
:class:`ServiceEngine` is the one implementation, over the inference service's façade.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from edged.core.public import ModelState
from edged.core.service import InferenceService
from edged.errors import EdgedError
from edged.repository.manifest import Evaluation
from edged.repository.store import VersionEntry
from edged.sync import quality
from edged.sync.trial import NOT_MODEL_ERRORS, Sample


@dataclass(frozen=True)
class Loaded:
    """How loading one version went: ``ready`` or the ``reason`` it is not; ``label``: the engine chosen."""

    ready: bool
    reason: str | None = None
    label: str | None = None


class EnginePort(Protocol):
    """What the updater asks of the serving side (pins, loads, statistics, evaluation-set scores)."""

    def pin(self, model: str, version: int | None) -> None: ...
    def ready_versions(self, model: str) -> list[int]: ...
    def version_count(self, model: str) -> int: ...
    def load(self, model: str, version: int) -> Loaded: ...
    def unload(self, model: str) -> None: ...
    def operator_unloaded(self, model: str) -> bool: ...
    def rehearse(self, entry: VersionEntry, stop: threading.Event) -> Loaded: ...
    def sample(self, model: str, version: int) -> Sample | None: ...
    def score(self, model: str, version: int, folder: Path, ev: Evaluation) -> quality.Score: ...


class ServiceEngine:
    """:class:`EnginePort` over the inference service's façade (nothing else of core)."""

    def __init__(self, service: InferenceService) -> None:
        self.service = service

    def pin(self, model: str, version: int | None) -> None:
        self.service.pin(model, version)

    def ready_versions(self, model: str) -> list[int]:
        return [mv.version for mv in self.service.versions(model) if mv.state is ModelState.READY]

    def version_count(self, model: str) -> int:
        return len(self.service.versions(model))

    def load(self, model: str, version: int) -> Loaded:
        results = self.service.load(model, [version])
        mv = results[0] if results else None
        if mv is None:
            return Loaded(False, "not loaded")
        if mv.state is not ModelState.READY:
            return Loaded(False, mv.reason or "not loaded")
        return Loaded(True, label=mv.candidate.label if mv.candidate else None)

    def unload(self, model: str) -> None:
        with contextlib.suppress(EdgedError):
            self.service.unload(model)

    def operator_unloaded(self, model: str) -> bool:
        return self.service.unloaded_by_operator(model)

    def rehearse(self, entry: VersionEntry, stop: threading.Event) -> Loaded:
        """Load, warm up and golden-check a staged version off to the side, then let it go (a pipeline
        compiles against the models served now); a better engine being built is waited for, unless ``stop``."""
        check = self.service.try_load(entry, stop)
        if check.engine is None:
            return Loaded(False, check.reason or "did not load")
        return Loaded(True, label=check.engine)

    def sample(self, model: str, version: int) -> Sample | None:
        """The version's outcomes so far (the model's own errors only), None when it is not served."""
        try:
            stats = self.service.version_statistics(model, version)
            mv = self.service.model(model, version)
        except EdgedError:
            return None
        if not stats:
            return None
        s = stats[0]
        errors = sum(n for code, n in s.failures_by_code.items() if code not in NOT_MODEL_ERRORS)
        counts = mv.stats.latency_counts() if mv.stats is not None else ()
        return Sample(ok=s.success.count, errors=errors, latency_counts=counts)

    def score(self, model: str, version: int, folder: Path, ev: Evaluation) -> quality.Score:
        return quality.score(self.service.model(model, version), folder, ev)
