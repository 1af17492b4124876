"""Protobuf's wire format at its top level, for readers that must not parse (or copy) a whole message.

Two use it: the gRPC transport, which keeps a request's raw tensor contents as views of the bytes
grpcio handed over (edged/protocol/grpc/wire.py), and the repository, which reads an ONNX file's
``metadata_props`` from a memory map without loading the model (edged/repository/onnx_metadata.py).
The same base-128 integers also size MQTT 5 properties (edged/protocol/mqtt_properties.py).
"""

from __future__ import annotations

import mmap

VARINT, FIXED64, LENGTH, FIXED32 = 0, 1, 2, 5  # wire types; groups (3, 4) are not read

Buffer = bytes | mmap.mmap


def varint(n: int) -> bytes:
    """A non-negative integer as a base-128 varint."""
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def read_varint(buf: Buffer, pos: int, end: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it; ValueError when cut off at ``end`` or overlong."""
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise ValueError("truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def length_delimited_fields(buf: Buffer, pos: int, end: int) -> list[tuple[int, int, int, int]]:
    """(field number, where its tag starts, where its payload starts, where it ends) for each
    length-delimited field between ``pos`` and ``end``, in order; the other wire types are skipped.
    ValueError for a group, an unknown wire type, or a field that runs past ``end``."""
    out = []
    while pos < end:
        at = pos
        key = buf[pos]  # one byte for fields 1..15, as nearly all are
        pos += 1
        if key >= 0x80:
            key, pos = read_varint(buf, at, end)
        wire = key & 7
        if wire == LENGTH:
            size, pos = read_varint(buf, pos, end)
            if pos + size > end:
                raise ValueError("field runs past the end")
            out.append((key >> 3, at, pos, pos + size))
            pos += size
        elif wire == VARINT:
            _, pos = read_varint(buf, pos, end)
        elif wire == FIXED64:
            pos += 8
        elif wire == FIXED32:
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
    if pos != end:
        raise ValueError("a fixed-size field runs past the end")
    return out
