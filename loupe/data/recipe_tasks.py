"""The seeds' kinds of task, drawn procedurally for CPU runs: arithmetic, counting and geometry.

The recipes Loupe reproduces train on math and counting data (R1-V: CLEVR counting and GeoQA geometry;
LMM-R1: text-only math, then geometry; EasyR1: geometry3k). Those sets are local paths in a real run
(loupe.data.recipe_formats reads them); these families stand in for them on a laptop, with exact answers:

- `arithmetic` (text-only, no image): "What is 17 + 5?" or a one-line word problem ("Ann has 17 apples and
  gets 5 more. How many apples does Ann have now?"); LMM-R1's foundational-reasoning stage in miniature.
- `counting` (one image, CLEVR-like): 1-6 solid shapes on a plain floor; "How many objects are there in the
  image?" or "How many red objects are there?" with objects of other colours around (R1-V's counting).
- `geometry` (one image, GeoQA-like): a labelled figure and its given values, also stated in the question as
  GeoQA's problems state theirs: the third angle of a triangle, a rectangle's area or perimeter.

Each record carries a `rationale` (a one-line worked solution, an extra task field) that the synth stage's
oracle teacher writes inside `<think>` when a task has no target box to zoom on. Answers are integers, scored
by `free_form_match: math` or `exact`. Every task draws from its own stream seeded by (seed, split, index),
like the zoom and synthetic families, and `generate_*` writes the same folder layout
(loupe.data.splits.write_splits).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from PIL import Image, ImageDraw, ImageFont
from pydantic import Field

from loupe.data.splits import SplitConfig, write_splits
from loupe.data.synthetic_draw import PALETTE
from loupe.data.tasks import TaskRecord
from loupe.png import encode_png

# Stream ids apart from the synthetic (1-3) and zoom (101-103) families'.
_STREAMS = {"arithmetic": 201, "counting": 211, "geometry": 221}
_SPLIT_OFFSET = {"train": 0, "val": 1, "test": 2}

Operation = Literal["add", "sub", "mul"]
ShapeName = Literal["circle", "square", "triangle"]
ColourName = Literal["red", "green", "blue", "yellow", "purple", "orange"]
GeometryKind = Literal["triangle_angle", "rectangle_area", "rectangle_perimeter"]

_NAMES = ("Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana")
_THINGS = ("apple", "marble", "pencil", "stamp", "coin", "card", "shell", "book")
_SYMBOL = {"add": "+", "sub": "-", "mul": "*"}


def _rng(family: str, seed: int, split: str, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, _STREAMS[family] + _SPLIT_OFFSET[split], index])


# --- arithmetic ---------------------------------------------------------------------------------------------


class RecipeSplitConfig(SplitConfig):
    """Split sizes of the recipe families: enough distinct questions for a cold start and RL on a laptop."""

    train: int = Field(2000, ge=0)
    """Number of training tasks."""
    val: int = Field(32, ge=0)
    """Number of validation tasks."""
    test: int = Field(200, ge=0)
    """Number of test tasks."""


class ArithmeticConfig(RecipeSplitConfig):
    """Text-only arithmetic questions (`data.arithmetic`)."""

    operations: tuple[Operation, ...] = Field(("add", "sub"), min_length=1)
    """Operations drawn in turn: add, sub (never negative) and mul."""
    operands: tuple[Annotated[int, Field(ge=0)], Annotated[int, Field(ge=0)]] = (0, 9)
    """[min, max] of each operand; answers of add and sub stay within [0, 2 * max]."""
    word_problems: float = Field(0.5, ge=0, le=1)
    """Share of questions worded as a one-line story rather than as `What is a + b?`."""


def make_arithmetic_task(cfg: ArithmeticConfig, split: str, index: int) -> TaskRecord:
    """Task `index` of `split` (no image)."""
    rng = _rng("arithmetic", cfg.seed, split, index)
    operation = cfg.operations[index % len(cfg.operations)]
    a, b = (int(v) for v in rng.integers(cfg.operands[0], cfg.operands[1] + 1, size=2))
    if operation == "sub" and b > a:
        a, b = b, a
    answer = {"add": a + b, "sub": a - b, "mul": a * b}[operation]
    name, thing = _NAMES[int(rng.integers(len(_NAMES)))], _THINGS[int(rng.integers(len(_THINGS)))]
    if rng.random() < cfg.word_problems:
        problem = {
            "add": f"{name} has {a} {thing}s and gets {b} more. How many {thing}s does {name} have now?",
            "sub": f"{name} has {a} {thing}s and gives away {b}. How many {thing}s are left?",
            "mul": f"{name} buys {a} bags with {b} {thing}s in each. How many {thing}s is that?",
        }[operation]
    else:
        problem = f"What is {a} {_SYMBOL[operation]} {b}?"
    return TaskRecord(doc_id=f"arithmetic-{split}-{index:06d}", problem=problem, solution=str(answer),
                      data_source="arithmetic", category=operation,
                      rationale=f"{a} {_SYMBOL[operation]} {b} = {answer}.")


def _save_arithmetic(cfg: ArithmeticConfig, split: str, index: int, folder: Path) -> TaskRecord:
    return make_arithmetic_task(cfg, split, index)


def generate_arithmetic_tasks(out_dir: Path, cfg: ArithmeticConfig, progress: bool = False,
                              workers: int = 1) -> dict[str, Path]:
    """Write the arithmetic splits into `out_dir`; returns {split: jsonl path}."""
    return write_splits(out_dir, cfg, _save_arithmetic, "arithmetic", progress, workers)


def _save_drawn(draw: Callable[..., tuple[TaskRecord, Image.Image]], cfg: RecipeSplitConfig, split: str, index: int,
                folder: Path) -> TaskRecord:
    """Task `index` of `split` drawn by `draw`, its one image saved under `folder` (picklable with partial)."""
    record, image = draw(cfg, split, index)
    (folder / record.images[0]).write_bytes(encode_png(image))
    return record


# --- counting -----------------------------------------------------------------------------------------------


class CountingConfig(RecipeSplitConfig):
    """CLEVR-like counting scenes (`data.counting`)."""

    canvas: tuple[Annotated[int, Field(ge=64, le=2048)], Annotated[int, Field(ge=64, le=2048)]] = (480, 320)
    """Width and height in pixels (CLEVR's renders are 480 x 320)."""
    count: tuple[Annotated[int, Field(ge=0)], Annotated[int, Field(ge=1, le=12)]] = (1, 6)
    """[min, max] of the right answer."""
    object_size: tuple[float, float] = (0.14, 0.2)
    """[min, max] object side as a fraction of the canvas's shorter side."""
    shapes: tuple[ShapeName, ...] = Field(("circle", "square", "triangle"), min_length=1)
    """Shapes objects are drawn as."""
    colours: tuple[ColourName, ...] = Field(("red", "green", "blue", "yellow"), min_length=2)
    """Object colours."""
    colour_questions: float = Field(0.5, ge=0, le=1)
    """Share of questions that count one colour among others ("How many red objects are there?"); the rest
    count every object."""
    distractors: tuple[Annotated[int, Field(ge=0)], Annotated[int, Field(ge=0)]] = (1, 3)
    """[min, max] objects of other colours in a colour question."""


def _place(rng: np.random.Generator, boxes: list[tuple[int, int, int, int]], width: int, height: int,
           side: int) -> tuple[int, int, int, int] | None:
    for _ in range(200):
        x, y = int(rng.integers(4, width - side - 4)), int(rng.integers(4, height - side - 4))
        box = (x, y, x + side, y + side)
        if all(box[2] + 6 <= o[0] or o[2] + 6 <= box[0] or box[3] + 6 <= o[1] or o[3] + 6 <= box[1] for o in boxes):
            return box
    return None


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], colour: tuple[int, int, int]) -> None:
    if shape == "circle":
        draw.ellipse(box, fill=colour, outline=(40, 40, 40), width=2)
    elif shape == "square":
        draw.rectangle(box, fill=colour, outline=(40, 40, 40), width=2)
    else:
        x0, y0, x1, y1 = box
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=colour, outline=(40, 40, 40))


