"""A ModelInferRequest's ``raw_input_contents`` as views of the received bytes, not copies.

Parsed by protobuf, each raw input is copied into the message, and copied again into a new
bytes object on every access of the field: two copies of every input (a 6 MB frame costs
milliseconds) before the model sees it. Walking the message's top-level fields instead finds
where each raw content lies in the bytes grpcio handed over; the message is then parsed without
them (a few hundred bytes of names and shapes) and the inputs are views of those bytes.

Protobuf allows fields in any order and repeated fields interleaved with others; the
contents keep their order, and the remaining fields theirs, so the smaller message parses
to exactly what the whole one would, minus the contents. Anything this walk does not take
(a group, a truncated or overlong field) gives None: the caller parses the whole message,
and protobuf says what is wrong with it.
"""

from __future__ import annotations

RAW_INPUT_CONTENTS = 7  # ModelInferRequest.raw_input_contents (grpc_service.proto)

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it; IndexError when cut off, ValueError when overlong."""
    result = shift = 0
    while True:
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift >= 64:
            raise ValueError("varint longer than 10 bytes")


def split_raw_contents(data: bytes, field: int = RAW_INPUT_CONTENTS) -> tuple[bytes, list[memoryview]] | None:
    """The message without its length-delimited ``field`` entries, and those entries' contents as views of
    ``data`` in their order; None when the top-level fields cannot be walked (the caller parses it whole)."""
    raws: list[memoryview] = []
    kept: list[bytes] = []
    view = memoryview(data)
    end = len(data)
    pos = start = 0
    try:
        while pos < end:
            at = pos
            key = data[pos]
            pos += 1
            if key >= 0x80:
                key, pos = _varint(data, at)
            kind = key & 7
            if kind == _LENGTH:
                size, pos = _varint(data, pos)
                if pos + size > end:
                    return None
                if key >> 3 == field:
                    kept.append(data[start:at])
                    raws.append(view[pos:pos + size])
                    start = pos + size
                pos += size
            elif kind == _VARINT:
                _, pos = _varint(data, pos)
            elif kind == _FIXED64:
                pos += 8
            elif kind == _FIXED32:
                pos += 4
            else:
                return None  # groups (deprecated) or an invalid wire type
    except (IndexError, ValueError):
        return None
    if pos != end:
        return None  # a fixed-size field cut off at the end
    if not raws:
        return data, raws
    kept.append(data[start:])
    return b"".join(kept), raws
