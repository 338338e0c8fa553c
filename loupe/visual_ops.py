"""Visual operations beyond the crop: segment the object at a point, measure it, read text, rotate, and on video
pick frames and track an object. Each is a tool in `loupe.tools.TOOLS`, registered with `operation`, so any
protocol that names tools can offer it (Pixelis' grammar: `loupe.protocol.PixelisProtocol`).

Every operation reads its source at full resolution (`source_pixels`: the original, or the region of it an
observation shows, not the downscaled copy the model saw), takes relative coordinates like the crop, and never
raises on a model's request: a bad argument comes back as a `ToolError` naming the field, a result as a
`ToolResult` with a text observation, new images, or both. The methods are classical and run offline on a CPU:

- `segment_at`: OpenCV's flood fill from the point (`cv2.floodFill`, fixed colour range, 4-connected): the
  connected region of colours within `tolerance` of the point's colour. It finds what a learned model finds on
  the flat-coloured objects of Loupe's synthetic tasks; a user with a learned segmenter (SAM, as Pixelis uses)
  registers it under the same name instead (docs/tools.md, "Adding an operation").
- `get_properties`: colour (mean and nearest named colour), area, box and shape measures (circularity,
  solidity, extent, aspect ratio, corners of the simplified outline) of a mask from `segment_at`, measured with
  OpenCV's contour functions.
- `read_text`: RapidOCR (PaddleOCR's detection and recognition models run by ONNX Runtime, shipped inside the
  `rapidocr-onnxruntime` wheel, so nothing is downloaded).
- `rotate`: PIL's rotation, counter-clockwise degrees, the canvas grown to hold the whole image.
- `select_frames`: frames of a video task by their 1-based number, at most 8 a call (Pixel-Reasoner's tool:
  `SelectFrames` and `execute_tool` in curiosity_driven_rl/openrlhf/trainer/ppo_utils/experience_maker.py).
- `track_object`: template matching (OpenCV's `matchTemplate`, normalised squared differences), the object's box
  on one frame followed through the following ones, the template renewed from each match (`MIN_MATCH`).
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any, Literal

import numpy as np
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field

from loupe.data.synthetic_draw import PALETTE
from loupe.protocol import ORIGINAL_IMAGE
from loupe.tools import (
    ImageSession,
    NewImage,
    PixelBudget,
    ToolError,
    ToolErrorKind,
    ToolResult,
    fit_to_budget,
    operation,
    round_outwards,
)

MIN_MATCH = 0.5
"""`track_object` calls the object lost on a frame where its best match scores less than this (1 minus the
normalised squared difference: 1 for the same pixels)."""

MAX_FRAMES_PER_CALL = 8
"""Pixel-Reasoner's cap on `select_frames` (execute_tool: 'no more than 8 frames')."""

NAMED_COLOURS: dict[str, tuple[int, int, int]] = {**PALETTE, "grey": (128, 128, 128)}
"""The colour names `get_properties` answers with: the synthetic tasks' palette, and grey."""

Point = tuple[float, float]
RelativeBox = tuple[float, float, float, float]


class _Arguments(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SegmentArguments(_Arguments):
    point: Point
    """[x, y] of a pixel of the object, each a fraction of the source's sides."""
    source: str = ORIGINAL_IMAGE
    """The image to look in: 'original_image' or 'observation_N'."""
    tolerance: int = Field(32, ge=0, le=255)
    """How far (per colour channel, 0-255) a pixel may be from the point's colour and still be the object."""


class PropertiesArguments(_Arguments):
    mask: str = Field(pattern=r"^mask_\d{1,6}$")
    """A mask from `segment_at` ('mask_1', ...)."""


class ReadTextArguments(_Arguments):
    bbox_2d: RelativeBox = (0.0, 0.0, 1.0, 1.0)
    """Where to read, as fractions of the source's sides; the whole source by default."""
    source: str = ORIGINAL_IMAGE


class RotateArguments(_Arguments):
    angle: float = Field(ge=-360.0, le=360.0)
    """Degrees counter-clockwise."""
    source: str = ORIGINAL_IMAGE
    canvas: Literal["grown", "kept"] = "grown"
    """`grown`: the canvas grows to hold the whole turned image, white corners, bicubic (Loupe's); `kept`: PIL's
    `Image.rotate(angle)` as DeepEyes' `image_rotate_tool` calls it, the image's own size, black corners,
    nearest neighbour (visual_toolbox_v2.py:90-95)."""


class SelectFramesArguments(_Arguments):
    target_frames: list[int] = Field(min_length=1)
    """1-based frame numbers of the video task's frames."""


class TrackArguments(_Arguments):
    bbox_2d: RelativeBox
    """The object's box on `start_frame`, as fractions of the frame's sides."""
    start_frame: int = Field(1, ge=1)
    """1-based frame the box is on; the object is followed through every later frame."""


def source_pixels(session: ImageSession, source: str) -> Image.Image | None:
    """The named source at full resolution: the original, an observation's region of its base cut from the
    base's pixels; None for an unknown source."""
    base, region = session.base_of(source), session.region(source)
    if base is None or region is None:
        return None
    pixels = session.base_image(base)
    if pixels is None:
        return None
    box = round_outwards(region)
    return pixels if box == (0, 0, pixels.width, pixels.height) else pixels.crop(box)


def _unknown_source(source: str) -> ToolError:
    return ToolError(ToolErrorKind.UNKNOWN_SOURCE, f"there is no image named {source[:40]!r}")


def _relative_box_px(box: RelativeBox, width: int, height: int) -> tuple[int, int, int, int] | ToolError:
    x0, y0, x1, y1 = (min(max(v, 0.0), 1.0) for v in box)
    left, top = math.floor(x0 * width), math.floor(y0 * height)
    right, bottom = math.ceil(x1 * width), math.ceil(y1 * height)
    if right - left < 1 or bottom - top < 1:
        return ToolError(ToolErrorKind.DEGENERATE_BOX, f"'bbox_2d' covers no pixel of the {width}x{height} image")
    return left, top, right, bottom


def _for_crops(image: Image.Image, budget: PixelBudget) -> Image.Image:
    """`image` as a crop is shown: resized into the crops' pixel budget."""
    return fit_to_budget(image, budget.for_crops())


def _fmt_box(box: tuple[float, ...]) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in box) + "]"


