"""The shared-memory protocol of one connection, without I/O: the core both shm clients drive.

Why: the blocking :class:`~edged.client.shm.ShmClient` and the asyncio
:class:`~edged.client.shm.AsyncShmClient` must speak the protocol identically. Everything that does
not wait on the socket lives here once: request ids, the connection's segments, model metadata and
input buffers, how each request is built and each answer read. A round trip is an *operation*: a
generator that yields ``(message, fd)`` and is sent the reply ``(status, count, body)``; the sync
face runs it with blocking calls (:func:`run`), the asyncio face with awaits (:func:`arun`). An error
of the call is thrown into the operation at its ``yield``, so its ``finally`` and ``except`` apply.
"""

from __future__ import annotations

import array
import contextlib
import math
import os
import socket
from collections.abc import Awaitable, Callable, Generator, Mapping
from typing import Any, TypeVar

import numpy as np
import orjson

from edged import datatypes
from edged.client.shm_memory import (
    ClientSegment,
    ModelInfo,
    PackedInputs,
    Slot,
    create_segment,
    encode_request,
    plan_inputs,
    read_outputs,
)
from edged.client.shm_prepared import PreparedBase
from edged.errors import EdgedError, ErrorCode, InvalidInputError
from edged.protocol import shm as p

T = TypeVar("T")
Key = tuple[str, int]
Reply = tuple[int, int, memoryview | bytes]  # status, count, body
Send = tuple[bytes | bytearray, int]  # message, fd to pass with it (-1: none)
Op = Generator[Send, Reply, T]
TRIES = 3  # an INFER is sent again at most twice, each time with a bigger output area

_Place = tuple[str, np.dtype[Any], tuple[int, ...], int]  # an input's name, dtype, shape and offset


def run(op: Op[T], call: Callable[[bytes | bytearray, int], Reply]) -> T:
    """Run an operation with a blocking ``call(message, fd) -> reply``."""
    try:
        msg, fd = next(op)
        while True:
            try:
                reply = call(msg, fd)
            except BaseException as e:
                msg, fd = op.throw(e)
            else:
                msg, fd = op.send(reply)
    except StopIteration as done:
        result: T = done.value
        return result


async def arun(op: Op[T], call: Callable[[bytes | bytearray, int], Awaitable[Reply]]) -> T:
    """Run an operation with an awaitable ``call(message, fd) -> reply``."""
    try:
        msg, fd = next(op)
        while True:
            try:
                reply = await call(msg, fd)
            except BaseException as e:
                msg, fd = op.throw(e)
            else:
                msg, fd = op.send(reply)
    except StopIteration as done:
        result: T = done.value
        return result


def check(status: int, body: memoryview | bytes) -> None:
    """Raise the daemon's error for a failed reply."""
    if status:
        needed, message = p.decode_error(body)
        raise p.error_from_status(status, message, needed)


def answer(reply: Reply, slot: Slot, copy: bool, grow_above: int) -> dict[str, np.ndarray] | int:
    """An INFER's outputs, or the bytes they need when that is more than ``grow_above`` (the slot was
    too small: grow it and send again; -1: never). Any other error is raised."""
    status, count, body = reply
    if not status:
        return read_outputs(slot, count, body, copy)
    return needed_bytes(status, body, grow_above)


def needed_bytes(status: int, body: memoryview | bytes, grow_above: int) -> int:
    """An INFER's error reply: the bytes its outputs need when the slot was too small and that is more
    than ``grow_above`` (-1: never); any other error is raised."""
    needed, message = p.decode_error(body)
    if grow_above < 0 or not needed or needed <= grow_above:
        raise p.error_from_status(status, message, needed)
    return needed


def grow_limit(attempt: int, limit: int) -> int:
    """``grow_above`` for try ``attempt``: the last try takes no "needs N bytes" for an answer."""
    return limit if attempt < TRIES - 1 else -1


def fds_message(fd: int) -> list[tuple[int, int, bytes]]:
    """The ancillary data that passes a memfd with a message."""
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())]


