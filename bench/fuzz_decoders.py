"""Fuzz every request decoder with hostile sizes: HTTP JSON, HTTP binary, MQTT (JSON and binary), gRPC, shm frames.

    .venv/bin/python -m bench.fuzz_decoders --seconds 600 [--seed 1]

Cases are built around the attack of issue #20 (declared shapes, element counts, byte sizes and
header lengths that disagree with the bytes present), then mutated (bit flips, truncation, splices).
The HTTP, MQTT and gRPC decoders are the functions their transports call on a request's bytes (for
gRPC: a ModelInferRequest serialized, then mutated as bytes, parsed and decoded); shm
frames go over a real ``SOCK_SEQPACKET`` to a real shm ``Connection`` thread with a registered memfd,
serving the bundled digits model. A crash is any exception that is not a typed ``EdgedError``
(for shm: an ``internal`` reply or no reply). Memory: the process's peak RSS (VmHWM) growth over the
run, which counts every transient allocation. The test suite runs a bounded slice of this
(tests/transports/test_decoder_fuzz.py); docs/security.md has the figures of a long run.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import fcntl
import json
import os
import random
import shutil
import socket
import struct
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edged import datatypes
from edged.errors import EdgedError, ErrorCode
from edged.protocol import mqtt as codec
from edged.protocol import shm as p
from edged.protocol.v2 import decode_request
from edged.protocol.v2_json import loads_request

ROOT = Path(__file__).resolve().parent.parent
DECODERS = ("http_json", "http_binary", "mqtt_json", "mqtt_binary", "grpc", "shm_frame")
_DIMS = (0, 1, 2, 3, 7, 64, 255, 256, 4096, 2**16, 2**29, 2**31, 2**32 + 1, 2**40, 2**62, 2**63 - 1, 2**64, -1)
_TYPES = (*sorted(datatypes.ALL_DATATYPES), "BYTES", "BYTES", "FP128", "", None, 3)


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


# ---- the decoders as their transports call them -------------------------------------------------
def http_json(body: bytes) -> None:
    decode_request(loads_request(body), b"", model="m", version=None)


def http_binary(body: bytes, hlen: int) -> None:
    """edged.transports.http.app's split: the header length comes from Inference-Header-Content-Length."""
    if not 0 <= hlen <= len(body):
        raise EdgedError("header length outside the body")
    view = memoryview(body)
    decode_request(loads_request(view[:hlen]), view[hlen:], model="m", version=None)


def mqtt(payload: bytes, hlen: int | None) -> None:
    fr = codec.parse(payload, hlen)
    decode_request(fr.header, fr.tail, model="m", version=None)


def grpc(message: bytes) -> None:
    """edged.transports.grpc.app's path: protobuf parse, then the codec, with no shm region registered."""
    from edged.protocol.grpc.gen import grpc_service_pb2 as pb
    from edged.transports.grpc import codec as grpc_codec

    req = grpc_codec.parse(pb.ModelInferRequest, message)
    grpc_codec.decode_infer(req, _no_regions())


def _no_regions() -> Any:
    from edged.transports.shm.sysshm import ShmView, SystemShmRegions

    return ShmView(SystemShmRegions(1 << 20), "fuzz")


def _grpc_message(rng: random.Random) -> bytes:
    """A ModelInferRequest built from the same hostile tensors: raw contents for the binary ones, typed
    contents for some of the others, odd shapes kept where protobuf's int64 can hold them."""
    from edged.protocol.grpc.gen import grpc_service_pb2 as pb
    from edged.transports.grpc import codec as grpc_codec

    binary = rng.random() < 0.6
    req = pb.ModelInferRequest(model_name=rng.choice(("m", "m", "")), id="f")
    for _ in range(rng.choice((1, 1, 2, 3, 0))):
        t, tail = _tensor(rng, binary)
        dt = t["datatype"] if isinstance(t["datatype"], str) else ""
        dims = t["shape"] if isinstance(t["shape"], list) else []
        shape = [d for d in dims if isinstance(d, int) and not isinstance(d, bool) and -2**63 <= d < 2**63]
        tensor = req.inputs.add(name=str(t["name"]), datatype=dt, shape=shape)
        if binary:
            req.raw_input_contents.append(tail)
        elif dt in ("FP32", "INT64", "INT32", "UINT8", "BOOL") and isinstance(t.get("data"), list):
            field = grpc_codec.CONTENTS[dt]
            values = [v for v in t["data"] if isinstance(v, (int, float)) and not isinstance(v, bool)]
            with contextlib.suppress(TypeError, ValueError):  # values the field's type cannot hold: none sent
                getattr(tensor.contents, field).extend(
                    [bool(v) for v in values] if dt == "BOOL" else [int(v) for v in values] if dt != "FP32"
                    else [float(v) for v in values])
        if rng.random() < 0.05:
            tensor.parameters["shared_memory_region"].string_param = "r"
    if rng.random() < 0.2:  # more raw contents than inputs, or one where typed contents were given
        req.raw_input_contents.append(os.urandom(rng.randrange(0, 16)))
    return bytes(req.SerializeToString())


