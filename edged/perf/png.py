"""A tiny RGB canvas that writes PNG with zlib and struct: lines, boxes and 5x7 bitmap text.

Why not matplotlib: it is tens of megabytes and a build of its own on arm64 edge
boxes, for one line chart; this is enough for latency against throughput.
"""

from __future__ import annotations

import struct
import zlib

RGB = tuple[int, int, int]

# 5x7 glyphs, one string of 7 rows of 5 pixels each ('1' = ink). Lowercase is drawn as uppercase.
_GLYPHS = {
    "0": "01110 10001 10011 10101 11001 10001 01110", "1": "00100 01100 00100 00100 00100 00100 01110",
    "2": "01110 10001 00001 00010 00100 01000 11111", "3": "11110 00001 00001 01110 00001 00001 11110",
    "4": "00010 00110 01010 10010 11111 00010 00010", "5": "11111 10000 11110 00001 00001 10001 01110",
    "6": "00110 01000 10000 11110 10001 10001 01110", "7": "11111 00001 00010 00100 01000 01000 01000",
    "8": "01110 10001 10001 01110 10001 10001 01110", "9": "01110 10001 10001 01111 00001 00010 01100",
    "A": "01110 10001 10001 11111 10001 10001 10001", "B": "11110 10001 10001 11110 10001 10001 11110",
    "C": "01110 10001 10000 10000 10000 10001 01110", "D": "11100 10010 10001 10001 10001 10010 11100",
    "E": "11111 10000 10000 11110 10000 10000 11111", "F": "11111 10000 10000 11110 10000 10000 10000",
    "G": "01110 10001 10000 10111 10001 10001 01111", "H": "10001 10001 10001 11111 10001 10001 10001",
    "I": "01110 00100 00100 00100 00100 00100 01110", "J": "00111 00010 00010 00010 00010 10010 01100",
    "K": "10001 10010 10100 11000 10100 10010 10001", "L": "10000 10000 10000 10000 10000 10000 11111",
    "M": "10001 11011 10101 10101 10001 10001 10001", "N": "10001 10001 11001 10101 10011 10001 10001",
    "O": "01110 10001 10001 10001 10001 10001 01110", "P": "11110 10001 10001 11110 10000 10000 10000",
    "Q": "01110 10001 10001 10001 10101 10010 01101", "R": "11110 10001 10001 11110 10100 10010 10001",
    "S": "01111 10000 10000 01110 00001 00001 11110", "T": "11111 00100 00100 00100 00100 00100 00100",
    "U": "10001 10001 10001 10001 10001 10001 01110", "V": "10001 10001 10001 10001 10001 01010 00100",
    "W": "10001 10001 10001 10101 10101 10101 01010", "X": "10001 10001 01010 00100 01010 10001 10001",
    "Y": "10001 10001 01010 00100 00100 00100 00100", "Z": "11111 00001 00010 00100 01000 10000 11111",
    " ": "00000 00000 00000 00000 00000 00000 00000", ".": "00000 00000 00000 00000 00000 01100 01100",
    ",": "00000 00000 00000 00000 01100 00100 01000", "-": "00000 00000 00000 11111 00000 00000 00000",
    "/": "00001 00010 00010 00100 01000 01000 10000", "(": "00010 00100 01000 01000 01000 00100 00010",
    ")": "01000 00100 00010 00010 00010 00100 01000", ":": "00000 01100 01100 00000 01100 01100 00000",
    "%": "11000 11001 00010 00100 01000 10011 00011", "_": "00000 00000 00000 00000 00000 00000 11111",
    "=": "00000 00000 11111 00000 11111 00000 00000", "+": "00000 00100 00100 11111 00100 00100 00000",
    "?": "01110 10001 00001 00010 00100 00000 00100",
}
GLYPH_W, GLYPH_H = 5, 7


def _glyph(ch: str) -> list[str]:
    return _GLYPHS.get(ch.upper(), _GLYPHS["?"]).split()


class Canvas:
    def __init__(self, width: int, height: int, background: RGB = (255, 255, 255)) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def dot(self, x: int, y: int, color: RGB) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = (y * self.width + x) * 3
            self.pixels[i:i + 3] = bytes(color)

    def box(self, x0: int, y0: int, x1: int, y1: int, color: RGB) -> None:
        """Filled rectangle, corners inclusive."""
        for y in range(max(0, min(y0, y1)), min(self.height, max(y0, y1) + 1)):
            for x in range(max(0, min(x0, x1)), min(self.width, max(x0, x1) + 1)):
                self.dot(x, y, color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: RGB, *, width: int = 1) -> None:
        """Bresenham's line, thickened by drawing a small square at each step."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        half = (width - 1) // 2
        while True:
            if width > 1:
                self.box(x0 - half, y0 - half, x0 - half + width - 1, y0 - half + width - 1, color)
            else:
                self.dot(x0, y0, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    @staticmethod
    def text_width(text: str, scale: int = 1) -> int:
        return max(0, len(text) * (GLYPH_W + 1) - 1) * scale

    def text(self, x: int, y: int, text: str, color: RGB, scale: int = 1, *, vertical: bool = False) -> None:
        """Left-aligned text with its top-left corner at (x, y); ``vertical`` reads bottom to top."""
        for k, ch in enumerate(text):
            rows = _glyph(ch)
            for gy, bits in enumerate(rows):
                for gx, bit in enumerate(bits):
                    if bit != "1":
                        continue
                    px = k * (GLYPH_W + 1) + gx
                    for a in range(scale):
                        for b in range(scale):
                            if vertical:  # rotate 90 degrees counter-clockwise around (x, y)
                                self.dot(x + gy * scale + b, y - px * scale - a, color)
                            else:
                                self.dot(x + px * scale + a, y + gy * scale + b, color)

    def png(self) -> bytes:
        stride = self.width * 3
        raw = b"".join(b"\x00" + bytes(self.pixels[y * stride:(y + 1) * stride]) for y in range(self.height))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + \
            chunk(b"IEND", b"")
