"""Synthetic visual-search tasks: a large cluttered canvas, one small target, one question about it.

Each task is a PNG canvas (1024-4096 px a side) with a muted textured background and many distractor shapes
and letters, in the spirit of VisualProbe: the question is about something small enough that it cannot be read
without zooming in. Question kinds (`QUESTION_KINDS`):

- colour:   "What colour is the hexagon with the letter K on it?" / "... the star next to the digit 7?"
- shape:    "What shape is the red object next to the letter K?"
- glyph:    "What letter is written on the purple circle?"
- count:    "How many blue stars are inside the box with the orange border?"
- position: "Where is the red star relative to the letter K?"  (left / right / above / below)

The words that name the target are unique on the canvas by construction: every letter or digit appears at most
once per canvas, an anchor's neighbourhood holds no other object matching the description, and a
"<colour> <shape>" description is held by no other shape. Distractors that share the target's shape or colour
and size are added on purpose. Difficulty (`DIFFICULTIES`) sets the target's size as a fraction of the
canvas's shorter side (`SyntheticConfig.target_size`).

`generate_tasks(out_dir, cfg)` writes `out_dir/{train,val,test}.jsonl` (task records, see loupe.data.tasks)
and `out_dir/images/<split>/<index>.png`. Every task draws from its own random stream seeded by
(seed, split, index), so a config always gives byte-identical files and no task depends on another.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Annotated, Literal, get_args

import numpy as np
from PIL import Image
from pydantic import Field, ValidationInfo, field_validator

from loupe.data.synthetic_draw import (
    DIGITS,
    GLYPH_SHAPES,
    LETTERS,
    MIN_GLYPH_PX,
    MIN_GLYPH_SHAPE_PX,
    MIN_SHAPE_PX,
    PALETTE,
    SHAPE_PLURALS,
    SHAPES,
    Box,
    Canvas,
    Item,
    glyph_class,
    glyph_footprint,
    shape_footprint,
    shift,
    textured_background,
    union_box,
)
from loupe.data.tasks import OPTION_LETTERS, TaskRecord
from loupe.data.splits import SplitConfig, write_splits
from loupe.png import encode_png

Difficulty = Literal["easy", "medium", "hard"]
QuestionKind = Literal["colour", "shape", "glyph", "count", "position"]
DIFFICULTIES: tuple[str, ...] = get_args(Difficulty)
QUESTION_KINDS: tuple[str, ...] = get_args(QuestionKind)
DIRECTIONS = ("left", "right", "above", "below")
COLOURS = tuple(PALETTE)
LETTERS_AND_DIGITS = LETTERS + DIGITS

# Fixed stream ids, so adding a split later never reshuffles the others.
_SPLIT_STREAMS = {"train": 1, "val": 2, "test": 3}
_MAX_ATTEMPTS = 20

CanvasSide = Annotated[int, Field(ge=1024, le=4096)]
OptionCount = Annotated[int, Field(ge=2, le=5)]
Weight = Annotated[float, Field(ge=0, allow_inf_nan=False)]
SizeFraction = Annotated[float, Field(gt=0, le=0.3)]

_DEFAULT_TARGET_SIZE: dict[str, tuple[float, float]] = {
    "easy": (0.06, 0.10),
    "medium": (0.03, 0.05),
    "hard": (0.012, 0.025),
}


class SyntheticConfig(SplitConfig):
    """How synthetic visual-search tasks are drawn (`data.synthetic` in params.yaml)."""

    canvas_side: tuple[CanvasSide, CanvasSide] = (1024, 2048)
    """[min, max] canvas width and height in pixels, each drawn independently; within 1024..4096."""
    difficulty_mix: dict[Difficulty, Weight] = {"easy": 1.0, "medium": 1.0, "hard": 1.0}
    """Relative weights of easy / medium / hard tasks; a difficulty left out is never drawn."""
    target_size: dict[Difficulty, tuple[SizeFraction, SizeFraction]] = dict(_DEFAULT_TARGET_SIZE)
    """Target width as a [min, max] fraction of the canvas's shorter side, per difficulty (missing keys keep
    the defaults easy 0.06-0.10, medium 0.03-0.05, hard 0.012-0.025). Glyph-bearing targets are at least
    20 px wide so their glyph stays legible at full resolution."""
    kind_mix: dict[QuestionKind, Weight] = {k: 1.0 for k in QUESTION_KINDS}
    """Relative weights of the question kinds colour / shape / glyph / count / position; a kind left out is
    never drawn."""
    choice_fraction: float = Field(0.5, ge=0.0, le=1.0)
    """Fraction of multiple-choice questions (options + letter solution); the rest are free-form."""
    option_count: tuple[OptionCount, OptionCount] = (2, 5)
    """[min, max] number of options of a choice question, within 2..5 (capped by the kind's answer set)."""
    clutter_count: tuple[Annotated[int, Field(ge=0, le=2000)], Annotated[int, Field(ge=0, le=2000)]] = (60, 150)
    """[min, max] number of random distractor objects tried per canvas (fewer when the canvas fills up)."""
    similar_count: tuple[Annotated[int, Field(ge=0, le=100)], Annotated[int, Field(ge=0, le=100)]] = (3, 8)
    """[min, max] number of extra distractors the target's size that share its shape or its colour."""
    count_answers: tuple[Annotated[int, Field(ge=0, le=9)], Annotated[int, Field(ge=0, le=9)]] = (1, 7)
    """[min, max] number of items a count question asks about."""
    png_compress_level: int = Field(1, ge=0, le=9)
    """zlib level of the saved PNGs: lower is faster and larger; pixels are the same at every level."""

    @field_validator("canvas_side", "option_count", "clutter_count", "similar_count", "count_answers")
    @classmethod
    def _range_is_ordered(cls, value: tuple, info: ValidationInfo) -> tuple:
        if value[0] > value[1]:
            raise ValueError(f"{info.field_name}: minimum {value[0]} is above maximum {value[1]}")
        return value

    @field_validator("difficulty_mix", "kind_mix")
    @classmethod
    def _some_weight(cls, value: dict, info: ValidationInfo) -> dict:
        if not any(w > 0 for w in value.values()):
            raise ValueError(f"{info.field_name}: at least one weight must be above zero")
        return value

    @field_validator("target_size")
    @classmethod
    def _sizes_complete_and_ordered(cls, value: dict) -> dict:
        for difficulty, (lo, hi) in value.items():
            if lo > hi:
                raise ValueError(f"target_size.{difficulty}: minimum {lo} is above maximum {hi}")
        return {d: tuple(value.get(d, _DEFAULT_TARGET_SIZE[d])) for d in DIFFICULTIES}


# ---------------------------------------------------------------------------------------------- scene


class _NoRoom(Exception):
    """The layout did not fit this canvas; the task is redrawn from the same random stream."""


@dataclass
class _Rule:
    """Forbids distractors matching (shape, colour) within `radius` of `centre` (anywhere when centre is None)."""

    matches: Callable[[str | None, str], bool]
    centre: tuple[float, float] | None = None
    radius: float = 0.0

    def forbids(self, shape: str | None, colour: str, at: tuple[float, float]) -> bool:
        if not self.matches(shape, colour):
            return False
        return self.centre is None or math.dist(at, self.centre) < self.radius


@dataclass
class _Scene:
    rng: np.random.Generator
    canvas: Canvas
    side: int
    """The canvas's shorter side: target sizes are fractions of it."""
    glyphs: list[str]
    """Characters not yet on the canvas; each is used at most once so "the letter K" is unique."""
    rules: list[_Rule] = field(default_factory=list)
    items: list[Item] = field(default_factory=list)
    """Everything drawn so far (tests check the question's description against it)."""

    @property
    def edge(self) -> int:
        """Structured elements keep this far from the border, so a zoom around them is never degenerate."""
        return max(4, round(0.02 * self.side))

    def pick(self, choices: Sequence[str], exclude: Sequence[str | None] = ()) -> str:
        allowed = [c for c in choices if c not in exclude]
        return allowed[int(self.rng.integers(len(allowed)))]

    def take_glyph(self, cls: str | None = None, avoid: str = "") -> str:
        for i, ch in enumerate(self.glyphs):
            if (cls is None or glyph_class(ch) == cls) and ch not in avoid:
                return self.glyphs.pop(i)
        raise _NoRoom

    def margin(self, n: int) -> int:
        """Clear space kept around an item n px wide, so neighbours never touch or overlap."""
        return max(3, n // 6)

    def place_shape(self, shape: str, colour: str, n: int, glyph: str | None = None) -> Item:
        """Draw a structured element (target, reference) at a random free spot away from the border."""
        footprint = shape_footprint(shape, n)
        centre = self.canvas.find_centre(self.rng, footprint, self.margin(n), self.edge)
        if centre is None:
            raise _NoRoom
        return self.commit(self.canvas.draw_shape(shape, colour, centre, n, glyph), n)

    def commit(self, item: Item, n: int) -> Item:
        self.canvas.reserve(item.box, self.margin(n))
        self.items.append(item)
        return item

    def place_anchor(self, target: Item, n: int, avoid_colour: str | None = None) -> tuple[Item, float]:
        """A free-standing glyph right next to `target`; returns it and the centre-to-centre distance."""
        rng = self.rng
        glyph = self.take_glyph()
        colour = self.pick(COLOURS, exclude=(avoid_colour,))
        cap = max(MIN_GLYPH_PX, round((target.box[3] - target.box[1]) * rng.uniform(0.8, 1.1)))
        footprint = glyph_footprint(glyph, cap)
        reach = 0.5 * max(target.box[2] - target.box[0], target.box[3] - target.box[1])
        reach += 0.5 * max(footprint[2] - footprint[0], footprint[3] - footprint[1])
        tx, ty = target.centre
        for _ in range(24):
            distance = reach + rng.uniform(0.25, 0.9) * n
            angle = rng.uniform(0, 2 * math.pi)
            centre = (round(tx + distance * math.cos(angle)), round(ty + distance * math.sin(angle)))
            box = shift(footprint, *centre)
            if self.canvas.is_free(box, self.margin(cap), self.edge):
                item = self.commit(self.canvas.draw_glyph(glyph, colour, centre, cap), cap)
                return item, math.dist(item.centre, target.centre)
        raise _NoRoom

    def forbid_near_anchor(self, matches: Callable[[str | None, str], bool], anchor: Item, distance: float,
                           n: int) -> None:
        # Any other match is at least 2.5x farther from the anchor than the target: "next to" is unambiguous.
        self.rules.append(_Rule(matches, anchor.centre, max(2.5 * distance, distance + 2 * n)))

    def allows(self, shape: str | None, colour: str, at: tuple[float, float]) -> bool:
        return not any(rule.forbids(shape, colour, at) for rule in self.rules)


@dataclass
class _Question:
    """What a kind builder returns: the question in both forms, its answer, and where to look."""

    ask: str
    """The question without an answer-format hint (choice form)."""
    hint: str
    """Appended to free-form questions so answers come back as one short normalisable string."""
    answer: str
    answer_space: Sequence[str]
    box: Box
    size: int
    """The target's width in px; similar distractors are drawn about this size."""
    similar: Callable[[], tuple[str, str]]
    """Draws a (shape, colour) that resembles the target in one attribute."""
    similar_glyphs: bool = False


def _target_size(scene: _Scene, fraction: float, minimum: int = MIN_SHAPE_PX) -> int:
    return max(minimum, round(fraction * scene.side))


def _resembling(scene: _Scene, shape: str, colour: str,
                shapes: Sequence[str] = SHAPES) -> Callable[[], tuple[str, str]]:
    """A drawer of (shape, colour) pairs sharing exactly one attribute with the target's."""

    def draw() -> tuple[str, str]:
        if scene.rng.random() < 0.5:
            return shape, scene.pick(COLOURS, exclude=(colour,))
        return scene.pick(shapes, exclude=(shape,)), colour

    return draw


# ---------------------------------------------------------------------------------------------- question kinds


def _colour_question(scene: _Scene, fraction: float) -> _Question:
    shape, colour = scene.pick(SHAPES), scene.pick(COLOURS)
    n = _target_size(scene, fraction)
    if shape in GLYPH_SHAPES and n >= MIN_GLYPH_SHAPE_PX and scene.rng.random() < 0.5:
        glyph = scene.take_glyph()
        target = scene.place_shape(shape, colour, n, glyph)
        ref = f"{shape} with the {glyph_class(glyph)} {glyph} on it"
    else:
        target = scene.place_shape(shape, colour, n)
        anchor, distance = scene.place_anchor(target, n)
        ref = f"{shape} next to the {glyph_class(anchor.glyph)} {anchor.glyph}"
        scene.forbid_near_anchor(lambda s, c: s == shape, anchor, distance, n)
    ask = _template(scene, ("What colour is the {ref}?", "What is the colour of the {ref}?",
                            "Which colour does the {ref} have?")).format(ref=ref)
    similar = lambda: (shape, scene.pick(COLOURS, exclude=(colour,)))  # noqa: E731 - same shape, other colours
    return _Question(ask, "Answer with one colour word.", colour, COLOURS, target.box, n, similar, True)


def _shape_question(scene: _Scene, fraction: float) -> _Question:
    shape, colour = scene.pick(SHAPES), scene.pick(COLOURS)
    n = _target_size(scene, fraction)
    target = scene.place_shape(shape, colour, n)
    anchor, distance = scene.place_anchor(target, n, avoid_colour=colour)
    scene.forbid_near_anchor(lambda s, c: c == colour, anchor, distance, n)
    ref = f"{colour} object next to the {glyph_class(anchor.glyph)} {anchor.glyph}"
    ask = _template(scene, ("What shape is the {ref}?", "Which shape is the {ref}?",
                            "What is the shape of the {ref}?")).format(ref=ref)
    similar = lambda: (scene.pick(SHAPES, exclude=(shape,)), colour)  # noqa: E731 - same colour, other shapes
    return _Question(ask, "Answer with one word.", shape, SHAPES, target.box, n, similar)


def _glyph_question(scene: _Scene, fraction: float, avoid: str = "") -> _Question:
    """`avoid`: characters never asked about nor offered, e.g. option letters, so that a choice answer "B"
    cannot mean both option B and the letter B."""
    cls = "letter" if scene.rng.random() < 0.7 else "digit"
    shape, colour = scene.pick(GLYPH_SHAPES), scene.pick(COLOURS)
    n = _target_size(scene, fraction, MIN_GLYPH_SHAPE_PX)
    glyph = scene.take_glyph(cls, avoid)
    target = scene.place_shape(shape, colour, n, glyph)
    scene.rules.append(_Rule(lambda s, c: s == shape and c == colour))
    ask = _template(scene, ("What {cls} is written on the {colour} {shape}?",
                            "Which {cls} is printed on the {colour} {shape}?",
                            "What {cls} does the {colour} {shape} carry?")).format(cls=cls, colour=colour, shape=shape)
    space = [ch for ch in (LETTERS if cls == "letter" else DIGITS) if ch not in avoid]
    return _Question(ask, f"Answer with the single {cls}.", glyph, space,
                     target.box, n, _resembling(scene, shape, colour, GLYPH_SHAPES), True)


def _count_question(scene: _Scene, fraction: float, answers: tuple[int, int]) -> _Question:
    rng = scene.rng
    shape, colour = scene.pick(SHAPES), scene.pick(COLOURS)
    frame_colour = scene.pick(COLOURS, exclude=(colour,))
    wanted = int(rng.integers(answers[0], answers[1] + 1))
    others = int(rng.integers(2, 6))
    n = _target_size(scene, fraction)
    # Items sit one per grid cell (jittered), a third of the cells left empty: placement never fails.
    cells_needed = math.ceil((wanted + others) * 1.5)
    cols = max(2, math.ceil(math.sqrt(cells_needed * rng.uniform(0.7, 1.4))))
    rows = max(2, math.ceil(cells_needed / cols))
    # Big (easy) items would make the box outgrow the canvas: shrink them to fit 60% of it.
    fit = min(0.6 * scene.canvas.width / (cols * 2 * n + n), 0.6 * scene.canvas.height / (rows * 2 * n + n), 1.0)
    n = max(MIN_SHAPE_PX, math.floor(n * fit))
    cell = 2 * n
    border = max(2, n // 6)
    pad = border + max(2, n // 3)
    footprint = (0, 0, cols * cell + 2 * pad, rows * cell + 2 * pad)
    corner = scene.canvas.find_centre(rng, footprint, scene.margin(n), scene.edge)
    if corner is None:
        raise _NoRoom
    region = shift(footprint, *corner)
    scene.canvas.reserve(region, scene.margin(n))
    scene.canvas.draw_frame(region, frame_colour, border)
    kinds = [(shape, colour)] * wanted + [_resembling(scene, shape, colour)() for _ in range(others)]
    for (item_shape, item_colour), slot in zip(kinds, rng.permutation(cols * rows).tolist()):
        size = max(MIN_SHAPE_PX, round(n * rng.uniform(0.85, 1.0)))
        gap = max(1, n // 8)  # keeps items in neighbouring cells from touching, so each counts on its own
        x = region[0] + pad + (slot % cols) * cell + size // 2 + int(rng.integers(gap, cell - size - gap + 1))
        y = region[1] + pad + (slot // cols) * cell + size // 2 + int(rng.integers(gap, cell - size - gap + 1))
        scene.items.append(scene.canvas.draw_shape(item_shape, item_colour, (x, y), size))
    plural = SHAPE_PLURALS[shape]
    ask = _template(scene, ("How many {colour} {plural} are inside the box with the {frame} border?",
                            "How many {colour} {plural} does the {frame}-bordered box contain?",
                            "Count the {colour} {plural} inside the box with the {frame} border. How many are there?"))
    ask = ask.format(colour=colour, plural=plural, frame=frame_colour)
    space = [str(v) for v in range(0, 10)]
    return _Question(ask, "Answer with a number.", str(wanted), space, region, n,
                     _resembling(scene, shape, colour))


def _position_question(scene: _Scene, fraction: float) -> _Question:
    rng = scene.rng
    shape, colour = scene.pick(SHAPES), scene.pick(COLOURS)
    n = _target_size(scene, fraction)
    target_fp = shape_footprint(shape, n)
    ref_size = max(MIN_SHAPE_PX, round(n * rng.uniform(0.9, 1.25)))
    if rng.random() < 0.5:
        ref_glyph = scene.take_glyph()
        ref_shape, ref_colour = None, scene.pick(COLOURS)
        ref_size = max(MIN_GLYPH_PX, ref_size)
        ref_fp = glyph_footprint(ref_glyph, ref_size)
        ref_words = f"{glyph_class(ref_glyph)} {ref_glyph}"
    else:
        ref_glyph = None
        ref_shape = scene.pick(SHAPES)
        ref_colour = scene.pick(COLOURS, exclude=(colour,) if ref_shape == shape else ())
        ref_fp = shape_footprint(ref_shape, ref_size)
        ref_words = f"{ref_colour} {ref_shape}"
    direction = scene.pick(DIRECTIONS)
    # Offset along the asked axis dominates the other by at least 3x, so the answer is never borderline.
    along = 0.5 * (n + ref_size) + rng.uniform(1.0, 4.0) * n
    across = rng.uniform(-0.3, 0.3) * along
    dx, dy = {"left": (-along, across), "right": (along, across),
              "above": (across, -along), "below": (across, along)}[direction]
    dx, dy = round(dx), round(dy)
    pair_fp = union_box(ref_fp, shift(target_fp, dx, dy))
    centre = scene.canvas.find_centre(rng, pair_fp, scene.margin(n), scene.edge)
    if centre is None:
        raise _NoRoom
    if ref_glyph is not None:
        reference = scene.canvas.draw_glyph(ref_glyph, ref_colour, centre, ref_size)
    else:
        reference = scene.canvas.draw_shape(ref_shape, ref_colour, centre, ref_size)
        scene.rules.append(_Rule(lambda s, c: s == ref_shape and c == ref_colour))
    scene.commit(reference, ref_size)
    target = scene.commit(scene.canvas.draw_shape(shape, colour, (centre[0] + dx, centre[1] + dy), n), n)
    scene.rules.append(_Rule(lambda s, c: s == shape and c == colour))
    ask = _template(scene, ("Where is the {a} relative to the {b}?",
                            "Where is the {a} located relative to the {b}?")).format(a=f"{colour} {shape}", b=ref_words)
    return _Question(ask, "Answer with one word: left, right, above or below.", direction, DIRECTIONS,
                     union_box(target.box, reference.box), n, _resembling(scene, shape, colour))


def _template(scene: _Scene, templates: Sequence[str]) -> str:
    return templates[int(scene.rng.integers(len(templates)))]


# ---------------------------------------------------------------------------------------------- clutter


def _add_clutter(scene: _Scene, cfg: SyntheticConfig, question: _Question) -> None:
    rng = scene.rng
    for _ in range(int(rng.integers(cfg.similar_count[0], cfg.similar_count[1] + 1))):
        shape, colour = question.similar()
        size = max(MIN_SHAPE_PX, round(question.size * rng.uniform(0.85, 1.15)))
        wants_glyph = question.similar_glyphs and shape in GLYPH_SHAPES and size >= MIN_GLYPH_SHAPE_PX
        _try_clutter_shape(scene, shape, colour, size, wants_glyph)

    smallest = max(MIN_SHAPE_PX, 0.01 * scene.side)
    largest = max(smallest + 1, 0.08 * scene.side)
    for _ in range(int(rng.integers(cfg.clutter_count[0], cfg.clutter_count[1] + 1))):
        size = round(math.exp(rng.uniform(math.log(smallest), math.log(largest))))
        roll = rng.random()
        if roll < 0.15 and scene.glyphs:
            _try_clutter_glyph(scene, max(MIN_GLYPH_PX, round(0.8 * size)))
        else:
            shape = scene.pick(SHAPES)
            wants_glyph = shape in GLYPH_SHAPES and size >= MIN_GLYPH_SHAPE_PX and roll > 0.6
            _try_clutter_shape(scene, shape, scene.pick(COLOURS), size, wants_glyph)


def _free_colour(scene: _Scene, shape: str | None, colour: str, at: tuple[float, float]) -> str | None:
    """`colour`, or another one the rules allow here; None when four tries all break a rule."""
    for _ in range(4):
        if scene.allows(shape, colour, at):
            return colour
        colour = scene.pick(COLOURS)
    return None


def _try_clutter_shape(scene: _Scene, shape: str, colour: str, n: int, wants_glyph: bool) -> None:
    centre = scene.canvas.find_centre(scene.rng, shape_footprint(shape, n), scene.margin(n), 2, tries=12)
    if centre is None or (colour := _free_colour(scene, shape, colour, centre)) is None:
        return
    glyph = scene.glyphs.pop() if wants_glyph and scene.glyphs else None
    scene.commit(scene.canvas.draw_shape(shape, colour, centre, n, glyph), n)


def _try_clutter_glyph(scene: _Scene, cap: int) -> None:
    glyph = scene.glyphs[-1]
    centre = scene.canvas.find_centre(scene.rng, glyph_footprint(glyph, cap), scene.margin(cap), 2, tries=12)
    if centre is None or (colour := _free_colour(scene, None, scene.pick(COLOURS), centre)) is None:
        return
    scene.glyphs.pop()
    scene.commit(scene.canvas.draw_glyph(glyph, colour, centre, cap), cap)


# ---------------------------------------------------------------------------------------------- one task


def _options(rng: np.random.Generator, question: _Question, count: int, kind: str) -> tuple[list[str], str]:
    """Option texts (the answer at a random position) and the answer's letter."""
    if kind == "count":  # wrong counts near the right one are the plausible mistakes
        right = int(question.answer)
        wrong = [str(v) for v in range(max(0, right - 4), right + 5) if v != right]
    else:
        wrong = [a for a in question.answer_space if a != question.answer]
    count = min(count, len(wrong) + 1)
    picks = [wrong[i] for i in rng.choice(len(wrong), size=count - 1, replace=False).tolist()]
    options = [question.answer, *picks]
    options = [options[i] for i in rng.permutation(count).tolist()]
    return options, OPTION_LETTERS[options.index(question.answer)]


def _relative_box(box: Box, width: int, height: int) -> list[float]:
    # Rounded outward to 4 decimals, so the stored box still covers every target pixel.
    return [math.floor(box[0] / width * 1e4) / 1e4, math.floor(box[1] / height * 1e4) / 1e4,
            min(1.0, math.ceil(box[2] / width * 1e4) / 1e4), min(1.0, math.ceil(box[3] / height * 1e4) / 1e4)]


def _weighted(rng: np.random.Generator, weights: dict[str, float], names: Sequence[str]) -> str:
    # Iterate in the canonical order, not the mapping's, so YAML key order cannot change the draw.
    values = np.array([weights.get(name, 0.0) for name in names], dtype=float)
    return names[int(rng.choice(len(names), p=values / values.sum()))]


def make_task(cfg: SyntheticConfig, split: str, index: int) -> tuple[TaskRecord, Image.Image]:
    """Task `index` of `split`: its record (image path relative to the output folder) and its image."""
    record, image, _ = _draw_task(cfg, split, index)
    return record, image


def _draw_task(cfg: SyntheticConfig, split: str, index: int) -> tuple[TaskRecord, Image.Image, list[Item]]:
    rng = np.random.default_rng([cfg.seed, _SPLIT_STREAMS[split], index])
    difficulty = _weighted(rng, cfg.difficulty_mix, DIFFICULTIES)
    kind = _weighted(rng, cfg.kind_mix, QUESTION_KINDS)
    is_choice = bool(rng.random() < cfg.choice_fraction)
    for _ in range(_MAX_ATTEMPTS):
        width, height = (int(v) for v in rng.integers(cfg.canvas_side[0], cfg.canvas_side[1] + 1, size=2))
        scene = _Scene(rng, Canvas(textured_background(rng, width, height)), min(width, height),
                       [LETTERS_AND_DIGITS[i] for i in rng.permutation(len(LETTERS_AND_DIGITS)).tolist()])
        fraction = float(rng.uniform(*cfg.target_size[difficulty]))
        builders: dict[str, Callable[[_Scene, float], _Question]] = {
            "colour": _colour_question,
            "shape": _shape_question,
            "glyph": partial(_glyph_question, avoid=OPTION_LETTERS[: cfg.option_count[1]] if is_choice else ""),
            "count": partial(_count_question, answers=cfg.count_answers),
            "position": _position_question,
        }
        try:
            question = builders[kind](scene, fraction)
            break
        except _NoRoom:
            continue
    else:  # pragma: no cover - only a config far outside the validated ranges gets here
        raise RuntimeError(f"synthetic task {split}/{index}: no layout fitted in {_MAX_ATTEMPTS} attempts")
    _add_clutter(scene, cfg, question)

    if is_choice:
        options, solution = _options(rng, question, int(rng.integers(cfg.option_count[0], cfg.option_count[1] + 1)),
                                     kind)
        problem = question.ask
    else:
        options, solution = None, question.answer
        problem = f"{question.ask} {question.hint}"
    record = TaskRecord(
        doc_id=f"synth-{split}-{index:06d}",
        images=[f"images/{split}/{index:06d}.png"],
        problem=problem,
        solution=solution,
        data_source="synthetic",
        options=options,
        category=f"{kind}/{difficulty}",
        bbox=_relative_box(question.box, width, height),
    )
    return record, scene.canvas.image, scene.items


# ---------------------------------------------------------------------------------------------- output


def _make_and_save(cfg: SyntheticConfig, split: str, index: int, folder: Path) -> TaskRecord:
    record, image = make_task(cfg, split, index)
    # Written directly: the whole folder is renamed into place only once every file is complete.
    (folder / record.images[0]).write_bytes(encode_png(image, cfg.png_compress_level))
    return record


def generate_tasks(out_dir: Path, cfg: SyntheticConfig, progress: bool = False, workers: int = 1) -> dict[str, Path]:
    """Write `out_dir/{train,val,test}.jsonl` and their images; return {split: jsonl path}
    (loupe.data.splits.write_splits: atomic, byte-identical for any `workers`)."""
    return write_splits(out_dir, cfg, _make_and_save, "synthetic", progress, workers)
