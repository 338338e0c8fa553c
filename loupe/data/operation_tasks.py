"""Operation tasks: questions a crop cannot answer, each needing one of Pixelis' visual operations.

Three kinds, drawn in turn (task i is kind `kinds[i % len(kinds)]`):

- **sign**: small signs, each a word in black on white, one in each cell of a row of three (left, middle,
  right). The question names a cell and asks for its word. At the model's downscaled view the letters are a
  pixel high; reading them is `read_text` (RapidOCR) on the cell's box::

      What word is written on the sign in the middle of the image? Answer with one word.

- **shape**: a small solid shape (circle, square or triangle) in each cell. The question asks for the shape in
  one cell. The shape is a few pixels at the downscaled view; `segment_at` on its centre, then
  `get_properties` on the mask, names it::

      What shape is the object on the left of the image? Answer with one word: circle, square or triangle.

- **motion**: a short video (a folder of frames) in which a small square in each cell moves in a straight line
  (left, right, up or down). The question asks where one of them goes; `track_object` from its box on the
  first frame answers::

      Which way does the square on the right of the video move? Answer with one word: left, right, up or down.

Every item sits at its cell's centre on one row of three, the layout the zoom tasks teach the tiny model
(loupe.data.zoom_tasks, CELL_NAMES); the other two cells hold decoys with other answers, so the question must be
read to pick the place. Answers are balanced within each kind (task i's answer is the kind's
`(i // len(kinds) + seed) mod count`-th), so a kind's chance rate is 1 / its answer count.

Records are ordinary task records (loupe.data.tasks) with two fields the oracle teacher (stages/synth/oracle.py)
plans from: `bbox`, the box to operate on (the sign's cell box, the shape's box, the square's box on frame 1),
and `operation`, the registered visual operation that answers (`read_text`, `segment_at`, `track_object`;
loupe.visual_ops). A motion task's frames are PNGs in `images/<split>/<index>/` named by its `video` field;
the other kinds' canvases are `images/<split>/<index>.png`, the layout of the other families.

`generate_operation_tasks(out_dir, cfg)` writes `out_dir/{train,val,test}.jsonl` and the images; every task
draws from its own random stream seeded by (seed, split, index), so a config always gives the same files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from PIL import Image, ImageDraw, ImageFont
from pydantic import Field, ValidationInfo, field_validator, model_validator

from loupe.data.splits import SplitConfig, write_splits
from loupe.data.synthetic_draw import PALETTE, textured_background
from loupe.data.tasks import TaskRecord
from loupe.data.zoom_tasks import CELL_NAMES, CELL_PREPOSITIONS
from loupe.png import encode_png

_SPLIT_STREAMS = {"train": 201, "val": 202, "test": 203}
DATA_SOURCE = "operations"
CELLS = CELL_NAMES[(1, 3)]
"""The row of three cells every item sits in: left, middle, right."""

Kind = Literal["sign", "shape", "motion"]
ShapeName = Literal["circle", "square", "triangle"]
Direction = Literal["left", "right", "up", "down"]
ColourName = Literal["red", "green", "blue", "yellow", "orange", "purple"]
Fraction = Annotated[float, Field(gt=0, le=0.3)]

OPERATION_OF_KIND: dict[str, str] = {"sign": "read_text", "shape": "segment_at", "motion": "track_object"}
"""The visual operation that answers each kind (the oracle's first call; a shape's mask is then read with
`get_properties`)."""


class OperationTaskConfig(SplitConfig):
    """How operation tasks are drawn (`data.operations` in params.yaml; sizes are fractions of the shorter side)."""

    train: int = Field(640, ge=0)
    """Number of training tasks."""
    val: int = Field(32, ge=0)
    """Number of validation tasks."""
    test: int = Field(200, ge=0)
    """Number of test tasks (held out: the eval stage's `synthetic` benchmark reads test.jsonl)."""
    kinds: tuple[Kind, ...] = ("sign", "shape", "motion")
    """The kinds drawn, in turn."""
    canvas_side: tuple[Annotated[int, Field(ge=256, le=4096)], Annotated[int, Field(ge=256, le=4096)]] = (768, 1024)
    """[min, max] width and height of a sign or shape canvas in pixels, each drawn independently."""
    words: tuple[Annotated[str, Field(pattern=r"^[A-Z0-9]{2,8}$")], ...] = ("EXIT", "OPEN", "STOP", "PARK")
    """The signs' words (capitals and digits, 2-8 characters): the answers of sign tasks."""
    text_height: tuple[Fraction, Fraction] = (0.016, 0.02)
    """[min, max] font size of a sign's word. RapidOCR reads 14 px and up; the model's view shows about 1 px."""
    shapes: tuple[ShapeName, ...] = ("circle", "square", "triangle")
    """The shapes drawn: the answers of shape tasks (the words `get_properties` names them with)."""
    shape_colours: tuple[ColourName, ...] = ("red", "green", "blue", "yellow")
    """Fill colours of the shapes and moving squares, each far from the muted background in some channel, so a
    flood fill from the object's centre stops at its outline."""
    object_size: tuple[Fraction, Fraction] = (0.04, 0.05)
    """[min, max] side of a shape."""
    frames: int = Field(8, ge=3, le=32)
    """Frames of a motion video (the protocol shows at most `video_max_frames` of them)."""
    frame_size: tuple[Annotated[int, Field(ge=96, le=1024)], Annotated[int, Field(ge=96, le=1024)]] = (384, 256)
    """Width and height of a motion video's frames in pixels."""
    square_size: float = Field(0.05, gt=0, le=0.2)
    """Side of a moving square, as a fraction of the frame's height."""
    travel: float = Field(0.12, gt=0, le=0.15)
    """How far a square moves from the first frame to the last, as a fraction of the frame's side along its
    direction (at most 0.15: a square in the left cell moving left stays in the frame)."""
    directions: tuple[Direction, ...] = ("left", "right", "up", "down")
    """The directions drawn: the answers of motion tasks."""
    view_side: float = Field(0.2, gt=0, le=0.33)
    """Side of the box a sign task's `bbox` gives (one box per cell, relative to each side): it holds the sign
    and none of its neighbours."""
    png_compress_level: int = Field(1, ge=0, le=9)
    """zlib level of the saved PNGs."""

    @field_validator("canvas_side", "text_height", "object_size")
    @classmethod
    def _range_is_ordered(cls, value: tuple, info: ValidationInfo) -> tuple:
        if value[0] > value[1]:
            raise ValueError(f"{info.field_name}: minimum {value[0]} is above maximum {value[1]}")
        return value

    @field_validator("kinds", "words", "shapes", "shape_colours", "directions")
    @classmethod
    def _distinct_and_enough(cls, value: tuple, info: ValidationInfo) -> tuple:
        if len(set(value)) != len(value):
            raise ValueError(f"{info.field_name}: an entry is listed twice")
        wanted = 1 if info.field_name == "kinds" else 3  # three cells: the answer and two decoys, all different
        if len(value) < wanted:
            raise ValueError(f"{info.field_name}: at least {wanted} are needed")
        return value

    @model_validator(mode="after")
    def _sign_fits_its_box(self) -> OperationTaskConfig:
        # A sign is about (characters + 1) x 0.62 font sizes wide; it must fit the cell's view box.
        widest = (max(len(w) for w in self.words) + 1) * 0.62 * self.text_height[1]
        if widest > self.view_side * 0.9:
            raise ValueError(f"view_side: {self.view_side} cannot hold a sign about {widest:.3f} wide; use a larger "
                             "view_side, a smaller text_height or shorter words")
        return self


def _cell_centre(cell: int) -> float:
    return (cell + 0.5) / len(CELLS)


def _view_box(cell: int, side: float) -> list[float]:
    """The fixed box of relative side `side` around the centre of `cell` (2 decimals)."""
    centre = _cell_centre(cell)
    return [round(centre - side / 2, 2), round(0.5 - side / 2, 2), round(centre + side / 2, 2), round(0.5 + side / 2, 2)]


def _relative(box: tuple[float, float, float, float], width: int, height: int) -> list[float]:
    return [round(box[0] / width, 4), round(box[1] / height, 4), round(box[2] / width, 4), round(box[3] / height, 4)]


def _answers_by_cell(rng: np.random.Generator, answer: str, choices: tuple[str, ...]) -> tuple[int, list[str]]:
    """The named cell and the answer of every cell: the answer in the named cell, two others elsewhere."""
    cell = int(rng.integers(len(CELLS)))
    others = [c for c in choices if c != answer]
    decoys = [others[i] for i in rng.permutation(len(others))[:len(CELLS) - 1].tolist()]
    return cell, decoys[:cell] + [answer] + decoys[cell:]


def _where(cell: int, medium: str) -> str:
    return f"{CELL_PREPOSITIONS.get(CELLS[cell], 'in')} the {CELLS[cell]} of the {medium}"


def _draw_sign(draw: ImageDraw.ImageDraw, centre: tuple[float, float], word: str, size: int) -> None:
    font = ImageFont.load_default(size=size)
    left, top, right, bottom = draw.textbbox((0, 0), word, font=font)
    pad = max(3, size // 2)
    width, height = right - left + 2 * pad, bottom - top + 2 * pad
    x0, y0 = round(centre[0] - width / 2), round(centre[1] - height / 2)
    draw.rectangle([x0, y0, x0 + width - 1, y0 + height - 1], fill=(250, 250, 250))
    draw.text((x0 + pad - left, y0 + pad - top), word, fill=(20, 20, 20), font=font)


def _shape_outline(shape: str, centre: tuple[float, float], side: int) -> tuple[str, list[float]]:
    cx, cy, half = centre[0], centre[1], side / 2
    box = [cx - half, cy - half, cx + half - 1, cy + half - 1]
    if shape == "triangle":  # apex up: the box's centre lies inside it
        return "polygon", [cx, cy - half, cx + half - 1, cy + half - 1, cx - half, cy + half - 1]
    return ("ellipse" if shape == "circle" else "rectangle"), box


def draw_sign_or_shape(cfg: OperationTaskConfig, kind: str, answer: str, split: str, index: int,
                       rng: np.random.Generator) -> tuple[TaskRecord, Image.Image]:
    width, height = (int(v) for v in rng.integers(cfg.canvas_side[0], cfg.canvas_side[1] + 1, size=2))
    short = min(width, height)
    image = textured_background(rng, width, height)
    draw = ImageDraw.Draw(image)
    cell, answers = _answers_by_cell(rng, answer, cfg.words if kind == "sign" else cfg.shapes)
    target_box: list[float] = []
    for i, value in enumerate(answers):
        centre = (_cell_centre(i) * width, 0.5 * height)
        if kind == "sign":
            _draw_sign(draw, centre, value, max(14, round(rng.uniform(*cfg.text_height) * short)))
        else:
            side = max(12, round(rng.uniform(*cfg.object_size) * short))
            colour = PALETTE[cfg.shape_colours[int(rng.integers(len(cfg.shape_colours)))]]
            method, outline = _shape_outline(value, centre, side)
            getattr(draw, method)(outline, fill=colour)
            if i == cell:
                half = side / 2
                target_box = _relative((centre[0] - half, centre[1] - half, centre[0] + half, centre[1] + half),
                                       width, height)
    if kind == "sign":
        problem = f"What word is written on the sign {_where(cell, 'image')}? Answer with one word."
        bbox = _view_box(cell, cfg.view_side)
    else:
        problem = (f"What shape is the object {_where(cell, 'image')}? Answer with one word: "
                   f"{', '.join(cfg.shapes[:-1])} or {cfg.shapes[-1]}.")
        bbox = target_box
    record = TaskRecord(doc_id=f"operations-{split}-{index:06d}", images=[f"images/{split}/{index:06d}.png"],
                        problem=problem, solution=answer, data_source=DATA_SOURCE, category=f"operations/{kind}",
                        bbox=bbox, operation=OPERATION_OF_KIND[kind])
    return record, image


_STEP = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}


def draw_motion(cfg: OperationTaskConfig, answer: str, split: str, index: int,
                rng: np.random.Generator) -> tuple[TaskRecord, list[Image.Image]]:
    width, height = cfg.frame_size
    background = textured_background(rng, width, height)
    side = max(6, round(cfg.square_size * height))
    cell, directions = _answers_by_cell(rng, answer, cfg.directions)
    colours = [cfg.shape_colours[i] for i in rng.permutation(len(cfg.shape_colours))[:len(CELLS)].tolist()]
    frames = []
    for f in range(cfg.frames):
        frame = background.copy()
        draw = ImageDraw.Draw(frame)
        for i, (direction, colour) in enumerate(zip(directions, colours)):
            dx, dy = _STEP[direction]
            moved = cfg.travel * f / (cfg.frames - 1)
            x0 = round(_cell_centre(i) * width + dx * moved * width - side / 2)
            y0 = round(0.5 * height + dy * moved * height - side / 2)
            draw.rectangle([x0, y0, x0 + side - 1, y0 + side - 1], fill=PALETTE[colour])
        frames.append(frame)
    # The tracked box: the named square on frame 1 with a 2-px rim of background, which the match keeps aligned.
    x0, y0 = round(_cell_centre(cell) * width - side / 2), round(0.5 * height - side / 2)
    bbox = _relative((x0 - 2, y0 - 2, x0 + side + 2, y0 + side + 2), width, height)
    problem = (f"Which way does the square {_where(cell, 'video')} move? Answer with one word: "
               f"{', '.join(cfg.directions[:-1])} or {cfg.directions[-1]}.")
    record = TaskRecord(doc_id=f"operations-{split}-{index:06d}", video=f"images/{split}/{index:06d}",
                        problem=problem, solution=answer, data_source=DATA_SOURCE, category="operations/motion",
                        bbox=bbox, operation=OPERATION_OF_KIND["motion"])
    return record, frames


def task_answer(cfg: OperationTaskConfig, index: int) -> tuple[str, str]:
    """Task `index`'s kind and answer: kinds in turn, each kind's answers in turn."""
    kind = cfg.kinds[index % len(cfg.kinds)]
    choices = {"sign": cfg.words, "shape": cfg.shapes, "motion": cfg.directions}[kind]
    return kind, choices[(index // len(cfg.kinds) + cfg.seed) % len(choices)]


def make_operation_task(cfg: OperationTaskConfig, split: str, index: int
                        ) -> tuple[TaskRecord, Image.Image | list[Image.Image]]:
    """Task `index` of `split`: its record and its canvas (a motion task: its frames)."""
    rng = np.random.default_rng([cfg.seed, _SPLIT_STREAMS[split], index])
    kind, answer = task_answer(cfg, index)
    if kind == "motion":
        return draw_motion(cfg, answer, split, index, rng)
    return draw_sign_or_shape(cfg, kind, answer, split, index, rng)


def _make_and_save(cfg: OperationTaskConfig, split: str, index: int, folder: Path) -> TaskRecord:
    record, drawn = make_operation_task(cfg, split, index)
    if isinstance(drawn, list):
        clip = folder / str(record.video)
        clip.mkdir()
        for number, frame in enumerate(drawn, start=1):
            (clip / f"{number:03d}.png").write_bytes(encode_png(frame, cfg.png_compress_level))
    else:
        (folder / record.images[0]).write_bytes(encode_png(drawn, cfg.png_compress_level))
    return record


def generate_operation_tasks(out_dir: Path, cfg: OperationTaskConfig, progress: bool = False,
                             workers: int = 1) -> dict[str, Path]:
    """Write `out_dir/{train,val,test}.jsonl` and their images and frames; return {split: jsonl path}."""
    return write_splits(out_dir, cfg, _make_and_save, "operations", progress, workers)