def _relative(box_px: tuple[int, int, int, int], width: int, height: int) -> tuple[float, float, float, float]:
    return box_px[0] / width, box_px[1] / height, box_px[2] / width, box_px[3] / height


@operation("segment_at", SegmentArguments, "the object at a point: its mask, box and area, and the object shown alone")
def segment_at(session: ImageSession, args: SegmentArguments, budget: PixelBudget) -> ToolResult | ToolError:
    import cv2

    image = source_pixels(session, args.source)
    if image is None:
        return _unknown_source(args.source)
    x, y = args.point
    if not (0.0 <= x <= 1.0 and 0.0 <= y <= 1.0):
        return ToolError(ToolErrorKind.BAD_ARGUMENTS, f"'point' must lie in [0, 1] x [0, 1], got [{x:g}, {y:g}]")
    width, height = image.size
    seed = (min(int(x * width), width - 1), min(int(y * height), height - 1))
    pixels = np.ascontiguousarray(np.asarray(image.convert("RGB")))
    fill = np.zeros((height + 2, width + 2), np.uint8)
    tol = (args.tolerance,) * 3
    cv2.floodFill(pixels.copy(), fill, seed, (0, 0, 0), tol, tol,
                  4 | cv2.FLOODFILL_FIXED_RANGE | cv2.FLOODFILL_MASK_ONLY | (255 << 8))
    mask = fill[1:-1, 1:-1] > 0
    rows, cols = np.nonzero(mask)
    box_px = (int(cols.min()), int(rows.min()), int(cols.max()) + 1, int(rows.max()) + 1)
    session.masks.append((args.source, mask))
    name = f"mask_{len(session.masks)}"
    area = int(mask.sum())
    # The object alone: its box, every pixel outside the mask greyed out.
    cut = pixels[box_px[1]:box_px[3], box_px[0]:box_px[2]].copy()
    cut[~mask[box_px[1]:box_px[3], box_px[0]:box_px[2]]] = 128
    alone = Image.fromarray(cut)
    box = _relative(box_px, width, height)
    text = (f"{name}: the object at [{x:.3f}, {y:.3f}] of {args.source} covers {area} px "
            f"({100 * area / (width * height):.1f}% of it), box {_fmt_box(box)}")
    return ToolResult(images=(NewImage(_for_crops(alone, budget), alone),), text=text,
                      record={"mask": name, "source": args.source, "box": list(box), "area": area})


def nearest_colour(rgb: tuple[float, float, float]) -> str:
    """The name in `NAMED_COLOURS` closest to `rgb` (Euclidean distance in RGB)."""
    return min(NAMED_COLOURS, key=lambda name: sum((a - b) ** 2 for a, b in zip(NAMED_COLOURS[name], rgb)))


