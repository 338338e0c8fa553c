"""Tools the model can call, looked up by name; the crop tool first.

The crop tool takes a box on a named source (the original image, or an earlier observation), clamps it to
that source, refuses degenerate boxes, and cuts the region from the original's full-resolution pixels: a box on
an observation is composed with the region of the original that observation shows, so each zoom can show more
detail than the last. This is Mini-o3's semantics: its rollout (`AsyncvLLMEngine.process_tool_call` in
verl/workers/rollout/vllm_rollout/vllm_async_engine.py, with `crop_image(..., resize=1)` and
`prepare_grounding_inputs_multi_turn` in function_tools.py) keeps each observation as the full-resolution crop
and shows the model a resized copy. Loupe keeps the region instead of the crop and composes the boxes in floats,
rounding outwards once on the original (Mini-o3 truncates each box to whole pixels with int()). The crop is
then resized into the pixel budget with the rule the model's image processor uses (`smart_resize`: sides
multiples of the model's grid, its patch times its merge, 28 px for Qwen2.5-VL and 32 for Qwen3-VL and Qwen3.5;
area within min/max pixels), so the processor does not resize it again.

A tool never raises on a model's request: `run_tool` returns either a result or a typed `ToolError` that the
rollout loop sends back as an error observation. Images the user supplied are another matter: a missing,
corrupt, truncated or oversized file, or a path outside the configured image root, raises `ImageError` naming
the file (see `loupe.images`), because that is the data's fault, not the model's.

Every tool is registered in `TOOLS` by name. The visual operations beyond the crop (segment, properties, read
text, rotate, select frames, track: `loupe.visual_ops`) register with `operation`, which types their arguments
with a pydantic model, and give back a `ToolResult`: new images (`NewImage`, each an image of its own that a
later crop cuts from), a text observation, or both.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from PIL import Image
from pydantic import BaseModel, ValidationError

from loupe.images import (  # noqa: F401 (re-exported)
    DEFAULT_MAX_DECODE_PIXELS,
    MAX_ASPECT_RATIO,
    ImageError,
    open_image,
)
from loupe.protocol import ORIGINAL_IMAGE, ToolCall

IMAGE_FACTOR = 28
"""Qwen2.5-VL's patch (14) times its spatial merge (2): the grid when no model says otherwise (a teacher without
a model); an engine's model gives its own (`PixelBudget.factor`, loupe.models.family)."""
QWEN_PROCESSOR_PIXELS = (3136, 12_845_056)
"""Qwen2.5-VL's image processor's own bounds (4 x 28 x 28 to 16,384 x 28 x 28 pixels, its
preprocessor_config.json's `min_pixels`, `max_pixels`): what its processor resizes into when no model says
otherwise (`PixelBudget.processor_pixels`)."""


CROP_CUTS = ("composed", "whole_pixels", "shown", "rounded")
"""How a crop's pixels are cut (`PixelBudget.crop_cut`); the `crop` docstring says what each does."""
CROP_RESAMPLES = ("bicubic", "mini_o3")
"""How a crop is resized for the model (`protocol.crop_resample`, `fit_crop`)."""


