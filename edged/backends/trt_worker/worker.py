"""The TensorRT engine worker: one plan, served over the shared-memory protocol on an inherited socket.

Runs under JetPack 5's system Python 3.8 with only numpy and TensorRT importable,
so it imports nothing from edged but the wire format module, found through
``--wire`` (the folder holding ``shm_wire.py``). Python 3.8 compatible on purpose:
no ``match``, no ``X | Y`` at run time, no 3.9+ library calls.

Why a process: the daemon's Python (3.10+) cannot import these bindings, and a GPU
fault or a hung engine then takes down only this process; the daemon restarts it.

Tensors never cross the socket: the daemon registers memfd segments once (fd passed
with SCM_RIGHTS) and each INFER names (segment, offset, size) ranges; outputs are
written straight into the daemon's output segment. With real TensorRT the segments
are registered with CUDA (``cudaHostRegister``, mapped), so the engine reads and
writes them in place on the Jetson's shared DRAM. A stand-in that says
``EDGED_STANDIN_HOST_POINTERS = True`` gets plain host addresses instead.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import importlib
import mmap
import os
import socket
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edged.protocol import shm_wire as wire
    from edged.protocol import shm_worker
    from edged.protocol.shm_worker import RequestError
else:  # bound in main(): found through --wire, since edged itself is not importable here
    wire = shm_worker = RequestError = None

MAX_SEGMENTS = 8
MAX_SEGMENT_BYTES = 1 << 34


class _Cuda:
    """The few CUDA runtime calls the worker needs, through ctypes on libcudart (no pycuda on the device)."""

    def __init__(self) -> None:
        name = ctypes.util.find_library("cudart") or "libcudart.so"
        self.lib = ctypes.CDLL(name)
        self.stream = ctypes.c_void_p()
        self._check(self.lib.cudaStreamCreate(ctypes.byref(self.stream)), "cudaStreamCreate")

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RequestError(wire.INTERNAL, f"{what} failed with CUDA error {rc}")

    def map_host(self, address: int, size: int) -> int:
        """Pin and map a host range; returns the device address of the same memory."""
        self._check(self.lib.cudaHostRegister(ctypes.c_void_p(address), ctypes.c_size_t(size), 2),
                    "cudaHostRegister")  # 2 = cudaHostRegisterMapped
        dev = ctypes.c_void_p()
        self._check(self.lib.cudaHostGetDevicePointer(ctypes.byref(dev), ctypes.c_void_p(address), 0),
                    "cudaHostGetDevicePointer")
        return int(dev.value or 0)

    def unmap_host(self, address: int) -> None:
        self.lib.cudaHostUnregister(ctypes.c_void_p(address))

    def synchronize(self) -> None:
        self._check(self.lib.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")


class _Segment:
    def __init__(self, fd: int, size: int, cuda: _Cuda | None, np: Any) -> None:
        self.size = size
        self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.host = int(np.frombuffer(self.map, dtype=np.uint8).ctypes.data)
        self.cuda = cuda
        self.device = cuda.map_host(self.host, size) if cuda is not None else self.host

    def close(self) -> None:
        if self.cuda is not None:
            self.cuda.unmap_host(self.host)


class Worker:
    """One deserialized plan and its execution context; requests run one at a time."""

    def __init__(self, trt: Any, np: Any, plan: bytes) -> None:
        self.trt, self.np = trt, np
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine(plan)
        if self.engine is None:
            raise RuntimeError("TensorRT could not deserialize the plan (built for another TensorRT or GPU?)")
        self.context = self.engine.create_execution_context()
        self.cuda = None if getattr(trt, "EDGED_STANDIN_HOST_POINTERS", False) else _Cuda()
        self.stream = int(self.cuda.stream.value or 0) if self.cuda is not None else 0
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        self.dtypes: dict[str, Any] = {}
        for i in range(self.engine.num_io_tensors):
            name = self.engine.get_tensor_name(i)
            is_input = self.engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
            (self.inputs if is_input else self.outputs).append(name)
            self.dtypes[name] = np.dtype(trt.nptype(self.engine.get_tensor_dtype(name)))
        self.table = shm_worker.SegmentTable(wire, lambda fd, size: _Segment(fd, size, self.cuda, np),
                                             max_segments=MAX_SEGMENTS, max_bytes=MAX_SEGMENT_BYTES)
        self.served = 0

    def describe(self) -> dict[str, Any]:
        def tensor(name: str) -> dict[str, Any]:
            code = wire.NUMPY_NAMES.index(self.dtypes[name].name)
            return {"name": name, "datatype": wire.DTYPES[code],
                    "shape": [int(d) for d in self.engine.get_tensor_shape(name)]}
        return {"protocol": wire.PROTOCOL_VERSION, "pid": os.getpid(), "python": sys.version.split()[0],
                "tensorrt": str(getattr(self.trt, "__version__", "unknown")), "served": self.served,
                "inputs": [tensor(n) for n in self.inputs], "outputs": [tensor(n) for n in self.outputs]}

    # ---- requests ---------------------------------------------------------------------------
    def _bind_inputs(self, inputs: list[wire.TensorDesc]) -> None:
        """Check each input against the engine (name, dtype, size, segment range, shape) and point the
        context at it."""
        ctx = self.context
        given = {t.name: t for t in inputs}
        if sorted(given) != sorted(self.inputs):
            raise RequestError(wire.INVALID_ARGUMENT, f"inputs {sorted(given)} do not match the engine's {self.inputs}")
        for name in self.inputs:
            t = given[name]
            dtype = self.dtypes[name]
            if not 0 < t.dtype < len(wire.NUMPY_NAMES) or wire.NUMPY_NAMES[t.dtype] != dtype.name:
                raise RequestError(wire.INVALID_ARGUMENT, f"input {name!r}: dtype code {t.dtype}, the engine wants "
                                                     f"{dtype.name}")
            count = 1
            for d in t.shape:
                if d < 0:
                    raise RequestError(wire.INVALID_ARGUMENT, f"input {name!r}: negative dimension in {t.shape}")
                count *= d
            if count * dtype.itemsize != t.nbytes or t.offset % dtype.itemsize:
                raise RequestError(wire.INVALID_ARGUMENT, f"input {name!r}: {t.nbytes} bytes at offset {t.offset} do "
                                                     f"not hold a {dtype.name} tensor of shape {list(t.shape)}")
            seg = self.table.range(t.segment, t.offset, t.nbytes, f"input {name!r}")
            if not ctx.set_input_shape(name, tuple(t.shape)):
                raise RequestError(wire.INVALID_ARGUMENT, f"input {name!r}: the engine refuses shape {list(t.shape)}")
            ctx.set_tensor_address(name, seg.device + t.offset)

    def infer(self, body: bytes) -> tuple[int, bytes]:
        try:
            desc = wire.decode_infer(body)
        except wire.WireError as e:
            raise RequestError(wire.INVALID_ARGUMENT, str(e)) from None
        np, ctx = self.np, self.context
        self._bind_inputs(desc.inputs)
        wanted = desc.outputs if desc.outputs is not None else self.outputs
        unknown = [n for n in wanted if n not in self.outputs]
        if unknown:
            raise RequestError(wire.INVALID_ARGUMENT, f"unknown outputs {unknown}; the engine has {self.outputs}")
        out = self.table.range(desc.out_segment, desc.out_offset, desc.out_capacity, "output range")
        placed = []
        pos = 0
        for name in self.outputs:  # every output needs an address; only the wanted ones are reported
            shape = tuple(int(d) for d in ctx.get_tensor_shape(name))
            nbytes = int(np.prod(shape, dtype=np.int64)) * self.dtypes[name].itemsize
            placed.append((name, shape, pos, nbytes))
            pos = wire.align(pos + nbytes)
        if pos > desc.out_capacity:
            raise RequestError(wire.INVALID_ARGUMENT, f"outputs need {pos} bytes, the range holds {desc.out_capacity}",
                          needed=pos)
        for name, _, at, _ in placed:
            ctx.set_tensor_address(name, out.device + desc.out_offset + at)
        if not ctx.execute_async_v3(self.stream):
            # As the in-process engine does with a failed context: the next request gets a fresh one.
            # (A refused input shape needs none: every request sets every input's shape again.)
            self.context = self.engine.create_execution_context()
            raise RequestError(wire.INTERNAL, "TensorRT execute_async_v3 failed")
        if self.cuda is not None:
            self.cuda.synchronize()
        self.served += 1
        parts = [wire.U32.pack(0)]
        for name, shape, at, nbytes in placed:
            if name in wanted:
                code = wire.NUMPY_NAMES.index(self.dtypes[name].name)
                parts.append(wire.encode_output(name, code, shape, offset=desc.out_offset + at, nbytes=nbytes))
        return len(parts) - 1, b"".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="edged's TensorRT engine worker (started by the daemon)")
    parser.add_argument("--fd", type=int, required=True, help="the inherited SOCK_SEQPACKET socket")
    parser.add_argument("--plan", required=True, help="the TensorRT plan file")
    parser.add_argument("--wire", required=True, help="the folder holding shm_wire.py and shm_worker.py")
    args = parser.parse_args(argv)
    sys.path.insert(0, args.wire)
    globals()["wire"] = importlib.import_module("shm_wire")
    globals()["shm_worker"] = importlib.import_module("shm_worker")
    globals()["RequestError"] = shm_worker.RequestError  # the worker's refusal, with its status byte
    sock = socket.socket(fileno=args.fd)
    try:
        import numpy
        import tensorrt

        with open(args.plan, "rb") as f:
            worker = Worker(tensorrt, numpy, f.read())
    except Exception as e:  # tell the daemon why, then exit: it will not retry a plan that cannot load
        sock.send(wire.encode_status_error(wire.HELLO, 0, wire.UNAVAILABLE, f"{type(e).__name__}: {e}"))
        return 3
    shm_worker.serve_engine(sock, wire, worker.table, worker.infer, worker.describe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
