"""Several instances of a model on a CPU: sharing every core per instance against splitting them.

    .venv/bin/python -m bench.instances [--backend onnxruntime|openvino] [--rounds 6] [--seconds 1.5]

In-process service at concurrency 8 (8 caller threads, dynamic batching on) for three set-ups of
the bundled mobilenet, measured in interleaved rounds against the raw engine (one instance, the
library's default threads) in the same round:

* ``1 instance``: the bundled manifest;
* ``2, shared``: two instances, each run allowed every core (what a count of 2 did before its
  threads were split: ONNX Runtime ``intra_op_threads = 0``, OpenVINO one LATENCY stream);
* ``2, split``: two instances splitting the cores (the default now).

Prints each round's throughput over the better of raw batch 1 and raw batch 8, the medians, and
the c1 latency each set-up gives a lone caller (splitting trades it for throughput).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import measure
from edged.config import ModelsSection
from edged.core.manager import ModelManager
from edged.core.service import InferenceService
from edged.profiles import BackendPreference
from edged.protocol.types import InferRequest

ROOT = Path(__file__).resolve().parent.parent
MODEL = "mobilenet"


def _manager(tmp: Path, label: str, backend: str, count: int, options: dict[str, Any]) -> ModelManager:
    repo = tmp / label
    shutil.copytree(ROOT / "models" / MODEL, repo / MODEL)
    toml = repo / MODEL / "1" / "model.toml"
    text = toml.read_text()
    if "[instances]\ncount = 1" not in text:
        raise SystemExit(f"{toml}: expected '[instances] count = 1' in the bundled manifest")
    toml.write_text(text.replace("[instances]\ncount = 1", f"[instances]\ncount = {count}"))
    prefs = [BackendPreference(backend=backend, device="CPU", precisions=["fp32"], options=options)]
    manager = ModelManager(repo, ModelsSection(), prefs)
    manager.load_all()
    return manager


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="onnxruntime", choices=["onnxruntime", "openvino"])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=1.5)
    args = ap.parse_args()
    shared = {"intra_op_threads": 0} if args.backend == "onnxruntime" else {"num_streams": 1}
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        setups = {"1 instance": _manager(tmp, "one", args.backend, 1, {}),
                  "2, shared": _manager(tmp, "shared", args.backend, 2, shared),
                  "2, split": _manager(tmp, "split", args.backend, 2, {})}
        services = {k: InferenceService(m) for k, m in setups.items()}
        for k, svc in services.items():
            engine = svc.ready_model(MODEL).engine
            assert engine is not None
            print(f"{k}: {engine.describe().get('intra_op_threads', engine.describe().get('streams'))}"
                  f" ({'intra-op threads' if args.backend == 'onnxruntime' else 'streams'})")
        raw_engine = services["1 instance"].ready_model(MODEL).engine
        assert raw_engine is not None
        rng = np.random.default_rng(0)
        x1 = rng.random((1, 3, 48, 192), dtype=np.float32)
        x8 = rng.random((8, 3, 48, 192), dtype=np.float32)
        s = args.seconds
        ratios: dict[str, list[float]] = {k: [] for k in services}
        c1_ms: dict[str, list[float]] = {k: [] for k in services}
        for r in range(args.rounds):
            raw1 = measure("raw b1", lambda: raw_engine.infer({"image": x1}), seconds=s)
            raw8 = measure("raw b8", lambda: raw_engine.infer({"image": x8}), seconds=s, samples_per_call=8)
            best = max(raw1.throughput, raw8.throughput)
            line = f"round {r + 1}: raw b1 {raw1.throughput:.0f}/s, b8 {raw8.throughput:.0f}/s"
            for k, svc in services.items():
                def queued(svc: InferenceService = svc) -> object:
                    return svc.infer(InferRequest(MODEL, {"image": x1}))

                def alone(svc: InferenceService = svc) -> object:
                    return svc.infer_blocking(InferRequest(MODEL, {"image": x1}))
                c8 = measure("c8", queued, seconds=s, concurrency=8)
                c1 = measure("c1", alone, seconds=s / 2)
                ratios[k].append(c8.throughput / best)
                c1_ms[k].append(c1.median_ms)
                line += f" | {k}: c8 {c8.throughput:.0f}/s ({c8.throughput / best:.2f}), c1 p50 {c1.median_ms:.2f} ms"
            print(line, flush=True)
        for m in setups.values():
            m.shutdown()
    print(f"{args.backend}, {args.rounds} rounds of {s:g} s; c8 over the better of raw b1 and raw b8:")
    for k in services:
        print(f"  {k:<11} median {statistics.median(ratios[k]):.2f} (rounds {min(ratios[k]):.2f}-"
              f"{max(ratios[k]):.2f}); c1 p50 median {statistics.median(c1_ms[k]):.2f} ms")


if __name__ == "__main__":
    main()