@dataclass(frozen=True)
class PixelBudget:
    """How many pixels an image given to the model may have (Mini-o3: 40,000 to 2,000,000), and how crops are cut."""

    min_pixels: int = 40_000
    max_pixels: int = 2_000_000
    min_crop_side: int = 1
    """A crop whose shorter side, in pixels of the image it is cut from (the original, except with
    `crop_cut: shown`), is below this is refused (DeepEyes: 31, its tool needs both sides above 30 px;
    Pixel-Reasoner: 29, its tool asserts both sides above 28 px)."""
    crop_min_pixels: int | None = None
    """Smallest area of a crop shown to the model; None: `min_pixels` (Pixel-Reasoner: 3,136)."""
    crop_max_pixels: int | None = None
    """Largest area of a crop shown to the model; None: `max_pixels` (Pixel-Reasoner: 784,000 for crops against
    1,568,000 for the question's image)."""
    crop_padding: float = 0.0
    """Added to each side of a box before it is cut, as a fraction of the source's side, then clamped to the
    source (Pixel-Reasoner's `crop_image_normalized`: 0.1)."""
    crop_cut: str = "composed"
    """Whose pixels a crop is cut from and how it is rounded: one of `CROP_CUTS` (`crop`)."""
    crop_resample: str = "bicubic"
    """How a crop is resized into the budget: `bicubic` (straight to Qwen's size) or `mini_o3` (`fit_crop`)."""
    factor: int = IMAGE_FACTOR
    """The model's grid (patch x merge): every side an image is shown at is a multiple of it, as its processor
    would resize it, so the processor never resizes it again."""
    image_resample: str = "bicubic"
    """How the question's image is resized for the model: `bicubic` or `mini_o3` (`fit_image`)."""
    processor_pixels: tuple[int, int] | None = None
    """(min, max) area the model's image processor resizes into; None: Qwen2.5-VL's (`QWEN_PROCESSOR_PIXELS`).
    The `mini_o3` resamplings end with the processor's resize within these bounds."""
    crop_box_checks: str = "cut"
    """Whether `min_crop_side` and `max_crop_aspect` are checked on the cut (`cut`) or the float box (`box`)."""
    max_crop_aspect: float = MAX_ASPECT_RATIO
    """The most elongated a crop may be, longer side over shorter (DeepEyes: 100)."""

    def __post_init__(self) -> None:
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"pixel budget needs 0 < min_pixels <= max_pixels, got {self.min_pixels}, {self.max_pixels}")
        if self.factor < 1:
            raise ValueError(f"the image grid must be a positive number of pixels, got {self.factor}")
        if self.max_pixels < self.factor * self.factor:
            raise ValueError(f"max_pixels must be at least {self.factor * self.factor} (one {self.factor}-px grid cell)")
        if self.crop_min_pixels is not None or self.crop_max_pixels is not None:
            self.for_crops()  # the crops' pair must be valid too
        if not (0.0 <= self.crop_padding < 1.0 and math.isfinite(self.crop_padding)):
            raise ValueError(f"crop_padding must be in [0, 1), got {self.crop_padding}")
        if self.crop_cut not in CROP_CUTS:
            raise ValueError(f"crop_cut must be one of {', '.join(CROP_CUTS)}, got {self.crop_cut!r}")
        if self.crop_resample not in CROP_RESAMPLES:
            raise ValueError(f"crop_resample must be one of {', '.join(CROP_RESAMPLES)}, got {self.crop_resample!r}")
        if self.image_resample not in CROP_RESAMPLES:
            raise ValueError(f"image_resample must be one of {', '.join(CROP_RESAMPLES)}, got {self.image_resample!r}")
        if self.crop_box_checks not in ("cut", "box"):
            raise ValueError(f"crop_box_checks must be cut or box, got {self.crop_box_checks!r}")
        if self.processor_pixels is not None and not 0 < self.processor_pixels[0] <= self.processor_pixels[1]:
            raise ValueError(f"the processor's pixel bounds need 0 < min <= max, got {self.processor_pixels}")

    def for_crops(self) -> PixelBudget:
        """The budget a crop is resized into: this one, with the crops' own area limits where set."""
        if self.crop_min_pixels is None and self.crop_max_pixels is None:
            return self
        return PixelBudget(self.crop_min_pixels or self.min_pixels, self.crop_max_pixels or self.max_pixels,
                           self.min_crop_side, factor=self.factor, processor_pixels=self.processor_pixels)

    def for_processor(self) -> PixelBudget:
        """The budget of the model's processor itself (`processor_pixels`), on the same grid."""
        low, high = self.processor_pixels or QWEN_PROCESSOR_PIXELS
        return PixelBudget(low, high, factor=self.factor)


