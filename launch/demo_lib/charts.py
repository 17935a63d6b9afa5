"""Line charts as inline SVG and as PNG, in pure Python (no plotting library needed).

One chart model (series, vertical markers, shaded bands) rendered two ways: SVG text for the HTML
report, and a small RGB raster written with zlib for the PNG files (3x5 pixel font for labels).
"""

from __future__ import annotations

import html
import itertools
import math
import struct
import zlib
from dataclasses import dataclass, field

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")


@dataclass(frozen=True)
class Series:
    name: str
    points: list[tuple[float, float]]
    color: str = ""
    step: bool = False  # draw as a step function (replica counts)


@dataclass(frozen=True)
class Marker:
    x: float
    label: str
    color: str = "#444444"


@dataclass(frozen=True)
class Band:
    x0: float
    x1: float
    label: str
    color: str = "#eeeeee"


@dataclass
class Chart:
    title: str
    series: list[Series]
    xlabel: str = "seconds since start"
    ylabel: str = ""
    markers: list[Marker] = field(default_factory=list)
    bands: list[Band] = field(default_factory=list)
    width: int = 760
    height: int = 260

    def colored(self) -> list[Series]:
        return [
            s if s.color else Series(s.name, s.points, PALETTE[i % len(PALETTE)], s.step)
            for i, s in enumerate(self.series)
        ]

    def bounds(self) -> tuple[float, float, float, float]:
        xs = [x for s in self.series for x, _ in s.points] + [m.x for m in self.markers]
        xs += [b.x0 for b in self.bands] + [b.x1 for b in self.bands]
        ys = [y for s in self.series for _, y in s.points]
        x0, x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
        y1 = max(ys) if ys else 1.0
        if x1 <= x0:
            x1 = x0 + 1.0
        return x0, x1, 0.0, nice_ceiling(y1)


def nice_ceiling(v: float) -> float:
    """The next 1/2/5 x 10^k at or above ``v`` (1 for v <= 0)."""
    if v <= 0:
        return 1.0
    exp = math.floor(math.log10(v))
    for m in (1, 2, 5, 10):
        if m * 10**exp >= v:
            return float(m * 10**exp)
    return float(10 ** (exp + 1))


def _step_points(points: list[tuple[float, float]], x_end: float) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for i, (x, y) in enumerate(points):
        if i:
            out.append((x, points[i - 1][1]))
        out.append((x, y))
    if points and x_end > points[-1][0]:
        out.append((x_end, points[-1][1]))
    return out