# ---- case generation ----------------------------------------------------------------------------
def _shape(rng: random.Random) -> Any:
    if rng.random() < 0.05:
        return rng.choice(["x", None, {}, [1.5], [True], [[2]]])
    ndim = rng.choice((0, 1, 1, 2, 3, 17))
    return [rng.choice(_DIMS) if rng.random() < 0.5 else rng.randrange(0, 9) for _ in range(ndim)]


def _bytes_elements(rng: random.Random) -> bytes:
    out = bytearray()
    for _ in range(rng.randrange(0, 6)):
        n = rng.choice((0, 1, 3, 2**31, 2**32 - 1, rng.randrange(0, 16)))
        out += struct.pack("<I", n) + os.urandom(min(n, rng.randrange(0, 16)))
    return bytes(out)


def _data(rng: random.Random, dt: Any) -> Any:
    n = rng.choice((0, 1, 2, 3, 64, rng.randrange(0, 200)))
    kind = rng.random()
    if kind < 0.1:
        return rng.choice([None, "abc", 5, {"a": 1}, [[1, 2], [3]], [[[]]]])
    if dt == "BYTES":
        return [rng.choice(["", "a", "xyz", 1, None]) for _ in range(n)]
    return [rng.choice((0, 1, -1, 1.5, 2**64, 1e308, True, "1")) for _ in range(n)]


def _consistent(rng: random.Random, binary: bool) -> tuple[dict[str, Any], bytes]:
    """A well-formed tensor (the mutations then break it in small ways)."""
    dt = rng.choice(("FP32", "INT64", "UINT8", "BOOL", "BYTES"))
    n = rng.choice((0, 1, 4, 64))
    t: dict[str, Any] = {"name": "pixels", "datatype": dt, "shape": rng.choice(([n], [1, n], [n, 1, 1]))}
    if not binary:
        t["data"] = [str(i) for i in range(n)] if dt == "BYTES" else [int(dt != "BOOL" and i) for i in range(n)]
        return t, b""
    if dt == "BYTES":
        tail = b"".join(struct.pack("<I", k % 5) + b"x" * (k % 5) for k in range(n))
    else:
        tail = bytes(n * datatypes.itemsize(dt))
    t["parameters"] = {"binary_data_size": len(tail)}
    return t, tail


def _tensor(rng: random.Random, binary: bool) -> tuple[dict[str, Any], bytes]:
    if rng.random() < 0.4:
        return _consistent(rng, binary)
    dt = rng.choice(_TYPES)
    t: dict[str, Any] = {"name": rng.choice(("pixels", "x", "", "pixels")), "datatype": dt, "shape": _shape(rng)}
    tail = b""
    if binary:
        tail = _bytes_elements(rng) if dt == "BYTES" and rng.random() < 0.7 else os.urandom(rng.randrange(0, 64))
        size = rng.choice((len(tail), len(tail), 0, len(tail) + 1, 2**31, -1))
        t["parameters"] = {"binary_data_size": size}
    else:
        t["data"] = _data(rng, dt)
    return t, tail


def _header(rng: random.Random, binary: bool) -> tuple[bytes, bytes]:
    inputs, tails = [], []
    for _ in range(rng.choice((1, 1, 2, 3, 0))):
        t, tail = _tensor(rng, binary)
        inputs.append(t)
        tails.append(tail)
    head: dict[str, Any] = {"id": "f", "inputs": inputs, "reply_to": "r"}
    if rng.random() < 0.1:
        head["outputs"] = [{"name": "o", "parameters": {"binary_data": rng.choice((True, 1, "x"))}}]
    if rng.random() < 0.05:
        head["parameters"] = rng.choice(({"timeout": -1}, [], {"binary_data_output": 2}))
    return json.dumps(head).encode(), b"".join(tails)


