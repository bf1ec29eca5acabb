"""Line charts as PNG bytes without a plotting library (none is installed; matplotlib would pull in a
dozen packages for one curve): zlib + struct, the PNG format's own building blocks. No text is drawn;
the report around the image names the series, their colours and their ranges."""

from __future__ import annotations

import math
import struct
import zlib

COLORS = ((31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14))
_MARGIN = 24


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_bytes(pixels: list[bytearray], width: int, height: int) -> bytes:
    """An 8-bit RGB PNG of `height` rows of `3 * width` bytes."""
    raw = b"".join(b"\0" + bytes(row) for row in pixels)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b"")


def _plot(pixels: list[bytearray], x: int, y: int, color: tuple[int, int, int], size: int = 1) -> None:
    for yy in range(y - size + 1, y + size):
        for xx in range(x - size + 1, x + size):
            if 0 <= yy < len(pixels) and 0 <= xx < len(pixels[0]) // 3:
                pixels[yy][3 * xx:3 * xx + 3] = bytes(color)


def _line(pixels: list[bytearray], a: tuple[int, int], b: tuple[int, int], color: tuple[int, int, int],
          size: int = 1) -> None:
    steps = max(abs(b[0] - a[0]), abs(b[1] - a[1]), 1)
    for i in range(steps + 1):
        _plot(pixels, round(a[0] + (b[0] - a[0]) * i / steps), round(a[1] + (b[1] - a[1]) * i / steps), color, size)


def line_chart(series: list[list[tuple[float, float]]], width: int = 480, height: int = 280) -> bytes:
    """Series of (x, y) points (None/NaN y skipped) on shared axes, each scaled to the joint range;
    colours in `COLORS` order, a marker on every point."""
    pixels = [bytearray(b"\xff" * 3 * width) for _ in range(height)]
    points = [(x, y) for s in series for x, y in s if y is not None and math.isfinite(y)]
    left, right, top, bottom = _MARGIN, width - _MARGIN, _MARGIN, height - _MARGIN
    for y in (top, bottom):  # frame: range bounds
        _line(pixels, (left, y), (right, y), (200, 200, 200))
    _line(pixels, (left, top), (left, bottom), (90, 90, 90))
    _line(pixels, (left, bottom), (right, bottom), (90, 90, 90))
    if not points:
        return png_bytes(pixels, width, height)
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)

    def at(x: float, y: float) -> tuple[int, int]:
        return (round(left + (x - x0) / (x1 - x0) * (right - left)), round(bottom - (y - y0) / (y1 - y0) * (bottom - top)))

    for index, s in enumerate(series):
        color = COLORS[index % len(COLORS)]
        kept = [at(x, y) for x, y in s if y is not None and math.isfinite(y)]
        for a, b in zip(kept, kept[1:], strict=False):
            _line(pixels, a, b, color, size=2)
        for p in kept:
            _plot(pixels, p[0], p[1], color, size=4)
    return png_bytes(pixels, width, height)