def _fmt(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 10 or v == int(v) else f"{v:.2g}"


PAD_L, PAD_R, PAD_T, PAD_B = 56, 150, 28, 34


def render_svg(chart: Chart) -> str:
    """The chart as a standalone ``<svg>`` element."""
    w, h = chart.width, chart.height
    x0, x1, y0, y1 = chart.bounds()
    pw, ph = w - PAD_L - PAD_R, h - PAD_T - PAD_B

    def sx(x: float) -> float:
        return PAD_L + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return PAD_T + ph - (y - y0) / (y1 - y0) * ph

    e = html.escape
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
        'font-family="sans-serif" font-size="11">',
        f'<text x="{PAD_L}" y="16" font-size="13" font-weight="bold">{e(chart.title)}</text>',
    ]
    for b in chart.bands:
        parts.append(
            f'<rect x="{sx(b.x0):.1f}" y="{PAD_T}" width="{max(0.0, sx(b.x1) - sx(b.x0)):.1f}" '
            f'height="{ph}" fill="{b.color}"/><text x="{sx(b.x0) + 3:.1f}" y="{PAD_T + 11}" '
            f'fill="#777">{e(b.label)}</text>'
        )
    for i in range(5):
        yv = y0 + (y1 - y0) * i / 4
        parts.append(
            f'<line x1="{PAD_L}" x2="{PAD_L + pw}" y1="{sy(yv):.1f}" y2="{sy(yv):.1f}" stroke="#ddd"/>'
            f'<text x="{PAD_L - 4}" y="{sy(yv) + 4:.1f}" text-anchor="end">{_fmt(yv)}</text>'
        )
    for i in range(6):
        xv = x0 + (x1 - x0) * i / 5
        parts.append(f'<text x="{sx(xv):.1f}" y="{PAD_T + ph + 14}" text-anchor="middle">{_fmt(xv)}</text>')
    parts.append(
        f'<rect x="{PAD_L}" y="{PAD_T}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>'
        f'<text x="{PAD_L + pw / 2}" y="{h - 4}" text-anchor="middle">{e(chart.xlabel)}</text>'
        f'<text x="12" y="{PAD_T + ph / 2}" transform="rotate(-90 12 {PAD_T + ph / 2})" '
        f'text-anchor="middle">{e(chart.ylabel)}</text>'
    )
    for m in chart.markers:
        parts.append(
            f'<line x1="{sx(m.x):.1f}" x2="{sx(m.x):.1f}" y1="{PAD_T}" y2="{PAD_T + ph}" '
            f'stroke="{m.color}" stroke-dasharray="4 3"><title>{e(m.label)}</title></line>'
            f'<text x="{sx(m.x) + 2:.1f}" y="{PAD_T + ph - 4}" fill="{m.color}" font-size="10">'
            f"{e(m.label[:18])}</text>"
        )
    for i, s in enumerate(chart.colored()):
        pts = _step_points(s.points, x1) if s.step else s.points
        if pts:
            path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
            parts.append(f'<polyline fill="none" stroke="{s.color}" stroke-width="1.6" points="{path}"/>')
        ly = PAD_T + 12 + 16 * i
        parts.append(
            f'<rect x="{PAD_L + pw + 10}" y="{ly - 8}" width="12" height="8" fill="{s.color}"/>'
            f'<text x="{PAD_L + pw + 26}" y="{ly}">{e(s.name)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


# ---- PNG -------------------------------------------------------------------------------------------

# 3x5 pixel glyphs: five rows of three cells, top to bottom ('#' = ink).
_GLYPHS = {
    "0": "###|# #|# #|# #|###", "1": " # |## | # | # |###", "2": "###|  #|###|#  |###",
    "3": "###|  #| ##|  #|###", "4": "# #|# #|###|  #|  #", "5": "###|#  |###|  #|###",
    "6": "###|#  |###|# #|###", "7": "###|  #|  #| # | # ", "8": "###|# #|###|# #|###",
    "9": "###|# #|###|  #|###", "A": " # |# #|###|# #|# #", "B": "## |# #|## |# #|## ",
    "C": " ##|#  |#  |#  | ##", "D": "## |# #|# #|# #|## ", "E": "###|#  |## |#  |###",
    "F": "###|#  |## |#  |#  ", "G": " ##|#  |# #|# #| ##", "H": "# #|# #|###|# #|# #",
    "I": "###| # | # | # |###", "J": "  #|  #|  #|# #| # ", "K": "# #|## |#  |## |# #",
    "L": "#  |#  |#  |#  |###", "M": "# #|###|###|# #|# #", "N": "## |# #|# #|# #|# #",
    "O": " # |# #|# #|# #| # ", "P": "## |# #|## |#  |#  ", "Q": " # |# #|# #|## | ##",
    "R": "## |# #|## |# #|# #", "S": " ##|#  | # |  #|## ", "T": "###| # | # | # | # ",
    "U": "# #|# #|# #|# #|###", "V": "# #|# #|# #|# #| # ", "W": "# #|# #|###|###|# #",
    "X": "# #|# #| # |# #|# #", "Y": "# #|# #| # | # | # ", "Z": "###|  #| # |#  |###",
    ".": "   |   |   |   | # ", ",": "   |   |   | # |#  ", "-": "   |   |###|   |   ",
    "+": "   | # |###| # |   ", ":": "   | # |   | # |   ", "/": "  #|  #| # |#  |#  ",
    "(": " # |#  |#  |#  | # ", ")": " # |  #|  #|  #| # ", ">": "#  | # |  #| # |#  ",
    "<": "  #| # |#  | # |  #", "%": "# #|  #| # |#  |# #", "_": "   |   |   |   |###",
    "=": "   |###|   |###|   ", " ": "   |   |   |   |   ",
}  # fmt: skip
_FONT = {k: v.replace("|", "") for k, v in _GLYPHS.items()}


def _rgb(color: str) -> tuple[int, int, int]:
    c = color.lstrip("#")
    return (int(c[0:2], 16), int(c[2:4], 16), int(c[4:6], 16))


class Canvas:
    """A tiny RGB raster with lines, rectangles and 3x5 text; ``png()`` encodes it."""

    def __init__(self, width: int, height: int) -> None:
        self.w, self.h = width, height
        self.px = bytearray(b"\xff" * (width * height * 3))

    def set(self, x: int, y: int, rgb: tuple[int, int, int]) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            i = (y * self.w + x) * 3
            self.px[i : i + 3] = bytes(rgb)

    def rect(self, x0: int, y0: int, x1: int, y1: int, rgb: tuple[int, int, int]) -> None:
        for y in range(max(0, y0), min(self.h, y1)):
            for x in range(max(0, x0), min(self.w, x1)):
                self.set(x, y, rgb)

    def line(self, x0: int, y0: int, x1: int, y1: int, rgb: tuple[int, int, int], dash: int = 0) -> None:
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err, n = dx + dy, 0
        while True:
            if not dash or (n // dash) % 2 == 0:
                self.set(x0, y0, rgb)
            n += 1
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, s: str, rgb: tuple[int, int, int] = (0, 0, 0), scale: int = 1) -> None:
        for ch in s.upper():
            glyph = _FONT.get(ch, _FONT[" "])
            for i, cell in enumerate(glyph):
                if cell == "#":
                    self.rect(x + (i % 3) * scale, y + (i // 3) * scale, x + (i % 3 + 1) * scale,
                              y + (i // 3 + 1) * scale, rgb)  # fmt: skip
            x += 4 * scale

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[y * self.w * 3 : (y + 1) * self.w * 3]) for y in range(self.h))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(raw, 6))
            + chunk(b"IEND", b"")
        )


