"""Engine choice on real models: is the engine the daemon picks within 5% of the faster raw engine?

    .venv/bin/python -m bench.bench_real_models [--models nudenet ocr_rec ...] [--seconds 6] [--rounds 6]

For each model of bench/real_corpus.py (ten models shipped inside PyPI wheels, their real input
shapes declared in ``[warmup.shapes]``): let the daemon's background choice (edged.core.chooser,
the daemon's own settings: bounded duty cycle, tie band) choose between ONNX Runtime and OpenVINO
on the CPU, twice, each time from a fresh cache (two fresh boots); then time raw ONNX Runtime (an
InferenceSession) and raw OpenVINO (``compile_model`` on CPU, one infer request) at batch 1 and at
the batch the scheduler forms (4, the auto-completed maximum, for models whose tensors all start
dynamic) on the declared shapes, interleaved in rounds so that load from other processes hits both
alike. Like with like: the raw engines get the settings the daemon's engines run with (ONNX Runtime:
one inter-op thread, all graph optimizations; OpenVINO: the LATENCY hint and f32 inference precision
for these fp32 models; default thread counts on both), and the same statistic as the daemon's
measurement (edged.backends.benchmark.typical_call_s: the median over rounds of each round's median).
Prints per model and batch size the ratio chosen engine / faster engine (goal <= 1.05 in latency,
i.e. >= 0.95x the faster engine's speed), whether the two choices agree wherever the raw engines
differ by more than 10% (goal: always), and the machine load before and after.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from bench import real_corpus
from bench.common import ratio_line
from bench.real_corpus import Model
from edged.backends.benchmark import typical_call_s
from edged.config import ModelsSection
from edged.core.manager import ModelManager
from edged.core.model_versions import ModelState
from edged.profiles import BackendPreference

PREFS = [BackendPreference(backend="onnxruntime", device="CPU", precisions=["fp32"]),
         BackendPreference(backend="openvino", device="CPU", precisions=["fp32"])]


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min) {five:.2f} (5 min) on {os.cpu_count()} CPUs"


def raw_runners(path: Path, x: Mapping[str, np.ndarray]) -> dict[str, Callable[[], object]]:
    import onnxruntime as ort
    import openvino as ov

    opts = ort.SessionOptions()  # as edged/backends/onnxruntime.py sets them with threads = 0
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
    feed = dict(x)
    runners: dict[str, Callable[[], object]] = {"onnxruntime": lambda: sess.run(None, feed)}
    try:  # as edged/backends/openvino.py compiles an fp32 variant for the CPU with threads = 0
        compiled = ov.Core().compile_model(str(path), "CPU", {"PERFORMANCE_HINT": "LATENCY",
                                                              "INFERENCE_PRECISION_HINT": "f32"})
    except RuntimeError as e:
        print(f"    raw openvino cannot compile {path.name}: {str(e).splitlines()[0][:120]}")
        return runners
    req = compiled.create_infer_request()
    runners["openvino"] = lambda: req.infer(feed)
    return runners


def timed(fn: Callable[[], object], seconds: float) -> list[float]:
    out: list[float] = []
    end = time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        out.append(t1 - t0)
        if t1 >= end and len(out) >= 3:
            return out


def chosen_engine(m: Model, onnx: Path, tmp: Path) -> tuple[str, str, float, str]:
    """The backend the daemon's background choice keeps from a fresh cache (for batch-1 runs), its own
    figures, the seconds it took, and the backend for runs of several samples (the same unless split)."""
    real_corpus.write_version(tmp / "models", m, onnx)
    mgr = ModelManager(tmp / "models", ModelsSection(), PREFS, cache_dir=tmp / "cache", select="benchmark",
                       defer_choice=True)
    try:
        mgr.load_all()
        t0 = time.monotonic()
        mgr.chooser.run_once(force=True)
        took = time.monotonic() - t0
        mv = mgr.table.find(m.name)
        assert mv is not None and mv.state is ModelState.READY and mv.candidate is not None, mv and mv.reason
        b = mv.benchmark
        own = ", ".join(f"{t.backend} {t.throughput_per_s:.0f}/s" for t in b.timings) \
            if b is not None else "not measured (one engine loads)"
        many = mv.candidate.backend
        if b is not None and b.chosen_batched:
            many = b.chosen_batched.split("/")[0]
            own += f"; batches of 2+ on {many}"
        return mv.candidate.backend, own, took, many
    finally:
        mgr.shutdown()


def raw_latency(path: Path, x: Mapping[str, np.ndarray], seconds: float, rounds: int) -> dict[str, float]:
    """Typical call (ms) of each raw engine that runs the input; engines that fail are left out."""
    runners = raw_runners(path, x)
    for k in list(runners):
        try:
            timed(runners[k], 0.3)  # untimed lead-in
        except Exception as e:
            print(f"    raw {k} cannot run {[(n, a.shape) for n, a in x.items()]}: {str(e)[:120]}")
            del runners[k]
    calls: dict[str, list[list[float]]] = {k: [] for k in runners}
    order = list(runners)
    for r in range(rounds):
        for k in order[r % len(order):] + order[:r % len(order)]:
            calls[k].append(timed(runners[k], seconds / rounds))
    return {k: typical_call_s(v) * 1e3 for k, v in calls.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=[m.name for m in real_corpus.MODELS])
    ap.add_argument("--seconds", type=float, default=4.0, help="timed seconds per raw engine, model and batch")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    print(f"before: {_load()}")
    models = [m for m in real_corpus.MODELS if m.name in args.models]
    files = real_corpus.fetch(models)
    lines = []
    for m in models:
        picks = []
        for _ in range(2):
            with tempfile.TemporaryDirectory() as tmp:
                picks.append(chosen_engine(m, files[m.name], Path(tmp)))
        print(f"{m.name:<12} {m.what}: chosen {picks[0][0]} ({picks[0][1]}; {picks[0][2]:.1f} s), "
              f"fresh again {picks[1][0]} ({picks[1][1]}; {picks[1][2]:.1f} s)")
        sizes = [1, m.batch] if m.batched else [1]
        gaps = []
        for b in sizes:
            med = raw_latency(files[m.name], m.sample(b), args.seconds, args.rounds)
            chosen = picks[0][0] if b == 1 else picks[0][3]
            if chosen not in med or len(med) < 2:
                print(f"  batch {b}: raw {med} (one engine only: nothing to compare)")
                continue
            fastest = min(med, key=lambda k: med[k])
            gaps.append(max(med.values()) / min(med.values()))
            print(f"  batch {b}: raw onnxruntime {med['onnxruntime']:8.2f} ms  openvino {med['openvino']:8.2f} ms "
                  f"(ORT/OV {med['onnxruntime'] / med['openvino']:.2f})")
            lines.append(ratio_line(f"{m.name} batch {b}: chosen ({chosen}) / faster ({fastest}) latency",
                                    med[chosen], med[fastest], 1.05, higher_is_better=False))
        differ = any(g > 1.10 for g in gaps)
        agree = picks[0][0] == picks[1][0] and picks[0][3] == picks[1][3]
        pair = [p[0] + (f"+{p[3]} for batches" if p[3] != p[0] else "") for p in picks]
        lines.append(f"{m.name}: two fresh choices {'agree' if agree else 'DIFFER'} ({pair[0]} / {pair[1]}); "
                     f"raw engines differ by {'more' if differ else 'at most'} than 10% "
                     f"-> {'ok' if agree or not differ else 'FAIL'}")
    print()
    for line in lines:
        print(line)
    print(f"after: {_load()}")


if __name__ == "__main__":
    main()
