"""Loading a model version: engine choice with fallback or by measurement, I/O auto-complete, warm-up.

For each version the loader intersects the manifest's variants with the profile's
preferences and the engines that work here. With ``select = "first"`` it loads the
first candidate that loads and warms up, falling back down the list and keeping the
reason for every candidate it skipped. With ``select = "benchmark"`` it loads every
candidate, times them on the device (:mod:`edged.backends.benchmark`), keeps the
fastest and remembers the result. A candidate whose engine must be built first
(TensorRT from ONNX) is built in the background while the version serves through
the next candidate, then switched in (:mod:`edged.core.upgrade`). What it loads is a
:class:`~edged.core.model_versions.ModelVersion`, kept in the daemon's table there.
"""

from __future__ import annotations

import hashlib
import json
import locale
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edged.backends.base import Engine, EngineTensor, LoadRequest
from edged.backends.benchmark import (
    BenchmarkResult,
    BenchmarkSettings,
    CandidateTiming,
    SelectionMemory,
    batch_sizes_for,
    choose,
    default_points,
    fingerprint_of,
    measure,
    measure_points,
    selection_key,
)
from edged.backends.build import EngineBuild, EngineBuildRequiredError
from edged.backends.enginecache import EngineCache, EngineCacheKey, variant_digest
from edged.backends.factory import get_backend
from edged.backends.options import BackendOptions, OpenVinoOptions, TensorRtOptions
from edged.backends.selection import Candidate, candidates, unavailable_reason
from edged.backends.specs import SPECS, spec_for
from edged.core.model_versions import DECLARE_HINT, ModelState, ModelVersion, sample_inputs, synthesized
from edged.core.upgrade import EngineUpgrade, SwappableEngine
from edged.cpus import DEFAULT_SPIN_US
from edged.errors import EdgedError, ErrorCode, ModelLoadError
from edged.repository.manifest import InputShape, ModelManifest, TensorSpec
from edged.repository.store import VersionEntry

if TYPE_CHECKING:
    from edged.hardware.facts import HardwareFacts
    from edged.profiles import BackendPreference

log = logging.getLogger("edged.core.model_versions")  # the name log filters have known these lines by

SELECT_MODES = ("first", "benchmark")


class LoadStoppedError(EdgedError):
    """The daemon is stopping: a load gives up at its next step instead of holding the stop up."""

    code = ErrorCode.UNAVAILABLE


def _io_from_engine(tensors: Sequence[EngineTensor], max_batch_size: int) -> list[TensorSpec]:
    specs = []
    for t in tensors:
        shape = list(t.shape[1:] if max_batch_size > 0 else t.shape)
        specs.append(TensorSpec(name=t.name, datatype=t.datatype, shape=shape))
    return specs


AUTO_MAX_BATCH_SIZE = 4  # Triton's default-max-batch-size for models whose tensors all start dynamic


def auto_max_batch_size(manifest: ModelManifest, engine: Engine) -> int | None:
    """Triton's auto-completion: a manifest that states neither max_batch_size nor tensors, for a model
    whose every input and output starts with a dynamic dimension, batches up to AUTO_MAX_BATCH_SIZE.

    None when the manifest decides (max_batch_size given, even 0, or tensors declared).
    """
    if "max_batch_size" in manifest.model_fields_set or manifest.inputs is not None or manifest.outputs is not None:
        return None
    tensors = [*engine.inputs, *engine.outputs]
    return AUTO_MAX_BATCH_SIZE if tensors and all(t.shape and t.shape[0] == -1 for t in tensors) else 0


def _check_shapes(shapes: dict[str, InputShape], inputs: Sequence[TensorSpec]) -> None:
    """Declared warm-up shapes must name real inputs and fit them (checked once the model's inputs are known)."""
    by_name = {t.name: t for t in inputs}
    for name, shp in shapes.items():
        spec = by_name.get(name)
        if spec is None:
            raise ModelLoadError(f"[warmup.shapes.{name}]: the model has no input {name!r} (it has {sorted(by_name)})")
        if len(spec.shape) != len(shp.shape) or any(w not in (-1, h) for w, h in zip(spec.shape, shp.shape,
                                                                                     strict=False)):
            raise ModelLoadError(f"[warmup.shapes.{name}]: shape {shp.shape} does not fit the input's shape "
                                 f"{spec.shape}")


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