def closed_error() -> EdgedError:
    return EdgedError("edged closed the shared-memory connection", code=ErrorCode.UNAVAILABLE)


def not_open_error() -> EdgedError:
    return EdgedError("the client is closed", code=ErrorCode.FAILED_PRECONDITION)


def link_error(e: OSError) -> EdgedError:
    return EdgedError(f"shared-memory connection failed: {e.strerror or e}", code=ErrorCode.UNAVAILABLE)


def prepared_places(
    info: ModelInfo, shapes: Mapping[str, tuple[int, ...] | list[int]], dtypes: Mapping[str, Any] | None
) -> tuple[list[_Place], int]:
    """Where each input of a prepared request lies in its segment, and the segment's size."""
    places: list[_Place] = []
    end = 0
    for name, shape in shapes.items():
        dt = input_dtype(info, name, (dtypes or {}).get(name))
        shp = tuple(int(d) for d in shape)
        if dt.kind in "SUO":
            raise InvalidInputError(
                f"input {name!r} is BYTES: its size follows its data, so it cannot be prepared; send it with infer()"
            )
        dt = dt.newbyteorder("=")  # the daemon reads native byte order (infer() converts; here nothing is)
        if dt not in p.NUMPY_CODE:
            raise InvalidInputError(f"input {name!r}: numpy dtype {dt} has no v2 datatype")
        if any(d < 0 for d in shp) or len(shp) > p.MAX_DIMS:
            raise InvalidInputError(f"input {name!r}: shape {list(shp)} is not a concrete tensor shape")
        end = p.align(end)
        places.append((name, dt, shp, end))
        end += dt.itemsize * math.prod(shp)
    return places, max(1, end)


def input_dtype(info: ModelInfo | None, name: str, dtype: Any) -> np.dtype[Any]:
    """``dtype`` when given, else the input's datatype from the model's metadata."""
    if dtype is not None:
        dt: np.dtype[Any] = np.dtype(dtype)
        return dt
    if info is None or name not in info.inputs:
        raise InvalidInputError(f"unknown input {name!r}; pass dtype=")
    return datatypes.to_numpy(info.inputs[name][0])