def draw_counting_task(cfg: CountingConfig, split: str, index: int) -> tuple[TaskRecord, Image.Image]:
    """Task `index` of `split` and its scene."""
    rng = _rng("counting", cfg.seed, split, index)
    width, height = cfg.canvas
    answer = int(rng.integers(cfg.count[0], cfg.count[1] + 1))
    by_colour = rng.random() < cfg.colour_questions
    target = cfg.colours[int(rng.integers(len(cfg.colours)))]
    others = [c for c in cfg.colours if c != target]
    extra = int(rng.integers(cfg.distractors[0], cfg.distractors[1] + 1)) if by_colour else 0
    colours = [target if by_colour else cfg.colours[int(rng.integers(len(cfg.colours)))] for _ in range(answer)]
    colours += [others[int(rng.integers(len(others)))] for _ in range(extra)]
    image = Image.new("RGB", (width, height), (150, 150, 146))
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, int(height * 0.35), width, height), fill=(132, 132, 128))  # a floor, as CLEVR's
    short = min(width, height)
    boxes: list[tuple[int, int, int, int]] = []
    for k, colour in enumerate(colours):
        side = max(8, round(rng.uniform(*cfg.object_size) * short))
        box = _place(rng, boxes, width, height, side)
        if box is None:
            raise RuntimeError(f"counting task {split}/{index}: no room for object {k + 1} of {len(colours)}; "
                               "lower data.counting.count or object_size")
        boxes.append(box)
        _draw_shape(draw, cfg.shapes[int(rng.integers(len(cfg.shapes)))], box, PALETTE[colour])
    if by_colour:
        problem = f"How many {target} objects are there in the image?"
        rationale = f"I count the {target} objects: there are {answer}."
    else:
        problem = "How many objects are there in the image?"
        rationale = f"I count the objects: there are {answer}."
    record = TaskRecord(doc_id=f"counting-{split}-{index:06d}", images=[f"images/{split}/{index:06d}.png"],
                        problem=problem, solution=str(answer), data_source="counting",
                        category="colour" if by_colour else "all", rationale=rationale)
    return record, image


