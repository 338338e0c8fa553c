"""Zoom tasks: a question whose answer is legible only after zooming, at a place the downscaled view shows.

Each task is a canvas (1024-1536 px a side by default) on the synthetic tasks' muted textured background
with one or more square **frames** (thick, visible at the downscaled view the model is first shown) near
the centres of a 3x3 grid, and in the centre of each frame a small solid **patch** of one answer colour.
The question names one frame by its colour and its cell, and asks for the colour of the patch inside it::

    What colour is the small square inside the black frame in the upper left part of the image?
    Answer with one colour word.

The patch is about 5 pixels at the downscaled view (where bicubic resampling mixes it with its surroundings)
and a vision token or more in a zoom on its cell, so the crop tool is necessary, and where to crop is both
named and visible.
Small **decoy** patches of the answer colours are scattered over the canvas away from the frames, so the
colours of the whole view say nothing about the answer. Everything that makes it harder is a knob
(`ZoomTaskConfig`): more frames (the question must be read to pick one), no grid (free placement, so boxes
must be placed precisely), smaller patches and markers, more colours (lower chance rate), option letters
instead of colour words.

Records are ordinary task records (loupe.data.tasks) whose `bbox` is the named frame (or the patch alone,
`bbox_target: patch`): the oracle teacher (stages/synth/oracle.py) zooms around it unchanged. The chance
rate of a split is `chance_rate(records)`: for free-form answers the share of the commonest answer (the
best constant guess), for choice answers the mean of 1 / option count.

`generate_zoom_tasks(out_dir, cfg)` writes `out_dir/{train,val,test}.jsonl` and
`out_dir/images/<split>/<index>.png`, the layout of `loupe.data.synthetic.generate_tasks`; every task draws
from its own random stream seeded by (seed, split, index), so a config always gives byte-identical files.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from PIL import Image
from pydantic import Field, ValidationInfo, field_validator, model_validator

from loupe.data.synthetic_draw import PALETTE, Box, Canvas, textured_background
from loupe.data.tasks import OPTION_LETTERS, TaskRecord
from loupe.data.splits import SplitConfig, write_splits
from loupe.png import encode_png

# Stream ids apart from the synthetic generator's (1, 2, 3), so the two families never share a canvas.
_SPLIT_STREAMS = {"train": 101, "val": 102, "test": 103}
_MAX_ATTEMPTS = 20
DATA_SOURCE = "zoom"

CELL_NAMES = {
    (1, 2): ("left", "right"),
    (1, 3): ("left", "middle", "right"),
    (2, 2): ("upper left part", "upper right part", "lower left part", "lower right part"),
    (3, 3): ("upper left part", "upper middle part", "upper right part", "left side", "centre", "right side",
             "lower left part", "lower middle part", "lower right part"),
}
"""Cells of a (rows, columns) grid in words, row-major. One row: one word a cell, the word right before "of the
image": the tiny model learns to read the word just before the phrase that follows a cell's name and misses
one a word further back ("upper" in "upper left part", "left" in "left side"; docs/learning.md)."""

TOO_SMALL_TO_READ = "a tiny square"
"""What the first zoom of a depth-2 task shows, in the oracle's words."""

CELL_PREPOSITIONS = {"left": "on", "right": "at"}
"""The word before "the <cell>" in a one-row question ("on the left", "in the middle", "at the right"; "in" for
every other cell). A side with a preposition of its own is read where "on the left" / "on the right" are not:
the SFT model, on the CPU CI runs on, reads the middle from its "in" and left and right no better than a coin
toss when both say "on" (docs/learning.md, "On an AMD EPYC").
"""

ColourName = Literal["red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white"]
CanvasSide = Annotated[int, Field(ge=256, le=4096)]
Fraction = Annotated[float, Field(gt=0, le=0.3)]