def smart_resize(height: int, width: int, budget: PixelBudget, factor: int | None = None) -> tuple[int, int]:
    """The Qwen processors' resize rule: round each side to a multiple of `factor` (the budget's grid when None),
    then scale into the budget (transformers' `models/qwen2_vl/image_processing_qwen2_vl.py`, `smart_resize`,
    which every Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 processor calls with its patch x merge).

    Sides are rounded to the nearest multiple; if the area then exceeds max_pixels, both sides shrink by the
    same factor and round down; if it falls under min_pixels, they grow and round up. Written here rather than
    imported so the crop tool works without transformers installed (the synth stage's CPU-light path), and
    tested against transformers' own function.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image sides must be positive, got {height}x{width}")
    factor = budget.factor if factor is None else factor
    # A side under factor/2 rounds to 0 here; the area is then under min_pixels and the branch below grows it.
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > budget.max_pixels:
        beta = math.sqrt(height * width / budget.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < budget.min_pixels:
        beta = math.sqrt(budget.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def fit_to_budget(image: Image.Image, budget: PixelBudget) -> Image.Image:
    """The image as the model is shown it: resized by Qwen's rule (`smart_resize`) into `budget` on its grid,
    bicubic."""
    height, width = smart_resize(image.height, image.width, budget)
    return image if image.size == (width, height) else image.resize((width, height), Image.Resampling.BICUBIC)


def fit_image(image: Image.Image, budget: PixelBudget) -> Image.Image:
    """A question's image as the model is shown it, by `budget.image_resample`: `bicubic` resizes it straight into
    the budget (`fit_to_budget`); `mini_o3` first runs Mini-o3's dataset `process_image` (LANCZOS into
    [min_pixels, max_pixels] with whole sides; verl/utils/dataset/multimodal_dataset.py:79-113), then the
    processor's resize of that result within the processor's own bounds, as Mini-o3's trainer shows it (:231-238)."""
    if budget.image_resample != "mini_o3":
        return fit_to_budget(image, budget)
    return fit_to_budget(mini_o3_resize(image, budget, Image.Resampling.LANCZOS), budget.for_processor())


def mini_o3_resize(image: Image.Image, budget: PixelBudget,
                   resample: Image.Resampling = Image.Resampling.NEAREST) -> Image.Image:
    """Mini-o3's `process_image` (verl/workers/rollout/vllm_rollout/vllm_async_engine.py:189-223), which its
    engine applies to every crop (`:551`) before the processor sees it: `resample` (NEAREST) throughout, the
    area scaled by a square root into [min_pixels, max_pixels] with `int()` sides, a side under 28 px scaled up
    to 28 (+1), an aspect of 200 or more squeezed to 190. Its output is not on Qwen's 28-px grid; the processor's own resize
    (bicubic, `smart_resize`) follows, in `fit_crop`. The question's image goes through the dataset's own
    `process_image` (multimodal_dataset.py:79-113): the same two area steps with `resample` LANCZOS, and an
    assertion, not a fix, for a side under 28 px (there the fix below is never reached for real images)."""
    if image.width * image.height > budget.max_pixels:
        factor = math.sqrt(budget.max_pixels / (image.width * image.height))
        image = image.resize((int(image.width * factor), int(image.height * factor)), resample=resample)
    if image.width * image.height < budget.min_pixels:
        factor = math.sqrt(budget.min_pixels / (image.width * image.height))
        image = image.resize((int(image.width * factor), int(image.height * factor)), resample=resample)
    if image.width < 28 or image.height < 28:
        factor = 28 / min(image.width, image.height)
        image = image.resize((int(image.width * factor + 1), int(image.height * factor + 1)), resample=resample)
    if image.width / image.height >= 200:
        image = image.resize((image.width, int(image.width / 190 + 1)), resample=resample)
    if image.height / image.width >= 200:
        image = image.resize((int(image.height / 190 + 1), image.height), resample=resample)
    return image


