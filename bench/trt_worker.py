"""What the TensorRT engine worker adds per request, against the bare IPC floor measured in the same run.

    .venv/bin/python -m bench.trt_worker [--rounds 5000] [--batch 1] [--python PATH]

The worker runs the TensorRT stand-in (tests/trt_standin) under Python 3.8 where this
machine has one, else the current interpreter. Per request it measures the engine
called through the worker (``WorkerEngine.infer``: copy in, INFER over the socket,
the engine, reply, copy out) and the same stand-in engine called in this process on
the same arrays; their difference is the worker's cost. The goal: that cost <= the
process-to-process round trip (bench/ipc_floor.py) + 50 us. Medians; noisy on a
shared machine, so the line says the load too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.ipc_floor import round_trips  # noqa: E402
from edged.backends.trt_worker.supervisor import WorkerEngine  # noqa: E402
from tests.trt_worker_env import STANDIN, default_worker_python, worker_python  # noqa: E402

GOAL_US = 50.0


def _median_us(fn: object, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times[rounds // 10:]) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5000)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--python", help="base interpreter for the worker (default: a 3.8 if found)")
    args = ap.parse_args()
    python, is_38 = (worker_python(args.python), False) if args.python else default_worker_python()
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((64, 10)).astype(np.float32)
    bias = rng.standard_normal(10).astype(np.float32)
    spec = {"edged_standin": 1, "weight": weight.tolist(), "bias": bias.tolist(),
            "inputs": [{"name": "x", "dtype": "float32", "shape": [-1, 64]}],
            "outputs": [{"name": "y", "dtype": "float32", "shape": [-1, 10]}]}
    x = rng.standard_normal((args.batch, 64)).astype(np.float32)

    sys.path.insert(0, str(STANDIN))
    import tensorrt as standin  # the same engine, in this process: the reference

    runtime = standin.Runtime(standin.Logger())
    ctx = runtime.deserialize_cuda_engine(json.dumps(spec).encode()).create_execution_context()
    y = np.empty((args.batch, 10), np.float32)

    def in_process() -> None:
        xin = np.ascontiguousarray(x)
        ctx.set_input_shape("x", xin.shape)
        ctx.set_tensor_address("x", xin.ctypes.data)
        ctx.set_tensor_address("y", y.ctypes.data)
        ctx.execute_async_v3(0)

    with tempfile.TemporaryDirectory() as tmp:
        plan = Path(tmp) / "model.plan"
        plan.write_text(json.dumps(spec))
        engine = WorkerEngine(str(python), plan, "bench")
        try:
            np.testing.assert_allclose(engine.infer({"x": x})["y"], x @ weight + bias, rtol=1e-5, atol=1e-5)
            in_process()
            np.testing.assert_allclose(y, x @ weight + bias, rtol=1e-5, atol=1e-5)
            worker_python_version = engine.health()["python"]
            floor = statistics.median(round_trips(args.rounds * 2, args.rounds // 5)) * 1e6
            through_worker = _median_us(lambda: engine.infer({"x": x}), args.rounds)
            direct = _median_us(in_process, args.rounds)
            floor_again = statistics.median(round_trips(args.rounds * 2, args.rounds // 5)) * 1e6
        finally:
            engine.unload()
    floor = min(floor, floor_again)
    added = through_worker - direct
    budget = floor + GOAL_US
    load = os.getloadavg()
    print(f"worker Python {worker_python_version}{'' if is_38 else ' (no 3.8 here)'}; batch {args.batch}; "
          f"load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"  IPC floor (bench.ipc_floor, median)      {floor:8.1f} us")
    print(f"  engine in this process (median)          {direct:8.1f} us")
    print(f"  engine through the worker (median)       {through_worker:8.1f} us")
    print(f"  added by the worker                      {added:8.1f} us")
    print(f"  goal: floor + {GOAL_US:.0f} us                     {budget:8.1f} us  -> ratio added/goal "
          f"{added / budget:.2f} ({'within' if added <= budget else 'OVER'})")


if __name__ == "__main__":
    main()
