"""Where edged's gRPC ModelInfer time goes, layer by layer, inside one running daemon.

    .venv/bin/python -m bench.grpc_layers [--rounds 3] [--seconds 20]

A daemon runs in this process (bench/wakeups.py, the bundled mobilenet). Beside its own gRPC
listener, bare grpcio servers are started on the daemon's own event loop, each adding one layer of
edged's path to the one before; a client process calls them all in shuffled turns with the same
message (the last of three calls of each counted, so each follows its own kind) and prints, per
layer, the median difference to the bare handler that runs the daemon's engine:

    floor          bare unary handler, the floor's own ONNX Runtime session (bench/floor_engine.py)
    engine         bare unary handler running the daemon's engine (the reference)
    read           request-streaming handler: the message read in the handler, as edged reads it
    admitted       edged's admission around it: the request memory reserved, the read's deadline
    decoded        + the message parsed and decoded by plan, the engine run on the decoded input
    service        + the inference service instead of the engine (validation, scheduler, statistics)
    answered       + the answer written from the service's response (GrpcApp.plans.answer)
    app            edged's whole gRPC app (GrpcApp.handler) on a bare server: + the answer written
    daemon         the daemon's own listener (its grpcio options and limits)

What the daemon's process itself costs (its ~24 threads, its objects, its loop) was measured apart:
the ``floor`` handler on the daemon's loop against the same handler in a process of its own
(bench/grpc_floor.py), +2 to +36 us on 2026-12-07. Everything above ``engine`` is edged's own Python.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.grpc_floor import METHOD
from bench.wakeups import MODEL, daemon_with_everything
from edged.protocol.types import InferResponse
from edged.protocol.v2 import DecodedRequest
from edged.transports.v2_ops import LOOP_INLINE_MAX_NS

LAYERS = ("floor", "engine", "read", "admitted", "decoded", "service", "answered", "app", "daemon")
REFERENCE = "engine"


def client(ports: list[int], seconds: float) -> list[list[float]]:
    """Unary calls to each port in shuffled turns; the latencies of the last of each three."""
    import grpc

    from edged.client.grpc import infer_request

    x1 = np.random.default_rng(0).random((1, 3, 48, 192), dtype=np.float32)
    calls = [grpc.insecure_channel(f"127.0.0.1:{p}").unary_unary(METHOD) for p in ports]

    def body() -> bytes:
        return bytes(infer_request(MODEL, {"image": x1}, None).SerializeToString())
    for call in calls:
        for _ in range(200):
            call(body())
    lat: list[list[float]] = [[] for _ in ports]
    order = list(range(len(calls)))
    shuffle = random.Random(1).shuffle
    pc = time.perf_counter
    end = pc() + seconds
    while pc() < end:
        shuffle(order)
        for k in order:
            for _ in range(3):
                t0 = pc()
                calls[k](body())
                t1 = pc()
            lat[k].append(t1 - t0)
    return lat


def _handlers(d: Any, reply: bytes) -> dict[str, tuple[str, Callable[..., Awaitable[bytes]]]]:
    """Each layer but the daemon's own: (grpcio handler kind, handler)."""
    from bench.floor_engine import engine_run
    from edged.transports.grpc.app import GrpcApp
    from edged.transports.grpc.codec import decode_infer

    rt = d.daemon.runtime
    app: GrpcApp = next(t for t in d.daemon.transports if t.name == "grpc").app
    engine = rt.service.ready_model(MODEL).engine
    shm = app.shm.view("")
    feed = {"image": np.random.default_rng(0).random((1, 3, 48, 192), dtype=np.float32)}
    floor_run = engine_run(d.daemon.cfg.device.model_repository / MODEL / "1" / "model.onnx")

    async def floor(request: bytes, context: Any) -> bytes:
        floor_run()
        return reply

    async def on_engine(request: bytes, context: Any) -> bytes:
        engine.infer(feed)
        return reply

    async def read(requests: Any, context: Any) -> bytes:
        await context.read()
        engine.infer(feed)
        return reply

    async def admitted(data: bytes, context: Any, hold: Any) -> bytes:
        hold.release()
        engine.infer(feed)
        return reply

    def after_decode(step: Callable[[DecodedRequest], Awaitable[bytes]]) -> Callable[..., Awaitable[bytes]]:
        """edged's admission, then the message parsed and decoded by plan, then ``step``."""
        async def handle(data: bytes, context: Any, hold: Any) -> bytes:
            try:
                msg = await app._received(data, hold)
                if msg.plan is None:  # the message's first time: decoded in full, its plan kept
                    request = decode_infer(msg.request, shm, msg.raw)
                    app.plans.learn(msg, request)
                    return await step(request)
                return await step(msg.plan.decode(msg.raw))
            finally:
                hold.release()
        return app._admitted(handle)

    async def decoded(request: DecodedRequest) -> bytes:
        engine.infer(request.request.inputs)
        return reply

    async def service(request: DecodedRequest) -> bytes:
        rt.service.infer_or_submit(request.request, LOOP_INLINE_MAX_NS)
        return reply

    async def answered(request: DecodedRequest) -> bytes:
        done = rt.service.infer_or_submit(request.request, LOOP_INLINE_MAX_NS)
        resp = done if isinstance(done, InferResponse) else await asyncio.wrap_future(done)
        return bytes(app.plans.answer(resp, request, shm))

    return {"floor": ("unary", floor), "engine": ("unary", on_engine), "read": ("stream", read),
            "admitted": ("stream", app._admitted(admitted)), "decoded": ("stream", after_decode(decoded)),
            "service": ("stream", after_decode(service)), "answered": ("stream", after_decode(answered))}


