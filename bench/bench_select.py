"""Engine choice by measurement: does ``select = "benchmark"`` keep the fastest engine on this machine?

    .venv/bin/python -m bench.bench_select [--models mobilenet digits] [--seconds 3] [--rounds 6]

For each model: load it the way the daemon does with ``select = "benchmark"`` (this machine's
device profile, the default time budget, a fresh cache) and note the candidate it kept. Then,
independently of the loader, load every candidate engine again and time it for much longer
(interleaved rounds, batch 1 and the preferred batch) with the same score: the geometric mean over
the two batch sizes of samples/s from the median of per-round median call times (the loader's
typical_call_s), which a burst of other processes' load on one round cannot move. Mean wall-clock
throughput is printed beside it. Prints every candidate's figures and the chosen/fastest ratio.
Goal (issue: engine choice by measurement): ratio >= 0.95.
"""

from __future__ import annotations

import argparse
import math
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import ratio_line
from edged.backends.base import Engine, LoadRequest
from edged.backends.benchmark import typical_call_s
from edged.backends.factory import get_backend
from edged.backends.selection import Candidate, candidates
from edged.config import ModelsSection
from edged.core.manager import ModelManager
from edged.core.model_versions import ModelState
from edged.errors import EdgedError
from edged.hardware.probe import probe
from edged.profiles import BackendPreference, load_profiles, match_profile
from edged.repository.manifest import parse_manifest

ROOT = Path(__file__).resolve().parent.parent


def _preferences() -> tuple[str, list[BackendPreference]]:
    profile = match_profile(probe(Path("/"), engines=False), load_profiles()).profile
    return profile.name, list(profile.backends)


def _calls(engine: Engine, inputs: dict[str, np.ndarray], seconds: float) -> list[float]:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds / 5:  # untimed lead-in, as the loader does
        engine.infer(inputs)
    out: list[float] = []
    end = time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        engine.infer(inputs)
        t1 = time.perf_counter()
        out.append(t1 - t0)
        if t1 >= end and len(out) >= 3:
            return out


def remeasure(version_dir: Path, cands: list[Candidate], seconds: float,
              rounds: int) -> tuple[dict[str, dict[int, float]], dict[str, dict[int, float]]]:
    """Every candidate's samples/s per batch size, measured here without the loader: (fast-end, mean)."""
    m = parse_manifest(version_dir / "model.toml")
    preferred = m.batching.preferred_batch_sizes if m.batching else []
    sizes = [1, max(preferred)] if preferred else [1]
    with np.load(version_dir / (m.warmup.file or "")) as data:
        first = {name: np.asarray(data[name][:1]) for name in data.files}
    engines: list[tuple[str, Engine]] = []
    for c in cands:
        req = LoadRequest(version_dir.parent.name, 1, version_dir, c.variant, device=c.device, options=c.options,
                          max_batch_size=m.max_batch_size, inputs=m.inputs)
        try:
            get_backend(c.backend).check_available()
            engines.append((c.label, get_backend(c.backend).load(req)))
        except EdgedError as e:
            print(f"  (not measured: {c.label}: {str(e)[:100]})")
    calls: dict[str, dict[int, list[list[float]]]] = {label: {b: [] for b in sizes} for label, _ in engines}
    per_slice = seconds / (rounds * len(sizes))
    for r in range(rounds):
        for label, engine in engines[r % len(engines):] + engines[:r % len(engines)]:
            for b in sizes:
                x = {n: np.ascontiguousarray(np.repeat(a, b, axis=0)) for n, a in first.items()}
                calls[label][b].append(_calls(engine, x, per_slice))
    for _, engine in engines:
        engine.unload()
    fast = {label: {b: b / typical_call_s(r) for b, r in per.items()} for label, per in calls.items()}
    mean = {label: {b: b * sum(map(len, r)) / sum(map(sum, r)) for b, r in per.items()} for label, per in calls.items()}
    return fast, mean


def _score(rates: dict[int, float]) -> float:
    return math.exp(sum(math.log(v) for v in rates.values()) / len(rates))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["mobilenet", "digits"])
    ap.add_argument("--seconds", type=float, default=3.0, help="re-measurement time per candidate")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    profile, prefs = _preferences()
    print(f"device profile {profile}: {', '.join(f'{p.backend}/{p.device}{p.precisions}' for p in prefs)}")
    lines = []
    for model in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            repo = Path(tmp) / "models"
            shutil.copytree(ROOT / "models" / model, repo / model)
            t0 = time.monotonic()
            mgr = ModelManager(repo, ModelsSection(), prefs, cache_dir=Path(tmp) / "cache", select="benchmark")
            mgr.load_all()
            load_s = time.monotonic() - t0
            mv = mgr.table.find(model)
            assert mv is not None and mv.state is ModelState.READY and mv.candidate is not None, mv
            chosen = mv.candidate.label
            recorded = {t.candidate: t.throughput_per_s for t in (mv.benchmark.timings if mv.benchmark else [])}
            mgr.shutdown()
            cands = candidates(mv.entry.usable_variants, prefs)
        print(f"\n{model}: chose {chosen} (first load {load_s:.2f} s including the measurement)")
        best, mean = remeasure(ROOT / "models" / model / "1", cands, args.seconds, args.rounds)
        scores = {label: _score(rates) for label, rates in best.items()}
        top = max(scores, key=lambda k: scores[k])
        print(f"  {'candidate':<42} {'score':>12}  {'per batch, typical call (median of rounds)':<40}"
              f"{'per batch, mean wall clock':<40}{'at load':>10}")
        for label, rates in best.items():
            per_batch = "  ".join(f"b{b} {v:11.1f}/s" for b, v in rates.items())
            walls = "  ".join(f"b{b} {v:11.1f}/s" for b, v in mean[label].items())
            mark = ("<- chosen" if label == chosen else "") + (" (fastest)" if label == top else "")
            rec = recorded.get(label)
            print(f"  {label:<42} {scores[label]:10.1f}/s  {per_batch}  {walls}  "
                  f"{f'{rec:10.1f}/s' if rec else '-':>12}  {mark}")
        lines.append(ratio_line(f"{model}: chosen / fastest re-measured score", scores.get(chosen, 0.0),
                                scores[top], 0.95))
    print()
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