def fit_crop(region: Image.Image, budget: PixelBudget) -> Image.Image:
    """A cut region as the model is shown it, by `budget.crop_resample`: `bicubic` resizes it straight into the
    crops' budget (`fit_to_budget`); `mini_o3` first runs Mini-o3's NEAREST `process_image` (`mini_o3_resize`),
    then the processor's resize of that result within the processor's own bounds (Qwen2.5-VL's: 3,136 to
    12,845,056 pixels), as Mini-o3's rollout shows a crop (vllm_async_engine.py:433,551; dp_actor.py:262): a
    20 x 15 crop becomes 230 x 173, then 224 x 168."""
    crops = budget.for_crops()
    if budget.crop_resample == "mini_o3":
        return fit_to_budget(mini_o3_resize(region, crops), budget.for_processor())
    return fit_to_budget(region, crops)


def round_outwards(box: tuple[float, float, float, float]) -> tuple[int, int, int, int]:
    """A float box rounded outwards to whole pixels, at least one each way; 1e-9 keeps float noise
    (279.9999999999) from adding a pixel."""
    left, top = math.floor(box[0] + 1e-9), math.floor(box[1] + 1e-9)
    right, bottom = math.ceil(box[2] - 1e-9), math.ceil(box[3] - 1e-9)
    return left, top, max(right, left + 1), max(bottom, top + 1)


class ToolErrorKind(str, Enum):
    UNKNOWN_TOOL = "unknown_tool"
    BAD_ARGUMENTS = "bad_arguments"
    UNKNOWN_SOURCE = "unknown_source"
    DEGENERATE_BOX = "degenerate_box"


@dataclass(frozen=True)
class ToolError:
    """Why a tool call could not run, in words the model reads in its error observation."""

    kind: ToolErrorKind
    detail: str


@dataclass(frozen=True)
class CropResult:
    """A crop ready to show the model."""

    image: Image.Image
    source: str
    """The source's name: 'original_image' or 'observation_N'."""
    box_px: tuple[int, int, int, int]
    """The box on the named source, in that source's pixels, clamped and rounded outwards (what the model
    pointed at on the image it was shown)."""
    region: tuple[float, float, float, float]
    """The box composed onto the source's base (the original, unless the source is an image of its own such as
    a rotated view), in its pixels (floats): what the observation shows."""
    region_px: tuple[int, int, int, int]
    """The pixels of the base that were cut: `region` rounded outwards."""
    base: int = 0
    """The image `region` is on: 0 for the original, N for observation N when it is an image of its own."""


