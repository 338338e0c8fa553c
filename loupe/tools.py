"""Tools the model can call, looked up by name; the crop tool first.

The crop tool takes a box on a named source (the original image, or an earlier observation), clamps it to
that source, refuses degenerate boxes, and cuts the region from the original's full-resolution pixels: a box on
an observation is composed with the region of the original that observation shows, so each zoom can show more
detail than the last. This is Mini-o3's semantics: its rollout (`AsyncvLLMEngine.process_tool_call` in
verl/workers/rollout/vllm_rollout/vllm_async_engine.py, with `crop_image(..., resize=1)` and
`prepare_grounding_inputs_multi_turn` in function_tools.py) keeps each observation as the full-resolution crop
and shows the model a resized copy. Loupe keeps the region instead of the crop and composes the boxes in floats,
rounding outwards once on the original (Mini-o3 truncates each box to whole pixels with int()). The crop is
then resized into the pixel budget with the rule Qwen2.5-VL's image processor uses (`smart_resize`: sides
multiples of 28, area within min/max pixels), so the processor does not resize it again.

A tool never raises on a model's request: `run_tool` returns either a result or a typed `ToolError` that the
rollout loop sends back as an error observation. Images the user supplied are another matter: a missing,
corrupt, truncated or oversized file, or a path outside the configured image root, raises `ImageError` naming
the file (see `loupe.images`), because that is the data's fault, not the model's.

New tools (rotate, read text, segment) register a `Tool` in `TOOLS` with a JSON schema of their arguments and
a function of the same signature as `crop`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Callable

from PIL import Image

from loupe.images import DEFAULT_MAX_DECODE_PIXELS, MAX_ASPECT_RATIO, ImageError, open_image  # noqa: F401 (re-exported)
from loupe.protocol import ORIGINAL_IMAGE, ToolCall

IMAGE_FACTOR = 28
"""Qwen2.5-VL's patch (14) times its spatial merge (2): image sides are multiples of this."""


@dataclass(frozen=True)
class PixelBudget:
    """How many pixels an image given to the model may have (Mini-o3: 40,000 to 2,000,000)."""

    min_pixels: int = 40_000
    max_pixels: int = 2_000_000
    min_crop_side: int = 1
    """A crop whose shorter side, in pixels of the original, is below this is refused (DeepEyes: 31, its tool
    needs both sides above 30 px)."""

    def __post_init__(self) -> None:
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"pixel budget needs 0 < min_pixels <= max_pixels, got {self.min_pixels}, {self.max_pixels}")
        if self.max_pixels < IMAGE_FACTOR * IMAGE_FACTOR:
            raise ValueError(f"max_pixels must be at least {IMAGE_FACTOR * IMAGE_FACTOR}")