def _mutate(rng: random.Random, data: bytes) -> bytes:
    if not data or rng.random() < 0.6:
        return data
    b = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        op = rng.random()
        i = rng.randrange(0, len(b)) if b else 0
        if op < 0.5 and b:
            b[i] ^= 1 << rng.randrange(8)
        elif op < 0.7:
            del b[i:i + rng.randrange(1, 8)]
        elif op < 0.9:
            b[i:i] = os.urandom(rng.randrange(1, 8))
        else:
            b = b[:i]
    return bytes(b)


def case(rng: random.Random, decoder: str) -> Callable[[], None]:
    """One fuzz case for ``decoder`` as a call that decodes it."""
    if decoder == "grpc":
        message = _mutate(rng, _grpc_message(rng))
        return lambda: grpc(message)
    binary = decoder in ("http_binary", "mqtt_binary")
    head, tail = _header(rng, binary)
    head, tail = _mutate(rng, head), _mutate(rng, tail)
    if decoder == "http_json":
        return lambda: http_json(head)
    if decoder == "http_binary":
        hlen = rng.choice((len(head), len(head), 0, len(head) + len(tail) + 1, rng.randrange(0, len(head) + 1)))
        return lambda: http_binary(head + tail, hlen)
    if decoder == "mqtt_json":
        return lambda: mqtt(head, None)
    if rng.random() < 0.5:
        prefix = rng.choice((len(head), len(head), 2**24 - 1, 0, len(head) + len(tail) + 5))
        payload = _mutate(rng, codec.PREFIX.pack(prefix & 0xFFFFFFFF) + head + tail)
        return lambda: mqtt(payload, None)
    hprop = rng.choice((len(head), len(head), 0, -1, len(head) + len(tail) + 1, 2**40))
    return lambda: mqtt(head + tail, hprop if hprop > 0 else None)


# ---- shm frames against a real connection ---------------------------------------------------------
class ShmTarget:
    """A real shm ``Connection`` (its own thread) on a socketpair, one 64 KiB memfd registered."""

    SEGMENT = 64 * 1024

    def __init__(self) -> None:
        from edged.config import ModelsSection
        from edged.core.manager import ModelManager
        from edged.core.service import InferenceService
        from edged.profiles import BackendPreference
        from edged.transports.shm.conn import Connection, Limits

        self.tmp = tempfile.mkdtemp(prefix="edged-fuzz-")
        shutil.copytree(ROOT / "models" / "digits", Path(self.tmp) / "digits")
        self.manager = ModelManager(Path(self.tmp), ModelsSection(),
                                    [BackendPreference(backend="onnxruntime", device="CPU", precisions=["fp32"])])
        self.manager.load_all()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        self.sock.settimeout(10)
        self.conn = Connection(theirs, (os.getpid(), os.getuid(), os.getgid()),
                               service=InferenceService(self.manager), limits=Limits(), on_closed=lambda c: None)
        self.conn.start()
        fd = os.memfd_create("edged-fuzz", os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, self.SEGMENT)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
            msg = p.header(p.REGISTER, 1) + p.U64.pack(self.SEGMENT)
            self.sock.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())])
        finally:
            os.close(fd)
        reply = self.sock.recv(p.MAX_MESSAGE)
        assert reply[1] == 0, reply
        (self.segment,) = p.U32.unpack_from(reply, p.HEADER.size)

    def frame(self, rng: random.Random) -> bytes:
        if rng.random() < 0.3:  # well-formed: one digits input, then perhaps mutated
            rows = rng.choice((1, 2))
            tensor = p.encode_tensor("pixels", 11, (rows, 64), segment=self.segment, offset=0, nbytes=rows * 256)
            msg = p.encode_infer(rng.randrange(1, 2**63), "digits", 0, [tensor], out_segment=self.segment,
                                 out_offset=4096, out_capacity=4096)
            return (_mutate(rng, msg) if rng.random() < 0.5 else msg) or b"\x04"
        inputs = []
        for _ in range(rng.choice((0, 1, 1, 2, 255))):
            dims = tuple(rng.choice((0, 1, 8, 64, 2**31, 2**62, 2**63 - 1, -1, -(2**63))) if rng.random() < 0.4
                         else rng.choice((1, 64)) for _ in range(rng.choice((1, 2, 2, 16))))
            dtype = rng.choice((11, 11, 0, 13, 255, rng.randrange(1, 13)))
            nbytes = rng.choice((256, 4 * 64, 0, 2**64 - 1, self.SEGMENT, self.SEGMENT + 1))
            offset = rng.choice((0, 0, 3, 64, self.SEGMENT, 2**64 - 1))
            seg = rng.choice((self.segment, self.segment, 0, 2**32 - 1))
            inputs.append(p.encode_tensor("pixels", dtype, dims, segment=seg, offset=offset, nbytes=nbytes))
        msg = p.encode_infer(rng.randrange(1, 2**63), rng.choice(("digits", "nope", "")), rng.choice((0, 1, -1, 7)),
                             inputs[:255], out_segment=rng.choice((self.segment, 0)),
                             out_offset=rng.choice((0, 4096, self.SEGMENT)),
                             out_capacity=rng.choice((4096, 0, 2**64 - 1)),
                             outputs=rng.choice((None, ["probabilities"], ["x"] * 3)))
        if rng.random() < 0.3:
            msg = _mutate(rng, msg) or b"\x04"
        if rng.random() < 0.05:
            msg = os.urandom(rng.randrange(0, 64))
        # An empty datagram reads as EOF (the client closing its own connection): not a decoder case.
        return msg[: p.MAX_MESSAGE] or b"\x04"

    def send(self, msg: bytes) -> str:
        """'ok', 'error' (a typed refusal) or 'crash' (an internal error or no reply)."""
        self.sock.send(msg)
        try:
            reply = self.sock.recv(p.MAX_MESSAGE)
        except TimeoutError:
            return "crash"
        if len(reply) < p.HEADER.size:
            return "crash"
        status = reply[1]
        if status == 0:
            return "ok"
        return "crash" if status >= len(p.STATUS_CODES) or status == p.STATUS_OF[ErrorCode.INTERNAL] else "error"

    def close(self) -> None:
        self.conn.shutdown()
        self.sock.close()
        self.conn.thread.join(10)
        self.manager.shutdown(0.0)
        shutil.rmtree(self.tmp, ignore_errors=True)


