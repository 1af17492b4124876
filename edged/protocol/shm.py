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
* ``UNREGISTER`` (3): body ``<I`` segment id. Reply: empty body. A segment still used
  by requests in flight loses its id at once and is unmapped when the last of them
  finishes (counted against the client's limits until then).
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
6 INT8, 7 INT16, 8 INT32, 9 INT64, 10 FP16, 11 FP32, 12 FP64, and 13 BYTES: a BYTES
tensor's range holds its elements serialized as in v2's binary form (each a 4-byte
little-endian length followed by the bytes: an encoded image for a pipeline), so its
``nbytes`` is the data's length, not the shape's; the daemon checks that the shape's
element count fits the range before allocating, copies the elements out, and writes
BYTES outputs (JSON documents, labels) into the output range in the same form.

The daemon checks every range against its segment (offset <= size and nbytes
<= size - offset, on Python integers, so no wrap-around), that nbytes equals the
shape's element count times the dtype size, and that offsets are aligned to the
element size. A bad descriptor gets an error reply; the connection stays usable.
"""

from __future__ import annotations

import functools
import mmap
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

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
from edged.protocol import shm_wire

# The wire format itself lives in shm_wire (one copy, shared with the engine worker); re-exported here.
from edged.protocol.shm_wire import (
    ALIGNMENT,
    BYTES,
    DTYPES,
    ERROR,
    FLAG_QUEUE,
    HEADER,
    HELLO,
    INFER,
    INFER_BODY,
    KINDS,
    MAX_DIMS,
    MAX_MESSAGE,
    META_BODY,
    METADATA,
    OUTPUT,
    PROTOCOL_VERSION,
    REGISTER,
    REPLY,
    TENSOR,
    U32,
    U64,
    UNREGISTER,
    InferDesc,
    OutputDesc,
    TensorDesc,
    align,
    decode_error,
    decode_outputs,
    header,
    set_request_flags,
    set_request_id,
)

__all__ = [
    "ALIGNMENT",
    "BYTES",
    "DEFAULT_SOCKET",
    "DTYPES",
    "DTYPE_CODE",
    "ERROR",
    "FLAG_QUEUE",
    "HEADER",
    "HELLO",
    "INFER",
    "INFER_BODY",
    "KINDS",
    "MAX_DIMS",
    "MAX_MESSAGE",
    "METADATA",
    "META_BODY",
    "NUMPY_CODE",
    "NUMPY_DTYPES",
    "OUTPUT",
    "PROTOCOL_VERSION",
    "REGISTER",
    "REPLY",
    "SOCKET_ENV",
    "STATUS_CODES",
    "STATUS_OF",
    "TENSOR",
    "U32",
    "U64",
    "UNREGISTER",
    "InferDesc",
    "OutputDesc",
    "ProtocolError",
    "TensorDesc",
    "align",
    "decode_error",
    "decode_infer",
    "decode_outputs",
    "encode_error",
    "encode_infer",
    "encode_output",
    "encode_tensor",
    "error_from_status",
    "header",
    "name_bytes",
    "segment_view",
    "set_request_flags",
    "set_request_id",
]

P = ParamSpec("P")
R = TypeVar("R")

DEFAULT_SOCKET = "/run/edged/edged.sock"
SOCKET_ENV = "EDGED_SHM_SOCKET"

# Status byte of a reply: 0 is OK, the rest index this tuple.
STATUS_CODES: tuple[ErrorCode | None, ...] = (
    None, ErrorCode.INVALID_ARGUMENT, ErrorCode.NOT_FOUND, ErrorCode.UNAVAILABLE, ErrorCode.OVERLOADED,
    ErrorCode.DEADLINE_EXCEEDED, ErrorCode.RESOURCE_EXHAUSTED, ErrorCode.FAILED_PRECONDITION, ErrorCode.INTERNAL,
    ErrorCode.UNAUTHENTICATED, ErrorCode.PERMISSION_DENIED,  # appended: the wire values above never move
)
STATUS_OF: dict[ErrorCode, int] = {c: i for i, c in enumerate(STATUS_CODES) if c is not None}

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


def segment_view(mapping: mmap.mmap, dtype: np.dtype[Any], shape: tuple[int, ...], offset: int) -> np.ndarray:
    """An ndarray over a mapped segment at ``offset`` (the caller has checked the range).

    frombuffer holds a buffer export, so the mapping cannot be closed under a live view (np.ndarray's
    ``buffer=`` would not: a later close would leave it pointing at unmapped memory)."""
    count = 1
    for d in shape:
        count *= d
    arr: np.ndarray = np.frombuffer(mapping, dtype, count, offset).reshape(shape)
    return arr


def error_from_status(status: int, message: str, needed: int = 0) -> EdgedError:
    """The typed error a reply status stands for (clients raise it)."""
    code = STATUS_CODES[status] if 0 < status < len(STATUS_CODES) else ErrorCode.INTERNAL
    assert code is not None
    err = _ERROR_TYPES.get(code, EdgedError)(message)
    err.code = code
    if needed:
        err.context["needed_bytes"] = needed
    return err


def encode_error(kind: int, rid: int, code: ErrorCode, message: str, needed: int = 0) -> bytes:
    return shm_wire.encode_status_error(kind, rid, STATUS_OF.get(code, STATUS_OF[ErrorCode.INTERNAL]), message,
                                        needed)


def decode_infer(buf: memoryview | bytes) -> InferDesc:
    """Parse an INFER body (after the header). Raises ProtocolError; never trusts a length."""
    try:
        return shm_wire.decode_infer(buf)
    except shm_wire.WireError as e:
        raise ProtocolError(str(e)) from None


def _typed(fn: Callable[P, R]) -> Callable[P, R]:
    """The wire module's plain ValueError, as the typed error the rest of edged expects."""
    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except shm_wire.WireError as e:
            raise InvalidInputError(str(e)) from None
    return call


name_bytes = _typed(shm_wire.name_bytes)
encode_tensor = _typed(shm_wire.encode_tensor)
encode_infer = _typed(shm_wire.encode_infer)
encode_output = _typed(shm_wire.encode_output)
