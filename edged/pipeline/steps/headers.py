"""Image sizes read from the first bytes of JPEG, PNG and WebP files, before anything is decoded.

A decoder allocates width x height x channels as soon as it has read the header; a
100000x100000 PNG of a few kilobytes would ask for 30 GB. Reading the size here lets
the decode step refuse it first. Formats other than these three are refused: fewer
decoders reachable by a hostile client.
"""

from __future__ import annotations

import struct

_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_JPEG_NO_LENGTH = {0x01, *range(0xD0, 0xDA)}


class HeaderError(ValueError):
    """The bytes are not a JPEG, PNG or WebP whose size can be read; the message says why."""


def image_size(data: bytes) -> tuple[str, int, int]:
    """(format, width, height) of an encoded image."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        if len(data) < 24 or data[12:16] != b"IHDR":
            raise HeaderError("PNG without an IHDR header")
        width, height = struct.unpack(">II", data[16:24])
        return "png", width, height
    if data.startswith(b"\xff\xd8"):
        return ("jpeg", *_jpeg_size(data))
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return ("webp", *_webp_size(data))
    raise HeaderError("not a JPEG, PNG or WebP image")


def _jpeg_size(data: bytes) -> tuple[int, int]:
    pos = 2
    n = len(data)
    while pos < n:
        if data[pos] != 0xFF:
            raise HeaderError(f"JPEG marker expected at byte {pos}")
        while pos < n and data[pos] == 0xFF:  # fill bytes
            pos += 1
        if pos >= n:
            break
        marker = data[pos]
        pos += 1
        if marker in _JPEG_NO_LENGTH:
            continue
        if marker == 0xDA:  # start of scan before any frame header
            break
        if pos + 2 > n:
            break
        (length,) = struct.unpack(">H", data[pos:pos + 2])
        if length < 2:
            raise HeaderError(f"JPEG segment with length {length} at byte {pos}")
        if marker in _JPEG_SOF:
            if pos + 7 > n:
                break
            height, width = struct.unpack(">HH", data[pos + 3:pos + 7])
            return width, height
        pos += length
    raise HeaderError("JPEG without a frame header")


def _webp_size(data: bytes) -> tuple[int, int]:
    chunk = data[12:16]
    if chunk == b"VP8 " and len(data) >= 30:
        width, height = struct.unpack("<HH", data[26:30])
        return width & 0x3FFF, height & 0x3FFF
    if chunk == b"VP8L" and len(data) >= 25 and data[20] == 0x2F:
        b0, b1, b2, b3 = data[21:25]
        return 1 + (b0 | (b1 & 0x3F) << 8), 1 + ((b1 >> 6) | b2 << 2 | (b3 & 0x0F) << 10)
    if chunk == b"VP8X" and len(data) >= 30:
        width = int.from_bytes(data[24:27], "little") + 1
        height = int.from_bytes(data[27:30], "little") + 1
        return width, height
    raise HeaderError("WebP without a readable frame header")
