"""Drawing for the synthetic visual-search tasks: textured backgrounds, flat shapes, glyphs, and a canvas
that places them without overlap.

Items are drawn with hard edges (no anti-aliasing) in exact `PALETTE` colours, and every background pixel
stays inside the muted band `BACKGROUND_LEVELS`, which no palette colour falls in (each has a channel
outside it). So a target's colour can be checked pixel by pixel and never leaks from the background.

An `Item` records the tight pixel box [x0, y0, x1, y1) of the ink it drew (x1, y1 exclusive).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache, lru_cache

import numpy as np
from PIL import Image, ImageDraw, ImageFont

PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "orange": (250, 140, 20),
    "yellow": (240, 210, 30),
    "green": (40, 160, 60),
    "blue": (40, 90, 220),
    "purple": (140, 60, 190),
    "pink": (250, 130, 190),
    "brown": (130, 75, 30),
    "black": (20, 20, 20),
    "white": (250, 250, 250),
}
"""Colour names (the free-form answers of colour questions) and the exact RGB each item is filled with."""

BACKGROUND_LEVELS = (80, 235)
"""Every background channel value lies in this band; every palette colour has a channel outside it."""

OUTLINE = (55, 55, 55)
"""Thin dark rim around shapes, so white and yellow shapes stay visible on a light background."""

SHAPES = ("circle", "square", "triangle", "star", "diamond", "hexagon", "cross")
SHAPE_PLURALS = {s: ("crosses" if s == "cross" else s + "s") for s in SHAPES}
GLYPH_SHAPES = ("circle", "square", "hexagon")
"""Shapes roomy enough to carry a letter or digit inside."""

# Characters that stay distinct in the default font at small sizes: no I/1, O/Q/0.
LETTERS = "ABCDEFGHJKLMNPRSTUVWXYZ"
DIGITS = "23456789"

MIN_SHAPE_PX = 10
MIN_GLYPH_SHAPE_PX = 20
"""A shape carrying a glyph is at least this wide, so its glyph (about 0.55 of it) is legible at full size."""
MIN_GLYPH_PX = 12
"""Smallest cap height of a free-standing glyph."""

Box = tuple[int, int, int, int]


def glyph_class(ch: str) -> str:
    """'digit' or 'letter', the word questions use for a glyph."""
    return "digit" if ch.isdigit() else "letter"


@dataclass(frozen=True)
class Item:
    """One drawn thing: a shape (optionally carrying a glyph) or a free-standing glyph (shape None)."""

    shape: str | None
    colour: str
    glyph: str | None
    box: Box

    @property
    def centre(self) -> tuple[float, float]:
        return ((self.box[0] + self.box[2]) / 2, (self.box[1] + self.box[3]) / 2)


def union_box(*boxes: Box) -> Box:
    return (min(b[0] for b in boxes), min(b[1] for b in boxes), max(b[2] for b in boxes), max(b[3] for b in boxes))


# ---------------------------------------------------------------------------------------------- geometry


def _shape_polygon(shape: str, n: int) -> list[tuple[int, int]] | None:
    """Integer vertices of `shape` in an n x n box at the origin; None for circle and square (drawn natively)."""
    last = n - 1
    mid = round(last / 2)
    if shape in ("circle", "square"):
        return None
    if shape == "triangle":
        return [(0, last), (last, last), (mid, 0)]
    if shape == "diamond":
        return [(mid, 0), (last, mid), (mid, last), (0, mid)]
    if shape == "hexagon":  # flat top: full width, 0.87 of the height
        r = last / 2
        return [(round(r + r * math.cos(a)), round(r + r * math.sin(a))) for a in (math.pi * k / 3 for k in range(6))]
    if shape == "star":
        r = last / 2
        points = []
        for k in range(10):
            radius = r if k % 2 == 0 else 0.45 * r
            angle = -math.pi / 2 + math.pi * k / 5
            points.append((round(r + radius * math.cos(angle)), round(r + radius * math.sin(angle))))
        return points
    if shape == "cross":
        a0, a1 = round(n / 3), round(2 * n / 3) - 1
        return [(a0, 0), (a1, 0), (a1, a0), (last, a0), (last, a1), (a1, a1), (a1, last), (a0, last),
                (a0, a1), (0, a1), (0, a0), (a0, a0)]
    raise ValueError(f"unknown shape {shape!r}")


@cache
def shape_footprint(shape: str, n: int) -> Box:
    """Tight box of `shape` drawn n px wide with its box's top-left at (-n//2, -n//2): offsets from the centre."""
    polygon = _shape_polygon(shape, n)
    if polygon is None:
        x0, y0, x1, y1 = 0, 0, n, n
    else:
        xs, ys = [p[0] for p in polygon], [p[1] for p in polygon]
        x0, y0, x1, y1 = min(xs), min(ys), max(xs) + 1, max(ys) + 1
    off = n // 2
    return (x0 - off, y0 - off, x1 - off, y1 - off)


