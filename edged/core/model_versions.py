"""Model versions and the table of them: state, engine, I/O, warm-up inputs, status for the APIs.

A version is made by :class:`edged.core.model_loader.ModelLoader` (engine choice, I/O
auto-complete, warm-up) and kept in :class:`ModelTable`, which the manager, pipelines and
chooser read.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from edged import datatypes
from edged.backends.base import Engine
from edged.backends.benchmark import BenchmarkResult
from edged.backends.selection import Candidate
from edged.core.scheduler import Scheduler
from edged.core.stats import ModelStats
from edged.core.upgrade import EngineUpgrade
from edged.repository.manifest import Batching, ModelManifest, TensorSpec
from edged.repository.store import VersionEntry

if TYPE_CHECKING:
    from edged.pipeline.graph import Pipeline

class ModelState(str, enum.Enum):
    LOADING = "loading"
    READY = "ready"
    UNAVAILABLE = "unavailable"
    UNLOADING = "unloading"
    UNLOADED = "unloaded"


class ChoiceView(Protocol):
    """What a version shows of how its engine is being chosen (edged.core.chooser.Choice)."""

    def status(self) -> dict[str, Any]: ...


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
    benchmark: BenchmarkResult | None = None  # set when the profile selects by measurement
    upgrade: EngineUpgrade | None = None  # set while/after a better engine is built in the background
    warmup_note: str | None = None  # warm-up skipped or ran on made-up data, and how to declare real shapes
    warmup_skipped: bool = False  # the model refused the made-up warm-up input (self-test skipped too)
    output_note: str | None = None  # a declared output shape the engine's answers contradict (core.output_shapes)
    validation_plan: Any = None  # edged.core.validation's precomputed checks, made on first use
    pipeline: Pipeline | None = None  # set for a pipeline version (edged.core.pipelines): no engine of its own
    choice: ChoiceView | None = None  # set when the engine is chosen by measurement while serving (core.chooser)
    candidates: list[Candidate] = field(default_factory=list)  # every candidate, in the profile's order
    selection_key: str = ""  # what a measurement of the candidates is remembered under
    notes: list[str] = field(default_factory=list)  # said at load and in `models list` (a batching choice...)

    @property
    def manifest(self) -> ModelManifest:
        assert self.entry.manifest is not None
        return self.entry.manifest

    auto_max_batch_size: int | None = None  # set when the manifest leaves max_batch_size to the model file

    @property
    def max_batch_size(self) -> int:
        if self.entry.manifest is None:
            return 0
        return self.manifest.max_batch_size if self.auto_max_batch_size is None else self.auto_max_batch_size

    @property
    def batching(self) -> Batching | None:
        """Dynamic batching: the manifest's, or the defaults for a model that batches (max_batch_size > 0,
        stated or auto-completed) without a [batching] section; None when it does not batch or says
        ``dynamic = false``."""
        if self.entry.manifest is None or self.max_batch_size <= 0:
            return None
        batching = self.manifest.batching
        if batching is None:
            return Batching()
        return batching if batching.dynamic else None

    def batching_note(self) -> str | None:
        """Why a model that could batch does not: said at load and in `models list`."""
        if self.entry.manifest is None or self.max_batch_size <= 0 or self.batching is not None:
            return None
        return (f"dynamic batching off ([batching] dynamic = false): each request runs alone, "
                f"up to max_batch_size {self.max_batch_size} rows")

    def status(self) -> dict[str, Any]:
        c = self.candidate
        out: dict[str, Any] = {
            "name": self.name,
            "version": self.version,
            "state": self.state.value,
            "reason": self.reason,
            "backend": c.backend if c else None,
            "device": c.device if c else None,
            "precision": c.precision if c else None,
            "variant": c.variant.file if c else None,
            "skipped": [{"candidate": k, "reason": r} for k, r in list(self.skipped)],
        }
        if self.entry.pipeline:
            out["kind"] = "pipeline"
            if self.pipeline is not None:
                out["models"] = sorted({m for m, _ in self.pipeline.models})
        if self.warmup_note:
            out["warmup"] = self.warmup_note
        if self.output_note:
            out["note"] = self.output_note
        if self.notes:
            out["notes"] = list(self.notes)
        if self.benchmark is not None:
            b = self.benchmark
            out["benchmark"] = [{"candidate": t.candidate, "throughput_per_s": round(t.throughput_per_s, 1),
                                 "batches": {str(k): round(v, 1) for k, v in t.batches.items()},
                                 "latency_ms": round(t.latency_ms, 3), "chosen": t.candidate == b.chosen,
                                 "source": b.source, "points": {k: round(v, 1) for k, v in t.points.items()}}
                                for t in list(b.timings)]
            out["benchmark_basis"] = {"basis": b.basis, "reason": b.reason, "workload": dict(b.workload),
                                      "measured_at": b.measured_at, "seconds": round(b.seconds, 2)}
        if self.choice is not None:
            out["choice"] = self.choice.status()
        how = choice_line(self)
        if how:
            out["chosen_how"] = how
        if self.upgrade is not None:
            out["upgrade"] = self.upgrade.status()
        placed = self.engine.processes() if self.engine is not None else None
        if placed is not None:
            out["engine_processes"] = placed
        return out


def choice_line(mv: ModelVersion) -> str | None:
    """One line on how the engine was chosen and on what evidence, for ``edged status`` and ``models list``."""
    state = mv.choice.status()["state"] if mv.choice is not None else None
    b = mv.benchmark
    if state == "single":
        others = "; ".join(f"{k}: {r[:80]}" for k, r in mv.skipped)
        return f"the only candidate that loads here ({others})" if others else "the only candidate that loads here"
    if b is None:
        return f"engine choice {state}: serving the profile's first candidate until measured" if state else None
    rates = ", ".join(f"{t.backend}{'*' if t.candidate == b.chosen else ''} {t.throughput_per_s:.0f}/s"
                      for t in sorted(b.timings, key=lambda t: -t.throughput_per_s))
    on = ", ".join(f"{k} {v:.0%}" for k, v in b.workload.items()) or "batch " + "/".join(map(str, b.batch_sizes))
    split = f"; batches of 2+ on {b.chosen_batched}" if b.chosen_batched else ""
    return f"chosen by measurement ({b.source}, {b.basis}: {on}): {rates}{split}" + (
        f"; now {state}" if state and state != "chosen" else "")


SYNTH_DIM = 64  # a made-up dynamic dimension: 1 is too small for many real models (pads, strides)
DECLARE_HINT = ("declare the shapes it really sees in model.toml ([warmup.shapes.<input>] shape = [...]) "
                "or sample data ([warmup] file)")


def synthesized(mv: ModelVersion, inputs: Sequence[TensorSpec] | None = None) -> list[str]:
    """The inputs whose warm-up data would be made up with guessed dynamic dimensions."""
    specs = list(inputs) if inputs is not None else mv.inputs
    w = mv.manifest.warmup
    if w.file:
        return []
    return [s.name for s in specs if s.name not in w.shapes and any(d < 0 for d in s.shape)]


def sample_inputs(mv: ModelVersion, inputs: Sequence[TensorSpec] | None = None) -> dict[str, np.ndarray]:
    """Warm-up inputs: the manifest's sample file, else data shaped as declared, else made up.

    Made-up dynamic dimensions are :data:`SYNTH_DIM` (the first one of an unbatched input,
    usually its batch, is 1); scalars (shape ``[]``) stay scalars.
    """
    specs = list(inputs) if inputs is not None else mv.inputs
    w = mv.manifest.warmup
    if w.file:
        with np.load(mv.entry.path / w.file) as data:
            return {spec.name: np.require(data[spec.name], requirements="C") for spec in specs}
    rng = np.random.default_rng(0)
    out = {}
    batched = mv.max_batch_size > 0
    for spec in specs:
        declared = w.shapes.get(spec.name)
        if declared is not None:
            shape = list(declared.shape)
        else:
            shape = [d if d >= 0 else (1 if i == 0 and not batched else SYNTH_DIM) for i, d in enumerate(spec.shape)]
        if batched:
            shape = [1, *shape]
        dtype = datatypes.to_numpy(spec.datatype)
        if declared is not None and declared.value is not None:
            out[spec.name] = np.full(shape, declared.value, dtype=dtype)
        elif dtype.kind == "f":
            out[spec.name] = np.asarray(rng.random(shape), dtype=dtype)
        else:
            out[spec.name] = np.zeros(shape, dtype=dtype)
    return out


class ModelTable:
    """The set of model versions the daemon knows, with thread-safe lookup."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._versions: dict[str, dict[int, ModelVersion]] = {}
        # The version an unpinned request gets, per name: found once, dropped on any put or remove.
        # Versions are published READY or not at all; one that stops being READY misses the cache.
        self._current: dict[str, ModelVersion] = {}

    def put(self, mv: ModelVersion) -> ModelVersion | None:
        with self._lock:
            self._current.clear()
            old = self._versions.setdefault(mv.name, {}).get(mv.version)
            self._versions[mv.name][mv.version] = mv
            return old

    def remove(self, name: str, version: int) -> ModelVersion | None:
        with self._lock:
            self._current.clear()
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

    def serving(self, name: str) -> ModelVersion | None:
        """The version requests without one go to, when it is known and READY (no lock: the hot path)."""
        mv = self._current.get(name)
        return mv if mv is not None and mv.state is ModelState.READY else None

    def find(self, name: str, version: int | None = None) -> ModelVersion | None:
        """The named version, or with None the newest READY one (else the newest known)."""
        if version is None and (mv := self.serving(name)) is not None:
            return mv
        with self._lock:
            versions = self._versions.get(name)
            if not versions:
                return None
            if version is not None:
                return versions.get(version)
            ready = [v for v, mv in versions.items() if mv.state is ModelState.READY]
            if not ready:
                return versions[max(versions)]
            mv = self._current[name] = versions[max(ready)]
            return mv
