"""The ``metadata_props`` of an ONNX file (key/value strings a model carries, e.g. PP-OCR's ``character``
list), read from the protobuf's top-level fields without the ``onnx`` package or loading the model.

The file is memory-mapped and only the tags of the top-level fields are walked; the graph's bytes are
skipped over, never copied.
"""

from __future__ import annotations

import mmap
from pathlib import Path

from edged.errors import ManifestError
from edged.protocol.protobuf import length_delimited_fields

_METADATA_PROPS = 14  # ModelProto.metadata_props: repeated StringStringEntryProto {key = 1, value = 2}


def read_metadata(path: Path) -> dict[str, str]:
    """``metadata_props`` of the ONNX model at ``path``; ManifestError when it is not a readable ONNX file."""
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            props: dict[str, str] = {}
            for field, _, start, end in length_delimited_fields(buf, 0, len(buf)):
                if field != _METADATA_PROPS:
                    continue
                entry = {k: bytes(buf[s:e]).decode("utf-8")
                         for k, _, s, e in length_delimited_fields(buf, start, end) if k in (1, 2)}
                props[entry.get(1, "")] = entry.get(2, "")
            return props
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{path.name}: cannot read its ONNX metadata: {exc}", file=str(path)) from None