class ZoomTaskConfig(SplitConfig):
    """How zoom tasks are drawn (`data.zoom` in params.yaml; every size is a fraction of the canvas's shorter side)."""

    train: int = Field(640, ge=0)
    """Number of training tasks."""
    val: int = Field(32, ge=0)
    """Number of validation tasks."""
    test: int = Field(200, ge=0)
    """Number of test tasks (held out: the eval stage's `synthetic` benchmark reads test.jsonl)."""
    canvas_side: tuple[CanvasSide, CanvasSide] = (1024, 1536)
    """[min, max] canvas width and height in pixels, each drawn independently."""
    colours: tuple[ColourName, ...] = ("red", "green", "blue", "yellow")
    """Answer colours (patches and decoys); the chance rate of free-form answers is about 1 / their count."""
    markers: tuple[Annotated[int, Field(ge=1, le=9)], Annotated[int, Field(ge=1, le=9)]] = (1, 1)
    """[min, max] frames per canvas, each with a patch; the question names one by its frame colour."""
    marker_colours: tuple[ColourName, ...] = ("black", "white", "purple", "orange", "pink", "brown")
    """Frame colours (distinct frames on a canvas get distinct colours; none may be an answer colour)."""
    marker_size: tuple[Fraction, Fraction] = (0.085, 0.09)
    """[min, max] outer side of a frame."""
    frame_width: float = Field(0.1, gt=0, le=0.3)
    """Frame line width as a fraction of the frame's side."""
    patch_size: tuple[Fraction, Fraction] = (0.035, 0.04)
    """[min, max] side of the answer patch (and of the decoys)."""
    decoys: tuple[Annotated[int, Field(ge=0, le=200)], Annotated[int, Field(ge=0, le=200)]] = (8, 16)
    """[min, max] decoy patches of the answer colours scattered away from the frames (and their view boxes)."""
    grid: int | None = Field(3, ge=1, le=6)
    """Frames sit at the centres of the cells of a grid `grid` columns wide (with `grid_jitter`); None places
    them anywhere."""
    grid_rows: int | None = Field(1, ge=1, le=6)
    """Rows of that grid; None: as many as columns (a square grid). One row of three (left, middle, right) is the
    default: the tiny model learns to carry a one-word cell name from the question into its box, and misses
    the first word of a two-word one (docs/learning.md)."""
    grid_jitter: float = Field(0.0, ge=0, le=0.3)
    """Largest shift of a frame from its cell's centre, as a fraction of the cell."""
    answer_format: Literal["free", "choice"] = "free"
    """free: answer with a colour word (exact match); choice: option letters over shuffled colour options."""
    balanced_answers: bool = True
    """Answer colours in turn (task i gets colour (i + seed) mod count), so every split's answers are as even
    as its size allows and the chance rate is 1 / colour count; false draws each answer at random."""
    option_count: int = Field(4, ge=2, le=10)
    """Options of a choice question (capped by the number of colours)."""
    bbox_target: Literal["view", "marker", "patch"] = "view"
    """What the record's `bbox` (the oracle's target) covers: `view`, a fixed box of side `view_side` around the
    centre of the frame's grid cell (one box per cell, so where to zoom is a choice among grid x grid boxes);
    `marker`, the named frame itself; `patch`, its patch alone."""
    view_side: float = Field(0.1, gt=0, le=1)
    """Side of the `view` box, relative to each image side (it must hold any frame its cell can hold)."""
    location_hint: bool = True
    """Name the frame's grid cell in the question ("... in the upper left part of the image"): where to zoom
    is then read from the question and what to answer from the crop, which the tiny model learns in minutes
    (docs/learning.md). False: the frame must be found by sight, a harder setting. Needs a grid named in
    CELL_NAMES (1x2, 1x3, 2x2, 3x3)."""
    pointers: bool = False
    """Two zooms, not one: a frame in each of the three cells of the row; the question names a cell whose frame
    holds a **pointer**, a patch whose colour names the cell holding the answer (`pointer_colours`, in cell
    order); the third frame holds a patch of another answer colour. A look at the pointer alone shows no answer,
    and a guess of where to look is wrong half the time: the search is zoom, read the pointer, zoom again,
    answer. Needs one row of three cells with the location hint and view boxes (the default layout)."""
    pointer_colours: tuple[ColourName, ColourName, ColourName] = ("purple", "orange", "pink")
    """The pointer colours that name the left, middle and right cell; none may be an answer colour, and frames
    take colours from `marker_colours` that are not pointer colours."""
    depth: Literal[1, 2] = 1
    """Zooms the answer needs. 1: the patch (`patch_size`) is legible in a zoom on its cell's view box. 2 (a zoom
    into a zoom): the answer patch is `inner_patch_size`, still a few pixels in that zoom, and legible only in a
    second zoom into the centre of that observation (`inner_view_side`); decoys keep `patch_size`. Needs
    `bbox_target: view` and one frame."""
    inner_patch_size: tuple[Fraction, Fraction] = (0.0055, 0.0065)
    """[min, max] side of the answer patch at depth 2: about as many pixels in the first zoom (a view box of side
    0.16) as a depth-1 patch has in the overview, a third of the second zoom."""
    inner_view_side: float = Field(0.12, gt=0, lt=1)
    """Side of the second zoom's box at depth 2, relative to the first zoom's observation, around its centre (the
    frame's centre): the same box on every task, so the second zoom needs no reading, only the habit."""
    png_compress_level: int = Field(1, ge=0, le=9)
    """zlib level of the saved PNGs: lower is faster and larger; pixels are the same at every level."""

    @field_validator("canvas_side", "markers", "marker_size", "patch_size", "decoys", "inner_patch_size")
    @classmethod
    def _range_is_ordered(cls, value: tuple, info: ValidationInfo) -> tuple:
        if value[0] > value[1]:
            raise ValueError(f"{info.field_name}: minimum {value[0]} is above maximum {value[1]}")
        return value

    @field_validator("colours", "marker_colours")
    @classmethod
    def _distinct(cls, value: tuple, info: ValidationInfo) -> tuple:
        if len(set(value)) != len(value):
            raise ValueError(f"{info.field_name}: a colour is listed twice")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ZoomTaskConfig:
        if len(self.colours) < 2:
            raise ValueError("colours: at least two answer colours are needed")
        if set(self.colours) & set(self.marker_colours):
            raise ValueError("marker_colours: a frame colour may not also be an answer colour")
        if len(self.marker_colours) < self.markers[1]:
            raise ValueError(f"marker_colours: {self.markers[1]} frames need as many distinct frame colours")
        if self.location_hint and self.grid_shape not in CELL_NAMES:
            raise ValueError(f"location_hint: cells are named on a {', '.join(f'{r}x{c}' for r, c in CELL_NAMES)} "
                             "grid (grid_rows x grid); pick one of those, or location_hint: false")
        if self.bbox_target == "view":
            if self.grid is None:
                raise ValueError("bbox_target: view boxes sit on grid cells; set a grid or another bbox_target")
            reach = self.grid_jitter / min(self.grid_shape) + self.marker_size[1] / 2  # farthest frame edge from a cell centre
            if reach > self.view_side / 2:
                raise ValueError(f"view_side: {self.view_side} cannot hold a frame {reach:.3f} from its cell centre; "
                                 f"use at least {2 * reach:.3f}")
        if self.grid is not None and self.grid_shape[0] * self.grid_shape[1] < self.markers[1]:
            raise ValueError(f"grid: {self.grid_shape[0]}x{self.grid_shape[1]} cells cannot hold "
                             f"{self.markers[1]} frames")
        if self.pointers:
            if self.grid_shape != (1, 3) or not self.location_hint or self.bbox_target != "view":
                raise ValueError("pointers: a pointer names one of three cells in a row; use grid 3, grid_rows 1, "
                                 "location_hint true and bbox_target view")
            if set(self.pointer_colours) & set(self.colours) or len(set(self.pointer_colours)) < 3:
                raise ValueError("pointer_colours: three distinct colours, none of them an answer colour")
            if len(set(self.marker_colours) - set(self.pointer_colours)) < 3:
                raise ValueError("marker_colours: three frame colours that are not pointer colours are needed")
        if self.depth == 2:
            if self.bbox_target != "view" or self.grid is None or self.markers != (1, 1) or self.pointers:
                raise ValueError("depth: 2 zooms into the frame's view box; use bbox_target view, a grid, markers "
                                 "[1, 1] and pointers false")
            reach = self.grid_jitter / min(self.grid_shape) + self.inner_patch_size[1] / 2 + 0.005  # + 2-decimal rounding
            if reach > self.inner_view_side * self.view_side / 2:
                raise ValueError(f"inner_view_side: {self.inner_view_side} of a {self.view_side} view box cannot hold "
                                 f"a patch {reach:.4f} from the box's centre; widen it or set grid_jitter 0")
        inner = self.marker_size[0] * (1 - 2 * self.frame_width)
        if self.patch_size[1] > 0.6 * inner:
            raise ValueError("patch_size: the largest patch must fit well inside the smallest frame's opening "
                             f"(at most {0.6 * inner:.4f})")
        return self

    @property
    def grid_shape(self) -> tuple[int, int] | None:
        """(rows, columns) of the grid, None without one."""
        if self.grid is None:
            return None
        return (self.grid if self.grid_rows is None else self.grid_rows, self.grid)


