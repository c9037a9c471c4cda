"""A PNG bar chart with no plotting library: the demo's figure (hc against Inductor and eager).

Written here rather than taken from matplotlib: one chart kind, a dozen bars and short labels do not
justify a dependency of that size (README: dependencies). Pixels go into a bytearray, text is a 5x7
bitmap font (upper case, digits and a few signs), and the file is PNG's minimal form: IHDR, one
zlib-compressed IDAT of filtered-0 RGB rows, IEND.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

# 5x7 glyphs, one string of 7 rows per character; a row's '#' are lit pixels.
_FONT_ROWS = {
    "A": ".###.#...##...#######...##...##...#", "B": "####.#...##...#####.#...##...#####.",
    "C": ".###.#...##....#....#....#...#.###.", "D": "####.#...##...##...##...##...#####.",
    "E": "######....#....####.#....#....#####", "F": "######....#....####.#....#....#....",
    "G": ".###.#...##....#.####...##...#.####", "H": "#...##...##...#######...##...##...#",
    "I": ".###...#....#....#....#....#...###.", "J": "..###...#....#....#....##..#..##...",
    "K": "#...##..#.#.#..##...#.#..#..#.#...#", "L": "#....#....#....#....#....#....#####",
    "M": "#...###.###.#.##...##...##...##...#", "N": "#...###..##.#.##..###...##...##...#",
    "O": ".###.#...##...##...##...##...#.###.", "P": "####.#...##...#####.#....#....#....",
    "Q": ".###.#...##...##...##.#.##..#..##.#", "R": "####.#...##...#####.#.#..#..#.#...#",
    "S": ".####.....#.....###.....#....#####.", "T": "#####..#....#....#....#....#....#..",
    "U": "#...##...##...##...##...##...#.###.", "V": "#...##...##...##...##...#.#.#...#..",
    "W": "#...##...##...##.#.##.#.##.#..#.#..", "X": "#...##...#.#.#...#...#.#.#...##...#",
    "Y": "#...##...#.#.#...#....#....#....#..", "Z": "#####....#...#...#...#...#....#####",
    "0": ".###.#...##..###.#.###..##...#.###.", "1": "..#...##....#....#....#....#...###.",
    "2": ".###.#...#....#...#...#...#...#####", "3": "#####...#...#.....#.....##...#.###.",
    "4": "...#...##..#.#.#..#.#####...#....#.", "5": "######....####.....#....##...#.###.",
    "6": "..##..#...#....####.#...##...#.###.", "7": "#####....#...#...#...#....#....#...",
    "8": ".###.#...##...#.###.#...##...#.###.", "9": ".###.#...##...#.####....#...#..##..",
    ".": "..........................##...##..", ",": ".....................##...#...#....",
    ":": ".....##...##.........##...##.......", "-": "................###................",
    "+": ".......#....#..#####..#....#.......", "/": ".....#...#...#...#...#.............",
    "(": "...#...#...#....#....#.....#.....#.", ")": ".#.....#.....#....#....#...#...#...",
    "=": "..........#####.....#####..........", "%": "##...##..#...#...#...#...#..##...##",
    " ": "...................................", "_": "..............................#####",
    "<": "...#...#...#...#.....#.....#.....#.", ">": ".#.....#.....#.....#...#...#...#...",
}
_FONT = {c: [[r[i * 5 + j] == "#" for j in range(5)] for i in range(7)] for c, r in _FONT_ROWS.items() if r}
_SCALE = 2  # font pixels per glyph pixel
_CHAR_W, _CHAR_H = 6 * _SCALE, 8 * _SCALE

WHITE, BLACK, GREY = (255, 255, 255), (40, 40, 40), (200, 200, 200)
PALETTE = [(120, 120, 120), (66, 133, 244), (219, 68, 55), (15, 157, 88), (244, 180, 0)]


@dataclass
class Panel:
    """One chart: for each group (a row label), one bar per series (values >= 0; None: not measured)."""

    title: str
    groups: list[tuple[str, dict[str, float | None]]]
    unit: str = ""


class _Canvas:
    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.pixels = bytearray(WHITE * (width * height))

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: tuple[int, int, int]) -> None:
        x0, x1 = max(0, min(x0, x1)), min(self.width, max(x0, x1))
        y0, y1 = max(0, min(y0, y1)), min(self.height, max(y0, y1))
        if x1 <= x0:
            return
        run = bytes(color) * (x1 - x0)
        for y in range(y0, y1):
            start = (y * self.width + x0) * 3
            self.pixels[start:start + len(run)] = run

    def text(self, x: int, y: int, text: str, color: tuple[int, int, int] = BLACK) -> int:
        """Draws `text` (upper-cased; unknown characters as blanks) with its top left at (x, y);
        returns the x after it."""
        for ch in text.upper():
            glyph = _FONT.get(ch)
            if glyph is not None:
                for gy, row in enumerate(glyph):
                    for gx, lit in enumerate(row):
                        if lit:
                            self.rect(x + gx * _SCALE, y + gy * _SCALE, x + (gx + 1) * _SCALE,
                                      y + (gy + 1) * _SCALE, color)
            x += _CHAR_W
        return x

    def png(self) -> bytes:
        def chunk(kind: bytes, data: bytes) -> bytes:
            body = kind + data
            return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body) & 0xFFFFFFFF)

        stride = self.width * 3
        raw = b"".join(b"\x00" + bytes(self.pixels[y * stride:(y + 1) * stride]) for y in range(self.height))
        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6))
                + chunk(b"IEND", b""))


def _format(value: float) -> str:
    return f"{value:.3g}" if value < 1000 else f"{value:.0f}"


def bar_chart_png(path: str, title: str, panels: list[Panel], series: list[str]) -> None:
    """Horizontal grouped bars, one panel under the other, a legend of `series` at the top; each
    bar carries its value, a missing one says "n/a"."""
    label_w = max([len(g) for p in panels for g, _ in p.groups] + [8]) * _CHAR_W + 16
    plot_w, value_w = 420, 8 * _CHAR_W
    bar_h, gap = _CHAR_H + 4, 10
    legend_w = sum(len(name) + 3 for name in series) * _CHAR_W
    width = max(label_w + plot_w + value_w, len(title) * _CHAR_W, legend_w) + 16
    height = 2 * _CHAR_H + 24
    for p in panels:
        height += 2 * _CHAR_H + sum(len(series) * bar_h + gap for _ in p.groups) + 16
    canvas = _Canvas(width, height)
    y = 8
    canvas.text(8, y, title)
    y += _CHAR_H + 6
    x = 8
    for i, name in enumerate(series):
        canvas.rect(x, y + 2, x + _CHAR_H - 4, y + _CHAR_H - 2, PALETTE[i % len(PALETTE)])
        x = canvas.text(x + _CHAR_H, y, name) + _CHAR_W
    y += _CHAR_H + 10
    for p in panels:
        canvas.text(8, y, f"{p.title} ({p.unit})" if p.unit else p.title)
        y += _CHAR_H + 8
        top = max([v for _, vals in p.groups for v in vals.values() if v is not None] + [1e-30])
        axis_top = y
        for group, values in p.groups:
            canvas.text(8, y + (len(series) * bar_h - _CHAR_H) // 2, group)
            for i, name in enumerate(series):
                value = values.get(name)
                if value is None:
                    canvas.text(label_w + 4, y + 2, "n/a", GREY)
                else:
                    end = label_w + max(1, round(plot_w * value / top))
                    canvas.rect(label_w, y + 2, end, y + bar_h - 2, PALETTE[i % len(PALETTE)])
                    canvas.text(end + 6, y + 2, _format(value))
                y += bar_h
            y += gap
        canvas.rect(label_w - 1, axis_top, label_w + 1, y - gap, BLACK)
        y += _CHAR_H
    with open(path, "wb") as f:
        f.write(canvas.png())
