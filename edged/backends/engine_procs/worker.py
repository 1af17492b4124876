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
import stat
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from edged.backends.base import Engine, LoadRequest
from edged.backends.factory import get_backend
from edged.backends.specs import spec_for
from edged.protocol import shm_wire as wire
from edged.repository.manifest import InputShape, TensorSpec, Variant

MAX_SEGMENTS = 8
MAX_LOAD_MESSAGE = 1 << 20


class RequestError(Exception):
    """A request the worker refuses or cannot run; its status byte goes back to the daemon."""

    def __init__(self, status: int, message: str, needed: int = 0) -> None:
        super().__init__(message)
        self.status, self.needed = status, needed


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
        threads=int(spec["threads"]), instances=1, cache_dir=Path(cache) if cache else None)


class _Segment:
    def __init__(self, fd: int, size: int) -> None:
        self.size = size
        self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def view(self, dtype: np.dtype[Any], shape: tuple[int, ...], offset: int) -> np.ndarray:
        count = 1
        for d in shape:
            count *= d
        arr: np.ndarray = np.frombuffer(self.map, dtype, count, offset).reshape(shape)
        return arr


class Worker:
    """The loaded engine and the daemon's segments; requests run one at a time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.segments: dict[int, _Segment] = {}
        self.next_segment = 1
        self.served = 0

    def describe(self) -> dict[str, Any]:
        e = self.engine
        return {"protocol": wire.PROTOCOL_VERSION, "pid": os.getpid(), "served": self.served,
                "backend": e.backend, "device": e.device, "precision": e.precision,
                "inputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in e.inputs],
                "outputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in e.outputs]}

    def register(self, body: bytes, fds: list[int]) -> bytes:
        if len(fds) != 1 or len(body) != wire.U64.size:
            raise RequestError(wire.INVALID_ARGUMENT, "REGISTER needs one fd and one u64 size")
        (size,) = wire.U64.unpack(body)
        st = os.fstat(fds[0])
        if not stat.S_ISREG(st.st_mode) or st.st_size != size or size <= 0:
            raise RequestError(wire.INVALID_ARGUMENT, f"segment size {size} does not match the fd ({st.st_size})")
        if len(self.segments) >= MAX_SEGMENTS:
            raise RequestError(wire.INVALID_ARGUMENT, f"at most {MAX_SEGMENTS} segments")
        sid = self.next_segment
        self.next_segment += 1
        self.segments[sid] = _Segment(fds[0], size)
        return wire.U32.pack(sid)

    def unregister(self, body: bytes) -> bytes:
        (sid,) = wire.U32.unpack(body)
        seg = self.segments.pop(sid, None)
        if seg is None:
            raise RequestError(wire.NOT_FOUND, f"no segment {sid}")
        return b""

    def _range(self, sid: int, offset: int, nbytes: int, what: str) -> _Segment:
        seg = self.segments.get(sid)
        if seg is None:
            raise RequestError(wire.NOT_FOUND, f"{what}: no segment {sid}")
        if offset > seg.size or nbytes > seg.size - offset:
            raise RequestError(wire.INVALID_ARGUMENT, f"{what}: range {offset}+{nbytes} is outside segment {sid}")
        return seg

    def infer(self, body: bytes) -> tuple[int, bytes]:
        try:
            desc = wire.decode_infer(body)
        except wire.WireError as e:
            raise RequestError(wire.INVALID_ARGUMENT, str(e)) from None
        inputs: dict[str, np.ndarray] = {}
        for t in desc.inputs:
            if not 0 < t.dtype < len(wire.NUMPY_NAMES) or t.dtype == wire.BYTES:
                raise RequestError(wire.INVALID_ARGUMENT, f"input {t.name!r}: dtype code {t.dtype} is not numeric")
            dtype = np.dtype(wire.NUMPY_NAMES[t.dtype])
            count = 1
            for d in t.shape:
                count *= d
            if count * dtype.itemsize != t.nbytes or t.offset % dtype.itemsize:
                raise RequestError(wire.INVALID_ARGUMENT, f"input {t.name!r}: {t.nbytes} bytes do not hold "
                                                          f"{dtype.name}{list(t.shape)}")
            seg = self._range(t.segment, t.offset, t.nbytes, f"input {t.name!r}")
            inputs[t.name] = seg.view(dtype, t.shape, t.offset)
        out = self._range(desc.out_segment, desc.out_offset, desc.out_capacity, "output range")
        outputs = self.engine.infer(inputs, desc.outputs)
        placed: list[tuple[str, np.ndarray, int, int]] = []
        pos = 0
        for name, arr in outputs.items():
            code = wire.NUMPY_NAMES.index(arr.dtype.name) if arr.dtype.name in wire.NUMPY_NAMES else -1
            if code <= 0 or code == wire.BYTES:
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


def _recv(sock: socket.socket, size: int) -> tuple[bytes, list[int]]:
    msg, fds, _, _ = socket.recv_fds(sock, size, 4)
    return msg, list(fds)


def _answer(sock: socket.socket, worker: Worker, msg: bytes, fds: list[int]) -> None:
    kind, _, _, rid = wire.HEADER.unpack_from(msg, 0)
    body = msg[wire.HEADER.size:]
    try:
        if kind == wire.INFER:
            count, reply = worker.infer(body)
        elif kind == wire.REGISTER:
            reply, count = worker.register(body, fds), 0
        elif kind == wire.UNREGISTER:
            reply, count = worker.unregister(body), 0
        elif kind == wire.HELLO:  # the daemon's health check
            reply, count = json.dumps(worker.describe()).encode(), 0
        else:
            raise RequestError(wire.INVALID_ARGUMENT, f"unknown request kind {kind}")
    except RequestError as e:
        sock.send(wire.encode_status_error(kind, rid, e.status, str(e), e.needed))
    except Exception as e:  # the engine's own failure: report it, keep serving
        sock.send(wire.encode_status_error(kind, rid, wire.INTERNAL, f"{type(e).__name__}: {e}"))
    else:
        sock.send(wire.header(kind | wire.REPLY, rid, 0, count) + reply)


def serve(sock: socket.socket, worker: Worker) -> None:
    """Answer requests until the daemon closes its end."""
    while True:
        msg, fds = _recv(sock, wire.MAX_MESSAGE)
        if not msg:
            return
        try:
            if len(msg) < wire.HEADER.size:
                sock.send(wire.encode_status_error(0x7F, 0, wire.INVALID_ARGUMENT, "message shorter than a header"))
                continue
            _answer(sock, worker, msg, fds)
        finally:
            for fd in fds:
                os.close(fd)  # a mapping keeps its memory without the fd


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="an edged engine worker (started by the daemon)")
    parser.add_argument("--fd", type=int, required=True, help="the inherited SOCK_SEQPACKET socket")
    args = parser.parse_args(argv)
    # A Ctrl-C in the daemon's terminal reaches its whole process group: the daemon drains its requests
    # first and ends this worker by closing the socket, so the worker must not die before it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=args.fd)
    msg, fds = _recv(sock, MAX_LOAD_MESSAGE)
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
    sock.send(wire.header(wire.HELLO | wire.REPLY, 0) + json.dumps(worker.describe()).encode())
    serve(sock, worker)
    return 0


if __name__ == "__main__":
    sys.exit(main())