class _NoRoom(Exception):
    """The layout did not fit this canvas; the task is redrawn from the same random stream."""


def _pick(rng: np.random.Generator, choices: Sequence[str]) -> str:
    return choices[int(rng.integers(len(choices)))]


def _square(centre: tuple[int, int], side: int) -> Box:
    x0, y0 = centre[0] - side // 2, centre[1] - side // 2
    return (x0, y0, x0 + side, y0 + side)


def _marker_centres(rng: np.random.Generator, cfg: ZoomTaskConfig, canvas: Canvas, count: int,
                    side: int) -> tuple[list[tuple[int, int]], list[int | None]]:
    """Centres of `count` frames `side` px wide and their grid cells (row-major; None without a grid):
    distinct grid cells, or free spots apart from each other."""
    edge = max(4, side // 4)
    if cfg.grid_shape is not None:
        rows, cols = cfg.grid_shape
        cell_w, cell_h = canvas.width / cols, canvas.height / rows
        centres, cells = [], rng.permutation(rows * cols)[:count].tolist()
        for cell in cells:
            cx = (cell % cols + 0.5) * cell_w + rng.uniform(-1, 1) * cfg.grid_jitter * cell_w
            cy = (cell // cols + 0.5) * cell_h + rng.uniform(-1, 1) * cfg.grid_jitter * cell_h
            half = side / 2 + edge
            centres.append((round(min(max(cx, half), canvas.width - half)),
                            round(min(max(cy, half), canvas.height - half))))
        return centres, cells
    centres = []
    footprint = (-(side // 2), -(side // 2), side - side // 2, side - side // 2)
    for _ in range(count):
        centre = canvas.find_centre(rng, footprint, side // 2, edge)
        if centre is None:
            raise _NoRoom
        canvas.reserve(_square(centre, side), side // 2)
        centres.append(centre)
    return centres, [None] * count





def _view_box(cell: int, shape: tuple[int, int], side: float) -> list[float]:
    """The fixed box of relative side `side` around the centre of `cell` of a (rows, columns) grid, shifted
    inside the image, 2 decimals."""
    rows, cols = shape
    box = []
    for centre in ((cell % cols + 0.5) / cols, (cell // cols + 0.5) / rows):
        low = min(max(centre - side / 2, 0.0), 1.0 - side)
        box.append((round(low, 2), round(low + side, 2)))
    return [box[0][0], box[1][0], box[0][1], box[1][1]]


def _centre_of(box: list[float], side: float) -> list[float]:
    """The box of relative side `side` around the centre of `box`, in the same coordinates as `box`: the region
    a zoom of box [c - side/2, c + side/2] into `box`'s observation shows (its call's box: `inner_box(side)`)."""
    (lo, hi) = inner_box(side)[0::2]
    w, h = box[2] - box[0], box[3] - box[1]
    return [box[0] + lo * w, box[1] + lo * h, box[0] + hi * w, box[1] + hi * h]


def inner_box(side: float) -> list[float]:
    """The centred box of relative side `side`, 2 decimals: the second zoom of a depth-2 task, on its observation."""
    lo, hi = round(0.5 - side / 2, 2), round(0.5 + side / 2, 2)
    return [lo, lo, hi, hi]


def _relative_box(box: Box, width: int, height: int) -> list[float]:
    # Rounded outward to 4 decimals, so the stored box still covers every pixel of the box.
    return [max(0.0, math.floor(box[0] / width * 1e4) / 1e4), max(0.0, math.floor(box[1] / height * 1e4) / 1e4),
            min(1.0, math.ceil(box[2] / width * 1e4) / 1e4), min(1.0, math.ceil(box[3] / height * 1e4) / 1e4)]


def draw_zoom_task(cfg: ZoomTaskConfig, split: str, index: int) -> tuple[TaskRecord, Image.Image, dict]:
    """Task `index` of `split`: its record, its canvas, and the layout (pixel boxes of frames, patches, decoys)."""
    if cfg.pointers:
        return draw_pointer_task(cfg, split, index)
    rng = np.random.default_rng([cfg.seed, _SPLIT_STREAMS[split], index])
    count = int(rng.integers(cfg.markers[0], cfg.markers[1] + 1))
    drawn = _pick(rng, cfg.colours)  # drawn either way, so `balanced_answers` changes nothing else
    answer = cfg.colours[(index + cfg.seed) % len(cfg.colours)] if cfg.balanced_answers else drawn
    for _ in range(_MAX_ATTEMPTS):
        width, height = (int(v) for v in rng.integers(cfg.canvas_side[0], cfg.canvas_side[1] + 1, size=2))
        short = min(width, height)
        canvas = Canvas(textured_background(rng, width, height))
        side = max(12, round(rng.uniform(*cfg.marker_size) * short))
        patch = max(2, round(rng.uniform(*cfg.patch_size) * short))
        try:
            centres, cells = _marker_centres(rng, cfg, canvas, count, side)
            break
        except _NoRoom:
            continue
    else:  # pragma: no cover - only a config far outside sensible ranges gets here
        raise RuntimeError(f"zoom task {split}/{index}: no layout fitted in {_MAX_ATTEMPTS} attempts")

    frame_colours = [cfg.marker_colours[i] for i in rng.permutation(len(cfg.marker_colours))[:count].tolist()]
    patch_colours = [answer] + [_pick(rng, cfg.colours) for _ in range(count - 1)]
    # Drawn only at depth 2, so depth-1 canvases stay what they were.
    answer_patch = max(2, round(rng.uniform(*cfg.inner_patch_size) * short)) if cfg.depth == 2 else patch
    border = max(2, round(cfg.frame_width * side))
    frames, patches = [], []
    for centre, frame_colour, patch_colour in zip(centres, frame_colours, patch_colours):
        frame = _square(centre, side)
        canvas.draw_frame(frame, frame_colour, border)
        square = _square(centre, answer_patch)
        canvas.draw.rectangle([square[0], square[1], square[2] - 1, square[3] - 1], fill=PALETTE[patch_colour])
        canvas.reserve(frame, max(patch, side // 4))
        frames.append(frame)
        patches.append(square)

    if cfg.bbox_target == "view":  # a zoom on a view shows one patch only: decoys stay out of every view box
        for cell in cells:
            vx0, vy0, vx1, vy1 = _view_box(cell, cfg.grid_shape, cfg.view_side)
            canvas.reserve((int(vx0 * width), int(vy0 * height), math.ceil(vx1 * width), math.ceil(vy1 * height)))
    decoys = _scatter_decoys(rng, cfg, canvas, patch)

    where = ""
    if cfg.location_hint:
        cell_name = CELL_NAMES[cfg.grid_shape][cells[0]]
        where = f" {CELL_PREPOSITIONS.get(cell_name, 'in')} the {cell_name} of the image"
    ask = f"What colour is the small square inside the {frame_colours[0]} frame{where}?"
    if cfg.answer_format == "choice":
        n = min(cfg.option_count, len(cfg.colours))
        wrong = [c for c in cfg.colours if c != answer]
        options = [answer] + [wrong[i] for i in rng.choice(len(wrong), size=n - 1, replace=False).tolist()]
        options = [options[i] for i in rng.permutation(n).tolist()]
        solution, problem = OPTION_LETTERS[options.index(answer)], ask
    else:
        options, solution, problem = None, answer, f"{ask} Answer with one colour word."
    waypoints = None
    if cfg.bbox_target == "view":
        bbox = _view_box(cells[0], cfg.grid_shape, cfg.view_side)
        if cfg.depth == 2:  # the view box becomes a waypoint; the answer is in the centre of its observation
            waypoints = [{"bbox": bbox, "seen": TOO_SMALL_TO_READ}]
            bbox = _centre_of(bbox, cfg.inner_view_side)
    else:
        bbox = _relative_box(frames[0] if cfg.bbox_target == "marker" else patches[0], width, height)
    record = TaskRecord(
        doc_id=f"zoom-{split}-{index:06d}",
        images=[f"images/{split}/{index:06d}.png"],
        problem=problem,
        solution=solution,
        data_source=DATA_SOURCE,
        options=options,
        category="zoom/nested" if cfg.depth == 2 else f"zoom/{'single' if count == 1 else 'multi'}",
        bbox=bbox,
        waypoints=waypoints,
    )
    layout = {"frames": frames, "patches": patches, "decoys": decoys, "frame_colours": frame_colours,
              "patch_colours": patch_colours, "answer": answer}
    return record, canvas.image, layout


def _scatter_decoys(rng: np.random.Generator, cfg: ZoomTaskConfig, canvas: Canvas, patch: int) -> list[Box]:
    """Patches of the answer colours away from everything reserved, so the overview's colours say nothing."""
    decoys = []
    footprint = (-(patch // 2), -(patch // 2), patch - patch // 2, patch - patch // 2)
    for _ in range(int(rng.integers(cfg.decoys[0], cfg.decoys[1] + 1))):
        centre = canvas.find_centre(rng, footprint, 2 * patch, 2, tries=12)
        if centre is None:
            continue
        square = _square(centre, patch)
        canvas.draw.rectangle([square[0], square[1], square[2] - 1, square[3] - 1], fill=PALETTE[_pick(rng, cfg.colours)])
        canvas.reserve(square, 2 * patch)
        decoys.append(square)
    return decoys


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def draw_pointer_task(cfg: ZoomTaskConfig, split: str, index: int) -> tuple[TaskRecord, Image.Image, dict]:
    """A two-zoom task (`pointers`): the named cell's frame holds a pointer to the cell whose frame holds the
    answer; the third frame a patch of another answer colour. Its record's `waypoints` is the pointer's view box,
    its `bbox` the answer's."""
    rng = np.random.default_rng([cfg.seed, _SPLIT_STREAMS[split], index])
    drawn = _pick(rng, cfg.colours)
    answer = cfg.colours[(index + cfg.seed) % len(cfg.colours)] if cfg.balanced_answers else drawn
    width, height = (int(v) for v in rng.integers(cfg.canvas_side[0], cfg.canvas_side[1] + 1, size=2))
    short = min(width, height)
    canvas = Canvas(textured_background(rng, width, height))
    side = max(12, round(rng.uniform(*cfg.marker_size) * short))
    patch = max(2, round(rng.uniform(*cfg.patch_size) * short))
    named = int(rng.integers(3))
    target, other = (int(c) for c in rng.permutation([c for c in range(3) if c != named]))
    frame_choices = [c for c in cfg.marker_colours if c not in cfg.pointer_colours]
    frame_colours = [frame_choices[i] for i in rng.permutation(len(frame_choices))[:3].tolist()]
    decoy_colour = _pick(rng, [c for c in cfg.colours if c != answer])
    fills = {named: cfg.pointer_colours[target], target: answer, other: decoy_colour}
    frames, patches = [], []
    border = max(2, round(cfg.frame_width * side))
    for cell in range(3):
        centre = (round((cell + 0.5) * width / 3), round(height / 2))
        frame = _square(centre, side)
        canvas.draw_frame(frame, frame_colours[cell], border)
        square = _square(centre, patch)
        canvas.draw.rectangle([square[0], square[1], square[2] - 1, square[3] - 1], fill=PALETTE[fills[cell]])
        canvas.reserve(frame, max(patch, side // 4))
        vx0, vy0, vx1, vy1 = _view_box(cell, (1, 3), cfg.view_side)
        canvas.reserve((int(vx0 * width), int(vy0 * height), math.ceil(vx1 * width), math.ceil(vy1 * height)))
        frames.append(frame)
        patches.append(square)
    decoys = _scatter_decoys(rng, cfg, canvas, patch)
    cells = CELL_NAMES[(1, 3)]
    where = lambda cell: f"{CELL_PREPOSITIONS.get(cells[cell], 'in')} the {cells[cell]}"  # noqa: E731
    code = ", ".join(f"{colour} {where(cell).split(' ', 1)[1]}" for cell, colour in enumerate(cfg.pointer_colours))
    problem = (f"What colour is the small square in the frame the pointer {where(named)} of the image points to? "
               f"A pointer's colour names its frame: {code}. Answer with one colour word.")
    record = TaskRecord(
        doc_id=f"zoom-{split}-{index:06d}",
        images=[f"images/{split}/{index:06d}.png"],
        problem=problem,
        solution=answer,
        data_source=DATA_SOURCE,
        category="zoom/pointer",
        bbox=_view_box(target, (1, 3), cfg.view_side),
        waypoints=[{"bbox": _view_box(named, (1, 3), cfg.view_side),
                    "seen": f"{_article(cfg.pointer_colours[target])} {cfg.pointer_colours[target]} pointer: the "
                            f"answer is {where(target)}"}],
    )
    layout = {"frames": frames, "patches": patches, "decoys": decoys, "frame_colours": frame_colours,
              "patch_colours": [fills[c] for c in range(3)], "answer": answer, "named": named, "target": target}
    return record, canvas.image, layout


def make_zoom_task(cfg: ZoomTaskConfig, split: str, index: int) -> tuple[TaskRecord, Image.Image]:
    """Task `index` of `split`: its record (image path relative to the output folder) and its canvas."""
    record, image, _ = draw_zoom_task(cfg, split, index)
    return record, image


def _make_and_save(cfg: ZoomTaskConfig, split: str, index: int, folder: Path) -> TaskRecord:
    record, image = make_zoom_task(cfg, split, index)
    (folder / record.images[0]).write_bytes(encode_png(image, cfg.png_compress_level))
    return record


def generate_zoom_tasks(out_dir: Path, cfg: ZoomTaskConfig, progress: bool = False, workers: int = 1) -> dict[str, Path]:
    """Write `out_dir/{train,val,test}.jsonl` and their images; return {split: jsonl path}
    (loupe.data.splits.write_splits: atomic, byte-identical for any `workers`)."""
    return write_splits(out_dir, cfg, _make_and_save, "zoom", progress, workers)
