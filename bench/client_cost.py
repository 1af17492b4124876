"""What edged's own clients cost per call, against the same call with its request prepared beforehand.

    .venv/bin/python -m bench.client_cost [--rounds 6] [--calls 300] [--client-tree PATH]

One daemon (this tree's, the bundled mobilenet, shm, HTTP and gRPC on) and, in alternating blocks of
``--calls`` calls: shm ``infer()`` (copying the 110 KB input in and the outputs out) and the prepared
``run()`` of the same request; HTTP ``infer()`` and ``request()`` with the request's bytes built
beforehand; gRPC ``infer()`` and ``call()`` with a message built beforehand. Per case: p50 latency, and
the client's CPU per call (``time.thread_time``), both against the prepared case of the same round.
``--client-tree`` imports the clients from another checkout (``git worktree add /tmp/old <ref>``),
against the same daemon: the difference between two runs is the clients' own (issue 41's c1 rows
carry the client users run). Prints the host with the figures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MODEL = "mobilenet"


def _pairs(closers: list[Callable[[], None]], sock: Path, x1: np.ndarray, http_port: int, grpc_port: int
           ) -> list[tuple[str, Callable[[], object], Callable[[], object]]]:
    """(name, edged's call, the same call with its request prepared) per transport."""
    import orjson

    from edged.client.grpc import GrpcClient, infer_request
    from edged.client.http import HttpClient
    from edged.client.shm import ShmClient
    from edged.protocol.grpc.gen import grpc_service_pb2 as pb

    shm = ShmClient(sock)
    closers.append(shm.close)
    prep = shm.prepare(MODEL, {"image": x1.shape})
    prep.inputs["image"][:] = x1
    http = HttpClient(f"127.0.0.1:{http_port}")
    closers.append(http.close)
    hjson = orjson.dumps({"inputs": [{"name": "image", "datatype": "FP32", "shape": list(x1.shape),
                                      "parameters": {"binary_data_size": x1.nbytes}}],
                          "parameters": {"binary_data_output": True}})
    body = [hjson, x1.tobytes()]
    headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(hjson))}

    def http_prebuilt() -> None:
        if http.request("POST", f"/v2/models/{MODEL}/infer", body, headers).status != 200:
            raise SystemExit("the daemon refused the prebuilt HTTP request")

    grpc = GrpcClient(f"127.0.0.1:{grpc_port}")
    closers.append(grpc.close)
    message = infer_request(MODEL, {"image": x1}, None)
    return [
        ("shm", lambda: shm.infer(MODEL, {"image": x1}), prep.run),
        ("HTTP", lambda: http.infer(MODEL, {"image": x1}), http_prebuilt),
        ("gRPC", lambda: grpc.infer(MODEL, {"image": x1}),
         lambda: grpc.call("ModelInfer", message, pb.ModelInferResponse)),
    ]


def _block(fn: Callable[[], object], n: int) -> tuple[float, float]:
    lat = []
    c0 = time.thread_time()
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        lat.append(time.perf_counter() - t0)
    return statistics.median(lat), (time.thread_time() - c0) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--client-tree", type=Path, default=None, help="import edged's clients from this checkout")
    args = ap.parse_args()
    # The suite's helpers with this tree's clients, before --client-tree swaps in the other checkout's.
    from bench.run_suite import machine, settle_choice
    from tests.netutil import free_port

    if args.client_tree is not None:
        sys.path.insert(0, str(args.client_tree.resolve()))
        for name in [m for m in sys.modules if m == "edged" or m.startswith("edged.")]:
            del sys.modules[name]
    import edged
    from bench.bench_shm import daemon
    from edged.client.http import HttpClient

    http_port, grpc_port = free_port(), free_port()
    with tempfile.TemporaryDirectory(prefix="edged-client-cost-") as t:
        tmp = Path(t)
        shutil.copytree(ROOT / "models" / MODEL, tmp / "models" / MODEL)
        cfg = tmp / "edged.toml"
        cfg.write_text(f'[device]\nid = "bench"\nprofile = "generic"\nstate_dir = "{tmp / "state"}"\n'
                       f'runtime_dir = "{tmp / "run"}"\nmodel_repository = "{tmp / "models"}"\n'
                       f'[http]\nlisten = "127.0.0.1:{http_port}"\n[grpc]\nlisten = "127.0.0.1:{grpc_port}"\n'
                       '[mqtt]\nenabled = false\n[logging]\nlevel = "warning"\n')
        sock = tmp / "run" / "edged.sock"
        with daemon(cfg, sock, tmp / "edged.log"):
            x1 = np.random.default_rng(0).random((1, 3, 48, 192), dtype=np.float32)
            closers: list[Callable[[], None]] = []
            pairs = _pairs(closers, sock, x1, http_port, grpc_port)
            for _ in range(200):
                for _, a, b in pairs:
                    a()
                    b()
            with HttpClient(f"127.0.0.1:{http_port}") as http:  # the engine choice measures after READY
                settled = settle_choice(http)
            got: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name, _, _ in pairs}
            for _ in range(args.rounds):
                for name, a, b in pairs:
                    la, ca = _block(a, args.calls)
                    lb, cb = _block(b, args.calls)
                    got[name].append((la, ca, lb, cb))
            for close in closers:
                close()
    print(f"host: {machine()}, load average {os.getloadavg()[0]:.2f}; clients from "
          f"{Path(edged.__file__).parent.parent}; {settled}")
    print(f"{args.rounds} rounds x {args.calls} calls a case, medians over rounds")
    for name, rows in got.items():
        med = [statistics.median(r[i] for r in rows) for i in range(4)]
        over = statistics.median(r[0] - r[2] for r in rows)
        cpu_over = statistics.median(r[1] - r[3] for r in rows)
        print(f"{name:5s} infer() p50 {med[0] * 1e6:8.1f} us, prepared {med[2] * 1e6:8.1f} us: "
              f"{over * 1e6:+7.1f} us; client CPU {med[1] * 1e6:6.1f} vs {med[3] * 1e6:6.1f} us: "
              f"{cpu_over * 1e6:+6.1f} us a call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
