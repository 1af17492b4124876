"""The floor under edged's HTTP path: the same server library (edged.transports.http.server) in its
own process, answering every request at once with a canned body of the size the client asks for.

    .venv/bin/python -m bench.http_floor PORT [MODEL.onnx]   # prints "ready", serves until stdin closes

The suite (bench/run_suite.py) sends it the very bytes it sends edged and asks for a reply as large
as edged's, so the difference between the two is edged's own work: decoding, validating, queueing,
encoding, not the socket, the HTTP parsing or the client. Given a model, it runs it once on its event
loop before each answer (bench/floor_engine.py): the floor under an inference, not only a round trip.
"""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from edged.transports.http.server import Headers, HttpServer, Request, Response

REPLY_SIZE = "bench-reply-size"  # request header: how many bytes to answer with


def _handler(run: Callable[[], None] | None) -> Callable[[Request], Awaitable[Response]]:
    async def handle(req: Request) -> Response:
        size = 0
        for name, value in req.headers:
            if name == REPLY_SIZE.encode():
                size = int(value)
        if run is not None:
            run()
        headers: Headers = [(b"content-type", b"application/octet-stream")]
        return 200, headers, bytes(size)
    return handle


async def _serve(port: int, run: Callable[[], None] | None) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(64)
    sock.setblocking(False)
    server = HttpServer(_handler(run))
    await server.start(sock)
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # until the suite closes our stdin
    await server.stop(1.0)


if __name__ == "__main__":
    from bench.floor_engine import engine_run

    asyncio.run(_serve(int(sys.argv[1]), engine_run(Path(sys.argv[2])) if len(sys.argv) > 2 else None))
