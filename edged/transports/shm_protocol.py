"""Wire protocol of the shared-memory fast path (protocol version 1), shared by daemon and client.

Why this shape: tensors never travel over the socket. The client creates memfd
segments, seals them against shrinking and passes their fds once (SCM_RIGHTS);
after that every request is a small binary descriptor naming (segment, offset,
size) ranges, and the daemon writes outputs straight into the client's memory.
JSON is used only off the hot path (hello, metadata).

Transport: AF_UNIX ``SOCK_SEQPACKET`` (one message per send, boundaries kept, fds
ride along). All integers little-endian. A message is at most
:data:`MAX_MESSAGE` bytes and starts with a 12-byte header::

    HEADER  <B B H Q   kind, flags/status, count, id

``kind`` is a request kind below; its reply has ``kind | 0x80`` and echoes ``id``
(the client's correlation id; replies may come out of order when requests are
pipelined). In requests the second byte holds flags: :data:`FLAG_QUEUE` (1) on an
INFER says "more requests of mine are on the way: queue this one for batching
rather than running it inline" (pipelining clients set it; without it the daemon
runs a request inline in the connection's thread when nothing else of that client
is in flight, the lowest-latency path). In replies it is 0 (OK) or a
status code: 1 invalid_argument, 2 not_found, 3 unavailable, 4 overloaded,
5 deadline_exceeded, 6 resource_exhausted, 7 failed_precondition, 8 internal
(:data:`STATUS_CODES`). ``count`` is kind-specific (0 when unused).
Any reply with ``status != 0`` has the body ``ERROR  <Q H`` (needed bytes, message
length) + UTF-8 message; ``needed`` > 0 means "the output slot is too small, it
needs this many bytes from its offset". A message too short to hold a header is
answered with kind 0xFF and id 0.

Requests (client -> daemon) and their successful replies:

* ``HELLO`` (1): body ``<I`` protocol version. Reply: JSON object with the
  daemon's per-client limits (``protocol``, ``max_segments``,
  ``max_mapped_bytes``, ``max_inflight``, ``max_message``, ``alignment``).
  Optional; a client that skips it speaks version 1.
* ``REGISTER`` (2): body ``<Q`` segment size; exactly one fd via SCM_RIGHTS: a
  memfd of exactly that size with ``F_SEAL_SHRINK`` set (so the daemon's mapping
  can never SIGBUS). Reply body ``<I`` segment id (per connection, never reused).
* ``UNREGISTER`` (3): body ``<I`` segment id. Reply: empty body. Refused while a
  request in flight uses the segment.
* ``INFER`` (4): body ``INFER  <i I I Q Q H B B``: model version (0 = the current
  one), timeout in microseconds (0 = none), output segment id, output offset,
  output capacity, model name length, number of inputs, number of requested
  outputs (0 = all); then the model name; then per input ``TENSOR  <B B B x I Q Q``
  (name length, dtype code, ndim, segment id, offset, nbytes) + ndim ``<q`` dims +
  name; then per requested output a ``<B`` length + name.
  Reply: ``count`` = number of outputs, body ``<I`` model version served, then per
  output ``OUTPUT  <B B B x Q Q`` (name length, dtype code, ndim, offset in the
  output segment, nbytes) + ndim ``<q`` dims + name. Outputs are packed into the
  output range in model order, each aligned to :data:`ALIGNMENT` bytes.
* ``METADATA`` (5): body ``<i H`` version, name length + model name. Reply: the v2
  model metadata as JSON, plus ``max_batch_size`` and the serving ``version``.

dtype codes (:data:`DTYPES`): 1 BOOL, 2 UINT8, 3 UINT16, 4 UINT32, 5 UINT64,
6 INT8, 7 INT16, 8 INT32, 9 INT64, 10 FP16, 11 FP32, 12 FP64. BYTES tensors have no
fixed size and go over HTTP or MQTT instead.

The daemon checks every range against its segment (offset <= size and nbytes
<= size - offset, on Python integers, so no wrap-around), that nbytes equals the
shape's element count times the dtype size, and that offsets are aligned to the
element size. A bad descriptor gets an error reply; the connection stays usable.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

from edged import datatypes
from edged.errors import (
    DeadlineExceededError,
    EdgedError,
    ErrorCode,
    InternalError,
    InvalidInputError,
    ModelNotFoundError,
    ModelNotReadyError,
    OverloadedError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
)

PROTOCOL_VERSION = 1
MAX_MESSAGE = 64 * 1024
MAX_DIMS = 16
ALIGNMENT = 64
DEFAULT_SOCKET = "/run/edged/edged.sock"
SOCKET_ENV = "EDGED_SHM_SOCKET"

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
_DIMS = [struct.Struct(f"<{n}q") for n in range(MAX_DIMS + 1)]

# Status byte of a reply: 0 is OK, the rest index this tuple.
STATUS_CODES: tuple[ErrorCode | None, ...] = (
    None, ErrorCode.INVALID_ARGUMENT, ErrorCode.NOT_FOUND, ErrorCode.UNAVAILABLE, ErrorCode.OVERLOADED,
    ErrorCode.DEADLINE_EXCEEDED, ErrorCode.RESOURCE_EXHAUSTED, ErrorCode.FAILED_PRECONDITION, ErrorCode.INTERNAL,
    ErrorCode.UNAUTHENTICATED, ErrorCode.PERMISSION_DENIED,  # appended: the wire values above never move
)
STATUS_OF: dict[ErrorCode, int] = {c: i for i, c in enumerate(STATUS_CODES) if c is not None}

# dtype code -> v2 datatype; 0 is invalid, BYTES (variable length) cannot live in a fixed range.
DTYPES: tuple[str | None, ...] = (
    None, "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64",
)
NUMPY_DTYPES: tuple[np.dtype[np.generic] | None, ...] = tuple(
    None if d is None else datatypes.to_numpy(d) for d in DTYPES)
DTYPE_CODE: dict[str, int] = {d: i for i, d in enumerate(DTYPES) if d is not None}
NUMPY_CODE: dict[np.dtype[np.generic], int] = {d: i for i, d in enumerate(NUMPY_DTYPES) if d is not None}

_ERROR_TYPES: dict[ErrorCode, type[EdgedError]] = {
    ErrorCode.INVALID_ARGUMENT: InvalidInputError, ErrorCode.NOT_FOUND: ModelNotFoundError,
    ErrorCode.UNAVAILABLE: ModelNotReadyError, ErrorCode.OVERLOADED: OverloadedError,
    ErrorCode.DEADLINE_EXCEEDED: DeadlineExceededError, ErrorCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    ErrorCode.INTERNAL: InternalError, ErrorCode.UNAUTHENTICATED: UnauthenticatedError,
    ErrorCode.PERMISSION_DENIED: PermissionDeniedError,
}


class ProtocolError(InvalidInputError):
    """A message that does not follow this protocol."""


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


def align(n: int, to: int = ALIGNMENT) -> int:
    return (n + to - 1) // to * to


def error_from_status(status: int, message: str, needed: int = 0) -> EdgedError:
    """The typed error a reply status stands for (clients raise it)."""
    code = STATUS_CODES[status] if 0 < status < len(STATUS_CODES) else ErrorCode.INTERNAL
    assert code is not None
    err = _ERROR_TYPES.get(code, EdgedError)(message)
    err.code = code
    if needed:
        err.context["needed_bytes"] = needed
    return err


# ---- encoding ---------------------------------------------------------------------------------
def header(kind: int, rid: int, status: int = 0, count: int = 0) -> bytes:
    return HEADER.pack(kind, status, count, rid)


def encode_error(kind: int, rid: int, code: ErrorCode, message: str, needed: int = 0) -> bytes:
    msg = message.encode("utf-8", "replace")[:4096]
    return HEADER.pack(kind | REPLY, STATUS_OF.get(code, STATUS_OF[ErrorCode.INTERNAL]), 0, rid) + \
        ERROR.pack(needed, len(msg)) + msg


def name_bytes(s: str) -> bytes:
    b = s.encode()
    if len(b) > 255:
        raise InvalidInputError(f"name {s[:40]!r}... is longer than 255 bytes")
    return b


def encode_tensor(name: str, dtype: int, shape: tuple[int, ...], *, segment: int, offset: int, nbytes: int) -> bytes:
    nb = name_bytes(name)
    return TENSOR.pack(len(nb), dtype, len(shape), segment, offset, nbytes) + _DIMS[len(shape)].pack(*shape) + nb


def encode_infer(rid: int, model: str, version: int, inputs: list[bytes], *, out_segment: int, out_offset: int,
                 out_capacity: int, outputs: list[str] | None = None, timeout_us: int = 0,
                 flags: int = 0) -> bytes:
    """An INFER message; ``inputs`` are :func:`encode_tensor` results. No checks: the daemon does them."""
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
    return OUTPUT.pack(len(nb), dtype, len(shape), offset, nbytes) + _DIMS[len(shape)].pack(*shape) + nb


# ---- decoding ---------------------------------------------------------------------------------
def _text(buf: memoryview | bytes, pos: int, n: int, what: str) -> str:
    if pos + n > len(buf):
        raise ProtocolError(f"message ends inside {what}")
    try:
        return bytes(buf[pos:pos + n]).decode()
    except UnicodeDecodeError:
        raise ProtocolError(f"{what} is not UTF-8") from None


def decode_infer(buf: memoryview | bytes) -> InferDesc:
    """Parse an INFER body (after the header). Raises ProtocolError; never trusts a length."""
    try:
        version, timeout_us, oseg, ooff, ocap, mlen, n_in, n_out = INFER_BODY.unpack_from(buf, 0)
        pos = INFER_BODY.size
        model = _text(buf, pos, mlen, "the model name")
        pos += mlen
        inputs: list[TensorDesc] = []
        for i in range(n_in):
            nlen, dtype, ndim, seg, off, nbytes = TENSOR.unpack_from(buf, pos)
            pos += TENSOR.size
            if ndim > MAX_DIMS:
                raise ProtocolError(f"input #{i} has {ndim} dimensions (at most {MAX_DIMS})")
            shape = _DIMS[ndim].unpack_from(buf, pos)
            pos += 8 * ndim
            name = _text(buf, pos, nlen, f"input #{i} name")
            pos += nlen
            inputs.append(TensorDesc(name, dtype, shape, seg, off, nbytes))
        outputs: list[str] | None = None
        if n_out:
            outputs = []
            for i in range(n_out):
                olen = buf[pos]
                outputs.append(_text(buf, pos + 1, olen, f"requested output #{i} name"))
                pos += 1 + olen
    except (struct.error, IndexError):
        raise ProtocolError("INFER message is truncated") from None
    if pos != len(buf):
        raise ProtocolError(f"INFER message has {len(buf) - pos} unexpected trailing bytes")
    return InferDesc(model, version, timeout_us, oseg, ooff, ocap, inputs, outputs)


class OutputDesc(NamedTuple):
    name: str
    dtype: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def decode_outputs(buf: memoryview | bytes, count: int) -> tuple[int, list[OutputDesc]]:
    """Parse a successful INFER reply body: (model version, outputs)."""
    (version,) = U32.unpack_from(buf, 0)
    pos = U32.size
    outs: list[OutputDesc] = []
    for _ in range(count):
        nlen, dtype, ndim, off, nbytes = OUTPUT.unpack_from(buf, pos)
        pos += OUTPUT.size
        shape = _DIMS[ndim].unpack_from(buf, pos)
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
