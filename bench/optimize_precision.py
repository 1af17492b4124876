"""Precision table: FP32, BF16 and INT8 (plain or accuracy-aware) on real models, measured here.

    .venv/bin/python -m bench.optimize_precision [--models ocr_cls ocr_rec orientation]
        [--calibration 64] [--eval 96] [--budget-s 240] [--timing-s 1] [--max-batch 8]

For each model of tests/optimize_corpus.py (PyPI wheels, generated labelled data) it runs
``edged optimize`` with the onnx-int8, openvino-bf16 and openvino-int8 variants and prints one
Markdown row per variant and engine: the task metric, the gate's verdict, how INT8 was made
(per-channel/per-tensor, opset, layers kept in float), the precision the engine reports running,
latency at batch 1 and at the max batch, and the speed ratio against FP32 on the same engine and
against the fastest FP32 of the run (the floor measured in the same run). Figures are for this
host only (printed first, with the load average).

The latencies are not optimize's own sequential timings: every kept variant is loaded again
through the daemon's backends and all of them are timed in interleaved rounds (``--rounds``, the
order rotating), each figure the median over rounds of the round's median call
(``edged.backends.benchmark.typical_call_s``), so load from other processes on a small shared
machine falls on every engine alike.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from edged.backends.benchmark import typical_call_s
from edged.optimize import command
from edged.optimize.engines import EngineSpec, load_engine
from edged.optimize.modelio import inspect_onnx
from edged.optimize.timing import cpu_flags, host_label
from edged.repository.manifest import parse_manifest
from tests.optimize_corpus import MODELS, UnavailableError


def interleaved(out: Path, report: dict[str, Any], x: np.ndarray, args: argparse.Namespace) -> None:
    """Replace the report's timings with interleaved-round figures of every kept variant and engine."""
    io_ = inspect_onnx(out / "model.onnx", args.max_batch)
    manifest = parse_manifest(out / "model.toml", model=out.parent.name, version=int(out.name))
    by_file = {v.file: v for v in manifest.variants}
    engines = []
    for v in report["variants"]:
        if v["status"] not in ("kept", "reference"):
            continue
        for backend in v["timings"]:
            spec = EngineSpec(by_file[v["file"]], backend)
            engines.append((v, backend, load_engine(spec, out, io_, name=out.parent.name, version=int(out.name))))
    name = io_.inputs[0].name
    feeds = {b: {name: np.ascontiguousarray(x[np.arange(b) % len(x)])} for b in (1, args.max_batch)}
    calls: dict[tuple[str, str, int], list[list[float]]] = {}
    for r in range(args.rounds):
        order = engines[r % len(engines):] + engines[:r % len(engines)]
        for v, backend, engine in order:
            for b, feed in feeds.items():
                engine.infer(feed)
                times: list[float] = []
                stop = time.monotonic() + args.slice_s
                while len(times) < 3 or time.monotonic() < stop:
                    t0 = time.perf_counter()
                    engine.infer(feed)
                    times.append(time.perf_counter() - t0)
                calls.setdefault((v["key"], backend, b), []).append(times)
    for v, backend, engine in engines:
        engine.unload()
        v["timings"][backend] = [{"batch_size": b, "latency_ms": typical_call_s(calls[(v["key"], backend, b)]) * 1e3}
                                 for b in feeds]


