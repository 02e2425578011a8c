"""A PNG line chart with no plotting library: memory over a run (``onnxplug run
--memory-plot``).

Step lines (a value holds until the next sample) on a white canvas, axes with tick marks and
the axis ranges written in a built-in 3x5 digit font; the legend (colour per series) is the
caller's to print. The PNG is written with zlib and struct only.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

import numpy as np

COLORS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14)]
COLOR_NAMES = ["blue", "red", "green", "purple", "orange"]
_MARGIN_L, _MARGIN_R, _MARGIN_T, _MARGIN_B = 70, 20, 20, 40
_SCALE = 2  # glyph pixel size
# 3x5 glyphs, rows top to bottom, 3 bits each (4 = left column)
_GLYPHS = {
    "0": (7, 5, 5, 5, 7),
    "1": (2, 6, 2, 2, 7),
    "2": (7, 1, 7, 4, 7),
    "3": (7, 1, 7, 1, 7),
    "4": (5, 5, 7, 1, 1),
    "5": (7, 4, 7, 1, 7),
    "6": (7, 4, 7, 5, 7),
    "7": (7, 1, 1, 1, 1),
    "8": (7, 5, 7, 5, 7),
    "9": (7, 5, 7, 1, 7),
    ".": (0, 0, 0, 0, 2),
}


def _text(img: np.ndarray, x: int, y: int, text: str, right: bool = False) -> None:
    """Write digits at (x, y) (top-left, or top-right with ``right``)."""
    w = 4 * _SCALE * len(text)
    if right:
        x -= w
    for k, ch in enumerate(text):
        rows = _GLYPHS.get(ch)
        if rows is None:
            continue
        for r, bits in enumerate(rows):
            for c in range(3):
                if bits & (4 >> c):
                    y0, x0 = y + r * _SCALE, x + (4 * k + c) * _SCALE
                    img[y0 : y0 + _SCALE, x0 : x0 + _SCALE] = 0


def _number(v: float) -> str:
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def _png(img: np.ndarray) -> bytes:
    h, w, _ = img.shape
    raw = b"".join(b"\x00" + img[y].tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


def step_chart_png(
    series: Sequence[Sequence[tuple[float, float]]], width: int = 800, height: int = 400
) -> bytes:
    """A PNG of ``series`` (each a list of (x, y) samples, x ascending) as step lines, in
    ``COLORS`` order, with both axes starting at 0 and the maxima written at their ends."""
    img = np.full((height, width, 3), 255, np.uint8)
    x_max = max((x for s in series for x, _ in s), default=0.0) or 1.0
    y_max = max((y for s in series for _, y in s), default=0.0) or 1.0
    left, right = _MARGIN_L, width - _MARGIN_R
    top, bottom = _MARGIN_T, height - _MARGIN_B

    def px(x: float) -> int:
        return left + round((right - left) * x / x_max)

    def py(y: float) -> int:
        return bottom - round((bottom - top) * y / y_max)

    for k, s in enumerate(series):
        color = COLORS[k % len(COLORS)]
        pts = [(px(x), py(y)) for x, y in s]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            img[y0 - 1 : y0 + 1, min(x0, x1) : max(x0, x1) + 1] = color  # hold the value
            img[min(y0, y1) : max(y0, y1) + 1, x1 - 1 : x1 + 1] = color  # then step
    img[top : bottom + 1, left - 1 : left + 1] = 0  # y axis
    img[bottom : bottom + 2, left : right + 1] = 0  # x axis
    for i in range(1, 5):
        img[bottom + 2 : bottom + 6, left + (right - left) * i // 4] = 0
        img[top + (bottom - top) * i // 4, left - 6 : left - 1] = 0
    _text(img, left - 10, top - 4, _number(y_max), right=True)
    _text(img, left - 10, bottom - 4, "0", right=True)
    _text(img, right, bottom + 12, _number(x_max), right=True)
    _text(img, left, bottom + 12, "0")
    return _png(img)


__all__ = ["COLORS", "COLOR_NAMES", "step_chart_png"]
