"""One engine instance in its own process, served over the shared-memory wire.

Started by the daemon (:mod:`edged.backends.engine_procs.pool`) with one end of a socketpair; the
first message is the load request (JSON), the reply is HELLO with the engine's tensors or the error
that kept it from loading. Then, as the TensorRT engine worker does: REGISTER maps a sealed memfd the
daemon made (fd passed with SCM_RIGHTS), INFER names input ranges in one segment and an output range
in another, and the outputs are copied once into that range; tensors never cross the socket and
nothing is pickled. The process serves one request at a time (the daemon runs one batch per worker at
a time) and ends at EOF on its socket, which is also what the daemon's exit looks like.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import signal
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from edged.backends.base import Engine, LoadRequest
from edged.backends.factory import get_backend
from edged.backends.specs import spec_for
from edged.protocol import shm as p
from edged.protocol import shm_wire as wire
from edged.protocol.shm_worker import RequestError, SegmentTable, receive, serve_engine
from edged.repository.manifest import InputShape, TensorSpec, Variant

MAX_SEGMENTS = 8
MAX_SEGMENT_BYTES = 1 << 34
MAX_LOAD_MESSAGE = 1 << 20


def request_from_json(spec: Mapping[str, Any]) -> tuple[str, LoadRequest]:
    """The backend name and the load request the daemon sent (see pool.load_message)."""
    backend = str(spec["backend"])
    options = spec_for(backend).options.model_validate(spec["options"])
    inputs = spec.get("inputs")
    cache = spec.get("cache_dir")
    return backend, LoadRequest(
        model=str(spec["model"]), version=int(spec["version"]), version_dir=Path(spec["version_dir"]),
        variant=Variant.model_validate(spec["variant"]), device=str(spec["device"]), options=options,
        precision=str(spec["precision"]), max_batch_size=int(spec["max_batch_size"]),
        inputs=[TensorSpec.model_validate(t) for t in inputs] if inputs is not None else None,
        shapes={k: InputShape.model_validate(v) for k, v in spec["shapes"].items()},
        threads=int(spec["threads"]), spin_us=int(spec["spin_us"]), instances=1,
        cache_dir=Path(cache) if cache else None)


class _Segment:
    def __init__(self, fd: int, size: int) -> None:
        self.size = size
        self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def view(self, dtype: np.dtype[Any], shape: tuple[int, ...], offset: int) -> np.ndarray:
        return p.segment_view(self.map, dtype, shape, offset)

    def close(self) -> None:
        """Nothing to do: the mapping goes with its last view (a request's inputs may still hold one)."""


class Worker:
    """The loaded engine and the daemon's segments; requests run one at a time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.table = SegmentTable(wire, _Segment, max_segments=MAX_SEGMENTS, max_bytes=MAX_SEGMENT_BYTES)
        self.served = 0

    def describe(self) -> dict[str, Any]:
        e = self.engine
        return {"protocol": wire.PROTOCOL_VERSION, "pid": os.getpid(), "served": self.served,
                "backend": e.backend, "device": e.device, "precision": e.precision,
                "inputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in e.inputs],
                "outputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in e.outputs]}

    def infer(self, body: bytes) -> tuple[int, bytes]:
        try:
            desc = wire.decode_infer(body)
        except wire.WireError as e:
            raise RequestError(wire.INVALID_ARGUMENT, str(e)) from None
        inputs: dict[str, np.ndarray] = {}
        for t in desc.inputs:
            dtype = p.NUMPY_DTYPES[t.dtype] if 0 < t.dtype < len(p.NUMPY_DTYPES) and t.dtype != p.BYTES else None
            if dtype is None:
                raise RequestError(wire.INVALID_ARGUMENT, f"input {t.name!r}: dtype code {t.dtype} is not numeric")
            count = 1
            for d in t.shape:
                count *= d
            if count * dtype.itemsize != t.nbytes or t.offset % dtype.itemsize:
                raise RequestError(wire.INVALID_ARGUMENT, f"input {t.name!r}: {t.nbytes} bytes do not hold "
                                                          f"{dtype.name}{list(t.shape)}")
            seg = self.table.range(t.segment, t.offset, t.nbytes, f"input {t.name!r}")
            inputs[t.name] = seg.view(dtype, t.shape, t.offset)
        out = self.table.range(desc.out_segment, desc.out_offset, desc.out_capacity, "output range")
        outputs = self.engine.infer(inputs, desc.outputs)
        placed: list[tuple[str, np.ndarray, int, int]] = []
        pos = 0
        for name, arr in outputs.items():
            code = p.NUMPY_CODE.get(arr.dtype)
            if code is None or code == p.BYTES:
                raise RequestError(wire.INVALID_ARGUMENT, f"output {name!r} of {arr.dtype} cannot cross the wire")
            placed.append((name, arr, code, pos))
            pos = wire.align(pos + arr.nbytes)
        if pos > desc.out_capacity:
            raise RequestError(wire.INVALID_ARGUMENT, f"outputs need {pos} bytes, the range holds "
                                                      f"{desc.out_capacity}", needed=pos)
        parts = [wire.U32.pack(0)]
        for name, arr, code, at in placed:
            where = desc.out_offset + at
            if arr.nbytes:
                np.copyto(out.view(arr.dtype, arr.shape, where), arr, casting="no")
            parts.append(wire.encode_output(name, code, arr.shape, offset=where, nbytes=arr.nbytes))
        self.served += 1
        return len(placed), b"".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="an edged engine worker (started by the daemon)")
    parser.add_argument("--fd", type=int, required=True, help="the inherited SOCK_SEQPACKET socket")
    args = parser.parse_args(argv)
    # A Ctrl-C in the daemon's terminal reaches its whole process group: the daemon drains its requests
    # first and ends this worker by closing the socket, so the worker must not die before it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=args.fd)
    msg, fds = receive(sock, MAX_LOAD_MESSAGE)
    for fd in fds:
        os.close(fd)
    if not msg:
        return 0
    try:
        backend, request = request_from_json(json.loads(msg))
        worker = Worker(get_backend(backend).load(request))
    except Exception as e:  # tell the daemon why, then exit: it will not retry a model that cannot load
        sock.send(wire.encode_status_error(wire.HELLO, 0, wire.UNAVAILABLE, f"{type(e).__name__}: {e}"))
        return 3
    serve_engine(sock, wire, worker.table, worker.infer, worker.describe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