async def _serve(layers: dict[str, tuple[str, Callable[..., Awaitable[bytes]]]], app_handler: Any,
                 ports: dict[str, int]) -> list[Any]:
    import grpc

    service, method = METHOD.rsplit("/", 1)
    servers = []
    for name, port in ports.items():
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        if name == "app":
            server.add_generic_rpc_handlers((app_handler,))
        else:
            kind, fn = layers[name]
            handler = (grpc.unary_unary_rpc_method_handler(fn) if kind == "unary"
                       else grpc.stream_unary_rpc_method_handler(fn))
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.lstrip("/"),
                                                                                  {method: handler}),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        servers.append(server)
    return servers


def _report(round_no: int, names: list[str], lat: list[list[float]]) -> None:
    ref = lat[names.index(REFERENCE)]
    print(f"round {round_no}: {len(ref)} calls of each; p50 of {REFERENCE} {statistics.median(ref) * 1e6:.0f} us; "
          "each layer's median difference to it, call by call:", flush=True)
    for name, values in zip(names, lat, strict=True):
        diff = statistics.median(a - b for a, b in zip(values, ref, strict=True))
        print(f"  {name:9s} {diff * 1e6:+7.1f} us", flush=True)


def measure(rounds: int, seconds: float) -> None:
    from edged.client.grpc import GrpcClient, infer_request
    from edged.protocol.grpc.gen import grpc_service_pb2 as pb
    from edged.transports.grpc.server import GrpcTransport
    from tests.netutil import free_port

    with tempfile.TemporaryDirectory(prefix="edged-grpc-layers-") as t, \
            daemon_with_everything(Path(t)) as (d, _http, grpc_port, _mqtt, _sock):
        def work() -> None:
            d.settled(90.0)
            x1 = np.random.default_rng(0).random((1, 3, 48, 192), dtype=np.float32)
            with GrpcClient(f"127.0.0.1:{grpc_port}") as c:  # the bare handlers answer as many bytes as edged
                answer = c.call("ModelInfer", infer_request(MODEL, {"image": x1}, None), pb.ModelInferResponse)
            reply = bytes(answer.ByteSize())
            assert d.daemon.runtime is not None
            served = d.daemon.runtime.service.ready_model(MODEL)
            # The background choice may settle on either engine: the floor's is ONNX Runtime.
            print(f"the daemon serves {MODEL} on {served.candidate.label if served.candidate else '?'}", flush=True)
            layers = _handlers(d, reply)
            ports = {name: free_port() for name in LAYERS if name != "daemon"}
            app = next(t for t in d.daemon.transports if isinstance(t, GrpcTransport)).app
            assert d.loop is not None
            servers = asyncio.run_coroutine_threadsafe(_serve(layers, app.handler(), ports), d.loop).result(30)
            ports["daemon"] = grpc_port
            names = list(LAYERS)
            try:
                for r in range(rounds):
                    out = subprocess.run([sys.executable, "-m", "bench.grpc_layers", "--client",
                                          ",".join(str(ports[n]) for n in names), "--seconds", str(seconds)],
                                         capture_output=True, text=True, check=True, cwd=Path(__file__).parent.parent)
                    _report(r + 1, names, [[float(v) for v in line.split()] for line in out.stdout.splitlines()])
            finally:
                for server in servers:
                    asyncio.run_coroutine_threadsafe(server.stop(0.1), d.loop).result(30)
        d.serve(work)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=20.0, help="per round, all layers in turns")
    ap.add_argument("--client", help=argparse.SUPPRESS)  # the client process: ports, comma-separated
    args = ap.parse_args()
    if args.client:
        for values in client([int(p) for p in args.client.split(",")], args.seconds):
            print(" ".join(f"{v:.9f}" for v in values))
        return
    measure(args.rounds, args.seconds)


if __name__ == "__main__":
    main()