@dataclass
class ImageSession:
    """The images one trajectory can crop from: the original (decoded once, lazily) and each crop so far.

    Each observation remembers the region of the original it shows (`regions`), so a box on it can be mapped
    back onto the original's full-resolution pixels. Samples of the same task may share a decoded original by
    passing it in as `original`.
    """

    original_path: Path | None = None
    original: Image.Image | None = None
    observations: list[Image.Image] = field(default_factory=list)
    regions: list[tuple[float, float, float, float]] = field(default_factory=list)
    """Per observation, the box of its base it shows, in the base's pixels (`CropResult.region`)."""
    bases: list[int] = field(default_factory=list)
    """Per observation, the image its region is on: 0 for the original, N for observation N when that
    observation is an image of its own (a rotated view, a video frame: `add_image`) rather than a region."""
    fulls: dict[int, Image.Image] = field(default_factory=dict)
    """Observation N's full-resolution pixels when it is an image of its own (what a crop of it cuts)."""
    frames: list[Image.Image] = field(default_factory=list)
    """A video task's frames (`loupe.video.read_clip`), at the resolution they were decoded."""
    masks: list[tuple[str, Any]] = field(default_factory=list)
    """Segmented objects so far, `mask_N` in order: (the source it was found on, a boolean array of its pixels)."""
    image_root: Path | None = None
    max_decode_pixels: int = DEFAULT_MAX_DECODE_PIXELS
    shown_original: Image.Image | None = None
    """The original as the model was shown it (resized into the budget); `crop_cut: shown` cuts from it."""

    def get(self, source: str) -> Image.Image | None:
        """The named image, or None if no such source exists yet."""
        number = self._number(source)
        if number == 0:
            return self._original()
        return self.observations[number - 1] if number is not None else None

    def shown(self, source: str, budget: PixelBudget) -> Image.Image | None:
        """The named image as the model saw it: an observation as it was shown, the original resized into
        `budget` (kept once made); None for an unknown source."""
        number = self._number(source)
        if number != 0:
            return self.get(source)
        if self.shown_original is None:
            original = self._original()
            if original is None:
                return None
            self.shown_original = fit_image(original, budget)
        return self.shown_original

    def region(self, source: str) -> tuple[float, float, float, float] | None:
        """The box of its base that the named source shows, in the base's pixels; None for an unknown source."""
        number = self._number(source)
        if number is None:
            return None
        if number == 0:
            original = self._original()
            return None if original is None else (0.0, 0.0, float(original.width), float(original.height))
        return self.regions[number - 1]

    def base_of(self, source: str) -> int | None:
        """Which image the named source's region is on (0: the original; N: observation N's own pixels)."""
        number = self._number(source)
        if number is None or number == 0:
            return number
        return self.bases[number - 1]

    def base_image(self, base: int) -> Image.Image | None:
        """The full-resolution pixels of a base: the original, or an observation that is an image of its own."""
        return self._original() if base == 0 else self.fulls[base]

    def add_observation(self, image: Image.Image, region: tuple[float, float, float, float], base: int = 0) -> str:
        """Keep a crop as the next observation, with the box of its base it shows; returns its name."""
        self.observations.append(image)
        self.regions.append(tuple(float(v) for v in region))  # type: ignore[arg-type]
        self.bases.append(base)
        return f"observation_{len(self.observations)}"

    def add_image(self, image: Image.Image, full: Image.Image | None = None) -> str:
        """Keep an image of its own (a rotated view, a frame) as the next observation: shown as `image`, cut
        from `full` (its full-resolution pixels, `image` itself when not given); returns its name."""
        full = image if full is None else full
        number = len(self.observations) + 1
        self.fulls[number] = full
        return self.add_observation(image, (0.0, 0.0, float(full.width), float(full.height)), base=number)

    def _number(self, source: str) -> int | None:
        """0 for the original, N for an existing observation N, None for anything else."""
        if source == ORIGINAL_IMAGE:
            return 0
        match = re.fullmatch(r"observation_(\d{1,9})", source, re.ASCII)  # bounded: int() refuses 4,300+ digits
        if match and int(match.group(1)) <= len(self.observations):
            return int(match.group(1))
        return None

    def _original(self) -> Image.Image | None:
        if self.original is None and self.original_path is not None:
            self.original = open_image(self.original_path, self.image_root, self.max_decode_pixels)
        return self.original


def _as_box(value: Any) -> tuple[float, float, float, float] | None:
    if not isinstance(value, (list, tuple)) or len(value) != 4:
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return None
    try:
        box = tuple(float(v) for v in value)
    except OverflowError:  # an int too large for a float
        return None
    return box if all(math.isfinite(v) for v in box) else None  # type: ignore[return-value]


