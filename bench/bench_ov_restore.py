"""OpenVINO after a refused input: which way of restoring the compiled model's shape state is cheapest?

    .venv/bin/python -m bench.bench_ov_restore [--models nudenet ocr_det ocr_rec ocr_cls] [--repeat 5]

OpenVINO's CPU plugin keeps a refused shape in its compiled model's per-stream graph: after a
request it refuses (ocr_det 33x47, say), requests at the shape that last succeeded fail until a
request of another shape succeeds, and a new infer request from the same compiled model does not
help. For each model of the public test corpus (tests/corpus.py) this script shows the poison
sequence on raw OpenVINO, then times the ways of getting a clean compiled model back while the
current one is poisoned, and checks that each answers the good shape again exactly as before:

- recompile: ``compile_model`` again from the ``ov.Model`` kept since load (a reshape back to the
  original shape has to recompile too: a compiled model cannot be reshaped);
- import: ``import_model`` of the compiled blob exported once at load and kept in memory;
- re-export: export the poisoned compiled model itself and import that (nothing held in memory);
- cache: ``compile_model`` of the file with a model cache directory (CACHE_DIR), as a restart would;
- spare: a second compiled model made at load and swapped in (no time on restore; the cost is
  the memory of a second compiled model, printed as the RSS it added).

Settings as edged/backends/openvino.py compiles an fp32 variant for the CPU (LATENCY, f32).
Prints the median restore times and the memory, with the host.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tests import corpus

CONFIG = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"}
# A shape each model refuses on OpenVINO (the detectors' strides, the recognisers' pooling), and another it takes.
BAD = {"nudenet": (33, 47), "ocr_det": (33, 47), "ocr_rec": (8, 8), "ocr_cls": (8, 8)}
OTHER = {"nudenet": (256, 256), "ocr_det": (256, 256), "ocr_rec": (48, 256), "ocr_cls": (48, 128)}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def host() -> str:
    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                     platform.processor())
    return f"{model}, {os.cpu_count()} CPUs, {platform.machine()}"


def answer(compiled: Any, x: np.ndarray) -> np.ndarray | None:
    try:
        req = compiled.create_infer_request()
        req.infer({0: x})
        return np.array(req.get_output_tensor(0).data, copy=True)
    except RuntimeError:
        return None


def poison_sequence(compiled: Any, good: np.ndarray, bad: np.ndarray, other: np.ndarray) -> str:
    return " ".join(f"{'x'.join(map(str, a.shape[2:]))}:{'ok' if answer(compiled, a) is not None else 'FAIL'}"
                    for a in (good, bad, good, good, other, good))


def timed(make: Callable[[], Any], good: np.ndarray, want: np.ndarray, repeat: int) -> tuple[float, bool]:
    """Median time of ``make`` and whether every model it made answers ``good`` exactly as ``want``."""
    times, ok = [], True
    for _ in range(repeat):
        t0 = time.perf_counter()
        c = make()
        times.append(time.perf_counter() - t0)
        got = answer(c, good)
        ok = ok and got is not None and np.array_equal(got, want)
    return statistics.median(times) * 1e3, ok


def bench_model(core: Any, m: corpus.CorpusModel, repeat: int) -> None:
    path = str(m.fetch())
    rng = np.random.default_rng(0)
    good = rng.random(m.shape, dtype=np.float32)
    bad = rng.random(m.shape[:2] + BAD[m.name], dtype=np.float32)
    other = rng.random(m.shape[:2] + OTHER[m.name], dtype=np.float32)
    model = core.read_model(path)
    compiled = core.compile_model(model, "CPU", CONFIG)
    want = answer(compiled, good)
    assert want is not None
    print(f"\n{m.name} {m.shape}: raw OpenVINO, a new infer request each time: "
          f"{poison_sequence(compiled, good, bad, other)}")
    blob_io = io.BytesIO()
    t0 = time.perf_counter()
    compiled.export_model(blob_io)
    export_ms = (time.perf_counter() - t0) * 1e3
    blob = blob_io.getvalue()

    def reexport() -> Any:
        b = io.BytesIO()
        compiled.export_model(b)
        return core.import_model(io.BytesIO(b.getvalue()), "CPU", CONFIG)

    answer(compiled, good)
    answer(compiled, bad)  # the current compiled model is poisoned from here on, as on the day
    assert answer(compiled, good) is None
    rows: list[tuple[str, float, bool]] = []
    ms, ok = timed(lambda: core.compile_model(model, "CPU", CONFIG), good, want, repeat)
    rows.append(("recompile from the kept ov.Model", ms, ok))
    ms, ok = timed(lambda: core.import_model(io.BytesIO(blob), "CPU", CONFIG), good, want, repeat)
    rows.append((f"import a blob exported at load ({len(blob) / 2**20:.1f} MB held, export {export_ms:.0f} ms)",
                 ms, ok))
    ms, ok = timed(reexport, good, want, repeat)
    rows.append(("export the poisoned compiled model and import it (none held)", ms, ok))
    with tempfile.TemporaryDirectory() as cache:
        cfg = dict(CONFIG, CACHE_DIR=cache)
        core.compile_model(path, "CPU", cfg)  # fills the cache
        ms, ok = timed(lambda: core.compile_model(path, "CPU", cfg), good, want, repeat)
        rows.append(("compile the file through a model cache (CACHE_DIR)", ms, ok))
    before = _rss_mb()
    spare = core.compile_model(model, "CPU", CONFIG)
    got = answer(spare, good)
    rows.append((f"a spare compiled model swapped in (+{_rss_mb() - before:.0f} MB RSS held)", 0.0,
                 got is not None and np.array_equal(got, want)))
    for label, ms, ok in rows:
        print(f"  {label:<66} {ms:8.1f} ms  {'restores exactly' if ok else 'DOES NOT RESTORE'}")


def main() -> None:
    import openvino as ov

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=list(BAD), choices=list(BAD))
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(f"host: {host()}; OpenVINO {ov.get_version()}; load average {os.getloadavg()[0]:.2f}")
    core = ov.Core()
    by_name = {m.name: m for m in corpus.CORPUS}
    for name in args.models:
        bench_model(core, by_name[name], args.repeat)


if __name__ == "__main__":
    main()
