"""The floor under edged's gRPC path: grpcio's asyncio server, as edged runs it, in its own process,
answering ModelInfer (and each ModelStreamInfer message) at once with a canned reply of a given size
and doing nothing else.

    .venv/bin/python -m bench.grpc_floor PORT REPLY_BYTES [MODEL.onnx]   # prints "ready", serves until
                                                                          # stdin closes

The suite (bench/run_suite.py) sends it the bytes edged gets and sets REPLY_BYTES to the size of
edged's answer, so the difference between the two is edged's own work, not grpcio's. Given a model,
it runs it once on its event loop before each answer (bench/floor_engine.py): the least any grpcio
server can take for an inference here.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc

METHOD = "/inference.GRPCInferenceService/ModelInfer"
STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"


async def _serve(port: int, reply: bytes, run: Callable[[], None] | None) -> None:
    async def infer(request: bytes, context: Any) -> bytes:
        if run is not None:
            run()
        return reply

    async def stream(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for _ in requests:
            if run is not None:
                run()
            yield reply

    service, method = METHOD.rsplit("/", 1)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        service.lstrip("/"), {method: grpc.unary_unary_rpc_method_handler(infer),
                              STREAM_METHOD.rsplit("/", 1)[1]: grpc.stream_stream_rpc_method_handler(stream)}),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the suite closes our stdin
    await server.stop(1.0)


if __name__ == "__main__":
    from bench.floor_engine import engine_run

    asyncio.run(_serve(int(sys.argv[1]), bytes(int(sys.argv[2])),
                       engine_run(Path(sys.argv[3])) if len(sys.argv) > 3 else None))