@lru_cache(maxsize=128)  # each font holds its own copy of the face: bound the count
def _font(size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=size)


@cache
def _cap_height_ratio() -> float:
    left, top, right, bottom = _font(100).getbbox("H")
    return (bottom - top) / 100


@cache
def glyph_layout(ch: str, cap_px: int) -> tuple[int, Box]:
    """Font size and the glyph's ink box as offsets from its centre, for a glyph about `cap_px` tall."""
    font_size = max(6, round(cap_px / _cap_height_ratio()))
    left, top, right, bottom = _font(font_size).getbbox(ch)
    dx, dy = (left + right) // 2, (top + bottom) // 2
    return font_size, (left - dx, top - dy, right - dx, bottom - dy)


def glyph_footprint(ch: str, cap_px: int) -> Box:
    return glyph_layout(ch, cap_px)[1]


def _readable_ink(fill: tuple[int, int, int]) -> tuple[int, int, int]:
    luminance = 0.299 * fill[0] + 0.587 * fill[1] + 0.114 * fill[2]
    return PALETTE["black"] if luminance > 140 else PALETTE["white"]


# ---------------------------------------------------------------------------------------------- background


def textured_background(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """A muted, smoothly varying canvas with faint strokes, every channel inside BACKGROUND_LEVELS.

    Noise is made at 1/16 scale and enlarged bilinearly (a convex blend, so it stays in the band): cheap to
    make and, being smooth, cheap to store as PNG, unlike per-pixel noise.
    """
    lo, hi = BACKGROUND_LEVELS
    base = rng.uniform(lo + 35, hi - 30) + rng.uniform(-14, 14, size=3)
    small_w, small_h = max(2, width // 16), max(2, height // 16)
    grid_h, grid_w = (int(v) for v in rng.integers(4, 14, size=2))
    # Mostly brightness variation with a little hue drift, like paper or ground, not a rainbow.
    shade = rng.normal(0, 16, size=(grid_h, grid_w, 1)) + rng.normal(0, 5, size=(grid_h, grid_w, 3))
    coarse = Image.fromarray(np.clip(base + shade, lo, hi).astype(np.uint8))
    mid = np.asarray(coarse.resize((small_w, small_h), Image.Resampling.BILINEAR), dtype=np.float32)
    mid = mid + rng.normal(0, 5, size=(small_h, small_w, 1))  # grey grain, keeps the tint
    image = Image.fromarray(np.clip(mid, lo, hi).astype(np.uint8)).resize((width, height), Image.Resampling.BILINEAR)

    draw = ImageDraw.Draw(image)
    side = min(width, height)
    for _ in range(int(rng.integers(15, 45))):
        shade = np.clip(base + rng.uniform(-40, 40) + rng.uniform(-8, 8, size=3), lo, hi).astype(int)
        colour = tuple(int(c) for c in shade)
        stroke = int(rng.integers(1, 5))
        if rng.random() < 0.6:
            points = [(int(rng.integers(0, width)), int(rng.integers(0, height)))]
            for _ in range(int(rng.integers(1, 4))):
                x, y = points[-1]
                step = rng.uniform(0.05, 0.4) * side
                angle = rng.uniform(0, 2 * math.pi)
                points.append((int(x + step * math.cos(angle)), int(y + step * math.sin(angle))))
            draw.line(points, fill=colour, width=stroke)
        else:
            r = rng.uniform(0.03, 0.25) * side
            cx, cy = rng.uniform(0, width), rng.uniform(0, height)
            start = float(rng.uniform(0, 360))
            draw.arc([cx - r, cy - r, cx + r, cy + r], start, start + float(rng.uniform(60, 300)), fill=colour,
                     width=stroke)
    return image


# ---------------------------------------------------------------------------------------------- canvas


class Canvas:
    """An image plus a coarse occupancy grid, so items can be placed without touching one another."""

    CELL = 4
    """Occupancy grid resolution in pixels; boxes are rounded outward to it."""

    def __init__(self, image: Image.Image):
        self.image = image
        self.draw = ImageDraw.Draw(image)
        self.width, self.height = image.size
        self._occupied = np.zeros((-(-self.height // self.CELL), -(-self.width // self.CELL)), dtype=bool)

    def _cells(self, box: Box, margin: int) -> tuple[slice, slice]:
        c = self.CELL
        return (slice(max(0, (box[1] - margin) // c), max(0, -(-(box[3] + margin) // c))),
                slice(max(0, (box[0] - margin) // c), max(0, -(-(box[2] + margin) // c))))

    def inside(self, box: Box, edge: int = 0) -> bool:
        return box[0] >= edge and box[1] >= edge and box[2] <= self.width - edge and box[3] <= self.height - edge

    def is_free(self, box: Box, margin: int = 0, edge: int = 0) -> bool:
        return self.inside(box, edge) and not self._occupied[self._cells(box, margin)].any()

    def reserve(self, box: Box, margin: int = 0) -> None:
        self._occupied[self._cells(box, margin)] = True

    def find_centre(self, rng: np.random.Generator, footprint: Box, margin: int, edge: int,
                    tries: int = 40) -> tuple[int, int] | None:
        """A random integer centre where `footprint` (offsets from the centre) lies free inside the canvas."""
        lo_x, hi_x = edge - footprint[0], self.width - edge - footprint[2]
        lo_y, hi_y = edge - footprint[1], self.height - edge - footprint[3]
        if lo_x > hi_x or lo_y > hi_y:
            return None
        xs = rng.integers(lo_x, hi_x + 1, size=tries)
        ys = rng.integers(lo_y, hi_y + 1, size=tries)
        for x, y in zip(xs.tolist(), ys.tolist()):
            if self.is_free(shift(footprint, x, y), margin):
                return x, y
        return None

    def draw_shape(self, shape: str, colour: str, centre: tuple[int, int], n: int, glyph: str | None = None) -> Item:
        """Draw `shape` n px wide centred on `centre` (integers), optionally with a glyph inside."""
        x0, y0 = centre[0] - n // 2, centre[1] - n // 2
        fill = PALETTE[colour]
        rim = max(1, n // 18)
        polygon = _shape_polygon(shape, n)
        if polygon is None:
            box = [x0, y0, x0 + n - 1, y0 + n - 1]
            if shape == "circle":
                self.draw.ellipse(box, fill=fill, outline=OUTLINE, width=rim)
            else:
                self.draw.rectangle(box, fill=fill, outline=OUTLINE, width=rim)
        else:
            points = [(x0 + x, y0 + y) for x, y in polygon]
            self.draw.polygon(points, fill=fill, outline=OUTLINE, width=rim)
        item_box = shift(shape_footprint(shape, n), *centre)
        if glyph is not None:
            # Centre on the shape's ink box (a hexagon is not square), sized to sit well inside it.
            ink_h = item_box[3] - item_box[1]
            cx, cy = (item_box[0] + item_box[2]) // 2, (item_box[1] + item_box[3]) // 2
            self._draw_glyph_at(glyph, _readable_ink(fill), (cx, cy), max(6, round(0.5 * ink_h)))
        return Item(shape, colour, glyph, item_box)

    def draw_glyph(self, ch: str, colour: str, centre: tuple[int, int], cap_px: int) -> Item:
        """Draw a free-standing glyph about `cap_px` tall, its ink centred on `centre`."""
        box = self._draw_glyph_at(ch, PALETTE[colour], centre, cap_px)
        return Item(None, colour, ch, box)

    def _draw_glyph_at(self, ch: str, fill: tuple[int, int, int], centre: tuple[int, int], cap_px: int) -> Box:
        font_size, footprint = glyph_layout(ch, cap_px)
        left, top, right, bottom = _font(font_size).getbbox(ch)
        # Place the origin so the ink box lands on `footprint` shifted to the centre.
        origin = (centre[0] + footprint[0] - left, centre[1] + footprint[1] - top)
        self.draw.text(origin, ch, font=_font(font_size), fill=fill)
        return shift(footprint, *centre)

    def draw_frame(self, box: Box, colour: str, width: int) -> None:
        """A hollow rectangle whose outer edge is `box` (x1, y1 exclusive)."""
        self.draw.rectangle([box[0], box[1], box[2] - 1, box[3] - 1], outline=PALETTE[colour], width=width)


def shift(box: Box, dx: int, dy: int) -> Box:
    return (box[0] + dx, box[1] + dy, box[2] + dx, box[3] + dy)
