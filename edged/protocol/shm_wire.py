"""The shared-memory protocol's wire format, with no dependency beyond the standard library.

Why apart from :mod:`edged.protocol.shm` (which documents the protocol
and adds the daemon's typed errors and numpy dtypes on top): the TensorRT engine
worker speaks this same protocol under JetPack 5's system Python 3.8, where
nothing else of edged can be imported. So this module must stay Python 3.8
compatible: no ``match``, no ``X | Y`` outside annotations, no 3.9+ library calls.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

PROTOCOL_VERSION = 1
MAX_MESSAGE = 64 * 1024
MAX_DIMS = 16
ALIGNMENT = 64

HELLO, REGISTER, UNREGISTER, INFER, METADATA = 1, 2, 3, 4, 5
FLAG_QUEUE = 1
REPLY = 0x80
KINDS = frozenset({HELLO, REGISTER, UNREGISTER, INFER, METADATA})

HEADER = struct.Struct("<BBHQ")
ERROR = struct.Struct("<QH")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
INFER_BODY = struct.Struct("<iIIQQHBB")
TENSOR = struct.Struct("<BBBxIQQ")
OUTPUT = struct.Struct("<BBBxQQ")
META_BODY = struct.Struct("<iH")
DIMS = [struct.Struct(f"<{n}q") for n in range(MAX_DIMS + 1)]

# Reply status byte (0 = OK); edged.protocol.shm.STATUS_CODES maps each to an ErrorCode.
INVALID_ARGUMENT, NOT_FOUND, UNAVAILABLE, INTERNAL = 1, 2, 3, 8

# dtype code -> v2 datatype; 0 is invalid, BYTES (variable length) cannot live in a fixed range.
DTYPES = (
    None, "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64",
)
# BYTES (13) lives outside those tables: its range holds the elements serialized as in v2's binary
# form (each a 4-byte little-endian length, then the bytes), so its size is the data's, not the shape's.
BYTES = 13
# numpy's names for the same codes (numpy is optional here: the worker has it, this module does not need it).
NUMPY_NAMES = (
    None, "bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64", "float16", "float32",
    "float64",
)


class WireError(ValueError):
    """A message that does not follow the protocol."""


class TensorDesc(NamedTuple):
    name: str
    dtype: int
    shape: tuple[int, ...]
    segment: int
    offset: int
    nbytes: int


class InferDesc(NamedTuple):
    model: str
    version: int
    timeout_us: int
    out_segment: int
    out_offset: int
    out_capacity: int
    inputs: list[TensorDesc]
    outputs: list[str] | None


class OutputDesc(NamedTuple):
    name: str
    dtype: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def align(n: int, to: int = ALIGNMENT) -> int:
    return (n + to - 1) // to * to


# ---- encoding ---------------------------------------------------------------------------------
def header(kind: int, rid: int, status: int = 0, count: int = 0) -> bytes:
    return HEADER.pack(kind, status, count, rid)


def set_request_id(msg: bytearray, rid: int) -> None:
    """Give an encoded message a new request id in place (the id is the header's last field)."""
    U64.pack_into(msg, HEADER.size - U64.size, rid)


def set_request_flags(msg: bytearray, flags: int) -> None:
    """Give an encoded request new flags in place (the header's second byte)."""
    msg[1] = flags


def encode_status_error(kind: int, rid: int, status: int, message: str, needed: int = 0) -> bytes:
    """An error reply with a raw status byte (the daemon's side maps ErrorCodes to it)."""
    msg = message.encode("utf-8", "replace")[:4096]
    return HEADER.pack(kind | REPLY, status, 0, rid) + ERROR.pack(needed, len(msg)) + msg


def name_bytes(s: str) -> bytes:
    b = s.encode()
    if len(b) > 255:
        raise WireError(f"name {s[:40]!r}... is longer than 255 bytes")
    return b


def encode_tensor(name: str, dtype: int, shape: tuple[int, ...], *, segment: int, offset: int, nbytes: int) -> bytes:
    nb = name_bytes(name)
    return TENSOR.pack(len(nb), dtype, len(shape), segment, offset, nbytes) + DIMS[len(shape)].pack(*shape) + nb


def encode_infer(rid: int, model: str, version: int, inputs: list[bytes], *, out_segment: int, out_offset: int,  # noqa: PLR0913  wire format: one argument per INFER field
                 out_capacity: int, outputs: list[str] | None = None, timeout_us: int = 0,
                 flags: int = 0) -> bytes:
    """An INFER message; ``inputs`` are :func:`encode_tensor` results. No checks: the receiver does them."""
    mb = model.encode()
    parts = [HEADER.pack(INFER, flags, 0, rid),
             INFER_BODY.pack(version, timeout_us, out_segment, out_offset, out_capacity, len(mb), len(inputs),
                             len(outputs or ())),
             mb, *inputs]
    for o in outputs or ():
        ob = name_bytes(o)
        parts.append(bytes((len(ob),)) + ob)
    return b"".join(parts)


def encode_output(name: str, dtype: int, shape: tuple[int, ...], *, offset: int, nbytes: int) -> bytes:
    nb = name_bytes(name)
    return OUTPUT.pack(len(nb), dtype, len(shape), offset, nbytes) + DIMS[len(shape)].pack(*shape) + nb


# ---- decoding ---------------------------------------------------------------------------------
def _text(buf: memoryview | bytes, pos: int, n: int, what: str) -> str:
    if pos + n > len(buf):
        raise WireError(f"message ends inside {what}")
    try:
        return bytes(buf[pos:pos + n]).decode()
    except UnicodeDecodeError:
        raise WireError(f"{what} is not UTF-8") from None


def decode_infer(buf: memoryview | bytes) -> InferDesc:
    """Parse an INFER body (after the header). Raises WireError; never trusts a length."""
    try:
        version, timeout_us, oseg, ooff, ocap, mlen, n_in, n_out = INFER_BODY.unpack_from(buf, 0)
        pos = INFER_BODY.size
        model = _text(buf, pos, mlen, "the model name")
        pos += mlen
        inputs = []
        for i in range(n_in):
            nlen, dtype, ndim, seg, off, nbytes = TENSOR.unpack_from(buf, pos)
            pos += TENSOR.size
            if ndim > MAX_DIMS:
                raise WireError(f"input #{i} has {ndim} dimensions (at most {MAX_DIMS})")
            shape = DIMS[ndim].unpack_from(buf, pos)
            pos += 8 * ndim
            name = _text(buf, pos, nlen, f"input #{i} name")
            pos += nlen
            inputs.append(TensorDesc(name, dtype, shape, seg, off, nbytes))
        outputs = None
        if n_out:
            outputs = []
            for i in range(n_out):
                olen = buf[pos]
                outputs.append(_text(buf, pos + 1, olen, f"requested output #{i} name"))
                pos += 1 + olen
    except (struct.error, IndexError):
        raise WireError("INFER message is truncated") from None
    if pos != len(buf):
        raise WireError(f"INFER message has {len(buf) - pos} unexpected trailing bytes")
    return InferDesc(model, version, timeout_us, oseg, ooff, ocap, inputs, outputs)


def decode_outputs(buf: memoryview | bytes, count: int) -> tuple[int, list[OutputDesc]]:
    """Parse a successful INFER reply body: (model version, outputs)."""
    (version,) = U32.unpack_from(buf, 0)
    pos = U32.size
    outs = []
    for _ in range(count):
        nlen, dtype, ndim, off, nbytes = OUTPUT.unpack_from(buf, pos)
        pos += OUTPUT.size
        shape = DIMS[ndim].unpack_from(buf, pos)
        pos += 8 * ndim
        outs.append(OutputDesc(bytes(buf[pos:pos + nlen]).decode(), dtype, shape, off, nbytes))
        pos += nlen
    return version, outs


def decode_error(buf: memoryview | bytes) -> tuple[int, str]:
    """(needed bytes, message) of an error reply body."""
    try:
        needed, mlen = ERROR.unpack_from(buf, 0)
    except struct.error:
        return 0, "malformed error reply"
    return needed, bytes(buf[ERROR.size:ERROR.size + mlen]).decode("utf-8", "replace")
