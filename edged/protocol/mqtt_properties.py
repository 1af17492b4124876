"""MQTT 5 PUBLISH properties encoded directly, for the reply path.

paho's generic ``Properties`` validates every assignment against tables it rebuilds per
instance and re-scans them in ``pack()``: about 35 us per reply, a sixth of the latency
budget over a plain echo. The bytes are the same (a test compares them with paho's own
encoding); paho accepts any ``Properties`` subclass and only calls ``pack()`` on it.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edged.errors import InvalidInputError
from edged.protocol.protobuf import varint


def publish_properties(*, correlation: bytes | None = None, content_type: str | None = None,
                       response_topic: str | None = None, expiry_s: int | None = None,
                       user: Sequence[tuple[str, str]] = ()) -> Properties:
    """PUBLISH properties as paho would encode them (MQTT 5.0 section 2.2.2), at a tenth of the cost."""
    out = bytearray()
    if expiry_s is not None:
        out += b"\x02" + _U32.pack(expiry_s)
    if content_type is not None:
        out += b"\x03" + _utf8(content_type)
    if response_topic is not None:
        out += b"\x08" + _utf8(response_topic)
    if correlation is not None:
        if len(correlation) > 65535:
            raise InvalidInputError("MQTT correlation data is longer than 65535 bytes")
        out += b"\x09" + _U16.pack(len(correlation)) + correlation
    for k, v in user:
        out += b"\x26" + _utf8(k) + _utf8(v)
    return _PackedProperties(varint(len(out)) + bytes(out))


class _PackedProperties(Properties):
    _packed: bytes

    def __init__(self, packed: bytes) -> None:  # skips the base class's table building on purpose
        object.__setattr__(self, "packetType", PacketTypes.PUBLISH)
        object.__setattr__(self, "_packed", packed)

    def pack(self) -> bytes:
        return self._packed

    def __str__(self) -> str:
        return f"<packed properties, {len(self._packed)} bytes>"


_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")


def _utf8(text: str) -> bytes:
    raw = text.encode()
    if len(raw) > 65535:
        raise InvalidInputError("an MQTT property string is longer than 65535 bytes")
    return _U16.pack(len(raw)) + raw


