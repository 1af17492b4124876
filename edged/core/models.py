"""Loaded model versions: engine choice with fallback, I/O auto-complete, warm-up and state."""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edged import datatypes
from edged.backends.base import Engine, EngineTensor, LoadRequest
from edged.backends.registry import get_backend
from edged.backends.selection import Candidate, candidates, unavailable_reason
from edged.core.scheduler import Scheduler
from edged.core.stats import ModelStats
from edged.errors import EdgedError, ModelLoadError
from edged.repository.manifest import ModelManifest, TensorSpec
from edged.repository.store import VersionEntry

if TYPE_CHECKING:
    from edged.profiles import BackendPreference

log = logging.getLogger(__name__)


class ModelState(str, enum.Enum):
    LOADING = "loading"
    READY = "ready"
    UNAVAILABLE = "unavailable"
    UNLOADING = "unloading"
    UNLOADED = "unloaded"


@dataclass
class ModelVersion:
    """One version of one model and everything known about serving it."""

    name: str
    version: int
    entry: VersionEntry
    state: ModelState = ModelState.LOADING
    reason: str | None = None
    engine: Engine | None = None
    candidate: Candidate | None = None
    skipped: list[tuple[str, str]] = field(default_factory=list)
    inputs: list[TensorSpec] = field(default_factory=list)
    outputs: list[TensorSpec] = field(default_factory=list)
    load_seconds: float = 0.0
    memory_mb: float = 0.0
    scheduler: Scheduler | None = None
    stats: ModelStats | None = None

    @property
    def manifest(self) -> ModelManifest:
        assert self.entry.manifest is not None
        return self.entry.manifest

    @property
    def max_batch_size(self) -> int:
        return self.manifest.max_batch_size if self.entry.manifest else 0

    def status(self) -> dict[str, Any]:
        c = self.candidate
        return {
            "name": self.name,
            "version": self.version,
            "state": self.state.value,
            "reason": self.reason,
            "backend": c.backend if c else None,
            "device": c.device if c else None,
            "precision": c.precision if c else None,
            "variant": c.variant.file if c else None,
            "skipped": [{"candidate": k, "reason": r} for k, r in self.skipped],
        }


def _io_from_engine(tensors: Sequence[EngineTensor], max_batch_size: int) -> list[TensorSpec]:
    specs = []
    for t in tensors:
        shape = list(t.shape[1:] if max_batch_size > 0 else t.shape)
        specs.append(TensorSpec(name=t.name, datatype=t.datatype, shape=shape))  # type: ignore[arg-type]
    return specs


def _check_io(kind: str, declared: Sequence[TensorSpec], engine: Sequence[EngineTensor], mbs: int) -> None:
    """The manifest's tensors must exist in the engine with the same datatype and compatible rank."""
    by_name = {t.name: t for t in engine}
    for spec in declared:
        et = by_name.get(spec.name)
        if et is None:
            raise ModelLoadError(f"{kind} {spec.name!r} is not in the model file (it has {sorted(by_name)})")
        if et.datatype != spec.datatype:
            raise ModelLoadError(f"{kind} {spec.name!r} is {spec.datatype} in the manifest but {et.datatype} "
                                 "in the model file")
        eshape = et.shape[1:] if mbs > 0 else et.shape
        if et.shape and len(eshape) != len(spec.shape):
            raise ModelLoadError(f"{kind} {spec.name!r} has shape {spec.shape} in the manifest but "
                                 f"{list(eshape)} in the model file (batch dimension "
                                 f"{'excluded' if mbs > 0 else 'included'})")


def sample_inputs(mv: ModelVersion) -> dict[str, np.ndarray]:
    """Warm-up inputs: the manifest's sample file, else deterministic data shaped like the inputs."""
    wf = mv.manifest.warmup.file
    if wf:
        with np.load(mv.entry.path / wf) as data:
            return {spec.name: np.ascontiguousarray(data[spec.name]) for spec in mv.inputs}
    rng = np.random.default_rng(0)
    out = {}
    for spec in mv.inputs:
        shape = [d if d > 0 else 1 for d in spec.shape]
        if mv.max_batch_size > 0:
            shape = [1, *shape]
        dtype = datatypes.to_numpy(spec.datatype)
        if dtype.kind == "f":
            out[spec.name] = rng.random(shape).astype(dtype)
        elif dtype.kind in "iu":
            out[spec.name] = np.zeros(shape, dtype=dtype)
        else:
            out[spec.name] = np.zeros(shape, dtype=dtype)
    return out


def warm_up(mv: ModelVersion, engine: Engine) -> None:
    """One inference before any traffic; with ``warmup.expected`` a golden check against known outputs."""
    try:
        inputs = sample_inputs(mv)
    except (OSError, KeyError, ValueError) as e:
        raise ModelLoadError(f"warm-up input {mv.manifest.warmup.file} is unusable: {e}") from None
    try:
        result = engine.infer(inputs)
    except Exception as e:
        raise ModelLoadError(f"warm-up inference failed: {e}") from None
    expected_file = mv.manifest.warmup.expected
    if not expected_file:
        return
    w = mv.manifest.warmup
    with np.load(mv.entry.path / expected_file) as expected:
        for name in expected.files:
            if name not in result:
                raise ModelLoadError(f"golden check: output {name!r} missing")
            got, want = result[name], expected[name]
            tol = max(w.atol, 0.05) if mv.candidate and mv.candidate.precision != "fp32" else w.atol
            if got.shape != want.shape or not np.allclose(got, want, rtol=w.rtol, atol=tol):
                err = float(np.max(np.abs(got.astype(np.float64) - want))) if got.shape == want.shape else -1.0
                raise ModelLoadError(f"golden check failed for output {name!r}: max abs error {err:.3g} "
                                     f"(shape {list(got.shape)} vs {list(want.shape)})")


