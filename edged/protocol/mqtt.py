"""MQTT payload framing and topic naming for the v2 inference protocol.

A request payload is either plain v2 JSON or the v2 binary form: a JSON header
followed by raw tensor bytes. The header's length travels in the MQTT 5 user
property ``Inference-Header-Content-Length`` or, where properties are not
available (MQTT 3.1.1), in a 4-byte big-endian prefix. JSON text never starts
with a zero byte and headers are capped below 16 MiB, so a payload whose first
byte is 0x00 is unambiguously the prefixed form. Replies use the request's form.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any

from edged.errors import EdgedError, InvalidInputError
from edged.protocol.mqtt_topics import Topics, topic_matches, valid_publish_topic
from edged.protocol.v2 import dumps
from edged.protocol.v2_json import loads_request

__all__ = ["Form", "Frame", "Topics", "topic_matches", "valid_publish_topic"]

HEADER_LENGTH_PROPERTY = "Inference-Header-Content-Length"
ERROR_CODE_PROPERTY = "Edged-Error-Code"
CONTENT_TYPE_JSON = "application/json"
CONTENT_TYPE_BINARY = "application/vnd.edged.v2+octet-stream"
PREFIX = struct.Struct(">I")
MAX_HEADER_BYTES = (1 << 24) - 1  # keeps the prefix's first byte zero


class Form(str, enum.Enum):
    JSON = "json"
    BINARY_PROPERTY = "binary-property"  # header length in a user property (MQTT 5)
    BINARY_PREFIX = "binary-prefix"  # header length in a 4-byte big-endian prefix


@dataclass
class Frame:
    form: Form
    header: dict[str, Any]
    tail: memoryview


def split(payload: bytes | bytearray, header_length: int | None) -> tuple[Form, memoryview, memoryview]:
    """Separate header bytes from tensor bytes without copying."""
    view = memoryview(payload)
    if header_length is not None:
        if not 0 < header_length <= len(view):
            raise InvalidInputError(
                f"{HEADER_LENGTH_PROPERTY} is {header_length} but the payload has {len(view)} bytes")
        return Form.BINARY_PROPERTY, view[:header_length], view[header_length:]
    if len(view) >= PREFIX.size and view[0] == 0:
        (n,) = PREFIX.unpack_from(view)
        if not 0 < n <= len(view) - PREFIX.size:
            raise InvalidInputError(
                f"binary payload: header length prefix {n} does not fit the {len(view)}-byte payload")
        end = PREFIX.size + n
        return Form.BINARY_PREFIX, view[PREFIX.size:end], view[end:]
    return Form.JSON, view, view[len(view):]


def parse(payload: bytes | bytearray, header_length: int | None) -> Frame:
    return parse_split(*split(payload, header_length))


def parse_split(form: Form, head: memoryview, tail: memoryview) -> Frame:
    header = loads_request(head)
    if not isinstance(header, dict):
        raise InvalidInputError("request header must be a JSON object")
    return Frame(form, header, tail)


def header_length_property(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        raise InvalidInputError(f"{HEADER_LENGTH_PROPERTY} must be an integer, got {value[:32]!r}") from None
    if n <= 0:
        raise InvalidInputError(f"{HEADER_LENGTH_PROPERTY} must be positive, got {n}")
    return n


def frame(form: Form, header: dict[str, Any], chunks: list[bytes], *,
          properties: bool) -> tuple[Form, bytes, int | None]:
    """Serialise a reply in the request's form; returns the form used, the payload, the header length.

    A JSON request that asked for binary outputs gets a binary reply (its chunks need a
    header length): the property form where MQTT 5 properties exist, else the prefix.
    """
    return frame_encoded(form, dumps(header), chunks, properties=properties)


def frame_encoded(form: Form, head: bytes, chunks: list[bytes], *,
                  properties: bool) -> tuple[Form, bytes, int | None]:
    """:func:`frame` for a header already serialised."""
    if form is Form.JSON:
        if not chunks:
            return form, head, None
        form = Form.BINARY_PROPERTY if properties else Form.BINARY_PREFIX
    if len(head) > MAX_HEADER_BYTES:
        raise InvalidInputError(f"response header of {len(head)} bytes is too large for the binary form")
    if form is Form.BINARY_PREFIX:
        return form, b"".join([PREFIX.pack(len(head)), head, *chunks]), len(head)
    return form, b"".join([head, *chunks]), len(head)


def error_header(err: EdgedError, request_id: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"error": err.message, "code": err.code.value}
    if request_id is not None:
        body["id"] = request_id
    return body


def reply_address(header: dict[str, Any]) -> tuple[str | None, str | None]:
    """``reply_to`` and ``id`` from a request header (the MQTT 3.1.1 correlation)."""
    reply_to = header.get("reply_to")
    rid = header.get("id")
    if reply_to is not None and (not isinstance(reply_to, str) or not valid_publish_topic(reply_to)):
        raise InvalidInputError("'reply_to' must be a topic name without wildcards")
    if rid is not None and not isinstance(rid, str):
        raise InvalidInputError("'id' must be a string")
    return reply_to, rid
