"""The ``metadata_props`` of an ONNX file (key/value strings a model carries, e.g. PP-OCR's ``character``
list), read from the protobuf's top-level fields without the ``onnx`` package or loading the model.

The file is memory-mapped and only the tags of the top-level fields are walked; the graph's bytes are
skipped over, never copied.
"""

from __future__ import annotations

import mmap
from pathlib import Path

from edged.errors import ManifestError

_METADATA_PROPS = 14  # ModelProto.metadata_props: repeated StringStringEntryProto {key = 1, value = 2}


def _varint(buf: mmap.mmap | bytes, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _fields(buf: mmap.mmap | bytes, pos: int, end: int) -> list[tuple[int, int, int]]:
    """(field number, start, end) of the length-delimited fields between ``pos`` and ``end``."""
    out = []
    while pos < end:
        key, pos = _varint(buf, pos, end)
        field, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _varint(buf, pos, end)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            size, pos = _varint(buf, pos, end)
            if pos + size > end:
                raise ValueError("field runs past the end")
            out.append((field, pos, pos + size))
            pos += size
        else:
            raise ValueError(f"unsupported wire type {wire}")
    if pos != end:
        raise ValueError("fields run past the end")
    return out


def read_metadata(path: Path) -> dict[str, str]:
    """``metadata_props`` of the ONNX model at ``path``; ManifestError when it is not a readable ONNX file."""
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            props: dict[str, str] = {}
            for field, start, end in _fields(buf, 0, len(buf)):
                if field != _METADATA_PROPS:
                    continue
                entry = {k: bytes(buf[s:e]).decode("utf-8") for k, s, e in _fields(buf, start, end) if k in (1, 2)}
                props[entry.get(1, "")] = entry.get(2, "")
            return props
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{path.name}: cannot read its ONNX metadata: {exc}", file=str(path)) from None
