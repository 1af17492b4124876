"""The floor under edged's HTTP path: the same server library (edged.transports.http.server) in its
own process, answering every request at once with a canned body of the size the client asks for.

    .venv/bin/python -m bench.http_floor PORT [MODEL.onnx [json]]   # prints "ready", serves until stdin closes

The suite (bench/run_suite.py) sends it the very bytes it sends edged and asks for a reply as large
as edged's, so the difference between the two is edged's own work: decoding, validating, queueing,
encoding, not the socket, the HTTP parsing or the client. Given a model, it runs it once on its event
loop before each answer (bench/floor_engine.py): the floor under an inference, not only a round trip.
With ``json`` it is the least a JSON inference server on this library does: the body parsed with
orjson, the input's ``data`` made an array by numpy, the model run on it, and the outputs written back
as v2 JSON by orjson (no validation, no names checked).
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


def _json_handler(model: Path) -> Callable[[Request], Awaitable[Response]]:
    import numpy as np
    import orjson

    from bench.floor_engine import engine_call

    run, names = engine_call(model)

    async def handle(req: Request) -> Response:
        doc = orjson.loads(req.body)
        tensor = doc["inputs"][0]
        x = np.asarray(tensor["data"], dtype=np.float32).reshape(tensor["shape"])
        outs = run(x)
        body = orjson.dumps({"model_name": model.parent.parent.name, "outputs": [
            {"name": n, "datatype": "FP32", "shape": list(o.shape), "data": o.ravel()}
            for n, o in zip(names, outs, strict=True)]}, option=orjson.OPT_SERIALIZE_NUMPY)
        return 200, [(b"content-type", b"application/json")], body
    return handle


async def _serve(port: int, handler: Callable[[Request], Awaitable[Response]]) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(64)
    sock.setblocking(False)
    server = HttpServer(handler)
    await server.start(sock)
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # until the suite closes our stdin
    await server.stop(1.0)


if __name__ == "__main__":
    from bench.floor_engine import engine_run

    if len(sys.argv) > 3 and sys.argv[3] == "json":
        asyncio.run(_serve(int(sys.argv[1]), _json_handler(Path(sys.argv[2]))))
    else:
        asyncio.run(_serve(int(sys.argv[1]), _handler(engine_run(Path(sys.argv[2])) if len(sys.argv) > 2 else None)))