def run_model(name: str, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    m = MODELS[name]
    onnx = m.fetch()
    xc, _ = m.data(args.calibration, 7)
    xe, ye = m.data(args.eval, 11)
    np.save(tmp / "cal.npy", xc)
    np.save(tmp / "eval.npy", xe)
    np.save(tmp / "labels.npy", ye)
    out = tmp / "repo" / name / "1"
    argv = [str(onnx), "--calibration", str(tmp / "cal.npy"), "--eval", str(tmp / "eval.npy"),
            "--labels", str(tmp / "labels.npy"), "--metric", m.metric, "--out", str(out),
            "--variants", "onnx-int8,openvino-bf16,openvino-int8", "--max-batch-size", str(args.max_batch),
            "--timing-budget-s", str(args.timing_s), "--accuracy-budget-s", str(args.budget_s), "--quiet"]
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = command.main(argv)
    if rc != 0:
        raise RuntimeError(err.getvalue())
    report: dict[str, Any] = json.loads((out / "optimize-report.json").read_text())
    report["opset"] = m.opset
    if args.rounds > 0:
        interleaved(out, report, xe, args)
    return report


def _how(v: dict[str, Any]) -> str:
    parts = []
    q = v.get("quantization")
    if q:
        parts.append(f"{q['weights']}, opset {q['opset_from']}->{q['opset_to']}")
    aa = v.get("accuracy_aware")
    if aa and "method" in aa:
        total = aa.get("quantized_layers") or "?"
        verdict = "passed" if aa["passed"] else f"failed ({aa.get('stopped') or 'gate'})"
        parts.append(f"accuracy-aware {verdict}: {len(aa['kept_float'])}/{total} layers float, {aa['seconds']:.0f} s")
    return "; ".join(parts) or "-"


def rows(report: dict[str, Any]) -> list[str]:
    variants = report["variants"]
    fp32 = next(v for v in variants if v["key"] == "fp32")
    floor: dict[int, float] = {}
    for ts in fp32["timings"].values():
        for t in ts:
            floor[t["batch_size"]] = min(floor.get(t["batch_size"], float("inf")), t["latency_ms"])
    out = []
    for v in variants:
        score = v["metrics"]["score"] * 100 if v["metrics"] else None
        cells = [report["model"], str(report["opset"]), v["key"], f"{score:.1f}" if score is not None else "-",
                 v["status"] if v["status"] in ("kept", "reference") else f"{v['status']}", _how(v)]
        if not v["timings"]:
            out.append("| " + " | ".join([*cells, "-", "-", "-", "-", "-"]) + " |")
            continue
        for backend, ts in v["timings"].items():
            ref = {t["batch_size"]: t["latency_ms"] for t in fp32["timings"].get(backend, [])}
            lat = {t["batch_size"]: t["latency_ms"] for t in ts}
            b1, bn = sorted(lat)[0], sorted(lat)[-1]
            same = " / ".join(f"{ref[b] / lat[b]:.2f}x" for b in (b1, bn) if b in ref)
            best = " / ".join(f"{floor[b] / lat[b]:.2f}x" for b in (b1, bn) if b in floor)
            prec = v["execution_precision"].get(backend, v["precision"])
            out.append("| " + " | ".join([*cells, f"{backend} ({prec})", f"{lat[b1]:.3g}", f"{lat[bn]:.3g}",
                                          same, best]) + " |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=sorted(MODELS))
    ap.add_argument("--calibration", type=int, default=64)
    ap.add_argument("--eval", type=int, default=96)
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--timing-s", type=float, default=1.0)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=8, help="interleaved timing rounds (0: optimize's own timings)")
    ap.add_argument("--slice-s", type=float, default=0.25, help="time per engine and batch size in each round")
    args = ap.parse_args()
    flags = cpu_flags()
    bf16 = sorted(f for f in flags if "bf16" in f) or "none"
    amx = sorted(f for f in flags if "amx" in f) or "none"
    print(f"host: {host_label()}, {platform.node()}, {os.cpu_count()} CPUs; bf16 flags: {bf16}; amx: {amx}; "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| model | opset | variant | metric % | gate | how | engine (runs in) | B1 ms | "
          f"B{args.max_batch} ms | vs FP32 same engine (B1 / B{args.max_batch}) | vs fastest FP32 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        with tempfile.TemporaryDirectory(prefix="edged-precision-") as tmp:
            try:
                report = run_model(name, Path(tmp), args)
            except UnavailableError as e:
                print(f"| {name} | skipped: {e} |")
                continue
            for line in rows(report):
                print(line, flush=True)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