def smart_resize(height: int, width: int, budget: PixelBudget, factor: int = IMAGE_FACTOR) -> tuple[int, int]:
    """Qwen2.5-VL's resize rule: round each side to a multiple of `factor`, then scale into the budget.

    Sides are rounded to the nearest multiple; if the area then exceeds max_pixels, both sides shrink by the
    same factor and round down; if it falls under min_pixels, they grow and round up. Written here rather than
    imported so the crop tool works without transformers installed (the synth stage's CPU-light path), and
    tested against transformers' own function.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image sides must be positive, got {height}x{width}")
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
    """The box composed onto the original, in its pixels (floats): what the observation shows."""
    region_px: tuple[int, int, int, int]
    """The pixels of the original that were cut: `region` rounded outwards."""


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
    """Per observation, the box of the original it shows, in the original's pixels (`CropResult.region`)."""
    image_root: Path | None = None
    max_decode_pixels: int = DEFAULT_MAX_DECODE_PIXELS

    def get(self, source: str) -> Image.Image | None:
        """The named image, or None if no such source exists yet."""
        number = self._number(source)
        if number == 0:
            return self._original()
        return self.observations[number - 1] if number is not None else None

    def region(self, source: str) -> tuple[float, float, float, float] | None:
        """The box of the original that the named source shows, in its pixels; None for an unknown source."""
        number = self._number(source)
        if number is None:
            return None
        if number == 0:
            original = self._original()
            return None if original is None else (0.0, 0.0, float(original.width), float(original.height))
        return self.regions[number - 1]

    def add_observation(self, image: Image.Image, region: tuple[float, float, float, float]) -> str:
        """Keep a crop as the next observation, with the box of the original it shows; returns its name."""
        self.observations.append(image)
        self.regions.append(tuple(float(v) for v in region))  # type: ignore[arg-type]
        return f"observation_{len(self.observations)}"

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
    """Crop `bbox_2d` of `source` out of the original's full-resolution pixels and resize it into `budget`.

    `frame` says how the box is given: 'relative' (each coordinate in [0, 1] of the source's sides) or
    'absolute' (pixels of the source). The box is clamped to the source; a box spanning less than one pixel of
    the source in either direction is refused (a model pointing at nothing learns nothing from a 1 px crop).
    On an observation, the box is mapped through the region of the original that observation shows, then
    rounded outwards to whole pixels of the original.
    """
    box = _as_box(arguments.get("bbox_2d"))
    if box is None:
        return ToolError(ToolErrorKind.BAD_ARGUMENTS, "'bbox_2d' must be four finite numbers")
    source = arguments.get("source", ORIGINAL_IMAGE)
    image = session.get(source) if isinstance(source, str) else None
    if image is None:
        return ToolError(ToolErrorKind.UNKNOWN_SOURCE, f"there is no image named {str(source)[:40]!r}")
    frame = arguments.get("frame", "relative")
    if frame not in ("relative", "absolute"):
        return ToolError(ToolErrorKind.BAD_ARGUMENTS, f"'frame' must be 'relative' or 'absolute', got {str(frame)[:20]!r}")
    width, height = image.size
    x0, y0, x1, y1 = box
    if frame == "relative":
        x0, x1, y0, y1 = x0 * width, x1 * width, y0 * height, y1 * height
    # Clamp before anything else: a huge relative coordinate times the side overflows to infinity.
    x0, x1 = (min(max(v, 0.0), float(width)) for v in (x0, x1))
    y0, y1 = (min(max(v, 0.0), float(height)) for v in (y0, y1))
    if x1 - x0 < 1.0 or y1 - y0 < 1.0:
        return ToolError(
            ToolErrorKind.DEGENERATE_BOX, f"the box covers less than one pixel of the {width}x{height} source"
        )
    source_name = ORIGINAL_IMAGE if source == "observation_0" else source
    # The source shows region (rx0, ry0, rx1, ry1) of the original, scaled to width x height.
    rx0, ry0, rx1, ry1 = session.region(source_name)  # type: ignore[misc]
    kx, ky = (rx1 - rx0) / width, (ry1 - ry0) / height
    composed = (rx0 + x0 * kx, ry0 + y0 * ky, rx0 + x1 * kx, ry0 + y1 * ky)
    # Outwards to whole pixels, once; 1e-9 keeps float noise (279.9999999999) from adding a pixel.
    left, top = math.floor(composed[0] + 1e-9), math.floor(composed[1] + 1e-9)
    right, bottom = math.ceil(composed[2] - 1e-9), math.ceil(composed[3] - 1e-9)
    right, bottom = max(right, left + 1), max(bottom, top + 1)
    crop_w, crop_h = right - left, bottom - top
    if min(crop_w, crop_h) < budget.min_crop_side:
        return ToolError(ToolErrorKind.DEGENERATE_BOX, f"the box is {crop_w}x{crop_h} px of the original; both sides "
                                                       f"must be at least {budget.min_crop_side} px")
    if max(crop_w, crop_h) / min(crop_w, crop_h) > MAX_ASPECT_RATIO:
        return ToolError(
            ToolErrorKind.DEGENERATE_BOX,
            f"the box is {crop_w}x{crop_h} px, more elongated than {MAX_ASPECT_RATIO}:1",
        )
    new_h, new_w = smart_resize(crop_h, crop_w, budget)
    if new_h * new_w > budget.max_pixels:
        # Only extreme aspect ratios get here: the short side cannot go under one factor.
        return ToolError(ToolErrorKind.DEGENERATE_BOX, f"the {crop_w}x{crop_h} px box is too thin for the pixel budget")
    original = session.get(ORIGINAL_IMAGE)
    assert original is not None  # the source exists, so the original it was cut from does
    region = original.crop((left, top, right, bottom))
    if region.size != (new_w, new_h):
        region = region.resize((new_w, new_h), Image.Resampling.BICUBIC)
    box_px = (math.floor(x0), math.floor(y0), math.ceil(x1), math.ceil(y1))
    return CropResult(image=region, source=source_name, box_px=box_px, region=composed, region_px=(left, top, right, bottom))


@dataclass(frozen=True)
class Tool:
    """A registered tool: its name, a JSON schema of its arguments, and the function that runs it."""

    name: str
    schema: dict[str, Any]
    run: Callable[[ImageSession, dict[str, Any], PixelBudget], CropResult | ToolError]


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
    if tool.name in TOOLS:
        raise ValueError(f"tool {tool.name!r} is already registered")
    TOOLS[tool.name] = tool
    return tool


register_tool(Tool("crop", CROP_SCHEMA, crop))


def run_tool(call: ToolCall, session: ImageSession, budget: PixelBudget) -> CropResult | ToolError:
    """Run a parsed call; a bad request comes back as a ToolError, never an exception."""
    tool = TOOLS.get(call.tool)
    if tool is None:
        return ToolError(ToolErrorKind.UNKNOWN_TOOL, f"unknown tool {call.tool!r}; known: {', '.join(sorted(TOOLS))}")
    if not isinstance(call.arguments, dict):
        return ToolError(ToolErrorKind.BAD_ARGUMENTS, "tool arguments must be an object")
    return tool.run(session, call.arguments, budget)