def crop(session: ImageSession, arguments: dict[str, Any], budget: PixelBudget) -> CropResult | ToolError:
    """Crop `bbox_2d` of `source` and resize it into the crops' budget (`budget.for_crops()`).

    `frame` says how the box is given: 'relative' (each coordinate a fraction of the source's sides) or
    'absolute' (pixels of the source). `budget.crop_padding` widens the box on every side by that fraction of
    the source; the box is then clamped to the source. `budget.crop_cut` says whose pixels are cut:

    - `composed` (Loupe): the box is composed, in floats, with the region of the original the source shows
      and rounded outwards once on the original's full-resolution pixels; a box under one pixel of the source
      is refused. Each zoom can show more detail than the last.
    - `whole_pixels` (Mini-o3: `prepare_grounding_inputs_multi_turn` and `crop_image(..., resize=1)` in
      verl/workers/rollout/vllm_rollout/function_tools.py): every source is kept at full resolution as it was
      cut; the box on it is truncated to whole pixels (`int()`), its far edge kept inside the last row and
      column, and a box less than one pixel wide or high is refused. Nested zooms lose a pixel at each level,
      as Mini-o3's do.
    - `shown` (Pixel-Reasoner: `crop_image_normalized` and `execute_tool` in
      curiosity_driven_rl/openrlhf/trainer/ppo_utils/experience_maker.py): the box is cut, rounded to whole
      pixels as PIL's `Image.crop` rounds, from the image as the model was shown it (the original resized into
      the budget, an observation as it was shown), so a crop holds no detail its source did not show.
    - `rounded` (DeepEyes: `Image.crop(bbox)` on the original in visual_toolbox_v2.py:87): the box is cut from
      the source at full resolution, each coordinate rounded as PIL rounds it (half to even).

    Then the cut's shorter side must reach `budget.min_crop_side`, and its aspect ratio stay within
    `budget.max_crop_aspect`; with `budget.crop_box_checks: box` both are checked on the clamped box in floats
    before any rounding instead, a side having to exceed `min_crop_side` - 1 (DeepEyes' `validate_bbox`,
    visual_toolbox_v2.py:129-139: above 30 px, with `min_crop_side` 31).
    """
    box = _as_box(arguments.get("bbox_2d"))
    if box is None:
        return ToolError(ToolErrorKind.BAD_ARGUMENTS, "'bbox_2d' must be four finite numbers")
    source = arguments.get("source", ORIGINAL_IMAGE)
    source = ORIGINAL_IMAGE if source == "observation_0" else source
    image = session.get(source) if isinstance(source, str) else None
    if image is None:
        return ToolError(ToolErrorKind.UNKNOWN_SOURCE, f"there is no image named {str(source)[:40]!r}")
    frame = arguments.get("frame", "relative")
    if frame not in ("relative", "absolute"):
        return ToolError(ToolErrorKind.BAD_ARGUMENTS, f"'frame' must be 'relative' or 'absolute', got {str(frame)[:20]!r}")
    # The source's region of the original (rx0, ry0, rx1, ry1), and the image the box is read on.
    rx0, ry0, rx1, ry1 = session.region(source)  # type: ignore[misc]
    if budget.crop_cut == "whole_pixels":
        width, height = max(1, round(rx1 - rx0)), max(1, round(ry1 - ry0))  # the full-resolution cut it was
    elif budget.crop_cut == "shown":
        image = session.shown(source, budget)  # type: ignore[assignment]
        width, height = image.size  # type: ignore[union-attr]
    else:
        width, height = image.size
    x0, y0, x1, y1 = box
    if frame == "relative":
        x0, x1, y0, y1 = x0 * width, x1 * width, y0 * height, y1 * height
    pad_x, pad_y = budget.crop_padding * width, budget.crop_padding * height
    x0, x1, y0, y1 = x0 - pad_x, x1 + pad_x, y0 - pad_y, y1 + pad_y
    # Clamp before anything else: a huge relative coordinate times the side overflows to infinity.
    x0, x1 = (min(max(v, 0.0), float(width)) for v in (x0, x1))
    y0, y1 = (min(max(v, 0.0), float(height)) for v in (y0, y1))
    kx, ky = (rx1 - rx0) / width, (ry1 - ry0) / height
    if budget.crop_box_checks == "box":
        refused = _box_refusal(x1 - x0, y1 - y0, budget)
        if refused is not None:
            return refused
    if budget.crop_cut == "whole_pixels":
        bx0, by0 = int(x0), int(y0)
        bx1, by1 = min(int(x1), width - 1), min(int(y1), height - 1)
        if bx0 > bx1 - 1 or by0 > by1 - 1:
            return ToolError(ToolErrorKind.DEGENERATE_BOX,
                             f"the box covers less than one whole pixel of the {width}x{height} source")
        left, top = round(rx0) + bx0, round(ry0) + by0
        right, bottom = round(rx0) + bx1, round(ry0) + by1
        composed = (float(left), float(top), float(right), float(bottom))
        box_px = (bx0, by0, bx1, by1)
    elif budget.crop_cut in ("shown", "rounded"):
        # PIL's Image.crop rounds a float box (round half to even), as Pixel-Reasoner's and DeepEyes' calls rely on.
        bx0, by0, bx1, by1 = round(x0), round(y0), round(x1), round(y1)
        if bx1 - bx0 < 1 or by1 - by0 < 1:
            seen = "image shown" if budget.crop_cut == "shown" else "source"
            return ToolError(ToolErrorKind.DEGENERATE_BOX, f"the box covers less than one pixel of the {width}x{height} {seen}")
        composed = (rx0 + bx0 * kx, ry0 + by0 * ky, rx0 + bx1 * kx, ry0 + by1 * ky)
        left, top, right, bottom = round_outwards(composed)
        box_px = (bx0, by0, bx1, by1)
    else:
        if x1 - x0 < 1.0 or y1 - y0 < 1.0:
            return ToolError(
                ToolErrorKind.DEGENERATE_BOX, f"the box covers less than one pixel of the {width}x{height} source"
            )
        composed = (rx0 + x0 * kx, ry0 + y0 * ky, rx0 + x1 * kx, ry0 + y1 * ky)
        left, top, right, bottom = round_outwards(composed)  # once, on the original
        box_px = (math.floor(x0), math.floor(y0), math.ceil(x1), math.ceil(y1))
    # The cut's size in pixels of the image it comes from: the shown image's, or the original's.
    cut_w, cut_h = ((box_px[2] - box_px[0], box_px[3] - box_px[1]) if budget.crop_cut == "shown"
                    else (right - left, bottom - top))
    where = "of the image shown" if budget.crop_cut == "shown" else "of the original"
    if budget.crop_box_checks == "cut" and min(cut_w, cut_h) < budget.min_crop_side:
        return ToolError(ToolErrorKind.DEGENERATE_BOX, f"the box is {cut_w}x{cut_h} px {where}; both sides "
                                                       f"must be at least {budget.min_crop_side} px")
    if budget.crop_box_checks == "cut" and max(cut_w, cut_h) / min(cut_w, cut_h) > budget.max_crop_aspect:
        return ToolError(
            ToolErrorKind.DEGENERATE_BOX,
            f"the box is {cut_w}x{cut_h} px, more elongated than {budget.max_crop_aspect:g}:1",
        )
    crops = budget.for_crops()
    new_h, new_w = smart_resize(cut_h, cut_w, crops)
    if new_h * new_w > crops.max_pixels:
        # Only extreme aspect ratios get here: the short side cannot go under one factor.
        return ToolError(ToolErrorKind.DEGENERATE_BOX, f"the {cut_w}x{cut_h} px box is too thin for the pixel budget")
    base = session.base_of(source)
    assert base is not None  # the source exists
    if budget.crop_cut == "shown":
        region = image.crop(box_px)  # type: ignore[union-attr]
    else:
        pixels = session.base_image(base)
        assert pixels is not None  # the source exists, so the image it was cut from does
        region = pixels.crop((left, top, right, bottom))
    region = fit_crop(region, budget)
    return CropResult(image=region, source=source, box_px=box_px, region=composed,
                      region_px=(left, top, right, bottom), base=base)


