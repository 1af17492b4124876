"""Client-side shared memory: sealed memfd segments, per-model slots, request packing, output views.

Shared by the sync and asyncio clients so both speak the protocol identically.
A *slot* is one segment laid out as ``[staged inputs][outputs]``: inputs that are
not already in shared memory are copied into the staging area (one copy), the
daemon writes outputs into the output area, and outputs come back as numpy views
on it. Inputs that already live in a registered segment (from
``client.tensor()`` / ``client.input_buffer()``) are sent by reference: zero copy.
"""

from __future__ import annotations

import fcntl
import math
import mmap
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edged import datatypes
from edged.errors import InvalidInputError
from edged.protocol import shm as p
from edged.protocol.v2 import bytes_from_buffer, bytes_to_buffer

PAGE = mmap.PAGESIZE
MEMFD_NAME = "edged-shm"
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_DEFAULT_DYNAMIC_OUTPUT = 1 << 20  # guess for outputs with dynamic dims; grown on "needs N bytes"
TEMPLATES_PER_SLOT = 16  # distinct requests (input shapes, outputs, timeout) a slot keeps encoded


def page_round(n: int) -> int:
    return max(PAGE, (n + PAGE - 1) // PAGE * PAGE)


class ClientSegment:
    """A memfd mapped into this process and registered with the daemon under ``id``."""

    __slots__ = ("base", "id", "mm", "size", "u8")

    def __init__(self, mm: mmap.mmap, size: int) -> None:
        self.id = 0
        self.mm = mm
        self.size = size
        self.u8: np.ndarray | None = np.frombuffer(mm, np.uint8)
        self.base: int = self.u8.__array_interface__["data"][0]

    def view(self, dtype: np.dtype[Any], shape: tuple[int, ...], offset: int) -> np.ndarray:
        return p.segment_view(self.mm, dtype, shape, offset)

    def close(self) -> None:
        """Drop our mapping; numpy views handed out keep it alive until they are gone."""
        self.u8 = None
        try:
            self.mm.close()
        except BufferError:
            pass


def create_segment(size: int) -> tuple[int, ClientSegment]:
    """A new memfd of ``size`` bytes (page-rounded), sealed so it can never shrink or grow, and mapped."""
    size = page_round(size)
    fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return fd, ClientSegment(mm, size)


def find_segment(segments: Mapping[int, ClientSegment], arr: np.ndarray) -> tuple[ClientSegment, int] | None:
    """The registered segment a C-contiguous array lies in, and its offset there (zero-copy inputs)."""
    if not segments or not arr.flags.c_contiguous:
        return None
    addr: int = arr.__array_interface__["data"][0]
    end = addr + arr.nbytes
    for seg in segments.values():
        if seg.base <= addr and end <= seg.base + seg.size and seg.u8 is not None:
            return seg, addr - seg.base
    return None


@dataclass
class ModelInfo:
    """What the client needs to size slots, from the daemon's metadata reply."""

    name: str
    version: int
    max_batch_size: int
    inputs: dict[str, tuple[str, list[int]]]
    outputs: list[tuple[str, str, list[int]]]  # name, datatype, shape without the batch dim
    metadata: dict[str, Any]
    output_hint: int = 0  # largest "needs N bytes" seen
    _out_cache: dict[int, int] = field(default_factory=dict)

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> ModelInfo:
        mbs = int(meta.get("max_batch_size", 0))
        cut = 1 if mbs > 0 else 0
        return cls(
            name=meta["name"], version=int(meta.get("version", 0)), max_batch_size=mbs,
            inputs={t["name"]: (t["datatype"], list(t["shape"][cut:])) for t in meta["inputs"]},
            outputs=[(t["name"], t["datatype"], list(t["shape"][cut:])) for t in meta["outputs"]],
            metadata=meta)

    def output_bytes(self, inputs: Mapping[str, np.ndarray]) -> int:
        """Capacity the output area needs for this request (a guess where dims are dynamic)."""
        batch = 1
        if self.max_batch_size > 0:
            for a in inputs.values():
                batch = a.shape[0] if a.ndim else 1
                break
        cached = self._out_cache.get(batch)
        if cached is not None:
            return max(cached, self.output_hint)
        total = 0
        for _, dt, shape in self.outputs:
            size = datatypes.itemsize(dt) if dt in p.DTYPE_CODE else 0
            if any(d < 0 for d in shape) or size == 0:
                total += _DEFAULT_DYNAMIC_OUTPUT
            else:
                total += p.align(batch * math.prod(shape) * size)
        self._out_cache[batch] = total + p.ALIGNMENT
        return max(total + p.ALIGNMENT, self.output_hint)


@dataclass
class Slot:
    segment: ClientSegment
    in_cap: int
    out_off: int
    out_cap: int
    # completion output descriptors seen on this slot (they repeat call after call), checked once
    decoded: dict[bytes, list[tuple[str, np.dtype[Any] | None, tuple[int, ...], int, int]]] = field(
        default_factory=dict)
    # the output views for each of those (numeric outputs only), made once: returned again uncopied
    views: dict[bytes, dict[str, np.ndarray]] = field(default_factory=dict)
    # requests this slot carried, encoded once (template_key -> Template)
    templates: dict[tuple[object, ...], Template] = field(default_factory=dict)

    @classmethod
    def layout(cls, in_need: int, out_need: int) -> tuple[int, int, int]:
        """(segment size, output offset, output capacity) for the needs, page-rounded."""
        in_cap = p.align(in_need)
        size = page_round(in_cap + out_need)
        return size, in_cap, size - in_cap

    def fits(self, in_need: int, out_need: int) -> bool:
        return self.in_cap >= in_need and self.out_cap >= out_need


@dataclass
class Template:
    """A request a slot has carried before, kept encoded. The same input names, shapes and dtypes, the same
    outputs and timeout make the same INFER message on the same slot but for its id (and the daemon
    caches its decoded plan by those bytes), so the next such call copies its inputs into ``views`` and
    sends ``message`` with a new id: no packing, no encoding, no slot lookup on the call's path."""

    message: bytearray
    views: list[np.ndarray]  # where each input, in the request's order, goes in the slot


def template_key(
    inputs: Mapping[str, Any], outputs: list[str] | None, timeout: float | None
) -> tuple[object, ...] | None:
    """The key of a request a :class:`Template` may carry, None when it may not: every input must be a
    numpy array of a numeric dtype that owns its memory. (An array over other memory may lie in a
    registered segment, a zero-copy input that goes by reference; that is :func:`plan_inputs`' to tell.)"""
    key: list[object] = [timeout, outputs if outputs is None else tuple(outputs)]
    for name, arr in inputs.items():
        if type(arr) is not np.ndarray or arr.base is not None or arr.dtype.kind in "SUO":
            return None
        key += (name, arr.shape, arr.dtype)
    return tuple(key)


def make_template(
    slot: Slot, key: tuple[object, ...] | None, packed: PackedInputs, message: bytes, views: list[np.ndarray]
) -> None:
    """Keep a sent request as ``slot``'s template for ``key`` (see :func:`template_key`), when it is one:
    every input copied into the slot, in native byte order, none empty."""
    if key is None or packed.refs or len(views) != len(packed.staged):
        return
    if any(blob is not None or arr.dtype not in p.NUMPY_CODE or not arr.nbytes for _, arr, blob in packed.staged):
        return
    if len(slot.templates) >= TEMPLATES_PER_SLOT:
        slot.templates.clear()
    slot.templates[key] = Template(bytearray(message), views)


@dataclass
class PackedInputs:
    """Inputs split into those sent by reference and those to copy into the slot."""

    refs: list[tuple[str, np.ndarray, ClientSegment, int]]
    staged: list[tuple[str, np.ndarray, bytes | None]]  # with a BYTES tensor's serialized elements
    staged_bytes: int


def plan_inputs(segments: Mapping[int, ClientSegment], inputs: Mapping[str, Any]) -> PackedInputs:
    refs: list[tuple[str, np.ndarray, ClientSegment, int]] = []
    staged: list[tuple[str, np.ndarray, bytes | None]] = []
    need = 0
    for name, value in inputs.items():
        arr = value if isinstance(value, np.ndarray) else np.asarray(value)
        if arr.dtype.kind in "SUO":  # BYTES (encoded images...): copied into the slot serialized
            if arr.ndim > p.MAX_DIMS:
                raise InvalidInputError(f"input {name!r} has {arr.ndim} dimensions (at most {p.MAX_DIMS})")
            blob = bytes_to_buffer(arr)
            staged.append((name, arr, blob))
            need = p.align(need) + len(blob)
            continue
        if arr.dtype not in p.NUMPY_CODE:
            if arr.dtype.newbyteorder("=") in p.NUMPY_CODE:
                arr = arr.astype(arr.dtype.newbyteorder("="))
            else:
                raise InvalidInputError(f"input {name!r}: numpy dtype {arr.dtype} has no v2 datatype")
        if arr.ndim > p.MAX_DIMS:
            raise InvalidInputError(f"input {name!r} has {arr.ndim} dimensions (at most {p.MAX_DIMS})")
        hit = find_segment(segments, arr)
        if hit is not None:
            refs.append((name, arr, hit[0], hit[1]))
        else:
            staged.append((name, arr, None))
            need = p.align(need) + arr.nbytes
    return PackedInputs(refs, staged, need)


def encode_request(  # noqa: PLR0913  one argument per field of the INFER message
        rid: int, model: str, version: int | None, slot: Slot, packed: PackedInputs, *,
                   outputs: list[str] | None, timeout: float | None, queue: bool = False,
                   views: list[np.ndarray] | None = None) -> bytes:
    """Copy staged inputs into the slot and build the INFER message; ``views``: given, it collects where
    each numeric staged input went (for :func:`make_template`)."""
    seg = slot.segment
    tensors: list[bytes] = []
    enc = p.encode_tensor
    for name, arr, rseg, off in packed.refs:
        tensors.append(enc(name, p.NUMPY_CODE[arr.dtype], arr.shape, segment=rseg.id, offset=off, nbytes=arr.nbytes))
    off = 0
    for name, arr, blob in packed.staged:
        off = p.align(off)
        if blob is not None:
            if blob:
                seg.view(np.dtype(np.uint8), (len(blob),), off)[:] = np.frombuffer(blob, np.uint8)
            tensors.append(enc(name, p.BYTES, arr.shape, segment=seg.id, offset=off, nbytes=len(blob)))
            off += len(blob)
            continue
        if arr.nbytes:
            dst = seg.view(arr.dtype, arr.shape, off)
            np.copyto(dst, arr, casting="no")
            if views is not None:
                views.append(dst)
        tensors.append(enc(name, p.NUMPY_CODE[arr.dtype], arr.shape, segment=seg.id, offset=off, nbytes=arr.nbytes))
        off += arr.nbytes
    timeout_us = 0 if timeout is None else max(1, min(int(timeout * 1e6), 2**32 - 1))
    return p.encode_infer(rid, model, version or 0, tensors, out_segment=seg.id, out_offset=slot.out_off,
                          out_capacity=slot.out_cap, outputs=outputs, timeout_us=timeout_us,
                          flags=p.FLAG_QUEUE if queue else 0)


def read_outputs(slot: Slot, count: int, body: memoryview | bytes, copy: bool) -> dict[str, np.ndarray]:
    """Outputs of a successful completion, as views on the slot (or copies)."""
    key = bytes(body[p.U32.size:])
    places = slot.decoded.get(key)
    if places is None:
        places = []
        lo, hi = slot.out_off, slot.out_off + slot.out_cap
        for o in p.decode_outputs(body, count)[1]:
            if o.dtype == p.BYTES and lo <= o.offset and o.nbytes <= hi - o.offset:
                places.append((o.name, None, o.shape, o.offset, o.nbytes))
                continue
            dt = p.NUMPY_DTYPES[o.dtype] if 0 < o.dtype < len(p.NUMPY_DTYPES) else None
            if dt is None or not (lo <= o.offset and o.nbytes <= hi - o.offset) or \
                    o.nbytes != dt.itemsize * math.prod(o.shape):
                raise InvalidInputError(f"output {o.name!r}: the daemon sent a descriptor outside the output slot")
            places.append((o.name, dt, o.shape, o.offset, o.nbytes))
        if len(slot.decoded) >= 64:
            slot.decoded.clear()
            slot.views.clear()
        slot.decoded[key] = places
    if not copy:
        views = slot.views.get(key)
        if views is not None:  # new array objects over the same memory: a caller's reshape stays its own
            return {name: v.view() for name, v in views.items()}
    view = slot.segment.view
    out: dict[str, np.ndarray] = {}
    for name, dt, shape, off, nbytes in places:
        if dt is None:  # BYTES: always decoded into new Python bytes objects
            data = view(np.dtype(np.uint8), (nbytes,), off)
            out[name] = bytes_from_buffer(data.tobytes(), math.prod(shape), f"output {name!r}").reshape(shape)
        else:
            out[name] = view(dt, shape, off).copy() if copy else view(dt, shape, off)
    if not copy and all(dt is not None for _, dt, *_ in places):
        slot.views[key] = {name: v.view() for name, v in out.items()}
    return out
