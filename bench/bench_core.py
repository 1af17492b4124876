"""Inference core benchmark: the service against the raw engine, same model, same run.

    .venv/bin/python -m bench.bench_core [--model mobilenet] [--seconds 3]

Goals (issue: inference core): concurrency 1 >= 0.9x raw batch-1 throughput; concurrency 8 with
batching >= 0.85x raw batch-8 throughput.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import numpy as np

from bench.common import measure, ratio_line
from edged.config import ModelsSection
from edged.core.manager import ModelManager
from edged.core.service import InferenceService
from edged.profiles import BackendPreference
from edged.protocol.types import InferRequest

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mobilenet")
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "models"
        shutil.copytree(ROOT / "models" / args.model, repo / args.model)
        prefs = [BackendPreference(backend="onnxruntime", device="CPU", precisions=["fp32"])]
        manager = ModelManager(repo, ModelsSection(), prefs)
        manager.load_all()
        svc = InferenceService(manager)
        mv = svc.ready_model(args.model)
        engine = mv.engine
        assert engine is not None
        spec = mv.inputs[0]
        rng = np.random.default_rng(0)
        x1 = rng.random((1, *spec.shape), dtype=np.float32)
        x8 = rng.random((8, *spec.shape), dtype=np.float32)
        name = spec.name
        s = args.seconds
        raw1 = measure("raw engine, batch 1", lambda: engine.infer({name: x1}), seconds=s)
        raw8 = measure("raw engine, batch 8", lambda: engine.infer({name: x8}), seconds=s, samples_per_call=8)
        svc1 = measure("service, concurrency 1", lambda: svc.infer(InferRequest(args.model, {name: x1})), seconds=s)
        svc1b = measure("service blocking (inline), concurrency 1",
                        lambda: svc.infer_blocking(InferRequest(args.model, {name: x1})), seconds=s)
        svc8 = measure("service, concurrency 8, batching", lambda: svc.infer(InferRequest(args.model, {name: x1})),
                       seconds=s, concurrency=8)
        manager.shutdown()
    print(f"model {args.model} on {mv.candidate.label if mv.candidate else '?'}, {s:.0f} s per row")
    for r in (raw1, raw8, svc1, svc1b, svc8):
        print(r.row())
    print(ratio_line("service c1 / raw batch-1 throughput", svc1.throughput, raw1.throughput, 0.9))
    print(ratio_line("service c1 inline / raw batch-1 throughput", svc1b.throughput, raw1.throughput, 0.9))
    print(ratio_line("service c8 batching / raw batch-8 throughput", svc8.throughput, raw8.throughput, 0.85))
    print(f"median overhead at c1: {(svc1.median_ms - raw1.median_ms) * 1e3:.0f} us (queued), "
          f"{(svc1b.median_ms - raw1.median_ms) * 1e3:.0f} us (inline)")


if __name__ == "__main__":
    main()
