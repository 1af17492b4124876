"""OpenVINO's engine run as edged feeds it, against the library's own ``infer`` dispatch, call by call.

    .venv/bin/python -m bench.ov_feed [--calls 4000]

``OpenVinoEngine.infer`` copies each input into the tensor its infer request owns and runs the
request with outputs as views, copying only the outputs asked for. Before, it handed the inputs to
``InferRequest.infer``, whose Python dispatcher copies them through several layers and which copies
every output into a result dictionary that edged then copied again. Both paths run here on the same
compiled model, in shuffled calls (a shared VM's drift hits both alike), on the bundled mobilenet
(110 KB in, 148 bytes out) and on a made model with a segmentation-sized output (48 KB in, 3 MB out;
needs the ``onnx`` package). Printed: each path's median, the feed's over the dispatcher's, the host.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import edged.backends.openvino as ov_backend
from bench.run_suite import machine

ROOT = Path(__file__).resolve().parent.parent


def _tiled_model(folder: Path) -> Path | None:
    """[N,3,64,64] -> Tile 8x8 -> [N,3,512,512]: little compute, a 3 MB output per sample."""
    try:
        import onnx
        from onnx import TensorProto, helper
    except ImportError:
        return None
    reps = helper.make_tensor("reps", TensorProto.INT64, [4], [1, 1, 8, 8])
    graph = helper.make_graph(
        [helper.make_node("Tile", ["x", "reps"], ["y"])], "tiled",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 64, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3, 512, 512])], [reps])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = folder / "tiled.onnx"
    onnx.save(model, str(path))
    return path


def compare(engine: Any, inputs: dict[str, np.ndarray], calls: int) -> dict[str, float]:
    """Median seconds per call of each path, the paths drawn at random call by call."""
    feed = ov_backend._feed
    paths: dict[str, Callable[..., bool]] = {"feed": feed, "dispatcher": lambda *a: False}
    want = engine.infer(inputs)
    times: dict[str, list[float]] = {k: [] for k in paths}
    try:
        for _ in range(calls):
            name = random.choice(list(paths))
            ov_backend._feed = paths[name]
            t0 = time.perf_counter()
            got = engine.infer(inputs)
            times[name].append(time.perf_counter() - t0)
            assert all(np.array_equal(got[k], want[k]) for k in want)
    finally:
        ov_backend._feed = feed
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=4000, help="per model, both paths together")
    args = ap.parse_args()
    import openvino as ov

    core = ov.Core()
    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"}
    rng = np.random.default_rng(0)
    print(f"machine: {machine()}; OpenVINO {ov.get_version()}")
    with tempfile.TemporaryDirectory() as tmp:
        cases: list[tuple[str, Path | None, dict[str, np.ndarray]]] = [
            ("mobilenet, 110 KB in", ROOT / "models" / "mobilenet" / "1" / "openvino" / "model.xml",
             {"image": rng.random((1, 3, 48, 192), dtype=np.float32)}),
            ("tiled, 3 MB out", _tiled_model(Path(tmp)), {"x": rng.random((1, 3, 64, 64), dtype=np.float32)}),
        ]
        for label, path, inputs in cases:
            if path is None:
                print(f"{label}: skipped (the onnx package is not installed)")
                continue
            engine = ov_backend.OpenVinoEngine(core.compile_model(str(path), "CPU", config), "CPU", "fp32", 1)
            for _ in range(100):
                engine.infer(inputs)
            med = compare(engine, inputs, args.calls)
            f, d = med["feed"], med["dispatcher"]
            print(f"{label}: feed p50 {f * 1e6:.1f} us, dispatcher p50 {d * 1e6:.1f} us, "
                  f"feed / dispatcher {f / d:.3f} ({(f - d) * 1e6:+.1f} us)")
            engine.unload()


if __name__ == "__main__":
    main()
