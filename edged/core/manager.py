"""Model lifecycle: load, reload and unload versions while serving, with memory admission.

A new version is loaded, warmed up and checked before it gets traffic; only then
is it published, and the version it replaces drains its in-flight requests before
its engine is released. A version that fails to load never replaces anything.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from edged.config import ModelsSection
from edged.core.chooser import EngineChooser, attach
from edged.core.model_loader import ModelLoader
from edged.core.model_versions import ModelState, ModelTable, ModelVersion
from edged.core.output_shapes import OutputShapeCheck
from edged.core.pipelines import PipelineRunner, ServedModels, load_pipeline_version
from edged.core.scheduler import Scheduler
from edged.core.stats import ModelStats
from edged.core.traffic import TrafficMix
from edged.cpus import DEFAULT_SPIN_US
from edged.errors import EdgedError, ModelNotFoundError, ResourceExhaustedError
from edged.heap import review_soon
from edged.pipeline.definition import load_pipeline
from edged.repository.digests import DigestCache
from edged.repository.store import VersionEntry, list_versions, load_version, scan_repository

if TYPE_CHECKING:
    from edged.backends.base import Engine
    from edged.hardware.facts import HardwareFacts
    from edged.profiles import BackendPreference

log = logging.getLogger(__name__)
DRAIN_TIMEOUT_S = 30.0
LOAD_WORKERS = 4
# A stop gives the engine choice at least this long to notice it between engine calls.
CHOOSER_STOP_MIN_S = 0.5


def estimate_memory_mb(entry: VersionEntry) -> float:
    """Before loading: the manifest's figure, else twice the largest variant's files (weights + workspace)."""
    m = entry.manifest
    if m is None:
        return 0.0
    if m.memory_mb is not None:
        return m.memory_mb
    sizes = []
    for v in entry.usable_variants:
        total = 0
        for art in [v, *v.extra_files]:
            try:
                total += (entry.path / art.file).stat().st_size
            except OSError:
                pass
        sizes.append(total)
    return 2.0 * max(sizes, default=0) / 1e6 + 4.0



def _free_when_drained(scheduler: Scheduler, engine: Engine) -> None:
    """Free a retired version's engine once the run still inside it ends (it may never: then never)."""
    scheduler.drain(None)
    engine.unload()
    log.info("model=%s version=%s: its last run ended; engine freed", scheduler.name, scheduler.version)


def _output_check(mv: ModelVersion) -> OutputShapeCheck:
    def note(text: str) -> None:
        mv.output_note = text

    return OutputShapeCheck(f"model {mv.name!r} version {mv.version}", mv.outputs, batched=mv.max_batch_size > 0,
                            on_note=note)