def _box_refusal(width: float, height: float, budget: PixelBudget) -> ToolError | None:
    """DeepEyes' `validate_bbox` on a clamped float box (`crop_box_checks: box`): both sides above
    `min_crop_side` - 1 px and the longer at most `max_crop_aspect` times the shorter; None when it passes."""
    if min(width, height) <= budget.min_crop_side - 1:
        return ToolError(ToolErrorKind.DEGENERATE_BOX, f"the box is {width:g}x{height:g} px; both sides must be "
                                                       f"above {budget.min_crop_side - 1} px")
    if max(width, height) / min(width, height) > budget.max_crop_aspect:
        return ToolError(ToolErrorKind.DEGENERATE_BOX, f"the box is {width:g}x{height:g} px, more elongated than "
                                                       f"{budget.max_crop_aspect:g}:1")
    return None


@dataclass(frozen=True)
class NewImage:
    """An image a tool shows the model as a new observation that is an image of its own (not a region of its
    source): a rotated view, a segmented object, a video frame. A later crop of it cuts `full`."""

    image: Image.Image
    """As shown to the model (already within the crops' pixel budget)."""
    full: Image.Image | None = None
    """Its full-resolution pixels, which a crop of it cuts; `image` itself when not given."""


@dataclass(frozen=True)
class ToolResult:
    """What an operation other than the crop gives back: new images, a text observation, or both."""

    images: tuple[NewImage, ...] = ()
    text: str | None = None
    """What the operation tells the model in words (found text, an object's properties, a track)."""
    record: dict[str, Any] = field(default_factory=dict)
    """The call's outcome as data, recorded on the observation turn (`Turn.tool`) for the viewer and rewards."""


