"""Zoom tasks: a question whose answer is legible only after zooming, at a place the downscaled view shows.

Each task is a canvas (1024-1536 px a side by default) on the synthetic tasks' muted textured background
with one or more square **frames** (thick, visible at the downscaled view the model is first shown) and
in the centre of each frame a small solid **patch** of one answer colour. The question names one frame by
its colour and asks for the colour of the patch inside it::

    What colour is the small square inside the black frame? Answer with one colour word.

The patch is a few pixels at the downscaled view (where bicubic resampling mixes it with its surroundings)
and tens of pixels in a crop of the frame, so the crop tool is necessary and where to crop is visible.
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
import multiprocessing
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from tqdm import tqdm

from loupe.data.synthetic_draw import PALETTE, Box, Canvas, encode_png, textured_background
from loupe.data.tasks import OPTION_LETTERS, TaskRecord, write_tasks
from loupe.io import atomic_directory

SPLITS = ("train", "val", "test")
# Stream ids apart from the synthetic generator's (1, 2, 3), so the two families never share a canvas.
_SPLIT_STREAMS = {"train": 101, "val": 102, "test": 103}
_MAX_ATTEMPTS = 20
DATA_SOURCE = "zoom"

ColourName = Literal["red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white"]
CanvasSide = Annotated[int, Field(ge=256, le=4096)]
Fraction = Annotated[float, Field(gt=0, le=0.3)]


class ZoomTaskConfig(BaseModel):
    """How zoom tasks are drawn (a `data` section variant; every size is a fraction of the canvas's shorter side)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    seed: int = Field(0, ge=0)
    """Root seed; task i of a split draws from its own stream seeded by (seed, split, i)."""
    train: int = Field(320, ge=0)
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
    marker_size: tuple[Fraction, Fraction] = (0.07, 0.10)
    """[min, max] outer side of a frame."""
    frame_width: float = Field(0.14, gt=0, le=0.3)
    """Frame line width as a fraction of the frame's side."""
    patch_size: tuple[Fraction, Fraction] = (0.010, 0.014)
    """[min, max] side of the answer patch (and of the decoys)."""
    decoys: tuple[Annotated[int, Field(ge=0, le=200)], Annotated[int, Field(ge=0, le=200)]] = (8, 16)
    """[min, max] decoy patches of the answer colours scattered away from the frames."""
    grid: int | None = Field(3, ge=1, le=6)
    """Frames sit at the centres of a grid x grid layout (with `grid_jitter`); None places them anywhere."""
    grid_jitter: float = Field(0.1, ge=0, le=0.3)
    """Largest shift of a frame from its cell's centre, as a fraction of the cell."""
    answer_format: Literal["free", "choice"] = "free"
    """free: answer with a colour word (exact match); choice: option letters over shuffled colour options."""
    option_count: int = Field(4, ge=2, le=10)
    """Options of a choice question (capped by the number of colours)."""
    bbox_target: Literal["marker", "patch"] = "marker"
    """What the record's `bbox` (the oracle's target) covers: the named frame, or its patch alone."""
    png_compress_level: int = Field(1, ge=0, le=9)
    """zlib level of the saved PNGs: lower is faster and larger; pixels are the same at every level."""

    @field_validator("canvas_side", "markers", "marker_size", "patch_size", "decoys")
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
        if self.grid is not None and self.grid * self.grid < self.markers[1]:
            raise ValueError(f"grid: {self.grid}x{self.grid} cells cannot hold {self.markers[1]} frames")
        inner = self.marker_size[0] * (1 - 2 * self.frame_width)
        if self.patch_size[1] > 0.6 * inner:
            raise ValueError("patch_size: the largest patch must fit well inside the smallest frame's opening "
                             f"(at most {0.6 * inner:.4f})")
        return self

    def split_size(self, split: str) -> int:
        """Number of tasks of `split`."""
        return {"train": self.train, "val": self.val, "test": self.test}[split]


class _NoRoom(Exception):
    """The layout did not fit this canvas; the task is redrawn from the same random stream."""


def _pick(rng: np.random.Generator, choices: Sequence[str]) -> str:
    return choices[int(rng.integers(len(choices)))]


def _square(centre: tuple[int, int], side: int) -> Box:
    x0, y0 = centre[0] - side // 2, centre[1] - side // 2
    return (x0, y0, x0 + side, y0 + side)


def _marker_centres(rng: np.random.Generator, cfg: ZoomTaskConfig, canvas: Canvas, count: int,
                    side: int) -> list[tuple[int, int]]:
    """Centres of `count` frames `side` px wide: distinct grid cells, or free spots apart from each other."""
    edge = max(4, side // 4)
    if cfg.grid is not None:
        g = cfg.grid
        cell_w, cell_h = canvas.width / g, canvas.height / g
        centres = []
        for cell in rng.permutation(g * g)[:count].tolist():
            cx = (cell % g + 0.5) * cell_w + rng.uniform(-1, 1) * cfg.grid_jitter * cell_w
            cy = (cell // g + 0.5) * cell_h + rng.uniform(-1, 1) * cfg.grid_jitter * cell_h
            half = side / 2 + edge
            centres.append((round(min(max(cx, half), canvas.width - half)),
                            round(min(max(cy, half), canvas.height - half))))
        return centres
    centres = []
    footprint = (-(side // 2), -(side // 2), side - side // 2, side - side // 2)
    for _ in range(count):
        centre = canvas.find_centre(rng, footprint, side // 2, edge)
        if centre is None:
            raise _NoRoom
        canvas.reserve(_square(centre, side), side // 2)
        centres.append(centre)
    return centres


def _relative_box(box: Box, width: int, height: int) -> list[float]:
    # Rounded outward to 4 decimals, so the stored box still covers every pixel of the box.
    return [max(0.0, math.floor(box[0] / width * 1e4) / 1e4), max(0.0, math.floor(box[1] / height * 1e4) / 1e4),
            min(1.0, math.ceil(box[2] / width * 1e4) / 1e4), min(1.0, math.ceil(box[3] / height * 1e4) / 1e4)]


def draw_zoom_task(cfg: ZoomTaskConfig, split: str, index: int) -> tuple[TaskRecord, Image.Image, dict]:
    """Task `index` of `split`: its record, its canvas, and the layout (pixel boxes of frames, patches, decoys)."""
    rng = np.random.default_rng([cfg.seed, _SPLIT_STREAMS[split], index])
    count = int(rng.integers(cfg.markers[0], cfg.markers[1] + 1))
    answer = _pick(rng, cfg.colours)
    for _ in range(_MAX_ATTEMPTS):
        width, height = (int(v) for v in rng.integers(cfg.canvas_side[0], cfg.canvas_side[1] + 1, size=2))
        short = min(width, height)
        canvas = Canvas(textured_background(rng, width, height))
        side = max(12, round(rng.uniform(*cfg.marker_size) * short))
        patch = max(2, round(rng.uniform(*cfg.patch_size) * short))
        try:
            centres = _marker_centres(rng, cfg, canvas, count, side)
            break
        except _NoRoom:
            continue
    else:  # pragma: no cover - only a config far outside sensible ranges gets here
        raise RuntimeError(f"zoom task {split}/{index}: no layout fitted in {_MAX_ATTEMPTS} attempts")

    frame_colours = [cfg.marker_colours[i] for i in rng.permutation(len(cfg.marker_colours))[:count].tolist()]
    patch_colours = [answer] + [_pick(rng, cfg.colours) for _ in range(count - 1)]
    border = max(2, round(cfg.frame_width * side))
    frames, patches = [], []
    for centre, frame_colour, patch_colour in zip(centres, frame_colours, patch_colours):
        frame = _square(centre, side)
        canvas.draw_frame(frame, frame_colour, border)
        square = _square(centre, patch)
        canvas.draw.rectangle([square[0], square[1], square[2] - 1, square[3] - 1], fill=PALETTE[patch_colour])
        canvas.reserve(frame, max(patch, side // 4))
        frames.append(frame)
        patches.append(square)

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

    ask = f"What colour is the small square inside the {frame_colours[0]} frame?"
    if cfg.answer_format == "choice":
        n = min(cfg.option_count, len(cfg.colours))
        wrong = [c for c in cfg.colours if c != answer]
        options = [answer] + [wrong[i] for i in rng.choice(len(wrong), size=n - 1, replace=False).tolist()]
        options = [options[i] for i in rng.permutation(n).tolist()]
        solution, problem = OPTION_LETTERS[options.index(answer)], ask
    else:
        options, solution, problem = None, answer, f"{ask} Answer with one colour word."
    target = frames[0] if cfg.bbox_target == "marker" else patches[0]
    record = TaskRecord(
        doc_id=f"zoom-{split}-{index:06d}",
        images=[f"images/{split}/{index:06d}.png"],
        problem=problem,
        solution=solution,
        data_source=DATA_SOURCE,
        options=options,
        category=f"zoom/{'single' if count == 1 else 'multi'}",
        bbox=_relative_box(target, width, height),
    )
    layout = {"frames": frames, "patches": patches, "decoys": decoys, "frame_colours": frame_colours,
              "patch_colours": patch_colours, "answer": answer}
    return record, canvas.image, layout


def make_zoom_task(cfg: ZoomTaskConfig, split: str, index: int) -> tuple[TaskRecord, Image.Image]:
    """Task `index` of `split`: its record (image path relative to the output folder) and its canvas."""
    record, image, _ = draw_zoom_task(cfg, split, index)
    return record, image


def chance_rate(records: Sequence[TaskRecord]) -> float:
    """Accuracy of guessing without looking: for free-form records the commonest answer's share (the best
    constant guess), for choice records 1 / option count; averaged over the records."""
    if not records:
        return 0.0
    free = [r.solution for r in records if not r.is_choice]
    choice = sum(1.0 / len(r.options or []) for r in records if r.is_choice)
    best_constant = max(Counter(free).values()) if free else 0
    return (best_constant + choice) / len(records)


def _make_and_save(cfg: ZoomTaskConfig, split: str, index: int, folder: Path) -> TaskRecord:
    record, image = make_zoom_task(cfg, split, index)
    (folder / record.images[0]).write_bytes(encode_png(image, cfg.png_compress_level))
    return record


def _check_replaceable(out_dir: Path) -> None:
    """Refuse to replace a folder that does not look like an earlier output of a task generator."""
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"{out_dir}: output path exists and is not a folder")
    if out_dir.is_dir():
        ours = {f"{s}.jsonl" for s in SPLITS} | {"images"}
        entries = {p.name for p in out_dir.iterdir()}
        if entries and not entries & ours:
            raise FileExistsError(f"{out_dir}: folder holds files that are not task files ({sorted(entries)[:5]}); "
                                  "refusing to replace it, pick an empty or new folder")


def generate_zoom_tasks(out_dir: Path, cfg: ZoomTaskConfig, progress: bool = False, workers: int = 1) -> dict[str, Path]:
    """Write `out_dir/{train,val,test}.jsonl` and their images; return {split: jsonl path}.

    Same contract as `loupe.data.synthetic.generate_tasks`: the folder is built beside `out_dir` and swapped
    in whole; `workers` > 1 draws tasks in spawned processes; the files are byte-identical for any `workers`.
    """
    out_dir = Path(out_dir)
    _check_replaceable(out_dir)
    with atomic_directory(out_dir) as tmp:
        spawn = multiprocessing.get_context("spawn")
        pool = ProcessPoolExecutor(workers, mp_context=spawn) if workers > 1 else None
        try:
            for split in SPLITS:
                count = cfg.split_size(split)
                (tmp / "images" / split).mkdir(parents=True)
                args = ([cfg] * count, [split] * count, range(count), [tmp] * count)
                results = pool.map(_make_and_save, *args, chunksize=4) if pool else map(_make_and_save, *args)
                records = list(tqdm(results, total=count, desc=f"zoom {split}", unit="task", disable=not progress))
                write_tasks(records, tmp / f"{split}.jsonl")
        finally:
            if pool is not None:
                pool.shutdown(cancel_futures=True)
    return {split: out_dir / f"{split}.jsonl" for split in SPLITS}