def workload_digest(mv: ModelVersion) -> str:
    """What a measurement ran on: declared tensors and shapes, and the sample data's bytes."""
    m = mv.manifest
    h = hashlib.sha256(json.dumps({
        "max_batch_size": mv.max_batch_size, "warmup": m.warmup.model_dump(mode="json"),
        "inputs": [i.model_dump(mode="json") for i in m.inputs] if m.inputs is not None else None,
    }, sort_keys=True).encode())
    if m.warmup.file:
        try:
            h.update((mv.entry.path / m.warmup.file).read_bytes())
        except OSError:
            h.update(b"unreadable")
    return h.hexdigest()


def warm_up(mv: ModelVersion, engine: Engine, *, inputs: Sequence[TensorSpec] | None = None,
            precision: str | None = None) -> None:
    """One inference before any traffic; with ``warmup.expected`` a golden check against known outputs.

    ``inputs``/``precision`` describe the candidate being checked when it is not (yet)
    the version's own, e.g. an engine built in the background for a version already serving.
    A made-up input the model refuses proves nothing about the model: the version still
    serves, with a note (``mv.warmup_note``) that says so and how to declare real shapes.
    """
    try:
        sample = sample_inputs(mv, inputs)
    except (OSError, KeyError, ValueError) as e:
        raise ModelLoadError(f"warm-up input {mv.manifest.warmup.file} is unusable: {e}") from None
    made_up = synthesized(mv, inputs)
    try:
        result = engine.infer(sample)
    except Exception as e:
        if not made_up:
            raise ModelLoadError(f"warm-up inference failed: {e}") from None
        shapes = ", ".join(f"{n} {list(sample[n].shape)}" for n in made_up)
        mv.warmup_note = (f"warm-up skipped: the model refused made-up input ({shapes}): "
                          f"{' '.join(str(e).split())[:300]}; {DECLARE_HINT}")
        mv.warmup_skipped = True
        log.warning("model=%s version=%s %s", mv.name, mv.version, mv.warmup_note)
        return
    mv.warmup_skipped = False
    if made_up:
        shapes = ", ".join(f"{n} {list(sample[n].shape)}" for n in made_up)
        mv.warmup_note = f"warm-up ran on made-up data ({shapes}); {DECLARE_HINT}"
    else:
        mv.warmup_note = None
    expected_file = mv.manifest.warmup.expected
    if not expected_file:
        return
    w = mv.manifest.warmup
    if precision is None:
        precision = mv.candidate.precision if mv.candidate else "fp32"
    with np.load(mv.entry.path / expected_file) as expected:
        for name in expected.files:
            if name not in result:
                raise ModelLoadError(f"golden check: output {name!r} missing")
            got, want = result[name], expected[name]
            tol = max(w.atol, 0.05) if precision != "fp32" else w.atol
            if got.shape != want.shape or not np.allclose(got, want, rtol=w.rtol, atol=tol):
                err = float(np.max(np.abs(got.astype(np.float64) - want))) if got.shape == want.shape else -1.0
                raise ModelLoadError(f"golden check failed for output {name!r}: max abs error {err:.3g} "
                                     f"(shape {list(got.shape)} vs {list(want.shape)})")


@dataclass
class _Opened:
    """A candidate engine that loaded, passed the I/O check and warmed up."""

    cand: Candidate
    engine: Engine
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]


_Attempt = tuple[_Opened | None, EngineBuildRequiredError | None, str | None]