class ShmCore:
    """One connection's protocol state: request ids, segments, model metadata, named input buffers."""

    def __init__(self) -> None:
        self.rid = 0
        self.segments: dict[int, ClientSegment] = {}
        self.models: dict[Key, ModelInfo] = {}
        self.buffers: dict[tuple[str, int, str], ClientSegment] = {}
        self.closed = False

    def next_id(self) -> int:
        self.rid += 1
        return self.rid

    def message(self, kind: int, body: bytes) -> bytes:
        """A request of ``kind`` under the next request id."""
        return p.header(kind, self.next_id()) + body

    def drop_all(self) -> None:
        for seg in self.segments.values():
            seg.close()
        self.segments.clear()
        self.buffers.clear()

    # ---- operations (one or more round trips) -----------------------------------------------
    def hello(self) -> Op[dict[str, Any]]:
        """Agree on the protocol version; the daemon's limits come back."""
        status, _, body = yield self.message(p.HELLO, p.U32.pack(p.PROTOCOL_VERSION)), -1
        check(status, body)
        server: dict[str, Any] = orjson.loads(bytes(body))
        return server

    def register(self, size: int) -> Op[ClientSegment]:
        """A new sealed segment of at least ``size`` bytes, mapped here and by the daemon."""
        fd, seg = create_segment(size)
        try:
            status, _, body = yield self.message(p.REGISTER, p.U64.pack(seg.size)), fd
        except BaseException:
            seg.close()  # cut off: the daemon's side, if it mapped it, is the caller's to give back
            raise
        finally:
            os.close(fd)
        if status:
            seg.close()
            check(status, body)
        (seg.id,) = p.U32.unpack_from(body)
        self.segments[seg.id] = seg
        return seg

    def unregister(self, seg: ClientSegment) -> Op[None]:
        """Give a segment back; the daemon unmaps it once no request in flight uses it (a failed round
        trip leaves it to the connection's end)."""
        self.segments.pop(seg.id, None)
        try:
            with contextlib.suppress(EdgedError):
                status, _, body = yield self.unregister_message(seg.id), -1
                check(status, body)
        finally:
            seg.close()

    def unregister_message(self, seg_id: int) -> bytes:
        return self.message(p.UNREGISTER, p.U32.pack(seg_id))

    def metadata(self, model: str, version: int | None) -> Op[dict[str, Any]]:
        nb = model.encode()
        status, _, body = yield self.message(p.METADATA, p.META_BODY.pack(version or 0, len(nb)) + nb), -1
        check(status, body)
        meta: dict[str, Any] = orjson.loads(bytes(body))
        return meta

    def info(self, model: str, version: int | None) -> Op[ModelInfo]:
        """The model's metadata as slots need it, asked for once per connection."""
        key = (model, version or 0)
        info = self.models.get(key)
        if info is None:
            info = ModelInfo.from_metadata((yield from self.metadata(model, version)))
            self.models[key] = info
        return info

    def area(self, in_need: int, out_need: int) -> Op[Slot]:
        """A new slot: ``in_need`` bytes of staged inputs, then ``out_need`` of outputs (page-rounded)."""
        size, out_off, out_cap = Slot.layout(in_need, out_need)
        return Slot((yield from self.register(size)), out_off, out_off, out_cap)

    def tensor(self, shape: tuple[int, ...] | list[int], dtype: Any) -> Op[np.ndarray]:
        """A new array in its own segment."""
        dt = np.dtype(dtype)
        shp = tuple(int(d) for d in shape)
        seg = yield from self.register(max(1, int(np.prod(shp, dtype=np.int64)) * dt.itemsize))
        return seg.view(dt, shp, 0)

    def input_buffer(
        self, model: str, name: str, shape: tuple[int, ...] | list[int], dtype: Any, version: int | None
    ) -> Op[np.ndarray]:
        """A shared array for one input of one model, reused across calls (grown for a bigger shape)."""
        info = yield from self.info(model, version)
        dt = input_dtype(info, name, dtype)
        shp = tuple(int(d) for d in shape)
        nbytes = int(np.prod(shp, dtype=np.int64)) * dt.itemsize
        key = (model, version or 0, name)
        seg = self.buffers.get(key)
        if seg is None or seg.size < nbytes:
            if seg is not None:
                yield from self.unregister(seg)
            seg = yield from self.register(max(1, nbytes))
            self.buffers[key] = seg
        return seg.view(dt, shp, 0)

    def prepared_inputs(
        self, info: ModelInfo, shapes: Mapping[str, tuple[int, ...] | list[int]], dtypes: Mapping[str, Any] | None
    ) -> Op[tuple[ClientSegment, dict[str, np.ndarray]]]:
        """A prepared request's input segment and its arrays."""
        places, size = prepared_places(info, shapes, dtypes)
        seg = yield from self.register(size)
        return seg, {name: seg.view(dt, shp, off) for name, dt, shp, off in places}

    # ---- prepared requests ------------------------------------------------------------------
    def prepared_packed(self, prep: PreparedBase) -> PackedInputs:
        """A prepared request's inputs, all sent by reference from its segment: nothing copied per run."""
        packed = plan_inputs(self.segments, prep.inputs)
        if packed.staged:
            raise EdgedError(
                "the prepared request's input buffers are no longer registered", code=ErrorCode.FAILED_PRECONDITION
            )
        return packed

    @staticmethod
    def encode_prepared(prep: PreparedBase, slot: Slot, packed: PackedInputs) -> None:
        """Encode a prepared request once, with ``slot`` as its output area (id and flags patched per run)."""
        prep.message = bytearray(
            encode_request(0, prep.model, prep.version, slot, packed, outputs=prep.outputs, timeout=prep.timeout)
        )
        prep.slot = slot