def shape_measures(mask: np.ndarray) -> dict[str, Any]:
    """Shape of a boolean mask's largest outline: circularity 4 pi A / P^2 (1 for a disc), solidity (area over
    its convex hull's), extent (area over its box's), aspect ratio (box width over height), the corners of its
    outline simplified to 4% of its perimeter, and the shape those suggest."""
    import cv2

    contours, _ = cv2.findContours(mask.astype(np.uint8), cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_NONE)
    outline = max(contours, key=cv2.contourArea)
    area = float(mask.sum())
    perimeter = max(cv2.arcLength(outline, True), 1.0)
    hull = max(cv2.contourArea(cv2.convexHull(outline)), 1.0)
    x, y, w, h = cv2.boundingRect(outline)
    corners = len(cv2.approxPolyDP(outline, 0.04 * perimeter, True))
    circularity = min(4 * math.pi * area / perimeter**2, 1.0)
    if corners == 3:
        shape = "triangle"
    elif corners == 4 and circularity < 0.85:
        shape = "square" if 0.85 <= w / h <= 1.18 else "rectangle"
    elif circularity >= 0.8:
        shape = "circle"
    else:
        shape = "polygon"
    return {"circularity": round(circularity, 3), "solidity": round(min(area / hull, 1.0), 3),
            "extent": round(area / (w * h), 3), "aspect_ratio": round(w / h, 3), "corners": corners, "shape": shape}


@operation("get_properties", PropertiesArguments, "colour, area, box and shape of a segmented object")
def get_properties(session: ImageSession, args: PropertiesArguments, budget: PixelBudget) -> ToolResult | ToolError:
    number = int(args.mask.split("_")[1])
    if not 1 <= number <= len(session.masks):
        known = f"mask_1 to mask_{len(session.masks)}" if session.masks else "none yet: call segment_at first"
        return ToolError(ToolErrorKind.UNKNOWN_SOURCE, f"there is no {args.mask} (masks: {known})")
    source, mask = session.masks[number - 1]
    image = source_pixels(session, source)
    assert image is not None  # the mask was made on it
    pixels = np.asarray(image.convert("RGB"))
    mean = tuple(float(v) for v in pixels[mask].mean(axis=0))
    rows, cols = np.nonzero(mask)
    height, width = mask.shape
    box = _relative((int(cols.min()), int(rows.min()), int(cols.max()) + 1, int(rows.max()) + 1), width, height)
    properties = {"colour": nearest_colour(mean), "mean_rgb": [round(v) for v in mean], "area": int(mask.sum()),
                  "area_fraction": round(float(mask.mean()), 4), "box": [round(v, 4) for v in box],
                  **shape_measures(mask)}
    text = (f"{args.mask}: colour {properties['colour']} (mean RGB {tuple(properties['mean_rgb'])}), "
            f"shape {properties['shape']} ({properties['corners']} corners, circularity {properties['circularity']}), "
            f"area {properties['area']} px ({100 * properties['area_fraction']:.1f}%), box {_fmt_box(box)}")
    return ToolResult(text=text, record={"mask": args.mask, **properties})


@cache
def ocr_engine() -> Any:
    """RapidOCR, loaded once per process (its three ONNX models come inside the wheel)."""
    try:
        from rapidocr_onnxruntime import RapidOCR
    except ImportError as error:
        raise RuntimeError("read_text needs RapidOCR: pip install rapidocr-onnxruntime (requirements/cpu.txt "
                           "pins it; the vLLM test venv does not install it)") from error
    return RapidOCR()


MIN_OCR_HEIGHT = 48
"""A region shorter than this is enlarged before reading: the recogniser reads lines about 48 px high."""


@operation("read_text", ReadTextArguments, "the text written in a region of an image (OCR)")
def read_text(session: ImageSession, args: ReadTextArguments, budget: PixelBudget) -> ToolResult | ToolError:
    image = source_pixels(session, args.source)
    if image is None:
        return _unknown_source(args.source)
    box = _relative_box_px(args.bbox_2d, image.width, image.height)
    if isinstance(box, ToolError):
        return box
    region = image.crop(box).convert("RGB")
    if region.height < MIN_OCR_HEIGHT:
        scale = MIN_OCR_HEIGHT / region.height
        region = region.resize((max(1, round(region.width * scale)), MIN_OCR_HEIGHT), Image.Resampling.BICUBIC)
    found, _ = ocr_engine()(np.asarray(region))
    lines = [{"text": text, "confidence": round(float(score), 3)} for _, text, score in (found or [])]
    if lines:
        text = "text found: " + "; ".join(f"{line['text']!r} ({line['confidence']:.2f})" for line in lines)
    else:
        text = "no text found in that region"
    return ToolResult(text=text, record={"source": args.source, "bbox_2d": list(args.bbox_2d), "lines": lines})


@operation("rotate", RotateArguments, "the image turned counter-clockwise by an angle in degrees")
def rotate(session: ImageSession, args: RotateArguments, budget: PixelBudget) -> ToolResult | ToolError:
    image = source_pixels(session, args.source)
    if image is None:
        return _unknown_source(args.source)
    if args.canvas == "kept":
        turned = image.rotate(args.angle)
    else:
        turned = image.rotate(args.angle, resample=Image.Resampling.BICUBIC, expand=True, fillcolor=(255, 255, 255))
    return ToolResult(images=(NewImage(_for_crops(turned, budget), turned),),
                      record={"source": args.source, "angle": args.angle, "size": list(turned.size)})