class ModelLoader:
    """Loads a version with the best candidate that works, remembering why others were skipped."""

    def __init__(self, preferences: Sequence[BackendPreference], *, cache_dir: Path | None, threads: int = 0,  # noqa: PLR0913  keyword-only settings from the daemon's config
                 select: str = "first", benchmark: BenchmarkSettings | None = None,
                 facts: HardwareFacts | None = None, defer_choice: bool = False, processes: int = 0,
                 stop: Callable[[], bool] | None = None, spin_us: int = DEFAULT_SPIN_US) -> None:
        """``stop`` true (SIGTERM): loads give up between engine calls (an engine's own call runs to its end)."""
        if select not in SELECT_MODES:
            raise ValueError(f"select must be one of {SELECT_MODES}, not {select!r}")
        self.preferences = list(preferences)
        self.cache_dir = cache_dir
        self.threads = threads
        self.spin_us = spin_us  # [limits] engine_spin_us
        self.processes = processes  # CPU engines in this many worker processes each ([limits] engine_processes)
        self.select = select
        self.facts = facts  # the daemon's probe, handed to the backends and the benchmark key
        self.benchmark_settings = benchmark or BenchmarkSettings()
        self.memory = SelectionMemory(cache_dir / "select") if cache_dir else None
        # Serve first, choose after: load the remembered choice or the first candidate and leave the
        # measuring to edged.core.chooser once the daemon is READY (False: measure while loading).
        self.defer_choice = defer_choice
        # Engine libraries set the C locale around parsing and put the old one back; two loads at once
        # (boot loads versions together, the chooser loads beside a reload) can interleave that and
        # leave the process in "C", where Python reads text as ASCII. Each load puts it back.
        self._locale = locale.setlocale(locale.LC_ALL)
        self.stopping: Callable[[], bool] = stop or (lambda: False)

    def _halt(self, mv: ModelVersion) -> None:
        """Raise LoadStoppedError once the daemon is stopping (checked before and after each engine call)."""
        if self.stopping():
            raise LoadStoppedError(f"model {mv.name!r} version {mv.version}: load stopped, edged is stopping",
                                   model=mv.name, version=mv.version)

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
        skipped_before = len(mv.skipped)
        log.info("model=%s version=%s loading (%d candidate engine(s))", mv.name, mv.version, len(cands))
        key = self._key(mv, cands)
        try:
            ok = self._load_with(mv, cands, key)
        except LoadStoppedError as e:  # every engine it opened is released already
            mv.state, mv.reason = ModelState.UNAVAILABLE, str(e)
            log.info("model=%s version=%s load stopped: edged is stopping", mv.name, mv.version)
            return mv
        mv.candidates, mv.selection_key = list(cands), key
        if ok:
            mv.state = ModelState.READY
            mv.load_seconds = time.monotonic() - t0
            assert mv.candidate is not None
            log.info("model=%s version=%s ready on %s in %.2fs", mv.name, mv.version, mv.candidate.label,
                     mv.load_seconds)
        else:
            mv.state = ModelState.UNAVAILABLE
            mv.reason = "every candidate engine failed: " + "; ".join(
                f"{k}: {r}" for k, r in mv.skipped[skipped_before:])
        return mv

    # ---- strategies -------------------------------------------------------------------------
    def _load_with(self, mv: ModelVersion, cands: Sequence[Candidate], key: str) -> bool:
        if self.select == "benchmark" and len(cands) > 1:
            if self.defer_choice:
                return self._load_remembered(mv, cands, key, set(), []) or self._load_first(mv, cands)
            return self._load_benchmark(mv, cands, key)
        return self._load_first(mv, cands)

    def _load_first(self, mv: ModelVersion, cands: Sequence[Candidate]) -> bool:
        pending: list[tuple[Candidate, EngineBuildRequiredError]] = []
        for cand in cands:
            opened, build, why = self._attempt(mv, cand)
            if opened is not None:
                self._adopt(mv, opened)
                self._start_upgrade(mv, pending, judge=False)
                return True
            if build is not None:
                log.info("model=%s version=%s %s needs a build; trying the next candidate meanwhile",
                         mv.name, mv.version, cand.label)
                pending.append((cand, build))
            else:
                self._skip(mv, cand, why or "failed")
        return self._build_now(mv, pending)

    def _key(self, mv: ModelVersion, cands: Sequence[Candidate]) -> str:
        """The selection key a measurement of these candidates is remembered under."""
        manifest = mv.manifest
        libraries = {c.backend: _library_version(c.backend) for c in cands}
        from edged.backends.onnxruntime import shared_pool_threads
        pool = shared_pool_threads()
        if pool is not None and "onnxruntime" in libraries:  # measured on the shared pool: another setup
            libraries["onnxruntime"] += f"; one pool of {pool} for the process"
        return selection_key(mv.name, mv.version, cands, libraries, threads=self.threads,
                             batch_sizes=batch_sizes_for(manifest), workload=workload_digest(mv),
                             instances=manifest.instances.count,
                             fingerprint=fingerprint_of(self.facts) if self.facts is not None else None)

    def _load_remembered(self, mv: ModelVersion, cands: Sequence[Candidate], key: str, tried: set[str],
                         load_failures: list[tuple[str, str]]) -> bool:
        """Load the engine a remembered measurement chose; False when there is none or it no longer loads."""
        remembered = self.memory.load(mv.name, mv.version, key) if self.memory else None
        if remembered is not None and remembered.complete:
            winner = next((c for c in cands if c.label == remembered.chosen), None)
            if winner is not None:
                opened, build, why = self._attempt(mv, winner)
                if opened is not None:
                    self._adopt(mv, opened)
                    mv.benchmark = remembered
                    self._explain_remembered(mv, cands, remembered)
                    return True
                if build is None:  # it no longer loads: measure what does
                    tried.add(winner.label)
                    self._skip(mv, winner, why or "failed")
                    load_failures.append((winner.label, why or "failed"))
        return False

    def _open_untried(self, mv: ModelVersion, cands: Sequence[Candidate], tried: set[str],
                      load_failures: list[tuple[str, str]]
                      ) -> tuple[list[_Opened], list[tuple[Candidate, EngineBuildRequiredError]]]:
        """Open each candidate not ``tried`` yet: those that load, those that need an engine built first;
        the others are skipped and added to ``load_failures``."""
        loaded: list[_Opened] = []
        pending: list[tuple[Candidate, EngineBuildRequiredError]] = []
        for cand in cands:
            if cand.label in tried:
                continue
            try:
                opened, build, why = self._attempt(mv, cand)
            except LoadStoppedError:
                _unload(loaded)
                raise
            if opened is not None:
                loaded.append(opened)
            elif build is not None:
                pending.append((cand, build))
            else:
                self._skip(mv, cand, why or "failed")
                load_failures.append((cand.label, why or "failed"))
        return loaded, pending

    def _load_benchmark(self, mv: ModelVersion, cands: Sequence[Candidate], key: str) -> bool:
        tried: set[str] = set()
        load_failures: list[tuple[str, str]] = []
        if self._load_remembered(mv, cands, key, tried, load_failures):
            return True
        loaded, pending = self._open_untried(mv, cands, tried, load_failures)
        if not loaded:
            return self._build_now(mv, pending)
        t0 = time.monotonic()
        batched = mv.max_batch_size > 0
        sizes = batch_sizes_for(mv.manifest, mv.max_batch_size, mv.batching)  # max_batch_size may be auto-completed
        sample = sample_inputs(mv, loaded[0].inputs)
        points = default_points({n: a[:1] for n, a in sample.items()} if batched else sample, sizes, batched)
        timings, failures = measure_points([(o.cand, o.engine) for o in loaded], points, batched=batched,
                                           settings=self.benchmark_settings, stop=self.stopping)
        if self.stopping():
            _unload(loaded)
            self._halt(mv)
        for label, why in failures:
            self._skip_label(mv, label, why)
        if not timings:
            if mv.warmup_skipped:  # nothing can be measured on an input the model refuses: keep profile order
                for o in loaded[1:]:
                    o.engine.unload()
                self._adopt(mv, loaded[0])
                mv.warmup_note = (mv.warmup_note or "").replace("warm-up skipped", "warm-up and engine benchmark "
                                                                "skipped", 1)
                return True
            for o in loaded:
                o.engine.unload()
            return self._build_now(mv, pending)
        best = choose(timings, self.benchmark_settings.margin)
        winner_opened = next(o for o in loaded if o.cand.label == best.candidate)
        for o in loaded:
            if o is not winner_opened:
                o.engine.unload()
        for t in timings:
            if t is not best:
                self._skip_label(mv, t.candidate, _slower(t, best), logging.INFO)
        self._adopt(mv, winner_opened)
        mv.benchmark = BenchmarkResult(key=key, chosen=best.candidate, timings=timings, batch_sizes=sizes,
                                       seconds=time.monotonic() - t0, complete=not pending and not failures,
                                       failures=load_failures + failures,
                                       workload={p.label: p.weight for p in points},
                                       basis="made-up" if synthesized(mv, loaded[0].inputs) else "declared",
                                       reason="first choice, measured while loading", measured_at=time.time())
        log.info("model=%s version=%s benchmark: %s", mv.name, mv.version,
                 ", ".join(f"{t.candidate} {t.throughput_per_s:.0f}/s" for t in timings))
        if self.memory is not None and mv.benchmark.complete:
            self.memory.save(mv.name, mv.version, mv.benchmark)
        self._start_upgrade(mv, pending, judge=True)
        return True

    def _explain_remembered(self, mv: ModelVersion, cands: Sequence[Candidate], result: BenchmarkResult) -> None:
        """Why the other candidates are not serving, from the measurement being reused."""
        best = result.timing(result.chosen)
        failed = dict(result.failures)
        for cand in cands:
            if cand.label in (result.chosen, result.chosen_batched):
                continue
            t = result.timing(cand.label)
            if t is not None and best is not None:
                self._skip(mv, cand, _slower(t, best) + " (remembered from the last measurement)", logging.INFO)
            else:
                why = failed.get(cand.label) or unavailable_reason(cand.backend, cand.options) or "not measured"
                self._skip(mv, cand, f"{why} (remembered from the last measurement)")

    def _build_now(self, mv: ModelVersion, pending: Sequence[tuple[Candidate, EngineBuildRequiredError]]) -> bool:
        """Nothing else can serve: build the pending engines in this thread, best first."""
        for cand, p in pending:
            self._halt(mv)
            try:
                engine = EngineBuild(cand.label, p.builder).run()
                self._adopt(mv, self._check(mv, cand, engine))
                return True
            except LoadStoppedError:
                raise
            except EdgedError as e:
                self._skip(mv, cand, str(e))
        return False

    # ---- one candidate ------------------------------------------------------------------------
    def _attempt(self, mv: ModelVersion, cand: Candidate) -> _Attempt:
        """(engine, None, None) when it loaded; (None, build, None) when it must be built; else the reason."""
        why = unavailable_reason(cand.backend, cand.options)
        if why is not None:
            return None, None, why
        try:
            return self._open(mv, cand), None, None
        except EngineBuildRequiredError as p:
            return None, p, None
        except LoadStoppedError:
            raise
        except EdgedError as e:
            return None, None, str(e)
        except Exception as e:  # an engine bug must not take the daemon down
            return None, None, f"unexpected {type(e).__name__}: {e}"

    def _open(self, mv: ModelVersion, cand: Candidate) -> _Opened:
        self._halt(mv)
        try:
            request = self._request(mv, cand)
            if self._in_processes(mv, cand):
                from edged.backends.engine_procs.pool import EngineProcesses

                engine: Engine = EngineProcesses(cand.backend, request, self.processes)
            else:
                engine = get_backend(cand.backend).load(request)
        finally:
            self.restore_locale()
        return self._check(mv, cand, engine)

    def _in_processes(self, mv: ModelVersion, cand: Candidate) -> bool:
        """Engine worker processes for this candidate: configured, a CPU engine, and tensors the wire carries
        (declared and numeric; BYTES and undeclared I/O stay in the daemon's process)."""
        if self.processes <= 0 or cand.device.upper() not in spec_for(cand.backend).process_devices:
            return False
        m = mv.manifest
        if m.inputs is None or m.outputs is None:
            return False
        return all(t.datatype != "BYTES" for t in [*m.inputs, *m.outputs])

    def restore_locale(self) -> None:
        """Put back the locale the process started with if an engine library left another one."""
        if locale.setlocale(locale.LC_ALL) != self._locale:
            log.debug("an engine library changed the process locale; restoring %s", self._locale)
            locale.setlocale(locale.LC_ALL, self._locale)

    def _check(self, mv: ModelVersion, cand: Candidate, engine: Engine) -> _Opened:
        """I/O against the manifest, then warm-up and golden check; releases the engine on failure
        or when the daemon stops while the engine loaded or warmed up."""
        manifest = mv.manifest
        try:
            self._halt(mv)
            mv.auto_max_batch_size = auto_max_batch_size(manifest, engine)
            mbs = mv.max_batch_size
            if manifest.inputs is not None:
                _check_io("input", manifest.inputs, engine.inputs, mbs)
            if manifest.outputs is not None:
                _check_io("output", manifest.outputs, engine.outputs, mbs)
            inputs = list(manifest.inputs) if manifest.inputs is not None else _io_from_engine(engine.inputs, mbs)
            outputs = list(manifest.outputs) if manifest.outputs is not None else _io_from_engine(engine.outputs, mbs)
            _check_shapes(manifest.warmup.shapes, inputs)
            warm_up(mv, engine, inputs=inputs, precision=cand.precision)
            self._halt(mv)
        except BaseException:
            engine.unload()
            raise
        return _Opened(cand, engine, inputs, outputs)

    def _request(self, mv: ModelVersion, cand: Candidate) -> LoadRequest:
        manifest = mv.manifest
        options = cand.options
        if isinstance(options, TensorRtOptions) and options.opt_batch_size is None:
            # TensorRT builds from ONNX with its batch profile tuned for the batch the model prefers.
            preferred = manifest.batching.preferred_batch_sizes if manifest.batching else []
            options = options.model_copy(update={"opt_batch_size": max(preferred) if preferred else 1})
        return LoadRequest(
            model=mv.name, version=mv.version, version_dir=mv.entry.path, variant=cand.variant,
            device=cand.device, options=options, precision=cand.precision, max_batch_size=mv.max_batch_size,
            inputs=manifest.inputs, shapes=manifest.warmup.shapes, threads=self.threads, spin_us=self.spin_us,
            instances=manifest.instances.count,
            cache_dir=self._cache_dir_for(mv, cand, options), facts=self.facts,
        )

    def _cache_dir_for(self, mv: ModelVersion, cand: Candidate, options: BackendOptions) -> Path | None:
        if self.cache_dir is None:
            return None
        if cand.backend != "openvino":
            return self.cache_dir / cand.backend
        # OpenVINO writes its own blobs into CACHE_DIR; a folder per key means an OpenVINO upgrade or a
        # changed model never meets a blob compiled for something else.
        key = EngineCacheKey(
            model=mv.name, version=mv.version, backend="openvino", variant=cand.variant.file,
            model_digest=variant_digest(cand.variant),
            library_versions={"openvino": _library_version("openvino")}, device=cand.device,
            precision=cand.precision,
            shape_profile=f"static_batch={OpenVinoOptions.of(options).static_batch or 'dynamic'}",
            options=options.as_text())
        try:
            return EngineCache(self.cache_dir / "openvino").dir_for(key)
        except OSError as e:
            log.warning("model=%s version=%s: OpenVINO cache unavailable (%s); compiling without it",
                        mv.name, mv.version, e)
            return None

    def _adopt(self, mv: ModelVersion, opened: _Opened) -> None:
        mv.inputs, mv.outputs, mv.candidate, mv.engine = opened.inputs, opened.outputs, opened.cand, opened.engine

    def _skip(self, mv: ModelVersion, cand: Candidate, why: str, level: int = logging.WARNING) -> None:
        self._skip_label(mv, cand.label, why, level)

    def _skip_label(self, mv: ModelVersion, label: str, why: str, level: int = logging.WARNING) -> None:
        """Note why a candidate is not serving. A candidate that failed is a WARNING; one that lost a
        measurement is the choice working (INFO: a device's every start would otherwise log one
        warning per losing candidate, which hides the warnings that matter)."""
        mv.skipped.append((label, why))
        log.log(level, "model=%s version=%s candidate %s skipped: %s", mv.name, mv.version, label, why)

    # ---- choosing while serving (edged.core.chooser) ----------------------------------------
    def choice_group(self, mv: ModelVersion) -> list[Candidate]:
        """The candidates measured against each other while the version serves: every candidate of a
        ``benchmark`` profile, else the CPU engines from the serving one on (every profile ends in
        them); empty when there is nothing to choose between."""
        serving, cands = mv.candidate, mv.candidates
        if serving is None or mv.engine is None:
            return []
        if self.select == "benchmark":
            pool = list(cands)
        elif serving.device == "CPU" and serving in cands:
            at = cands.index(serving)
            pool = [serving] + [c for c in cands[at + 1:] if c.device == "CPU"]
        else:
            return []
        group = [c for c in pool if c == serving or unavailable_reason(c.backend, c.options) is None]
        return group if len(group) > 1 else []

    def open_alternate(self, mv: ModelVersion, cand: Candidate) -> _Opened | str:
        """Another candidate for a serving version, loaded and warmed up; or why it could not be.

        What loading it finds out about the model (its auto-completed batch size, the warm-up note)
        must not change the version serving: it is put back, and a candidate that would batch
        differently is refused.
        """
        kept = (mv.auto_max_batch_size, mv.warmup_note, mv.warmup_skipped)
        try:
            opened, build, why = self._attempt(mv, cand)
            batches = mv.auto_max_batch_size
        except LoadStoppedError:
            return "edged is stopping"
        finally:
            mv.auto_max_batch_size, mv.warmup_note, mv.warmup_skipped = kept
        if opened is not None:
            if batches != kept[0]:
                opened.engine.unload()
                return (f"it would batch up to {batches}, the serving engine up to {kept[0]} "
                        "(the model file's dimensions read differently)")
            return opened
        if build is not None:
            return "its engine must be built first (the background build measures it when done)"
        return why or "failed"

    def explain(self, mv: ModelVersion, group: Sequence[Candidate], result: BenchmarkResult) -> None:
        """Replace the skip reasons of ``group`` with what ``result`` measured."""
        labels = {c.label for c in group}
        best = result.timing(result.chosen)
        failed = dict(result.failures)
        kept = [(k, r) for k, r in mv.skipped if k not in labels]
        for c in group:
            if c.label in (result.chosen, result.chosen_batched):
                continue
            t = result.timing(c.label)
            kept.append((c.label, _slower(t, best) if t is not None and best is not None
                         else failed.get(c.label, "not measured")))
        mv.skipped = kept

    def remember(self, mv: ModelVersion, result: BenchmarkResult) -> None:
        if self.memory is not None and result.complete:
            self.memory.save(mv.name, mv.version, result)

    @staticmethod
    def proxy(mv: ModelVersion) -> SwappableEngine:
        assert mv.engine is not None
        if not isinstance(mv.engine, SwappableEngine):
            mv.engine = SwappableEngine(mv.engine)
        return mv.engine

    # ---- background builds ------------------------------------------------------------------
    def _start_upgrade(self, mv: ModelVersion, pending: Sequence[tuple[Candidate, EngineBuildRequiredError]], *,
                       judge: bool) -> None:
        """Serve now through ``mv.engine``; build the better candidates behind it and switch when one is ready."""
        if not pending or mv.engine is None:
            return
        proxy = self.proxy(mv)

        def prepare(cand: Candidate, engine: Engine) -> None:
            opened = self._check(mv, cand, engine)
            if opened.inputs != mv.inputs or opened.outputs != mv.outputs:
                engine.unload()
                raise ModelLoadError(f"{cand.label} has other inputs/outputs than the engine serving now")

        def switched(cand: Candidate) -> None:
            mv.candidate = cand
            if mv.stats is not None:
                mv.stats.backend = cand.backend

        def faster(cand: Candidate, engine: Engine) -> bool:
            assert mv.candidate is not None and mv.benchmark is not None
            sizes = mv.benchmark.batch_sizes
            # The built candidate comes first in the profile, so it wins ties.
            timings, failures = measure([(cand, engine), (mv.candidate, proxy.current)], sample_inputs(mv),
                                        sizes, batched=mv.max_batch_size > 0, settings=self.benchmark_settings)
            new = next((t for t in timings if t.candidate == cand.label), None)
            if new is None:
                raise ModelLoadError(failures[0][1] if failures else "not measured")
            mv.benchmark.timings = [t for t in mv.benchmark.timings if t.candidate != cand.label] + [new]
            if new is choose(timings, self.benchmark_settings.margin):
                mv.benchmark.chosen = cand.label
                return True
            return False

        builds = [(cand, EngineBuild(cand.label, p.builder)) for cand, p in pending]
        mv.upgrade = EngineUpgrade(f"model={mv.name} version={mv.version}", proxy, builds, prepare=prepare,
                                   on_switch=switched, on_failure=lambda c, why: self._skip(mv, c, why),
                                   judge=faster if judge else None)
        mv.upgrade.start()


def _unload(opened: Sequence[_Opened]) -> None:
    for o in opened:
        o.engine.unload()


def _slower(t: CandidateTiming, best: CandidateTiming) -> str:
    if t.throughput_per_s > best.throughput_per_s:
        return (f"as fast as {best.candidate} within measurement noise ({t.throughput_per_s:.0f}/s vs "
                f"{best.throughput_per_s:.0f}/s); the profile lists that one first")
    return (f"measured slower here: {t.throughput_per_s:.0f}/s vs {best.throughput_per_s:.0f}/s "
            f"for {best.candidate}")


def _library_version(backend: str) -> str:
    """The engine library's version, read from package metadata so that keying a cache does not
    import (and keep in memory) an engine that may never run here."""
    from importlib import metadata

    spec = SPECS.get(backend)
    for dist in spec.distributions if spec is not None else ():
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    try:
        return get_backend(backend).library_version()
    except EdgedError as e:
        return f"unavailable ({e.code.value})"
