"""Everything a model update needs from the serving side, in one place.

The update steps (``edged.sync.update``) see the engines only through :class:`EnginePort`;
:class:`ServiceEngine` is the one implementation, and the only sync module that reaches
into the model manager, its loader and its gateway. When the inference service grows a
façade for these, this class is the one place to point at it.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from edged.config import VersionPolicy
from edged.core.model_versions import ModelState
from edged.core.pipelines import load_pipeline_version
from edged.core.service import InferenceService
from edged.errors import EdgedError
from edged.repository.digests import DigestCache
from edged.repository.manifest import Evaluation
from edged.repository.store import VersionEntry
from edged.sync import quality
from edged.sync.trial import NOT_MODEL_ERRORS, Sample

UPGRADE_WAIT_S = 1.0


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
    """:class:`EnginePort` over today's :class:`InferenceService` and its model manager."""

    def __init__(self, service: InferenceService) -> None:
        self.service = service
        self.manager = service.manager

    def pin(self, model: str, version: int | None) -> None:
        """Make the live version policy (the ModelManager's, replaced on SIGHUP) name exactly this version."""
        models = self.manager.models_cfg
        if version is None:
            if model not in models.disabled:
                models.disabled.append(model)
            return
        models.policies[model] = VersionPolicy(specific=[version])
        if model in models.disabled:
            models.disabled.remove(model)

    def ready_versions(self, model: str) -> list[int]:
        return [mv.version for mv in self.manager.table.versions(model) if mv.state is ModelState.READY]

    def version_count(self, model: str) -> int:
        return len(self.manager.table.versions(model))

    def load(self, model: str, version: int) -> Loaded:
        results = self.manager.load_model(model, [version])
        mv = results[0] if results else None
        if mv is None:
            return Loaded(False, "not loaded")
        if mv.state is not ModelState.READY:
            return Loaded(False, mv.reason or "not loaded")
        return Loaded(True, label=mv.candidate.label if mv.candidate else None)

    def unload(self, model: str) -> None:
        with contextlib.suppress(EdgedError):
            self.manager.unload_model(model)

    def operator_unloaded(self, model: str) -> bool:
        return model in self.manager.operator_unloaded

    def rehearse(self, entry: VersionEntry, stop: threading.Event) -> Loaded:
        """Load, warm up and golden-check a staged version off to the side, then let it go.

        A pipeline has no engine: it is compiled against the models served now. A better engine
        being built (e.g. TensorRT) is waited for, so its cache is warm at activation, unless ``stop``.
        """
        if entry.pipeline:
            mv = load_pipeline_version(entry, self.manager.gateway, DigestCache(None))
            ok = mv.state is ModelState.READY
            return Loaded(ok, None if ok else mv.reason or "did not compile", "pipeline" if ok else None)
        mv = self.manager.loader.load(entry)
        if mv.upgrade is not None:
            while not mv.upgrade.wait(UPGRADE_WAIT_S) and not stop.is_set():
                pass
            mv.upgrade.cancel()
        if mv.state is not ModelState.READY or mv.engine is None:
            return Loaded(False, mv.reason or "did not load")
        label = mv.candidate.label if mv.candidate else None
        mv.engine.unload()
        mv.engine = None
        return Loaded(True, label=label)

    def sample(self, model: str, version: int) -> Sample | None:
        """The version's outcomes so far (the model's own errors only), None when it is not served."""
        try:
            stats = self.service.statistics(model, version)
            mv = self.service.model(model, version)
        except EdgedError:
            return None
        if not stats:
            return None
        s = stats[0]
        ok = int(s["inference_stats"]["success"]["count"])
        by_code: dict[str, int] = s.get("failures_by_code", {})
        errors = sum(n for code, n in by_code.items() if code not in NOT_MODEL_ERRORS)
        counts = mv.stats.latency_counts() if mv.stats is not None else ()
        return Sample(ok=ok, errors=errors, latency_counts=counts)

    def score(self, model: str, version: int, folder: Path, ev: Evaluation) -> quality.Score:
        return quality.score(self.service.model(model, version), folder, ev)