ToolRun = Callable[[ImageSession, dict[str, Any], PixelBudget], "CropResult | ToolResult | ToolError"]


@dataclass(frozen=True)
class Tool:
    """A registered tool: its name, a JSON schema of its arguments, the function that runs it, and a line the
    model's tool list can show."""

    name: str
    schema: dict[str, Any]
    run: ToolRun
    description: str = ""


CROP_SCHEMA = {
    "type": "object",
    "properties": {
        "bbox_2d": {"type": "array", "items": {"type": "number"}, "minItems": 4, "maxItems": 4},
        "source": {"type": "string"},
        "frame": {"enum": ["relative", "absolute"]},
    },
    "required": ["bbox_2d"],
}

TOOLS: dict[str, Tool] = {}


def register_tool(tool: Tool) -> Tool:
    """Add a tool under its name; a second tool of the same name is refused (rename yours)."""
    if tool.name in TOOLS:
        raise ValueError(f"tool {tool.name!r} is already registered")
    TOOLS[tool.name] = tool
    return tool


def validation_detail(error: ValidationError) -> str:
    """A pydantic error in the words the model reads: each bad argument named with what was wrong."""
    parts = []
    for item in error.errors()[:4]:
        where = ".".join(str(p) for p in item["loc"]) or "arguments"
        parts.append(f"{where!r}: {item['msg']}")
    return "; ".join(parts)


def operation(name: str, arguments: type[BaseModel], description: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a function `fn(session, args, budget)` as the tool `name`, its arguments typed by the pydantic
    model `arguments`: a call whose arguments do not validate gets a `bad_arguments` error naming each bad
    field, and `fn` receives a validated `arguments` instance. This is how a user adds an operation
    (docs/tools.md, "Adding an operation")."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(session: ImageSession, raw: dict[str, Any], budget: PixelBudget) -> CropResult | ToolResult | ToolError:
            try:
                args = arguments.model_validate(raw)
            except ValidationError as error:
                return ToolError(ToolErrorKind.BAD_ARGUMENTS, validation_detail(error))
            return fn(session, args, budget)

        register_tool(Tool(name, arguments.model_json_schema(), run, description))
        return fn

    return wrap


register_tool(Tool("crop", CROP_SCHEMA, crop, "cut a box of an image and show it at the crops' resolution"))


def run_tool(call: ToolCall, session: ImageSession, budget: PixelBudget) -> CropResult | ToolResult | ToolError:
    """Run a parsed call; a bad request comes back as a ToolError, never an exception."""
    tool = TOOLS.get(call.tool)
    if tool is None:
        return ToolError(ToolErrorKind.UNKNOWN_TOOL, f"unknown tool {call.tool!r}; known: {', '.join(sorted(TOOLS))}")
    if not isinstance(call.arguments, dict):
        return ToolError(ToolErrorKind.BAD_ARGUMENTS, "tool arguments must be an object")
    return tool.run(session, call.arguments, budget)