class ModelLoader:
    """Loads a version with the first candidate that works, remembering why others were skipped."""

    def __init__(self, preferences: Sequence[BackendPreference], *, cache_dir: Path | None, threads: int = 0) -> None:
        self.preferences = list(preferences)
        self.cache_dir = cache_dir
        self.threads = threads

    def load(self, entry: VersionEntry) -> ModelVersion:
        mv = ModelVersion(entry.model, entry.version, entry)
        for bad, why in entry.bad_variants.items():
            mv.skipped.append((bad, why))
        if entry.error or entry.manifest is None:
            mv.state, mv.reason = ModelState.UNAVAILABLE, entry.error
            return mv
        t0 = time.monotonic()
        cands = candidates(entry.usable_variants, self.preferences)
        if not cands:
            formats = sorted({f"{v.format}/{v.precision}" for v in entry.usable_variants})
            mv.state = ModelState.UNAVAILABLE
            mv.reason = f"no variant ({', '.join(formats)}) matches the device profile's engines"
            log.error("model=%s version=%s unavailable: %s", mv.name, mv.version, mv.reason)
            return mv
        for cand in cands:
            why = unavailable_reason(cand.backend)
            if why is None:
                try:
                    self._try(mv, cand)
                except EdgedError as e:
                    why = str(e)
                except Exception as e:  # an engine bug must not take the daemon down
                    why = f"unexpected {type(e).__name__}: {e}"
            if why is None:
                mv.state = ModelState.READY
                mv.load_seconds = time.monotonic() - t0
                log.info("model=%s version=%s ready on %s in %.2fs", mv.name, mv.version, cand.label, mv.load_seconds)
                return mv
            mv.skipped.append((cand.label, why))
            log.warning("model=%s version=%s candidate %s failed: %s", mv.name, mv.version, cand.label, why)
        mv.state = ModelState.UNAVAILABLE
        mv.reason = "every candidate engine failed: " + "; ".join(f"{k}: {r}" for k, r in mv.skipped[-len(cands):])
        return mv

    def _try(self, mv: ModelVersion, cand: Candidate) -> None:
        manifest = mv.manifest
        req = LoadRequest(
            model=mv.name, version=mv.version, version_dir=mv.entry.path, variant=cand.variant,
            device=cand.device, options=cand.options, max_batch_size=manifest.max_batch_size,
            inputs=manifest.inputs, threads=self.threads, instances=manifest.instances.count,
            cache_dir=(self.cache_dir / cand.backend) if self.cache_dir else None,
        )
        engine = get_backend(cand.backend).load(req)
        try:
            mbs = manifest.max_batch_size
            if manifest.inputs is not None:
                _check_io("input", manifest.inputs, engine.inputs, mbs)
            if manifest.outputs is not None:
                _check_io("output", manifest.outputs, engine.outputs, mbs)
            inputs = list(manifest.inputs) if manifest.inputs is not None else _io_from_engine(engine.inputs, mbs)
            outputs = list(manifest.outputs) if manifest.outputs is not None else _io_from_engine(engine.outputs, mbs)
            prev = (mv.inputs, mv.outputs, mv.candidate)
            mv.inputs, mv.outputs, mv.candidate = inputs, outputs, cand
            try:
                warm_up(mv, engine)
            except BaseException:
                mv.inputs, mv.outputs, mv.candidate = prev
                raise
        except BaseException:
            engine.unload()
            raise
        mv.engine = engine


class ModelTable:
    """The set of model versions the daemon knows, with thread-safe lookup."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._versions: dict[str, dict[int, ModelVersion]] = {}

    def put(self, mv: ModelVersion) -> ModelVersion | None:
        with self._lock:
            old = self._versions.setdefault(mv.name, {}).get(mv.version)
            self._versions[mv.name][mv.version] = mv
            return old

    def remove(self, name: str, version: int) -> ModelVersion | None:
        with self._lock:
            versions = self._versions.get(name, {})
            mv = versions.pop(version, None)
            if not versions:
                self._versions.pop(name, None)
            return mv

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._versions)

    def versions(self, name: str) -> list[ModelVersion]:
        with self._lock:
            return [mv for _, mv in sorted(self._versions.get(name, {}).items())]

    def all(self) -> list[ModelVersion]:
        with self._lock:
            return [mv for name in sorted(self._versions) for _, mv in sorted(self._versions[name].items())]

    def find(self, name: str, version: int | None = None) -> ModelVersion | None:
        """The named version, or with None the newest READY one (else the newest known)."""
        with self._lock:
            versions = self._versions.get(name)
            if not versions:
                return None
            if version is not None:
                return versions.get(version)
            ready = [v for v, mv in versions.items() if mv.state is ModelState.READY]
            return versions[max(ready)] if ready else versions[max(versions)]
