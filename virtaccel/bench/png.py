"""A tiny PNG writer (numpy + zlib) and a bar chart of benchmark ratios vs targets.

No plotting dependency: the chart is rasterised into an RGB array by hand. Y is log10
from 0.01 to 100; each row is a bar (green when met, orange when not) with its target
drawn as a dark line across the bar's slot; grey lines mark 0.1, 1 and 10. Row labels
(a, b, c1, ...) are drawn under the bars with a 3x5 pixel font.
"""
from __future__ import annotations

import math
import struct
import zlib
from typing import Sequence

import numpy as np

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# 3x5 glyphs, rows top to bottom, 3 bits each (MSB = left column).
_FONT = {
    "0": (7, 5, 5, 5, 7), "1": (2, 6, 2, 2, 7), "2": (7, 1, 7, 4, 7), "3": (7, 1, 7, 1, 7),
    "4": (5, 5, 7, 1, 1), "5": (7, 4, 7, 1, 7), "6": (7, 4, 7, 5, 7), "7": (7, 1, 1, 1, 1),
    "8": (7, 5, 7, 5, 7), "9": (7, 5, 7, 1, 7), "a": (2, 5, 7, 5, 5), "b": (6, 5, 6, 5, 6),
    "c": (7, 4, 4, 4, 7), "d": (6, 5, 5, 5, 6), "e": (7, 4, 6, 4, 7), "f": (7, 4, 6, 4, 4),
    "g": (7, 4, 5, 5, 7), "h": (5, 5, 7, 5, 5), ".": (0, 0, 0, 0, 2), "x": (5, 5, 2, 5, 5),
}


def _chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))


def encode_png(rgb: np.ndarray) -> bytes:
    """PNG bytes of an (h, w, 3) uint8 image (8-bit RGB, no interlace, filter 0)."""
    if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8:
        raise ValueError("encode_png needs an (h, w, 3) uint8 array")
    h, w, _ = rgb.shape
    raw = np.zeros((h, 1 + 3 * w), dtype=np.uint8)  # filter byte 0 per scanline
    raw[:, 1:] = rgb.reshape(h, 3 * w)
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (PNG_SIGNATURE + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(raw.tobytes(), 9))
            + _chunk(b"IEND", b""))


def read_png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """(type, data) of every chunk; ValueError on a bad signature, length or CRC."""
    if not data.startswith(PNG_SIGNATURE):
        raise ValueError("not a PNG: bad signature")
    pos, out = len(PNG_SIGNATURE), []
    while pos < len(data):
        if pos + 12 > len(data):
            raise ValueError("truncated chunk")
        (n,) = struct.unpack_from(">I", data, pos)
        kind = data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + n]
        if len(body) != n:
            raise ValueError("truncated chunk data")
        (crc,) = struct.unpack_from(">I", data, pos + 8 + n)
        if zlib.crc32(kind + body) & 0xFFFFFFFF != crc:
            raise ValueError(f"bad CRC in chunk {kind!r}")
        out.append((kind, body))
        pos += 12 + n
    return out


def _text(img: np.ndarray, x: int, y: int, text: str, scale: int = 2) -> None:
    for ch in text.lower():
        glyph = _FONT.get(ch)
        if glyph is not None:
            for r, bits in enumerate(glyph):
                for c in range(3):
                    if bits >> (2 - c) & 1:
                        y0, x0 = y + r * scale, x + c * scale
                        img[y0:y0 + scale, x0:x0 + scale] = 0
        x += 4 * scale


LOG_MIN, LOG_MAX = -2.0, 2.0


def bar_chart(labels: Sequence[str], ratios: Sequence[float | None], targets: Sequence[float],
              met: Sequence[bool], width: int = 640, height: int = 360) -> np.ndarray:
    """The RGB image of the ratio-vs-target chart (log10 y axis, 0.01 .. 100)."""
    img = np.full((height, width, 3), 255, dtype=np.uint8)
    top, bottom, left = 10, height - 30, 30
    plot_h = bottom - top

    def y_of(v: float) -> int:
        lv = min(max(math.log10(v), LOG_MIN), LOG_MAX) if v > 0 else LOG_MIN
        return int(round(bottom - (lv - LOG_MIN) / (LOG_MAX - LOG_MIN) * plot_h))

    for dec in (0.01, 0.1, 1.0, 10.0, 100.0):
        y = y_of(dec)
        img[max(y, 0), left:width - 5] = (200, 200, 200) if dec != 1.0 else (120, 120, 120)
    _text(img, 2, y_of(1.0) - 5, "1")
    _text(img, 2, y_of(10.0) - 5, "10")
    _text(img, 2, y_of(0.1) - 5, ".1")
    img[top:bottom + 1, left] = 0
    n = max(len(labels), 1)
    slot = (width - left - 10) // n
    for i, (lab, r, t, ok) in enumerate(zip(labels, ratios, targets, met)):
        x0 = left + 5 + i * slot
        x1 = x0 + max(slot - 10, 4)
        if r is not None and r > 0:
            y = y_of(r)
            color = (60, 170, 60) if ok else (235, 140, 30)
            y_lo, y_hi = sorted((y, bottom))
            img[y_lo:y_hi + 1, x0 + slot // 6:x1 - slot // 6] = color
        ty = y_of(t)
        img[max(ty - 1, 0):ty + 2, x0:x1] = (200, 30, 30)
        _text(img, x0 + slot // 2 - 8, bottom + 8, lab[:4])
    return img


def write_chart(path: str, labels: Sequence[str], ratios: Sequence[float | None],
                targets: Sequence[float], met: Sequence[bool]) -> None:
    """Write the ratio-vs-target chart as a PNG file."""
    with open(path, "wb") as f:
        f.write(encode_png(bar_chart(labels, ratios, targets, met)))
