"""What the cyclic garbage collector's full collections cost the daemon's answers (edged/heap.py).

    .venv/bin/python -m bench.gc_pauses [--calls 15000]

Runs the daemon twice, each time in a child process of this script (on its main thread): with
start-up's objects frozen (as ``edged run`` does) and with the freeze switched off. Each time it waits for the engine
choice and the review after it, then a client in a process of its own sends ``--calls`` gRPC
ModelInfer calls one at a time (the bundled CNN, pre-serialized bytes), and the daemon's process
notes each full (generation 2) collection and how long it took. It prints, per mode, the latency
tail, the calls over 20 and 40 ms, and the full collections seen. p50 and p99 move with the host's
noise; a full collection of an unfrozen heap is tens of milliseconds and shows as the maximum.
"""

from __future__ import annotations

import argparse
import gc
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

CLIENT = """
import sys, time
import numpy as np, grpc
from edged.client.grpc import infer_request
port, n = int(sys.argv[1]), int(sys.argv[2])
x1 = np.random.default_rng(0).random((1, 3, 48, 192), dtype=np.float32)
body = bytes(infer_request("mobilenet", {"image": x1}, None).SerializeToString())
call = grpc.insecure_channel(f"127.0.0.1:{port}").unary_unary("/inference.GRPCInferenceService/ModelInfer")
for _ in range(200):
    call(body)
lat = []
for _ in range(n):
    t = time.perf_counter()
    call(body)
    lat.append(time.perf_counter() - t)
lat.sort()
q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))] * 1e3
print(f"p50 {q(0.5):.3f}  p99 {q(0.99):.3f}  p99.9 {q(0.999):.3f}  max {lat[-1] * 1e3:.1f} ms; "
      f"calls over 20 ms {sum(x > 0.02 for x in lat)}, over 40 ms {sum(x > 0.04 for x in lat)}")
"""


def one_mode(frozen: bool, calls: int) -> None:
    """The daemon here, the client in a child process; prints one line."""
    sys.path.insert(0, str(ROOT))
    from bench.wakeups import daemon_with_everything
    from edged import heap

    if not frozen:
        heap.HeapKeeper.start = lambda self: heap.Frozen(0, 0.0, 0.0)  # type: ignore[method-assign]
        heap.HeapKeeper.stop = lambda self: None  # type: ignore[method-assign]
    full: list[float] = []
    began = [0]

    def note(phase: str, info: dict[str, Any]) -> None:
        if info["generation"] == 2:
            if phase == "start":
                began[0] = time.perf_counter_ns()
            else:
                full.append((time.perf_counter_ns() - began[0]) / 1e6)

    with tempfile.TemporaryDirectory() as tmp, daemon_with_everything(Path(tmp), quick_choice=True) as (
            d, _http, grpc_port, _mqtt, _sock):
        def work() -> None:
            d.settled(90.0)
            time.sleep(3.0)  # the heap review that follows the engine choice (edged/heap.py SOON_S)
            gc.callbacks.append(note)
            try:
                out = subprocess.run([sys.executable, "-c", CLIENT, str(grpc_port), str(calls)], cwd=ROOT,
                                     capture_output=True, text=True, check=True, timeout=calls * 0.05 + 60)
            finally:
                gc.callbacks.remove(note)
            tracked = len(gc.get_objects())
            print(f"{'frozen' if frozen else 'not frozen':10s}  {out.stdout.strip()}; full collections "
                  f"{len(full)} ({', '.join(f'{x:.0f}' for x in full) or '-'} ms); objects tracked {tracked}, "
                  f"frozen {gc.get_freeze_count()}", flush=True)
        d.serve(work)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=15000)
    ap.add_argument("--mode", choices=("frozen", "not-frozen"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        one_mode(args.mode == "frozen", args.calls)
        return
    from bench.run_suite import machine

    print(f"host: {machine()}; {args.calls} gRPC ModelInfer calls, one at a time", flush=True)
    for mode in ("not-frozen", "frozen"):
        done = subprocess.run([sys.executable, "-m", "bench.gc_pauses", "--mode", mode, "--calls", str(args.calls)],
                              cwd=ROOT, capture_output=True, text=True)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith(("frozen", "not frozen"))]
        print("\n".join(lines) if lines and done.returncode == 0 else f"{mode}: failed\n{done.stderr[-3000:]}",
              flush=True)


if __name__ == "__main__":
    main()
