"""Tools the model can call, looked up by name; the crop tool first.

The crop tool takes a box on a named source (the original image at full resolution, or an earlier crop),
clamps it to the image, refuses degenerate boxes, and resizes the crop into the pixel budget with the rule
Qwen2.5-VL's image processor uses (`smart_resize`: sides multiples of 28, area within min/max pixels), so the
processor does not resize it again.

A tool never raises on a model's request: `run_tool` returns either a result or a typed `ToolError` that the
rollout loop sends back as an error observation. Images the user supplied are another matter: a missing,
corrupt, truncated or oversized file, or a path outside the configured image root, raises `ImageError` naming
the file, because that is the data's fault, not the model's.

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

# open_image enforces its own, configurable pixel limit before decoding; PIL's fixed global limit would
# otherwise refuse large images first (and warn on 8K benchmark images) whatever max_decode_pixels says.
Image.MAX_IMAGE_PIXELS = None

from loupe.protocol import ORIGINAL_IMAGE, ToolCall

IMAGE_FACTOR = 28
"""Qwen2.5-VL's patch (14) times its spatial merge (2): image sides are multiples of this."""
MAX_ASPECT_RATIO = 200
"""Qwen2.5-VL's processor refuses images more elongated than this."""
DEFAULT_MAX_DECODE_PIXELS = 20_000 * 20_000
"""Images larger than this are refused before decoding (decompression-bomb guard)."""


class ImageError(ValueError):
    """A source image that cannot be used; the message names the file."""


@dataclass(frozen=True)
class PixelBudget:
    """How many pixels an image given to the model may have (Mini-o3: 40,000 to 2,000,000)."""

    min_pixels: int = 40_000
    max_pixels: int = 2_000_000

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


def open_image(path: str | Path, root: str | Path | None = None, max_pixels: int = DEFAULT_MAX_DECODE_PIXELS) -> Image.Image:
    """Decode an image file fully into RGB, or raise ImageError naming the file and what is wrong.

    With `root`, the resolved path must lie inside it (no `..` or symlink escapes).
    """
    path = Path(path)
    if root is not None:
        root_resolved = Path(root).resolve()
        resolved = (root_resolved / path).resolve() if not path.is_absolute() else path.resolve()
        if not resolved.is_relative_to(root_resolved):
            raise ImageError(f"{path}: image path escapes the image root {root_resolved}")
        path = resolved
    if not path.is_file():
        raise ImageError(f"{path}: image file not found")
    try:
        with Image.open(path) as img:
            width, height = img.size
            if width * height > max_pixels:
                raise ImageError(
                    f"{path}: image is {width}x{height} = {width * height:,} pixels, over the limit of {max_pixels:,} "
                    "(a decompression bomb, or raise max_decode_pixels)"
                )
            img.load()
            return img.convert("RGB")
    except ImageError:
        raise
    except Image.DecompressionBombError as err:
        raise ImageError(f"{path}: refused as a decompression bomb ({err})") from None
    except (OSError, SyntaxError, ValueError) as err:
        raise ImageError(f"{path}: corrupt or truncated image ({err})") from None


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
    """The crop's pixel box on the source, after clamping."""


@dataclass
class ImageSession:
    """The images one trajectory can crop from: the original (decoded once, lazily) and each crop so far.

    Samples of the same task may share a decoded original by passing it in as `original`.
    """

    original_path: Path | None = None
    original: Image.Image | None = None
    observations: list[Image.Image] = field(default_factory=list)
    image_root: Path | None = None
    max_decode_pixels: int = DEFAULT_MAX_DECODE_PIXELS

    def get(self, source: str) -> Image.Image | None:
        """The named image, or None if no such source exists yet."""
        if source == ORIGINAL_IMAGE or source == "observation_0":
            if self.original is None:
                if self.original_path is None:
                    return None
                self.original = open_image(self.original_path, self.image_root, self.max_decode_pixels)
            return self.original
        match = re.fullmatch(r"observation_(\d{1,9})", source, re.ASCII)  # bounded: int() refuses 4,300+ digits
        if match and 1 <= int(match.group(1)) <= len(self.observations):
            return self.observations[int(match.group(1)) - 1]
        return None

    def add_observation(self, image: Image.Image) -> str:
        self.observations.append(image)
        return f"observation_{len(self.observations)}"


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
    """Crop `bbox_2d` out of `source` and resize it into `budget`.

    `frame` says how the box is given: 'relative' (each coordinate in [0, 1] of the source's sides) or
    'absolute' (pixels of the source).
    """
    box = _as_box(arguments.get("bbox_2d"))
    if box is None:
        return ToolError(ToolErrorKind.BAD_ARGUMENTS, "'bbox_2d' must be four finite numbers")
    source = arguments.get("source", ORIGINAL_IMAGE)
    image = session.get(source) if isinstance(source, str) else None
    if image is None:
        return ToolError(ToolErrorKind.UNKNOWN_SOURCE, f"there is no image named {source!r}")
    frame = arguments.get("frame", "relative")
    if frame not in ("relative", "absolute"):
        return ToolError(ToolErrorKind.BAD_ARGUMENTS, f"'frame' must be 'relative' or 'absolute', got {frame!r}")
    width, height = image.size
    x0, y0, x1, y1 = box
    if frame == "relative":
        x0, x1, y0, y1 = x0 * width, x1 * width, y0 * height, y1 * height
    # Clamp before rounding: a huge relative coordinate times the side overflows to infinity.
    x0, x1 = (min(max(v, 0.0), float(width)) for v in (x0, x1))
    y0, y1 = (min(max(v, 0.0), float(height)) for v in (y0, y1))
    left, top = math.floor(x0), math.floor(y0)
    right, bottom = math.ceil(x1), math.ceil(y1)
    crop_w, crop_h = right - left, bottom - top
    if crop_w < 1 or crop_h < 1:
        return ToolError(ToolErrorKind.DEGENERATE_BOX, f"the box covers no pixels of the {width}x{height} source")
    if max(crop_w, crop_h) / min(crop_w, crop_h) > MAX_ASPECT_RATIO:
        return ToolError(
            ToolErrorKind.DEGENERATE_BOX,
            f"the box is {crop_w}x{crop_h} px, more elongated than {MAX_ASPECT_RATIO}:1",
        )
    new_h, new_w = smart_resize(crop_h, crop_w, budget)
    if new_h * new_w > budget.max_pixels:
        # Only extreme aspect ratios get here: the short side cannot go under one factor.
        return ToolError(ToolErrorKind.DEGENERATE_BOX, f"the {crop_w}x{crop_h} px box is too thin for the pixel budget")
    region = image.crop((left, top, right, bottom))
    if region.size != (new_w, new_h):
        region = region.resize((new_w, new_h), Image.Resampling.BICUBIC)
    return CropResult(image=region, source=source if source != "observation_0" else ORIGINAL_IMAGE, box_px=(left, top, right, bottom))


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