class ModelManager:
    def __init__(self, repository: Path, models: ModelsSection, preferences: Sequence[BackendPreference], *,  # noqa: PLR0913  keyword-only options passed through from the daemon's config
                 cache_dir: Path | None = None, threads: int = 0, memory_budget_mb: float = 0.0,
                 select: str = "first", facts: HardwareFacts | None = None, defer_choice: bool = False,
                 processes: int = 0, stop: Callable[[], bool] | None = None, spin_us: int = DEFAULT_SPIN_US) -> None:
        """``stop`` true (the daemon stopping): loads in progress give up at their next step (ModelLoader)."""
        self.repository = repository
        self.models_cfg = models
        self.loader = ModelLoader(preferences, cache_dir=cache_dir, threads=threads, select=select, facts=facts,
                                  defer_choice=defer_choice, processes=processes, stop=stop, spin_us=spin_us)
        self.table = ModelTable()
        # Measures engines while serving and switches (edged.core.chooser); the daemon starts it once READY.
        self.chooser = EngineChooser(self.table, self.loader)
        self.memory_budget_mb = memory_budget_mb
        # Versions loaded at once by load_all (engine compilation runs outside the GIL); 1: one by one.
        # CPU engines only: GPU engine builds (TensorRT) each take a large share of a device's memory.
        cpu_only = all(p.device == "CPU" for p in preferences)
        self.load_workers = min(LOAD_WORKERS, max(2, os.cpu_count() or 1)) if cpu_only else 1
        self.digests = DigestCache(cache_dir / "digests.json" if cache_dir else None)
        self._lock = threading.Lock()  # one lifecycle change at a time
        self.failed: dict[tuple[str, int], ModelVersion] = {}
        self._failed_lock = threading.Lock()  # statuses() must not wait for a slow load
        # Models an operator unloaded through a management API: the updater pauses a trial instead of failing it.
        self.operator_unloaded: set[str] = set()
        # Pipelines compile against this table; their requests run on the runner's loop, their model
        # steps going back through the InferenceService that started each one (InferenceService.call_model).
        self.gateway = ServedModels(self.table)
        self.runner = PipelineRunner()

    # ---- admission --------------------------------------------------------------------------
    def committed_mb(self) -> float:
        return sum(mv.memory_mb for mv in self.table.all() if mv.state is ModelState.READY)

    def _admit(self, entry: VersionEntry) -> float:
        need = estimate_memory_mb(entry)
        if self.memory_budget_mb > 0:
            used = self.committed_mb()
            if used + need > self.memory_budget_mb:
                raise ResourceExhaustedError(
                    f"model {entry.model!r} version {entry.version} needs about {need:.0f} MB but only "
                    f"{max(0.0, self.memory_budget_mb - used):.0f} MB of the {self.memory_budget_mb:.0f} MB "
                    "model budget is left", model=entry.model, version=entry.version)
        return need

    # ---- loading ----------------------------------------------------------------------------
    def _load_entry(self, entry: VersionEntry) -> ModelVersion:
        if entry.pipeline:
            return load_pipeline_version(entry, self.gateway, self.digests)
        try:
            estimate = self._admit(entry)
        except ResourceExhaustedError as e:
            mv = ModelVersion(entry.model, entry.version, entry, ModelState.UNAVAILABLE, str(e))
            log.error("model=%s version=%s refused: %s", entry.model, entry.version, e)
            return mv
        rss0 = psutil.Process(os.getpid()).memory_info().rss
        mv = self.loader.load(entry)
        return self._finish(mv, estimate, (psutil.Process(os.getpid()).memory_info().rss - rss0) / 1e6)

    def _finish(self, mv: ModelVersion, estimate: float, grown: float) -> ModelVersion:
        """A loaded version gets its memory figure, statistics, scheduler and (maybe) an engine choice."""
        choice = attach(mv, self.loader) if mv.state is ModelState.READY else None
        if mv.state is ModelState.READY and mv.engine is not None:
            mv.memory_mb = max(estimate, grown + mv.engine.process_memory_mb())
            manifest = mv.manifest
            mv.stats = ModelStats(mv.name, mv.version, mv.candidate.backend if mv.candidate else "")
            mv.scheduler = Scheduler(mv.name, mv.version, mv.engine, max_batch_size=mv.max_batch_size,
                                     batching=mv.batching,
                                     instances=max(manifest.instances.count, mv.engine.parallel),
                                     stats=mv.stats, shapes_vary=any(-1 in s.shape for s in mv.inputs),
                                     output_check=_output_check(mv))
            if choice is not None:
                choice.traffic = mv.scheduler.traffic = TrafficMix(mv.max_batch_size > 0)
            note = mv.batching_note()
            if note:
                mv.notes.append(note)
                log.warning("model=%s version=%s: %s", mv.name, mv.version, note)
        return mv

    def load_all(self) -> list[ModelVersion]:
        """Initial load of every selected version; broken ones are kept with their reason."""
        with self._lock:
            out = []
            entries = scan_repository(self.repository, self.models_cfg, self.digests)
            models = [e for e in entries if not e.pipeline]
            if len(models) > 1 and self.load_workers > 1:
                for mv in self._load_together(models):
                    self.table.put(mv)
                    out.append(mv)
                models = []
            # Pipelines after every model: they are compiled against the models being served.
            for entry in [*models, *(e for e in entries if e.pipeline)]:
                mv = self._load_entry(entry)
                self.table.put(mv)
                out.append(mv)
            self.digests.save()
            return out

    def _load_together(self, entries: Sequence[VersionEntry]) -> list[ModelVersion]:
        """Load several versions at once (engines compile outside the GIL): a first boot with many models
        is READY in a fraction of the time. Memory is admitted for all of them before any loads (each
        estimate reserved in turn); the growth of the process is shared out in proportion to the estimates."""
        out: dict[int, ModelVersion] = {}
        admitted: list[tuple[int, VersionEntry, float]] = []
        reserved = 0.0
        for i, entry in enumerate(entries):
            need = estimate_memory_mb(entry)
            if entry.manifest is not None and self.memory_budget_mb > 0:
                used = self.committed_mb() + reserved
                if used + need > self.memory_budget_mb:
                    e = ResourceExhaustedError(
                        f"model {entry.model!r} version {entry.version} needs about {need:.0f} MB but only "
                        f"{max(0.0, self.memory_budget_mb - used):.0f} MB of the {self.memory_budget_mb:.0f} MB "
                        "model budget is left", model=entry.model, version=entry.version)
                    log.error("model=%s version=%s refused: %s", entry.model, entry.version, e)
                    out[i] = ModelVersion(entry.model, entry.version, entry, ModelState.UNAVAILABLE, str(e))
                    continue
            reserved += need
            admitted.append((i, entry, need))
        rss0 = psutil.Process(os.getpid()).memory_info().rss
        workers = min(self.load_workers, len(admitted)) or 1
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="edged-load") as pool:
            futures = [(i, need, pool.submit(self.loader.load, entry)) for i, entry, need in admitted]
            loaded = [(i, need, f.result()) for i, need, f in futures]
        self.loader.restore_locale()  # the last load may have interleaved with another's
        grown = (psutil.Process(os.getpid()).memory_info().rss - rss0) / 1e6
        total = sum(need for _, need, mv in loaded if mv.state is ModelState.READY) or 1.0
        for i, need, mv in loaded:
            out[i] = self._finish(mv, need, grown * need / total)
        return [out[i] for i in range(len(entries))]

    def load_model(self, name: str, versions: Sequence[int] | None = None) -> list[ModelVersion]:
        """(Re)load a model's versions from the repository without downtime.

        With ``versions`` None the config's version policy decides. New versions are
        published only once ready; versions no longer wanted are drained and unloaded.
        A pipeline's models that are not being served are loaded first (as Triton loads
        an ensemble's composing models).
        """
        with self._lock:
            return self._load_model(name, versions, dependencies=True)

    def _load_dependencies(self, entry: VersionEntry) -> None:
        """Load the models a pipeline version names that are not served; what fails is left to its compile."""
        try:
            spec = load_pipeline(entry.path)
        except EdgedError:
            return
        for step in spec.steps:
            if step.model is None or step.model == entry.model:
                continue
            mv = self.table.find(step.model, step.version)
            if mv is not None and mv.state is ModelState.READY:
                continue
            try:
                self._load_model(step.model, None, dependencies=False)
            except EdgedError as exc:
                log.warning("pipeline=%s: its model %s could not be loaded: %s", entry.model, step.model, exc)

    def _load_model(self, name: str, versions: Sequence[int] | None, *, dependencies: bool) -> list[ModelVersion]:
        model_dir = self.repository / name
        if not model_dir.is_dir():  # Triton's wording, then edged's
            raise ModelNotFoundError(f"failed to load '{name}', failed to poll from model repository "
                                     f"(model {name!r} is not in the repository)")
        available = list_versions(model_dir)
        wanted = list(versions) if versions is not None else self.models_cfg.policy_for(name).select(available)
        missing = [v for v in wanted if v not in available]
        if missing:
            raise ModelNotFoundError(f"model {name!r} has no version(s) {missing} in the repository")
        results: list[ModelVersion] = []
        try:
            self._load_versions(name, model_dir, wanted, results, dependencies=dependencies)
        except BaseException:
            if any(mv.state is ModelState.READY for mv in self.table.versions(name)):
                self.operator_unloaded.discard(name)  # serving again, whatever failed after
            raise
        # Only now: while the versions load, a watcher (a release's trial) must still see the operator's
        # unload, not a model that vanished on its own.
        self.operator_unloaded.discard(name)
        ready_new = any(mv.state is ModelState.READY for mv in results)
        if ready_new or not results:
            for old in self.table.versions(name):
                if old.version not in wanted:
                    self.table.remove(name, old.version)
                    self._retire(old)
        self.digests.save()
        return results

    def _load_versions(self, name: str, model_dir: Path, wanted: list[int], results: list[ModelVersion], *,
                       dependencies: bool) -> None:
        """Load and publish each wanted version (a ready copy keeps serving when its reload fails)."""
        for v in wanted:
            entry = load_version(name, v, model_dir / str(v), self.digests)
            if entry.pipeline and dependencies and not entry.error:
                self._load_dependencies(entry)
            mv = self._load_entry(entry)
            results.append(mv)
            current = self.table.find(name, v)
            if mv.state is ModelState.READY:
                if mv.stats is not None and current is not None and current.stats is not None:
                    mv.stats.continue_activation(current.stats)
                old = self.table.put(mv)
                with self._failed_lock:
                    self.failed.pop((name, v), None)
                if old is not None and old is not mv:
                    self._retire(old)
            elif current is None or current.state is not ModelState.READY:
                self.table.put(mv)
            else:
                # Keep serving the copy that works; remember why the reload failed.
                with self._failed_lock:
                    self.failed[(name, v)] = mv
                log.error("model=%s version=%s reload failed, previous copy keeps serving: %s",
                          name, v, mv.reason)

    def unload_model(self, name: str, *, by_operator: bool = False) -> None:
        with self._lock:
            versions = self.table.versions(name)
            if not versions:
                raise ModelNotFoundError(f"model {name!r} is not loaded")
            if by_operator:
                self.operator_unloaded.add(name)
            for mv in versions:
                self.table.remove(name, mv.version)
                self._retire(mv)

    def _retire(self, mv: ModelVersion) -> None:
        """Drain in-flight work of a version no longer published, then free its engine."""
        mv.state = ModelState.UNLOADING
        scheduler = mv.scheduler
        if scheduler is not None and not scheduler.drain(DRAIN_TIMEOUT_S):
            # A run is still inside the engine: freeing it under the run could crash the process. It is
            # freed when the run ends, by a thread that waits for that.
            log.warning("model=%s version=%s did not drain within %.0fs; its engine is freed when its last "
                        "run ends", mv.name, mv.version, DRAIN_TIMEOUT_S)
            engine, mv.engine = mv.engine, None
            if engine is not None:
                threading.Thread(target=_free_when_drained, args=(scheduler, engine), daemon=True,
                                 name=f"edged-retire-{mv.name}-v{mv.version}").start()
        elif mv.engine is not None:
            mv.engine.unload()
            mv.engine = None
        mv.state = ModelState.UNLOADED
        log.info("model=%s version=%s unloaded", mv.name, mv.version)
        review_soon()  # what it held since start-up is frozen from the collector (edged/heap.py)

    def shutdown(self, timeout: float = DRAIN_TIMEOUT_S, *, lock_wait_s: float | None = None
                 ) -> list[threading.Thread]:
        """Release every published version. ``lock_wait_s``: how long to wait for a load in progress (it
        may be inside an engine call that runs for minutes), and for the engine choice's measurement;
        past it the versions are released without it, and that load, once its call returns, gives up and
        releases its own engine (``stop``). Returns the threads left inside an engine call (the engine
        choice's): the caller exits without joining them (``Daemon.exit_past_abandoned``)."""
        chooser = self.chooser.stop(60.0 if lock_wait_s is None else max(lock_wait_s, CHOOSER_STOP_MIN_S))
        if chooser is not None:
            log.warning("the engine choice is still inside a candidate's engine call; stopping without it")
        locked = self._lock.acquire(timeout=-1 if lock_wait_s is None else lock_wait_s)
        if not locked:
            log.warning("a model load is still inside its engine; releasing the versions served without waiting")
        try:
            for mv in self.table.all():
                drained = mv.scheduler is None or mv.scheduler.drain(timeout)
                # Else a run is inside the engine (a request's, or the engine choice timing the engine
                # serving): the process exit frees it.
                if mv.engine is not None and drained and chooser is None:
                    mv.engine.unload()
                mv.engine = None
                mv.state = ModelState.UNLOADED
        finally:
            if locked:
                self._lock.release()
        self.runner.stop()
        return [chooser] if chooser is not None else []

    def statuses(self) -> list[dict[str, object]]:
        out = [mv.status() for mv in self.table.all()]
        with self._failed_lock:  # load_model changes `failed` from other threads
            failed = sorted(self.failed.items())
        for _key, mv in failed:
            s = mv.status()
            s["state"] = "reload_failed"
            out.append(s)
        return out
