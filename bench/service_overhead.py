"""What the in-process service adds to an engine run, measured call by call.

    .venv/bin/python -m bench.service_overhead [--model mobilenet] [--seconds 5]

Three loops of one request at a time on the same engine object: the raw engine, the least service
(bench/floor_service.py) and ``InferenceService.infer_blocking``. They take turns, three calls of
each at a time, so a shared VM's drift in speed hits all three alike; the last call of each turn
is kept (it follows a call of its own kind, as in a loop of one). Printed: each loop's p50 and its
p50 over raw, and how long the engine run itself took inside it (an engine run slowed by what
runs around it would show there, not in the time outside it).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.floor_service import LeastService
from edged.config import ModelsSection
from edged.core.manager import ModelManager
from edged.core.service import InferenceService
from edged.profiles import BackendPreference
from edged.protocol.types import InferRequest

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mobilenet")
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args()
    model = args.model
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "models"
        shutil.copytree(ROOT / "models" / model, repo / model)
        manager = ModelManager(repo, ModelsSection(),
                               [BackendPreference(backend="onnxruntime", device="CPU", precisions=["fp32"])])
        manager.load_all()
        try:
            report(model, InferenceService(manager), args.seconds)
        finally:
            manager.shutdown()


def report(model: str, svc: InferenceService, seconds: float) -> None:
    mv = svc.ready_model(model)
    engine = mv.engine
    assert engine is not None
    if len(mv.inputs) != 1 or -1 in mv.inputs[0].shape or mv.inputs[0].datatype != "FP32":
        raise SystemExit(f"{model}: this benchmark feeds one FP32 input of a fixed shape")
    name = mv.inputs[0].name
    batch = (1,) if mv.max_batch_size > 0 else ()
    x = np.random.default_rng(0).random((*batch, *mv.inputs[0].shape), dtype=np.float32)
    pc = time.perf_counter_ns
    inner = [0]
    run = engine.infer

    def timed(inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, Any]:
        t = pc()
        out = run(inputs, outputs)
        inner[0] = pc() - t
        return out

    engine.infer = timed  # type: ignore[method-assign]  # every loop below goes through it
    least = LeastService(model, timed)
    loops: dict[str, Callable[[], object]] = {
        "raw engine": lambda: timed({name: x}),
        "least service": lambda: least.infer(model, {name: x}),
        "infer_blocking": lambda: svc.infer_blocking(InferRequest(model, {name: x})),
    }
    for fn in loops.values():
        for _ in range(100):
            fn()
    total: dict[str, list[int]] = {k: [] for k in loops}
    in_engine: dict[str, list[int]] = {k: [] for k in loops}
    end = pc() + int(seconds * 1e9)
    while pc() < end:
        for k, fn in loops.items():
            for _ in range(3):
                t0 = pc()
                fn()
                d = pc() - t0
            total[k].append(d)
            in_engine[k].append(inner[0])
    raw = statistics.median(total["raw engine"])
    print(f"model {model}, {len(total['raw engine'])} turns of 3 calls each; microseconds at p50")
    for k in loops:
        p50 = statistics.median(total[k])
        print(f"  {k:<15} {p50 / 1e3:8.1f}  over raw {(p50 - raw) / 1e3:+6.1f}  ({raw / p50:.3f}x raw's "
              f"throughput)  engine run inside {statistics.median(in_engine[k]) / 1e3:8.1f}")


if __name__ == "__main__":
    main()