def render_png(chart: Chart) -> bytes:
    """The chart as PNG bytes (same layout as the SVG, coarser text)."""
    w, h = chart.width, chart.height
    c = Canvas(w, h)
    x0, x1, y0, y1 = chart.bounds()
    pw, ph = w - PAD_L - PAD_R, h - PAD_T - PAD_B

    def sx(x: float) -> int:
        return round(PAD_L + (x - x0) / (x1 - x0) * pw)

    def sy(y: float) -> int:
        return round(PAD_T + ph - (y - y0) / (y1 - y0) * ph)

    c.text(PAD_L, 8, chart.title, scale=2)
    for b in chart.bands:
        c.rect(sx(b.x0), PAD_T, sx(b.x1), PAD_T + ph, _rgb(b.color))
        c.text(sx(b.x0) + 3, PAD_T + 3, b.label, (120, 120, 120))
    for i in range(5):
        yv = y0 + (y1 - y0) * i / 4
        c.line(PAD_L, sy(yv), PAD_L + pw, sy(yv), (221, 221, 221))
        label = _fmt(yv)
        c.text(PAD_L - 4 - 4 * len(label), sy(yv) - 2, label)
    for i in range(6):
        xv = x0 + (x1 - x0) * i / 5
        label = _fmt(xv)
        c.text(sx(xv) - 2 * len(label), PAD_T + ph + 6, label)
    c.text(PAD_L + pw // 2 - 2 * len(chart.xlabel), h - 9, chart.xlabel)
    grey = (136, 136, 136)
    c.line(PAD_L, PAD_T, PAD_L + pw, PAD_T, grey)
    c.line(PAD_L, PAD_T + ph, PAD_L + pw, PAD_T + ph, grey)
    c.line(PAD_L, PAD_T, PAD_L, PAD_T + ph, grey)
    c.line(PAD_L + pw, PAD_T, PAD_L + pw, PAD_T + ph, grey)
    for m in chart.markers:
        c.line(sx(m.x), PAD_T, sx(m.x), PAD_T + ph, _rgb(m.color), dash=4)
    for i, s in enumerate(chart.colored()):
        rgb = _rgb(s.color)
        pts = _step_points(s.points, x1) if s.step else s.points
        for (ax, ay), (bx, by) in itertools.pairwise(pts):
            c.line(sx(ax), sy(ay), sx(bx), sy(by), rgb)
            c.line(sx(ax), sy(ay) + 1, sx(bx), sy(by) + 1, rgb)
        ly = PAD_T + 6 + 14 * i
        c.rect(PAD_L + pw + 10, ly, PAD_L + pw + 22, ly + 6, rgb)
        c.text(PAD_L + pw + 26, ly, s.name[:28])
    return c.png()
