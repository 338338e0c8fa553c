"""The visual operations beyond the crop (loupe/visual_ops.py), each on an image drawn so the right result is known."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from loupe import visual_ops
from loupe.config import ProtocolParams
from loupe.protocol import ToolCall
from loupe.tools import TOOLS, CropResult, ImageSession, ToolError, ToolErrorKind, ToolResult, crop, operation, run_tool

BUDGET = ProtocolParams().budget
RED, BLUE, YELLOW, GROUND = (220, 30, 30), (30, 60, 200), (240, 210, 30), (200, 200, 200)


def scene() -> Image.Image:
    """A red 80x80 square at (50, 60), a blue disc of diameter 100 at (200, 50), a yellow triangle, a sign."""
    image = Image.new("RGB", (400, 300), GROUND)
    draw = ImageDraw.Draw(image)
    draw.rectangle((50, 60, 129, 139), fill=RED)
    draw.ellipse((200, 50, 299, 149), fill=BLUE)
    draw.polygon([(60, 280), (140, 280), (100, 200)], fill=YELLOW)
    draw.rectangle((210, 210, 390, 270), fill=(255, 255, 255))
    draw.text((222, 218), "EXIT 7", fill=(0, 0, 0), font=ImageFont.load_default(size=36))
    return image


def call(session: ImageSession, tool: str, **arguments):
    return run_tool(ToolCall(tool, arguments), session, BUDGET)


def test_every_operation_is_registered_with_a_schema_and_a_description():
    for name in ("crop", "segment_at", "get_properties", "read_text", "rotate", "select_frames", "track_object"):
        assert name in TOOLS and TOOLS[name].description and TOOLS[name].schema["type"] == "object"
    assert "point" in TOOLS["segment_at"].schema["properties"]


@pytest.mark.parametrize("point, colour, box, area, shape", [
    ((0.2, 0.33), "red", (50, 60, 130, 140), 6400, "square"),
    ((0.62, 0.33), "blue", (200, 50, 300, 150), None, "circle"),
    ((0.25, 0.85), "yellow", (60, 200, 141, 281), None, "triangle"),
])
def test_segment_then_properties_find_the_object_drawn_there(point, colour, box, area, shape):
    session = ImageSession(original=scene())
    found = call(session, "segment_at", point=list(point))
    assert isinstance(found, ToolResult) and found.record["mask"] == "mask_1"
    expected = (box[0] / 400, box[1] / 300, box[2] / 400, box[3] / 300)
    assert found.record["box"] == pytest.approx(expected, abs=1 / 300)
    if area is not None:
        assert found.record["area"] == area
    alone = found.images[0].full
    assert alone.size == (box[2] - box[0], box[3] - box[1])
    assert max(found.images[0].image.size) <= max(alone.size) * 2  # shown within the crops' budget
    properties = call(session, "get_properties", mask="mask_1")
    assert isinstance(properties, ToolResult)
    assert properties.record["colour"] == colour and properties.record["shape"] == shape
    assert colour in properties.text and shape in properties.text


def test_a_disc_is_rounder_than_a_square_and_a_triangle_fills_half_its_box():
    session = ImageSession(original=scene())
    for point in ([0.2, 0.33], [0.62, 0.33], [0.25, 0.85]):
        call(session, "segment_at", point=point)
    square, disc, triangle = (call(session, "get_properties", mask=f"mask_{n}").record for n in (1, 2, 3))
    assert disc["circularity"] > square["circularity"] > triangle["circularity"]
    assert square["extent"] == pytest.approx(1.0, abs=0.01)
    assert triangle["extent"] == pytest.approx(0.5, abs=0.05)
    assert disc["extent"] == pytest.approx(np.pi / 4, abs=0.03)


def test_segment_on_an_observation_reads_its_full_resolution_pixels():
    session = ImageSession(original=scene())
    zoom = crop(session, {"bbox_2d": [0.0, 0.0, 0.5, 0.5]}, BUDGET)
    assert isinstance(zoom, CropResult)
    session.add_observation(zoom.image, zoom.region)
    found = call(session, "segment_at", point=[0.45, 0.66], source="observation_1")  # the square, on the crop
    assert isinstance(found, ToolResult)
    assert found.record["area"] == 6400  # full resolution, not the 112-px view


def test_read_text_reads_the_sign_and_nothing_where_there_is_none():
    session = ImageSession(original=scene())
    sign = call(session, "read_text", bbox_2d=[0.5, 0.66, 1.0, 0.95])
    assert isinstance(sign, ToolResult)
    assert [line["text"] for line in sign.record["lines"]] == ["EXIT 7"]
    assert "EXIT 7" in sign.text
    blank = call(session, "read_text", bbox_2d=[0.0, 0.0, 0.1, 0.1])
    assert blank.record["lines"] == [] and blank.text == "no text found in that region"


def test_rotate_turns_the_image_and_a_crop_of_it_cuts_the_turned_pixels():
    session = ImageSession(original=scene())
    turned = call(session, "rotate", angle=90)
    assert isinstance(turned, ToolResult) and turned.images[0].full.size == (300, 400)
    # 90 degrees counter-clockwise: the original's top-left corner goes to the bottom-left.
    assert turned.images[0].full.getpixel((100, 400 - 100)) == RED
    name = session.add_image(turned.images[0].image, turned.images[0].full)
    assert session.base_of(name) == 1
    zoom = crop(session, {"bbox_2d": [0.2, 0.6, 0.45, 0.9], "source": name}, BUDGET)
    assert isinstance(zoom, CropResult) and zoom.base == 1
    assert zoom.region_px == (60, 240, 135, 360)  # on the turned image's 300x400 pixels
    middle = zoom.image.getpixel((zoom.image.width // 2, zoom.image.height // 2))
    assert middle == RED


def moving_square_frames(count: int = 12, step: int = 6) -> list[Image.Image]:
    frames = []
    for i in range(count):
        frame = Image.new("RGB", (160, 120), GROUND)
        ImageDraw.Draw(frame).rectangle((10 + i * step, 40, 34 + i * step, 64), fill=RED)
        frames.append(frame)
    return frames


def test_select_frames_returns_the_frames_asked_for_and_refuses_out_of_range_or_too_many():
    frames = moving_square_frames()
    session = ImageSession(original=frames[0], frames=frames)
    picked = call(session, "select_frames", target_frames=[1, 12])
    assert isinstance(picked, ToolResult) and [image.full for image in picked.images] == [frames[0], frames[11]]
    late = call(session, "select_frames", target_frames=[13])
    assert isinstance(late, ToolError) and "numbered 1 to 12" in late.detail
    many = call(session, "select_frames", target_frames=list(range(1, 10)))
    assert isinstance(many, ToolError) and "at most 8" in many.detail
    image_only = ImageSession(original=scene())
    assert isinstance(call(image_only, "select_frames", target_frames=[1]), ToolError)


def test_track_object_follows_a_moving_square():
    frames = moving_square_frames()
    session = ImageSession(original=frames[0], frames=frames)
    start = [10 / 160, 40 / 120, 35 / 160, 65 / 120]
    tracked = call(session, "track_object", bbox_2d=start, start_frame=1)
    assert isinstance(tracked, ToolResult)
    track = tracked.record["track"]
    assert [step["frame"] for step in track] == list(range(1, 13))
    for step in track:  # the square moves 6 px a frame to the right and stays at y = 40
        x0, y0 = step["box"][0] * 160, step["box"][1] * 120
        assert abs(x0 - (10 + 6 * (step["frame"] - 1))) <= 1 and abs(y0 - 40) <= 1, step
    # 66 px right on a 160-px frame: 0.41 of the width, said in words after the track
    assert tracked.record["movement"] == "moved right by 0.41 of the width"
    assert tracked.text.endswith("overall: moved right by 0.41 of the width")
    again = call(ImageSession(original=frames[0], frames=frames), "track_object", bbox_2d=start, start_frame=1)
    assert again.record == tracked.record  # the same call, the same track
    gone = frames[:6] + [Image.new("RGB", (160, 120), GROUND)] * 2
    lost = call(ImageSession(original=frames[0], frames=gone), "track_object", bbox_2d=start, start_frame=1)
    assert [step["box"] is None for step in lost.record["track"]] == [False] * 6 + [True] * 2
    assert lost.record["movement"] == "moved right by 0.19 of the width"  # from frame 1 to frame 6, the last found
    still = call(ImageSession(original=frames[0], frames=[frames[0]] * 4), "track_object", bbox_2d=start)
    assert still.record["movement"] == "stayed in place"


@pytest.mark.parametrize("tool, arguments, kind, words", [
    ("segment_at", {"point": [2, 0.5]}, ToolErrorKind.BAD_ARGUMENTS, "'point' must lie in"),
    ("segment_at", {"pt": [0.2, 0.3]}, ToolErrorKind.BAD_ARGUMENTS, "'pt': Extra inputs"),
    ("segment_at", {"point": "middle"}, ToolErrorKind.BAD_ARGUMENTS, "'point'"),
    ("segment_at", {"point": [0.2, 0.3], "source": "observation_4"}, ToolErrorKind.UNKNOWN_SOURCE, "observation_4"),
    ("get_properties", {"mask": "mask_1"}, ToolErrorKind.UNKNOWN_SOURCE, "call segment_at first"),
    ("get_properties", {"mask": "the red one"}, ToolErrorKind.BAD_ARGUMENTS, "'mask'"),
    ("rotate", {"angle": 1000}, ToolErrorKind.BAD_ARGUMENTS, "'angle'"),
    ("read_text", {"bbox_2d": [0.5, 0.5, 0.5, 0.9]}, ToolErrorKind.DEGENERATE_BOX, "covers no pixel"),
    ("track_object", {"bbox_2d": [0, 0, 0.1, 0.1]}, ToolErrorKind.BAD_ARGUMENTS, "not a video"),
])
def test_a_bad_call_gets_an_error_naming_what_was_wrong(tool, arguments, kind, words):
    result = call(ImageSession(original=scene()), tool, **arguments)
    assert isinstance(result, ToolError) and result.kind == kind and words in result.detail


def test_a_user_registers_an_operation_of_their_own():
    from pydantic import BaseModel

    before = dict(TOOLS)

    class CountArguments(BaseModel):
        colour: str

    @operation("count_pixels", CountArguments, "how many pixels have a named colour")
    def count_pixels(session, args, budget):
        pixels = np.asarray(visual_ops.source_pixels(session, "original_image"))
        count = int((pixels == np.array(visual_ops.NAMED_COLOURS[args.colour])).all(axis=-1).sum())
        return ToolResult(text=f"{count} {args.colour} pixels", record={"count": count})

    try:
        result = call(ImageSession(original=scene()), "count_pixels", colour="red")
        assert result.record["count"] == 6400
        assert isinstance(call(ImageSession(original=scene()), "count_pixels"), ToolError)
        with pytest.raises(ValueError, match="already registered"):
            operation("count_pixels", CountArguments, "twice")(count_pixels)
    finally:
        TOOLS.clear()
        TOOLS.update(before)