def generate_counting_tasks(out_dir: Path, cfg: CountingConfig, progress: bool = False,
                            workers: int = 1) -> dict[str, Path]:
    """Write the counting splits into `out_dir`; returns {split: jsonl path}."""
    return write_splits(out_dir, cfg, partial(_save_drawn, draw_counting_task), "counting", progress, workers)


# --- geometry -----------------------------------------------------------------------------------------------


class GeometryConfig(RecipeSplitConfig):
    """Labelled figures with numeric answers (`data.geometry`)."""

    side: int = Field(336, ge=64, le=2048)
    """Width and height of the figure in pixels."""
    kinds: tuple[GeometryKind, ...] = Field(("triangle_angle", "rectangle_area", "rectangle_perimeter"), min_length=1)
    """Question kinds, drawn in turn: the third angle of a triangle from two; a rectangle's area or perimeter."""
    angle_step: int = Field(10, ge=1, le=30)
    """Given angles are multiples of this many degrees."""
    lengths: tuple[Annotated[int, Field(ge=1)], Annotated[int, Field(ge=1)]] = (1, 9)
    """[min, max] rectangle side lengths."""


def _font(size: int) -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow without FreeType: its bitmap font has one size
        return ImageFont.load_default()


def draw_geometry_task(cfg: GeometryConfig, split: str, index: int) -> tuple[TaskRecord, Image.Image]:
    """Task `index` of `split` and its figure."""
    rng = _rng("geometry", cfg.seed, split, index)
    kind = cfg.kinds[index % len(cfg.kinds)]
    s = cfg.side
    image = Image.new("RGB", (s, s), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    font = _font(max(10, s // 14))
    ink = (20, 20, 20)
    if kind == "triangle_angle":
        steps = 180 // cfg.angle_step
        while True:
            a, b = (int(v) * cfg.angle_step for v in rng.integers(1, steps, size=2))
            if a + b < 180:
                break
        c = 180 - a - b
        # Drawn to its angles (law of sines), then fitted into the square.
        ac = math.sin(math.radians(b)) / math.sin(math.radians(c))
        corners = [(0.0, 0.0), (1.0, 0.0), (ac * math.cos(math.radians(a)), ac * math.sin(math.radians(a)))]
        xs, ys = [x for x, _ in corners], [y for _, y in corners]
        scale = 0.7 * s / max(max(xs) - min(xs), max(ys) - min(ys))
        ox = (s - scale * (max(xs) - min(xs))) / 2 - scale * min(xs)
        oy = (s + scale * max(ys)) / 2
        points = [(ox + scale * x, oy - scale * y) for x, y in corners]
        draw.polygon(points, outline=ink, width=max(2, s // 100))
        # Each base vertex's name and given angle below it (inside, a flat triangle's labels would collide).
        draw.text((points[0][0] - 0.1 * s, points[0][1] + 0.02 * s), f"A {a}°", fill=ink, font=font)
        draw.text((points[1][0] - 0.05 * s, points[1][1] + 0.02 * s), f"B {b}°", fill=ink, font=font)
        draw.text((points[2][0] - 0.02 * s, points[2][1] - 0.1 * s), "C", fill=ink, font=font)
        problem = (f"In triangle ABC, angle A = {a}° and angle B = {b}°. "
                   "What is the measure of angle C in degrees?")
        answer = c
        rationale = f"The angles of a triangle add up to 180, so C = 180 - {a} - {b} = {c}."
    else:
        w, h = (int(v) for v in rng.integers(cfg.lengths[0], cfg.lengths[1] + 1, size=2))
        scale = 0.7 * s / max(w, h, 1)
        x0, y0 = (s - w * scale) / 2, (s - h * scale) / 2
        draw.rectangle((x0, y0, x0 + w * scale, y0 + h * scale), outline=ink, width=max(2, s // 100))
        draw.text((x0 + w * scale / 2 - 0.03 * s, y0 + h * scale + 0.02 * s), str(w), fill=(200, 30, 30), font=font)
        draw.text((x0 + w * scale + 0.02 * s, y0 + h * scale / 2 - 0.03 * s), str(h), fill=(200, 30, 30), font=font)
        if kind == "rectangle_area":
            problem = f"The rectangle in the figure is {w} wide and {h} tall. What is its area?"
            answer, rationale = w * h, f"Area = width * height = {w} * {h} = {w * h}."
        else:
            problem = f"The rectangle in the figure is {w} wide and {h} tall. What is its perimeter?"
            answer, rationale = 2 * (w + h), f"Perimeter = 2 * ({w} + {h}) = {2 * (w + h)}."
    record = TaskRecord(doc_id=f"geometry-{split}-{index:06d}", images=[f"images/{split}/{index:06d}.png"],
                        problem=problem, solution=str(answer), data_source="geometry", category=kind,
                        rationale=rationale)
    return record, image


def generate_geometry_tasks(out_dir: Path, cfg: GeometryConfig, progress: bool = False,
                            workers: int = 1) -> dict[str, Path]:
    """Write the geometry splits into `out_dir`; returns {split: jsonl path}."""
    return write_splits(out_dir, cfg, partial(_save_drawn, draw_geometry_task), "geometry", progress, workers)