def _no_video() -> ToolError:
    return ToolError(ToolErrorKind.BAD_ARGUMENTS, "this task is an image, not a video: there are no frames to "
                                                  "select or track; look closer at the image instead")


@operation("select_frames", SelectFramesArguments, "frames of the video, by number, to look at again (at most 8)")
def select_frames(session: ImageSession, args: SelectFramesArguments, budget: PixelBudget) -> ToolResult | ToolError:
    if not session.frames:
        return _no_video()
    count = len(session.frames)
    if len(args.target_frames) > MAX_FRAMES_PER_CALL:
        return ToolError(ToolErrorKind.BAD_ARGUMENTS, f"{len(args.target_frames)} frames selected; pick at most "
                                                      f"{MAX_FRAMES_PER_CALL} a call")
    outside = [n for n in args.target_frames if not 1 <= n <= count]
    if outside:
        return ToolError(ToolErrorKind.BAD_ARGUMENTS, f"there are {count} frames, numbered 1 to {count}; "
                                                      f"{outside} is out of range")
    frames = [session.frames[n - 1] for n in args.target_frames]
    return ToolResult(images=tuple(NewImage(_for_crops(f, budget), f) for f in frames),
                      record={"frames": list(args.target_frames)})


@operation("track_object", TrackArguments, "follow an object from its box on one frame through the later frames")
def track_object(session: ImageSession, args: TrackArguments, budget: PixelBudget) -> ToolResult | ToolError:
    import cv2

    if not session.frames:
        return _no_video()
    count = len(session.frames)
    if args.start_frame > count:
        return ToolError(ToolErrorKind.BAD_ARGUMENTS, f"'start_frame' is {args.start_frame}; there are {count} frames")
    first = session.frames[args.start_frame - 1]
    box = _relative_box_px(args.bbox_2d, first.width, first.height)
    if isinstance(box, ToolError):
        return box
    # Template matching (`cv2.matchTemplate`), the template renewed from each frame's match: deterministic, where
    # OpenCV's MIL tracker drew different tracks for the same call.
    template = np.asarray(first.convert("RGB"))[box[1]:box[3], box[0]:box[2]]
    track: list[dict[str, Any]] = [{"frame": args.start_frame, "box": list(_relative(box, first.width, first.height))}]
    for number in range(args.start_frame + 1, count + 1):
        frame = session.frames[number - 1]
        pixels = np.asarray(frame.convert("RGB"))
        if pixels.shape[0] < template.shape[0] or pixels.shape[1] < template.shape[1]:
            track.append({"frame": number, "box": None})
            continue
        # Squared differences, normalised: a flat-coloured object has no variance for correlation to read.
        differences = cv2.matchTemplate(pixels.astype(np.float32), template.astype(np.float32), cv2.TM_SQDIFF_NORMED)
        least, _, (x, y), _ = cv2.minMaxLoc(differences)
        if not np.isfinite(least) or 1.0 - least < MIN_MATCH:
            track.append({"frame": number, "box": None})
            continue
        h, w = template.shape[:2]
        template = pixels[y:y + h, x:x + w]
        track.append({"frame": number, "box": [round(v, 4) for v in _relative((x, y, x + w, y + h), frame.width,
                                                                                frame.height)]})
    parts = [f"frame {step['frame']}: {_fmt_box(tuple(step['box'])) if step['box'] else 'lost'}" for step in track]
    movement = overall_movement(track)
    return ToolResult(text="track: " + "; ".join(parts) + f"; overall: {movement}",
                      record={"track": track, "movement": movement})


MIN_MOVEMENT = 0.02
"""A tracked object whose centre moved less than this (a fraction of the frame's side) stayed in place."""


def overall_movement(track: list[dict[str, Any]]) -> str:
    """Where the object went from its first box to its last found one, in words: the larger of its horizontal and
    vertical shifts (`moved right by 0.12 of the width`), `stayed in place`, or `lost` when no later frame has it.
    A track is a column of numbers; the summary is what a reader of it wants first."""
    found = [step["box"] for step in track if step["box"] is not None]
    if len(found) < 2:
        return "lost"
    (a0, b0, a1, b1), (c0, d0, c1, d1) = found[0], found[-1]
    dx, dy = (c0 + c1 - a0 - a1) / 2, (d0 + d1 - b0 - b1) / 2
    if max(abs(dx), abs(dy)) < MIN_MOVEMENT:
        return "stayed in place"
    if abs(dx) >= abs(dy):
        return f"moved {'right' if dx > 0 else 'left'} by {abs(dx):.2f} of the width"
    return f"moved {'down' if dy > 0 else 'up'} by {abs(dy):.2f} of the height"