@contextlib.contextmanager
def shm_target() -> Iterator[ShmTarget]:
    t = ShmTarget()
    try:
        yield t
    finally:
        t.close()


# ---- the run --------------------------------------------------------------------------------------
@dataclass
class Report:
    seconds: float = 0.0
    cases: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    crashes: list[str] = field(default_factory=list)
    rss_growth: int = 0

    def lines(self) -> list[str]:
        out = [f"{d:12s} {self.cases[d]:9d} cases, {self.refused[d]:9d} refused with a typed error"
               for d in DECODERS]
        total = sum(self.cases.values())
        out.append(f"total        {total:9d} cases in {self.seconds:.0f} s ({total / max(self.seconds, 1e-9):.0f}/s), "
                   f"{len(self.crashes)} crashes, peak RSS growth {self.rss_growth / 2**20:.1f} MiB")
        out += [f"CRASH {c}" for c in self.crashes[:20]]
        return out


def run(seconds: float, seed: int = 1) -> Report:
    """Round-robin over the decoders until ``seconds`` have passed (monotonic)."""
    rng = random.Random(seed)
    rep = Report()
    with shm_target() as shm:
        # Warm-up outside the measured window: the model's first run and the allocator's arenas.
        for _ in range(50):
            shm.send(shm.frame(rng))
            for d in DECODERS[:5]:
                with contextlib.suppress(EdgedError):
                    case(rng, d)()
        base = peak_rss()
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            for d in DECODERS:
                rep.cases[d] += 1
                if d == "shm_frame":
                    msg = shm.frame(rng)
                    result = shm.send(msg)
                    if result == "crash":
                        rep.crashes.append(f"shm_frame {msg.hex()[:200]}")
                    elif result == "error":
                        rep.refused[d] += 1
                    continue
                call = case(rng, d)
                try:
                    call()
                except EdgedError:
                    rep.refused[d] += 1
                except Exception as e:
                    rep.crashes.append(f"{d}: {type(e).__name__}: {e}"[:300])
        rep.seconds = time.monotonic() - t0
        rep.rss_growth = peak_rss() - base
    return rep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rep = run(args.seconds, args.seed)
    print(f"load: {os.getloadavg()[0]:.2f} (1-min average), seed {args.seed}")
    for line in rep.lines():
        print(line)
    raise SystemExit(1 if rep.crashes else 0)


if __name__ == "__main__":
    main()
