"""CPU time per round trip of the bare floors: the HTTP floor, grpcio unary and grpcio stream.

    .venv/bin/python -m bench.floor_cpu [--round-trips 3000] [--rounds 2]

Client and server each run in their own process on this machine, as in the suite; printed per round
trip: the wall time and the CPU time of each process (psutil). On a machine whose cores are the limit
(every concurrency-8 case on two cores), a transport cannot answer faster than its library's CPU cost
per message allows, whatever edged does above it.
"""

from __future__ import annotations

import argparse
import time

import grpc as grpcio
import numpy as np
import orjson
import psutil

from bench.http_floor import REPLY_SIZE
from bench.run_suite import floor_server, grpc_floor_client, stop_floor
from edged.client.grpc import infer_request
from edged.client.http import HttpClient
from tests.netutil import free_port

REPLY_BYTES = 4200  # about edged's answer for the bundled mobilenet


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--round-trips", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    x = np.random.default_rng(0).random((1, 3, 48, 192), dtype=np.float32)
    http_port, grpc_port = free_port(), free_port()
    http_proc = floor_server("bench.http_floor", http_port)
    grpc_proc = floor_server("bench.grpc_floor", grpc_port, REPLY_BYTES)
    header = orjson.dumps({"inputs": [{"name": "image", "datatype": "FP32", "shape": list(x.shape),
                                       "parameters": {"binary_data_size": x.nbytes}}],
                           "parameters": {"binary_data_output": True}})
    headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header)),
               REPLY_SIZE: str(REPLY_BYTES)}
    http = HttpClient(f"127.0.0.1:{http_port}")
    grpc = grpc_floor_client(grpcio.insecure_channel(f"127.0.0.1:{grpc_port}"),
                             lambda: bytes(infer_request("m", {"image": x}, None).SerializeToString()))
    cases = {"HTTP": (http_proc, lambda: http.request("POST", "/v2/models/m/infer", [header, x.tobytes()], headers)),
             "gRPC unary": (grpc_proc, grpc.unary), "gRPC stream": (grpc_proc, grpc.stream)}
    me = psutil.Process()
    try:
        for _ in range(args.rounds):
            for name, (proc, call) in cases.items():
                for _ in range(200):
                    call()
                server, n = psutil.Process(proc.pid), args.round_trips
                c0, s0, t0 = me.cpu_times(), server.cpu_times(), time.perf_counter()
                for _ in range(n):
                    call()
                c1, s1, t1 = me.cpu_times(), server.cpu_times(), time.perf_counter()
                client_us = (c1.user + c1.system - c0.user - c0.system) / n * 1e6
                server_us = (s1.user + s1.system - s0.user - s0.system) / n * 1e6
                print(f"{name:12s} wall {(t1 - t0) / n * 1e6:6.0f} us   CPU: client {client_us:5.0f} + server "
                      f"{server_us:5.0f} = {client_us + server_us:5.0f} us per round trip", flush=True)
    finally:
        grpc.close()
        http.close()
        stop_floor(http_proc)
        stop_floor(grpc_proc)


if __name__ == "__main__":
    main()
