"""Choosing an engine by timing the candidates on this device (a profile's ``select = "benchmark"``).

Which engine is fastest depends on the model and the machine: OpenVINO beats ONNX
Runtime by a wide margin on some CNNs and loses badly on tiny MLPs, and INT8 can be
slower than FP32 on CPUs without fast int8 paths. So the loader times every
candidate it could load, on the device, for a short bounded time and keeps the
fastest. Rounds are interleaved (every candidate once per round, rotating the
order) and a candidate's speed is the median of its per-round median call times
(:func:`typical_call_s`): load from other processes on a small shared machine
that lands on one round moves that round, not the result. A low quantile of
pooled calls was used before; measured on small classifiers it hid a 12% gap
(two engines equal at the fast end, one with a long tail of slow calls that a
caller does see), so the typical call is what is ranked now.

What is timed is a list of work points (:class:`WorkPoint`): an input of the shapes
the model sees at a batch size the scheduler forms, with the share of the traffic's
samples it stands for. At load that is batch 1 and the model's preferred (else
largest, at most 8) batch on the declared shapes, half the samples each; once the
daemon has served traffic, the shapes and batch sizes it really served
(:mod:`edged.core.chooser`). The score is samples per second over the whole mix:
the inverse of the weighted time per sample, so a point that carries most of the
traffic decides most of the score. The result is remembered on disk, keyed by the variant digests, the
engine library versions, the candidate list and options, the thread setting and
the device's facts: any change re-measures on the next load.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edged.backends.base import Engine
from edged.backends.enginecache import variant_digest
from edged.backends.selection import Candidate
from edged.fsutil import atomic_write_text
from edged.hardware.facts import HardwareFacts
from edged.repository.manifest import Batching, ModelManifest, Variant

log = logging.getLogger(__name__)

_KEY_CHARS = 16
# How candidates are timed and ranked: a change re-measures choices remembered under the old method.
_METHOD = 3  # 3: work points weighted by their share of samples (2: geometric mean over batch 1 and preferred)


@dataclass(frozen=True)
class BenchmarkSettings:
    """Bounds on how long first load may spend measuring."""

    time_per_candidate_s: float = 0.6
    total_s: float = 3.0
    rounds: int = 8  # more, shorter rounds: a burst of load spoils one round's median, not the result
    min_iterations: int = 2
    margin: float = 0.03  # scores this close count as equal: the profile's order decides
    settle_s: float = 0.05  # idle pause before timing a different engine than the last slice, see measure
    duty: float = 1.0  # share of wall time spent timing; below 1 the rest is idle (background choice)
    # Stop after this many rounds when one candidate was the fastest by ``clear`` in every round so far:
    # time goes to close calls, where it decides something (0: always run every round).
    decided_after: int = 0
    clear: float = 0.25
    min_rounds: int = 1  # rounds every candidate gets even past ``total_s`` (slow engines: one spike is one round)


@dataclass(frozen=True)
class WorkPoint:
    """One thing to time: an input (one sample, batch dimension 1 when batched) run at ``batch``,
    standing for ``weight`` of the samples served (weights of one measurement sum to 1)."""

    label: str
    sample: Mapping[str, np.ndarray]
    batch: int
    weight: float


def shape_label(sample: Mapping[str, np.ndarray], batch: int, batched: bool) -> str:
    """``x[3,48,320]@4``: per-sample shapes (batch dimension left out when batched) at a batch size."""
    skip = 1 if batched else 0
    shapes = ",".join(f"{n}[{','.join(str(d) for d in a.shape[skip:])}]" for n, a in sorted(sample.items()))
    return f"{shapes}@{batch}" if batched else shapes


def default_points(sample: Mapping[str, np.ndarray], batch_sizes: Sequence[int], batched: bool) -> list[WorkPoint]:
    """Each batch size on the one sample, the samples shared equally between them."""
    sizes = list(batch_sizes) if batched else [1]
    return [WorkPoint(shape_label(sample, b, batched), sample, b, 1.0 / len(sizes)) for b in sizes]


def mix_score(rates: Mapping[str, float], weights: Mapping[str, float]) -> float:
    """Samples per second over a mix: 1 / sum(weight / rate) (weights normalised)."""
    total = sum(weights.get(k, 0.0) for k in rates) or 1.0
    cost = sum(weights.get(k, 0.0) / total / max(v, 1e-12) for k, v in rates.items())
    return 1.0 / cost if cost > 0 else 0.0


@dataclass
class CandidateTiming:
    candidate: str
    backend: str
    device: str
    precision: str
    variant: str
    batches: dict[int, float]  # batch size -> samples per second (from the typical call, typical_call_s)
    throughput_per_s: float  # the score: geometric mean over ``batches``
    latency_ms: float  # typical time of one batch-1 call (or of one call for unbatched models)
    iterations: int
    seed_throughput_per_s: float | None = None  # what `edged optimize` recorded, if anything
    points: dict[str, float] = field(default_factory=dict)  # work point label -> samples per second

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["batches"] = {str(b): round(v, 3) for b, v in self.batches.items()}
        d["throughput_per_s"] = round(self.throughput_per_s, 3)
        d["latency_ms"] = round(self.latency_ms, 4)
        d["points"] = {k: round(v, 3) for k, v in self.points.items()}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CandidateTiming:
        data = dict(d)
        data["batches"] = {int(b): float(v) for b, v in dict(d["batches"]).items()}
        data["points"] = {str(k): float(v) for k, v in dict(d.get("points", {})).items()}
        return cls(**data)


@dataclass
class BenchmarkResult:
    key: str
    chosen: str
    timings: list[CandidateTiming]
    batch_sizes: list[int]
    seconds: float = 0.0
    complete: bool = True  # False when a candidate could not be measured yet (engine still building)
    source: str = "measured"  # or "remembered"
    failures: list[tuple[str, str]] = field(default_factory=list)
    workload: dict[str, float] = field(default_factory=dict)  # work point label -> share of samples
    basis: str = "declared"  # what the work points came from: declared shapes, made-up data, served traffic
    reason: str = ""  # why this measurement ran (first choice, traffic changed...)
    measured_at: float = 0.0  # wall clock (seconds since the epoch), for people reading it
    chosen_batched: str | None = None  # the engine for runs of several samples, when not ``chosen``

    def timing(self, label: str) -> CandidateTiming | None:
        return next((t for t in self.timings if t.candidate == label), None)

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "chosen": self.chosen, "batch_sizes": self.batch_sizes,
                "seconds": round(self.seconds, 3), "complete": self.complete, "source": self.source,
                "timings": [t.as_dict() for t in self.timings],
                "failures": [{"candidate": c, "reason": r} for c, r in self.failures],
                "workload": {k: round(v, 4) for k, v in self.workload.items()}, "basis": self.basis,
                "reason": self.reason, "measured_at": round(self.measured_at, 1),
                "chosen_batched": self.chosen_batched}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BenchmarkResult:
        return cls(key=str(d["key"]), chosen=str(d["chosen"]),
                   timings=[CandidateTiming.from_dict(t) for t in d["timings"]],
                   batch_sizes=[int(b) for b in d["batch_sizes"]], seconds=float(d.get("seconds", 0.0)),
                   complete=bool(d.get("complete", True)), source=str(d.get("source", "measured")),
                   failures=[(str(f["candidate"]), str(f["reason"])) for f in d.get("failures", [])],
                   workload={str(k): float(v) for k, v in dict(d.get("workload", {})).items()},
                   basis=str(d.get("basis", "declared")), reason=str(d.get("reason", "")),
                   measured_at=float(d.get("measured_at", 0.0)),
                   chosen_batched=str(d["chosen_batched"]) if d.get("chosen_batched") else None)


# ---- what to measure ------------------------------------------------------------------------
def batch_sizes_for(manifest: ModelManifest, max_batch_size: int | None = None,
                    batching: Batching | None = None) -> list[int]:
    """Batch 1, plus the largest preferred batch the dynamic batcher aims for (when it batches at all).

    ``max_batch_size``/``batching``: the version's own, when auto-completed from the model file
    (a manifest that states neither still batches, up to Triton's default of 4).
    """
    mbs = manifest.max_batch_size if max_batch_size is None else max_batch_size
    batching = manifest.batching if batching is None else batching
    if mbs <= 0 or batching is None:
        return [1]
    preferred = [b for b in batching.preferred_batch_sizes if b <= mbs]
    big = max(preferred) if preferred else min(8, mbs)
    return [1] if big <= 1 else [1, big]


def inputs_for_batch(sample: Mapping[str, np.ndarray], batch: int, batched: bool) -> dict[str, np.ndarray]:
    """The first sample row repeated ``batch`` times (or the sample itself for an unbatched model)."""
    if not batched:
        return dict(sample)
    return {n: np.ascontiguousarray(np.repeat(a[:1], batch, axis=0)) for n, a in sample.items()}


def seed_throughput(variant: Variant) -> float | None:
    """The best throughput `edged optimize` recorded for the variant, to order measurement."""
    rates = [t.throughput_per_s for t in variant.timings]
    return max(rates) if rates else None


# ---- measuring ------------------------------------------------------------------------------
def _slice(engine: Engine, inputs: Mapping[str, np.ndarray], seconds: float, min_iterations: int) -> list[float]:
    """Per-call durations for ``seconds`` (at least ``min_iterations`` calls)."""
    # Untimed lead-in: the previous engine's worker threads may still be spinning and this one's
    # may be parked; a fifth of the slice lets both settle (at least one call re-warms the caches).
    t0 = time.perf_counter()
    while True:
        engine.infer(inputs)
        if time.perf_counter() - t0 >= seconds / 5:
            break
    durations: list[float] = []
    end = time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        engine.infer(inputs)
        t1 = time.perf_counter()
        durations.append(t1 - t0)
        if t1 >= end and len(durations) >= min_iterations:
            return durations


def typical_call_s(rounds: Sequence[Sequence[float]]) -> float:
    """The median over rounds of each round's median per-call time.

    What a caller waits for is the typical call, tail included, so the median ranks; the
    per-round median first keeps a round that other processes' load fell on from weighing
    more than its share (its many slow calls count once), and interleaved rounds spread
    that load over every candidate alike.
    """
    medians = [statistics.median(r) for r in rounds if r]
    if not medians:
        raise ValueError("no calls were timed")
    return statistics.median(medians)


def measure(engines: Sequence[tuple[Candidate, Engine]], sample: Mapping[str, np.ndarray], batch_sizes: Sequence[int],
            *, batched: bool, settings: BenchmarkSettings | None = None,
            ) -> tuple[list[CandidateTiming], list[tuple[str, str]]]:
    """Time every engine on ``sample`` at each batch size (equal shares); see :func:`measure_points`."""
    return measure_points(engines, default_points(sample, batch_sizes, batched), batched=batched, settings=settings)


def measure_points(engines: Sequence[tuple[Candidate, Engine]], points: Sequence[WorkPoint], *, batched: bool,
                   settings: BenchmarkSettings | None = None, stop: Callable[[], bool] | None = None,
                   ) -> tuple[list[CandidateTiming], list[tuple[str, str]]]:
    """Time every engine at every work point in interleaved rounds; returns (timings, [(candidate, why it failed)]).

    With ``settings.duty`` below 1 each slice is followed by an idle pause, so that a measurement
    made while the daemon serves takes at most that share of the time it runs for. ``stop`` (checked
    between rounds) ends it early, with what was timed so far (the daemon stopping).
    """
    settings = settings or BenchmarkSettings()
    inputs = {p.label: inputs_for_batch(p.sample, p.batch, batched) for p in points}
    per_candidate = min(settings.time_per_candidate_s, settings.total_s / max(1, len(engines)))
    slice_s = per_candidate / (max(1, settings.rounds) * len(points))
    calls: dict[str, dict[str, list[list[float]]]] = {c.label: {p.label: [] for p in points} for c, _ in engines}
    failed: dict[str, str] = {}
    started = time.monotonic()
    live = list(engines)
    last = ""
    duty = min(1.0, max(0.05, settings.duty))
    for r in range(max(1, settings.rounds)):
        order = live[r % len(live):] + live[:r % len(live)] if live else []
        for cand, engine in order:
            if last and last != cand.label:
                # The engine timed before may still have worker threads spinning (ONNX Runtime's pool
                # does after each run); on a 2-core device they held the cores of the next engine's
                # slice (OpenVINO at 1.9 ms instead of 1.0 ms for a whole slice after ONNX Runtime's).
                # Busy calls do not make them stop; idling does. Served alone, no engine pays that.
                time.sleep(settings.settle_s)
            last = cand.label
            for p in points:
                t0 = time.monotonic()
                try:
                    calls[cand.label][p.label].append(_slice(engine, inputs[p.label], slice_s,
                                                             settings.min_iterations))
                except Exception as e:  # an engine that cannot run the sample loses, it does not crash the load
                    failed[cand.label] = f"failed while being measured: {e}"
                    break
                if duty < 1.0:
                    time.sleep((time.monotonic() - t0) * (1.0 - duty) / duty)
        live = [(c, e) for c, e in live if c.label not in failed]
        if stop is not None and stop():
            break
        if time.monotonic() - started > settings.total_s / duty and r + 1 >= settings.min_rounds:
            break  # the cap holds even for slow engines, once every candidate got min_rounds rounds
        if settings.decided_after and r + 1 >= settings.decided_after and _decided(calls, points, live, settings.clear):
            break
    by_label = {p.label: p for p in points}
    weights = {p.label: p.weight for p in points}
    timings = []
    for cand, _ in engines:
        if cand.label in failed:
            continue
        per_point = calls[cand.label]
        rates = {k: by_label[k].batch / typical_call_s(r) for k, r in per_point.items()}
        batches: dict[int, float] = {}
        for p in sorted(points, key=lambda p: -p.weight):  # per batch size: its heaviest point, for display
            batches.setdefault(p.batch, rates[p.label])
        one_point = min(points, key=lambda p: (p.batch, -p.weight))
        one = rates[one_point.label]
        timings.append(CandidateTiming(
            candidate=cand.label, backend=cand.backend, device=cand.device, precision=cand.precision,
            variant=cand.variant.file, batches=batches, throughput_per_s=mix_score(rates, weights),
            latency_ms=1000.0 * one_point.batch / one,
            iterations=sum(len(d) for r in per_point.values() for d in r),
            seed_throughput_per_s=seed_throughput(cand.variant), points=rates))
    return timings, sorted(failed.items())


def _decided(calls: Mapping[str, Mapping[str, Sequence[Sequence[float]]]], points: Sequence[WorkPoint],
             live: Sequence[tuple[Candidate, Engine]], clear: float) -> bool:
    """Whether one candidate led every round so far by more than ``clear`` (its mix score per round)."""
    if len(live) < 2:
        return True
    weights = {p.label: p.weight for p in points}
    batch = {p.label: p.batch for p in points}
    rounds = min(len(r) for c, _ in live for r in calls[c.label].values())
    leader = None
    for i in range(rounds):
        scores = sorted(((mix_score({k: batch[k] / statistics.median(r[i]) for k, r in calls[c.label].items()},
                                    weights), c.label) for c, _ in live), reverse=True)
        (top, who), (second, _) = scores[0], scores[1]
        if top < (1.0 + clear) * second or (leader is not None and who != leader):
            return False
        leader = who
    return leader is not None


def fastest(timings: Sequence[CandidateTiming]) -> CandidateTiming:
    """The highest score; equal scores keep the profile's order."""
    return max(timings, key=lambda t: t.throughput_per_s)


def choose(timings: Sequence[CandidateTiming], margin: float = 0.03, *,
           incumbent: str | None = None) -> CandidateTiming:
    """The ``incumbent`` (the engine serving now) when it is within ``margin`` of the fastest,
    else the first candidate, in the profile's order, within ``margin`` of the fastest.

    Differences of a few percent are within the noise of a short measurement on a
    busy device; the engine already serving (or the profile's order) then decides, so
    the choice does not flip between restarts or back and forth while serving.
    """
    top = fastest(timings).throughput_per_s
    near = [t for t in timings if t.throughput_per_s >= (1.0 - margin) * top]
    return next((t for t in near if t.candidate == incumbent), near[0])


# ---- what the result depends on -------------------------------------------------------------
def fingerprint_of(f: HardwareFacts) -> dict[str, Any]:
    """The facts that change engine speed: CPU model and ISA, GPUs, Jetson release."""
    return {
        "cpu": [f.cpu.arch, f.cpu.vendor, f.cpu.model, f.cpu.cores, sorted(f.cpu.flags)],
        "nvidia_gpu": [f.nvidia_gpu.name, f.nvidia_gpu.compute_capability, f.nvidia_gpu.driver_version],
        "jetson": [f.jetson.module, f.jetson.l4t],
        "intel": [f.intel_gpu.device_id, f.intel_npu.device_id],
    }


@functools.lru_cache(maxsize=1)
def device_fingerprint() -> dict[str, Any]:
    """:func:`fingerprint_of` this machine, probed once; for callers without the daemon's facts."""
    try:
        from edged.hardware.probe import probe
        f = probe(Path("/"), engines=False)
    except Exception as e:  # the probe is best effort; a fingerprint without it still works
        log.warning("benchmark: hardware probe failed (%s); keying on the CPU count only", e)
        import os
        return {"cpu.cores": os.cpu_count()}
    return fingerprint_of(f)


def selection_key(model: str, version: int, cands: Sequence[Candidate], library_versions: Mapping[str, str], *,  # noqa: PLR0913  every input a measurement depends on is part of its key
                  threads: int, batch_sizes: Sequence[int], fingerprint: Mapping[str, Any] | None = None,
                  workload: str = "", instances: int = 1) -> str:
    """Everything a measurement depends on: variants, options, libraries, hardware, and ``workload``
    (a digest of the declared shapes / warm-up data it ran on); ``instances`` changes how a CPU engine
    is set up (its threads or streams are split between them)."""
    doc = {
        "method": _METHOD, "model": model, "version": version, "threads": threads, "batch_sizes": list(batch_sizes),
        "workload": workload, "instances": instances,
        "device": dict(fingerprint if fingerprint is not None else device_fingerprint()),
        "candidates": [{"label": c.label, "digest": variant_digest(c.variant),
                        "options": c.options.model_dump(mode="json", exclude_unset=True),
                        "library": library_versions.get(c.backend, "")} for c in cands],
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


class SelectionMemory:
    """Benchmark results under ``<cache_dir>/select/<model>-<version>-<key>.json``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, model: str, version: int, key: str) -> Path:
        return self.root / f"{model}-{version}-{key[:_KEY_CHARS]}.json"

    def load(self, model: str, version: int, key: str) -> BenchmarkResult | None:
        path = self.path(model, version, key)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            result = BenchmarkResult.from_dict(data)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("benchmark memory %s is unreadable (%s); measuring again", path.name, e)
            return None
        if result.key != key:
            return None
        result.source = "remembered"
        return result

    def save(self, model: str, version: int, result: BenchmarkResult) -> None:
        path = self.path(model, version, result.key)
        try:
            atomic_write_text(path, json.dumps(result.as_dict(), indent=1) + "\n")
        except OSError as e:
            log.warning("cannot remember the benchmark result for %s version %s: %s", model, version, e)
            return
        stale = re.compile(re.escape(f"{model}-{version}-") + rf"[0-9a-f]{{{_KEY_CHARS}}}\.json$")
        for other in self.root.iterdir():
            if other != path and stale.fullmatch(other.name):
                try:
                    other.unlink()
                except OSError:
                    pass
