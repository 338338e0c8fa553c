"""The tools: Qwen's resize rule, the crop tool and how crops are cut (image decoding, the image session and
the tool registry: tests/test_tool_inputs.py)."""

from __future__ import annotations

import random

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from PIL import Image

from loupe.protocol import ORIGINAL_IMAGE
from loupe.tools import (
    IMAGE_FACTOR,
    MAX_ASPECT_RATIO,
    CropResult,
    ImageSession,
    PixelBudget,
    ToolError,
    ToolErrorKind,
    crop,
    smart_resize,
)
from tests.tool_cases import (
    BLUE,
    FUZZ,
    NO_RESIZE,
    RED,
    WHITE,
    near,
    noise_image,
)

# --- smart_resize ------------------------------------------------------------------------------------------

try:  # transformers 5.x keeps the rule beside the Qwen2-VL image processor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import (
        smart_resize as hf_smart_resize,
    )
except ImportError:  # pragma: no cover - an environment without transformers
    hf_smart_resize = None

needs_transformers = pytest.mark.skipif(hf_smart_resize is None, reason="transformers is not installed")


@st.composite
def sides_within_aspect(draw, largest: int = 30_000):
    short = draw(st.one_of(st.integers(1, 60), st.integers(1, largest)))  # thin images are where rules differ
    long_ = draw(st.integers(short, min(largest, short * MAX_ASPECT_RATIO)))
    return (short, long_) if draw(st.booleans()) else (long_, short)


@st.composite
def budgets(draw):
    min_pixels = draw(st.integers(IMAGE_FACTOR * IMAGE_FACTOR, 1_000_000))
    max_pixels = draw(st.integers(max(min_pixels, IMAGE_FACTOR * IMAGE_FACTOR), 20_000_000))
    return PixelBudget(min_pixels, max_pixels)


@needs_transformers
@FUZZ
@given(sides=sides_within_aspect(), budget=budgets())
def test_smart_resize_equals_transformers_for_random_sizes_and_budgets(sides, budget):
    height, width = sides
    expected = hf_smart_resize(height, width, IMAGE_FACTOR, budget.min_pixels, budget.max_pixels)
    assert smart_resize(height, width, budget) == tuple(expected)


@needs_transformers
@pytest.mark.parametrize(
    "height, width",
    [(1, 1), (1, 200), (200, 1), (13, 2600), (14, 2800), (27, 27), (28, 28), (5000, 25), (3024, 4032),
     (8000, 8000), (4320, 7680), (100, 100), (57, 33)],
)
@pytest.mark.parametrize("budget", [PixelBudget(), PixelBudget(56 * 56, 28 * 28 * 1280), PixelBudget(256 * 784, 1280 * 784)])
def test_smart_resize_equals_transformers_on_edge_sizes(height, width, budget):
    expected = hf_smart_resize(height, width, IMAGE_FACTOR, budget.min_pixels, budget.max_pixels)
    assert smart_resize(height, width, budget) == tuple(expected)


@FUZZ
@given(sides=sides_within_aspect())
def test_smart_resize_fits_the_default_budget_in_multiples_of_28(sides):
    budget = PixelBudget()
    new_h, new_w = smart_resize(*sides, budget)
    assert new_h % IMAGE_FACTOR == 0 and new_w % IMAGE_FACTOR == 0
    assert new_h >= IMAGE_FACTOR and new_w >= IMAGE_FACTOR
    assert budget.min_pixels <= new_h * new_w <= budget.max_pixels


@FUZZ
@given(sides=sides_within_aspect(), budget=budgets())
def test_smart_resize_leaves_the_budget_only_when_the_short_side_is_pinned(sides, budget):
    assume(budget.max_pixels >= 4 * budget.min_pixels)
    new_h, new_w = smart_resize(*sides, budget)
    assert new_h % IMAGE_FACTOR == 0 and new_w % IMAGE_FACTOR == 0
    assert new_h * new_w >= budget.min_pixels
    assert new_h * new_w <= budget.max_pixels or min(new_h, new_w) == IMAGE_FACTOR


def test_smart_resize_keeps_a_size_already_on_the_grid_and_in_budget():
    assert smart_resize(224, 280, PixelBudget()) == (224, 280)


@pytest.mark.parametrize("height, width", [(0, 10), (10, 0), (-5, 10)])
def test_smart_resize_refuses_empty_sides(height, width):
    with pytest.raises(ValueError, match="positive"):
        smart_resize(height, width, PixelBudget())


@pytest.mark.parametrize("low, high", [(0, 100_000), (50_000, 40_000), (100, 500)])
def test_pixel_budget_refuses_impossible_bounds(low, high):
    with pytest.raises(ValueError):
        PixelBudget(low, high)


# --- crop -----------------------------------------------------------------------------------------------------


def test_relative_crop_is_exactly_that_region_of_the_original(noise):
    result = crop(ImageSession(original=noise), {"bbox_2d": [0.25, 0.25, 0.5, 0.5], "frame": "relative"}, NO_RESIZE)
    assert isinstance(result, CropResult)
    assert result.box_px == (280, 224, 560, 448)
    assert result.source == ORIGINAL_IMAGE
    assert result.image.size == (280, 224)
    assert result.image.tobytes() == noise.crop((280, 224, 560, 448)).tobytes()


def test_absolute_crop_is_exactly_that_region_of_the_original(noise):
    result = crop(ImageSession(original=noise), {"bbox_2d": [280, 224, 560, 448], "frame": "absolute"}, NO_RESIZE)
    assert result.box_px == (280, 224, 560, 448)
    assert result.image.tobytes() == noise.crop((280, 224, 560, 448)).tobytes()


def test_crop_without_a_frame_reads_the_box_as_relative(noise):
    result = crop(ImageSession(original=noise), {"bbox_2d": [0.25, 0.25, 0.5, 0.5]}, NO_RESIZE)
    assert result.box_px == (280, 224, 560, 448)


def test_crop_of_a_coloured_square_shows_that_square(square_image):
    session = ImageSession(original=square_image)
    red = crop(session, {"bbox_2d": [0.2, 0.125, 0.3, 0.25], "frame": "relative"}, PixelBudget())
    assert red.box_px == (200, 100, 300, 200)
    assert red.image.size == (224, 224)  # 100x100 is under 40,000 pixels: scaled up into the budget
    assert all(near(c, RED) for _, c in red.image.getcolors(1 << 16))
    blue = crop(session, {"bbox_2d": [600, 500, 700, 600], "frame": "absolute"}, PixelBudget())
    assert all(near(c, BLUE) for _, c in blue.image.getcolors(1 << 16))


def test_crop_around_a_square_keeps_its_position(square_image):
    result = crop(ImageSession(original=square_image), {"bbox_2d": [100, 50, 400, 250], "frame": "absolute"}, PixelBudget())
    w, h = result.image.size
    assert near(result.image.getpixel((w // 2, h // 2)), RED)
    assert near(result.image.getpixel((w // 12, h // 2)), WHITE)
    assert near(result.image.getpixel((w - 1 - w // 12, h // 2)), WHITE)
    assert near(result.image.getpixel((w // 2, h // 10)), WHITE)


@pytest.mark.parametrize(
    "box, frame, expected",
    [
        ([-100, -50, 280, 224], "absolute", (0, 0, 280, 224)),
        ([840, 672, 5000, 5000], "absolute", (840, 672, 1120, 896)),
        ([0.75, 0.75, 1.3, 2.0], "relative", (840, 672, 1120, 896)),
        ([-0.5, -1.0, 0.25, 0.25], "relative", (0, 0, 280, 224)),
    ],
)
def test_crop_clamps_boxes_partly_outside_the_image(noise, box, frame, expected):
    result = crop(ImageSession(original=noise), {"bbox_2d": box, "frame": frame}, NO_RESIZE)
    assert isinstance(result, CropResult)
    assert result.box_px == expected
    assert result.image.tobytes() == noise.crop(expected).tobytes()


def test_crop_rounds_a_fractional_box_outwards(noise):
    result = crop(ImageSession(original=noise), {"bbox_2d": [10.5, 20.2, 40.1, 50.9], "frame": "absolute"}, NO_RESIZE)
    assert result.box_px == (10, 20, 41, 51)


def test_crop_of_an_observation_is_cut_from_the_originals_pixels_at_the_composed_box(noise):
    session = ImageSession(original=noise)
    first = crop(session, {"bbox_2d": [0.25, 0.25, 0.5, 0.5], "frame": "relative"}, PixelBudget(28 * 28, 28 * 28 * 16))
    assert first.region_px == (280, 224, 560, 448) and first.image.size == (112, 84)  # downscaled 2.5x
    assert session.add_observation(first.image, first.region) == "observation_1"
    second = crop(session, {"bbox_2d": [0.0, 0.0, 0.5, 0.5], "source": "observation_1", "frame": "relative"},
                  PixelBudget())
    assert isinstance(second, CropResult)
    assert second.source == "observation_1"
    assert second.box_px == (0, 0, 56, 42)  # on the observation the model was shown
    assert second.region_px == (280, 224, 420, 336)  # on the original: the composed box
    new_h, new_w = smart_resize(112, 140, PixelBudget())
    expected = noise.crop((280, 224, 420, 336)).resize((new_w, new_h), Image.Resampling.BICUBIC)
    assert second.image.tobytes() == expected.tobytes()  # full-resolution pixels, not the 56x42 downscaled ones


def test_a_deeper_zoom_shows_detail_the_first_observation_lost(noise):
    session = ImageSession(original=noise)
    small = PixelBudget(28 * 28, 28 * 28 * 4)
    first = crop(session, {"bbox_2d": [0.0, 0.0, 1.0, 1.0]}, small)
    name = session.add_observation(first.image, first.region)
    second = crop(session, {"bbox_2d": [0.5, 0.5, 0.5625, 0.5625], "source": name}, PixelBudget())
    # 1/16 of each side of the original is 70x56 px of real noise; cut from the 56x28 observation it would be
    # 3.5x1.75 px blown up.
    assert second.region_px == (560, 448, 630, 504)
    expected = noise.crop(second.region_px).resize(second.image.size, Image.Resampling.BICUBIC)
    assert second.image.tobytes() == expected.tobytes()


def test_zooms_chained_through_observations_compose_exactly(noise):
    session = ImageSession(original=noise)
    name = ORIGINAL_IMAGE
    for box in ([0.1, 0.2, 0.9, 0.8], [0.25, 0.25, 0.75, 0.75], [0.5, 0.0, 1.0, 0.5]):
        result = crop(session, {"bbox_2d": box, "source": name}, PixelBudget())
        # The region the observation shows is whole pixels; the next box composes with that, not the floats.
        rx0, ry0, rx1, ry1 = session.region(name)
        w, h = rx1 - rx0, ry1 - ry0
        composed = (rx0 + box[0] * w, ry0 + box[1] * h, rx0 + box[2] * w, ry0 + box[3] * h)
        assert all(abs(a - b) < 1.0 for a, b in zip(result.region_px, composed)), (result.region_px, composed)
        name = session.add_observation(result.image, result.region)
    assert session.region(name) == result.region


def test_observation_0_names_the_original(noise):
    result = crop(ImageSession(original=noise), {"bbox_2d": [0.25, 0.25, 0.5, 0.5], "source": "observation_0"}, NO_RESIZE)
    assert result.source == ORIGINAL_IMAGE
    assert result.image.tobytes() == noise.crop((280, 224, 560, 448)).tobytes()


def test_large_crop_is_scaled_down_into_the_budget(noise):
    budget = PixelBudget(min_pixels=10_000, max_pixels=200_000)
    result = crop(ImageSession(original=noise), {"bbox_2d": [0, 0, 1, 1]}, budget)
    w, h = result.image.size
    assert result.box_px == (0, 0, 1120, 896)
    assert w * h <= budget.max_pixels and w % IMAGE_FACTOR == 0 and h % IMAGE_FACTOR == 0
    assert abs(w / h - 1120 / 896) < 0.1


@pytest.mark.parametrize(
    "source",
    ["observation_1", "observation_2", "foo", "", 3, None, ["original_image"], "observation_\u0661",
     "observation_" + "1" * 5000],
)
def test_crop_of_an_unknown_source_is_a_tool_error(noise, source):
    session = ImageSession(original=noise)
    if source != "observation_1":
        session.add_observation(noise_image(56, 56), (0, 0, 112, 112))
    else:
        assert session.observations == []
    result = crop(session, {"bbox_2d": [0.1, 0.1, 0.5, 0.5], "source": source}, PixelBudget())
    assert isinstance(result, ToolError)
    assert result.kind == ToolErrorKind.UNKNOWN_SOURCE
    assert repr(str(source)[:40]) in result.detail and len(result.detail) < 100  # named, and short


def test_crop_without_any_original_is_an_unknown_source():
    result = crop(ImageSession(), {"bbox_2d": [0.1, 0.1, 0.5, 0.5]}, PixelBudget())
    assert isinstance(result, ToolError) and result.kind == ToolErrorKind.UNKNOWN_SOURCE


@pytest.mark.parametrize(
    "box, frame, words",
    [
        ([1.2, 0.1, 1.5, 0.5], "relative", "less than one pixel"),  # wholly right of the image
        ([-50, -50, -10, -10], "absolute", "less than one pixel"),  # wholly above-left
        ([10, 10, 10, 20], "absolute", "less than one pixel"),  # zero width
        ([0.3, 0.3, 0.2, 0.4], "relative", "less than one pixel"),  # x1 < x0
        ([0, 0, 1000, 4], "absolute", "more elongated than 200"),  # 250:1
        ([0, 0, 1, 0.004], "relative", "more elongated than 200"),  # 1120 x 4 px
    ],
)
def test_degenerate_boxes_are_refused(noise, box, frame, words):
    result = crop(ImageSession(original=noise), {"bbox_2d": box, "frame": frame}, PixelBudget())
    assert isinstance(result, ToolError)
    assert result.kind == ToolErrorKind.DEGENERATE_BOX
    assert words in result.detail


def test_a_box_of_aspect_exactly_200_is_allowed_and_fits_the_budget(noise):
    result = crop(ImageSession(original=noise), {"bbox_2d": [0, 0, 1000, 5], "frame": "absolute"}, PixelBudget())
    assert isinstance(result, CropResult)
    w, h = result.image.size
    assert 40_000 <= w * h <= 2_000_000 and w % 28 == 0 and h % 28 == 0


@pytest.mark.parametrize(
    "box, expected",
    [
        ([0, 0, 1e308, 1e308], (0, 0, 1120, 896)),  # times the side: overflows to infinity
        ([-1e308, -1e308, 0.25, 0.25], (0, 0, 280, 224)),
        ([0.25, 0.25, 1e300, 0.5], (280, 224, 1120, 448)),
    ],
)
def test_huge_relative_coordinates_are_clamped_not_overflowing(noise, box, expected):
    result = crop(ImageSession(original=noise), {"bbox_2d": box, "frame": "relative"}, PixelBudget())
    assert isinstance(result, CropResult)
    assert result.box_px == expected


@pytest.mark.parametrize("frame", ["relative", "absolute"])
def test_an_integer_too_large_for_a_float_is_bad_arguments(noise, frame):
    result = crop(ImageSession(original=noise), {"bbox_2d": [0, 0, 10**400, 1], "frame": frame}, PixelBudget())
    assert isinstance(result, ToolError) and result.kind == ToolErrorKind.BAD_ARGUMENTS


@pytest.mark.parametrize(
    "box, frame",
    [([10.2, 10, 10.4, 20], "absolute"), ([0.5, 0.5, 0.5005, 0.6], "relative"), ([0.5, 0.5, 0.6, 0.5008], "relative")],
)
def test_a_box_under_one_pixel_of_its_source_is_refused_not_cropped_to_one_pixel(noise, box, frame):
    result = crop(ImageSession(original=noise), {"bbox_2d": box, "frame": frame}, PixelBudget())
    assert isinstance(result, ToolError) and result.kind == ToolErrorKind.DEGENERATE_BOX
    assert "less than one pixel" in result.detail


def test_a_box_under_one_pixel_of_an_observation_is_refused_though_it_spans_original_pixels(noise):
    session = ImageSession(original=noise)
    first = crop(session, {"bbox_2d": [0, 0, 1, 1]}, PixelBudget(28 * 28, 28 * 28 * 4))
    assert first.image.size == (56, 28)  # showing all 1120x896 px of the original
    name = session.add_observation(first.image, first.region)
    result = crop(session, {"bbox_2d": [0.5, 0.2, 0.51, 0.8], "source": name}, PixelBudget())  # 0.56 px wide
    assert isinstance(result, ToolError) and "less than one pixel of the 56x28 source" in result.detail


@pytest.mark.parametrize(
    "arguments",
    [
        {},
        {"bbox_2d": "0.1, 0.1, 0.5, 0.5"},
        {"bbox_2d": [0.1, 0.1, 0.5]},
        {"bbox_2d": [0.1, 0.1, 0.5, 0.5, 0.6]},
        {"bbox_2d": [0.1, float("nan"), 0.5, 0.5]},
        {"bbox_2d": [0.1, 0.1, float("inf"), 0.5]},
        {"bbox_2d": [False, False, True, True]},
        {"bbox_2d": ["0.1", "0.1", "0.5", "0.5"]},
        {"bbox_2d": [0.1, 0.1, 0.5, 0.5], "frame": "pixels"},
        {"bbox_2d": [0.1, 0.1, 0.5, 0.5], "frame": None},
    ],
)
def test_malformed_crop_arguments_are_bad_arguments(noise, arguments):
    result = crop(ImageSession(original=noise), arguments, PixelBudget())
    assert isinstance(result, ToolError)
    assert result.kind == ToolErrorKind.BAD_ARGUMENTS
    assert result.detail


any_coordinate = st.one_of(
    st.floats(),  # NaN, infinities, huge, tiny and negative included
    st.floats(-2.0, 3.0),
    st.integers(-(10**20), 10**20),
    st.integers(-5, 400),
    st.sampled_from([0, 1, 0.5, 1e308, -1e308, 5e-324, 10**400, -(10**400)]),
)


@st.composite
def ordered_boxes(draw, coordinate):
    a, b, c, d = (draw(coordinate) for _ in range(4))
    return [min(a, b), min(c, d), max(a, b), max(c, d)]


@st.composite
def plausible_boxes(draw, corner, side):
    x0, y0 = draw(corner), draw(corner)
    return [x0, y0, x0 + draw(side), y0 + draw(side)]


any_box = st.one_of(
    plausible_boxes(st.floats(-0.2, 0.9), st.floats(0.05, 1.0)),  # relative boxes, partly outside the image too
    plausible_boxes(st.integers(-30, 280), st.integers(4, 400)),  # pixel boxes
    st.one_of(  # anything at all
        ordered_boxes(any_coordinate),
        st.lists(any_coordinate, min_size=4, max_size=4),
        st.lists(st.one_of(any_coordinate, st.booleans(), st.none(), st.text(max_size=2)), max_size=6),
        st.none(),
        st.text(max_size=5),
    ),
)
SMALL_BUDGETS = [PixelBudget(), PixelBudget(28 * 28 * 4, 28 * 28 * 64), PixelBudget(28 * 28, 28 * 28 * 4)]


@FUZZ
@given(
    box=any_box,
    frame=st.sampled_from(["relative", "absolute"] * 3 + [None, "pixels", 1]),
    omit_frame=st.booleans(),
    source=st.sampled_from([ORIGINAL_IMAGE, ORIGINAL_IMAGE, "observation_0", "observation_1", "observation_1",
                            "observation_2", "x", None, "observation_" + "1" * 5000]),
    budget=st.sampled_from(SMALL_BUDGETS),
)
def test_crop_of_any_box_is_a_result_in_budget_or_a_tool_error(box, frame, omit_frame, source, budget):
    session = ImageSession(original=noise_image(300, 200))
    session.add_observation(noise_image(90, 60, seed=1), (30, 20, 210, 140))
    arguments = {"bbox_2d": box, "source": source}
    if not omit_frame:
        arguments["frame"] = frame
    result = crop(session, arguments, budget)
    assert isinstance(result, (CropResult, ToolError))
    if isinstance(result, ToolError):
        assert isinstance(result.kind, ToolErrorKind) and result.detail
        return
    w, h = result.image.size
    assert w % IMAGE_FACTOR == 0 and h % IMAGE_FACTOR == 0
    assert budget.min_pixels <= w * h <= budget.max_pixels
    left, top, right, bottom = result.box_px
    source_w, source_h = session.get(result.source).size
    assert 0 <= left < right <= source_w and 0 <= top < bottom <= source_h
    left, top, right, bottom = result.region_px  # the pixels cut lie inside the source's own region
    rx0, ry0, rx1, ry1 = session.region(result.source)
    assert rx0 <= left < right <= rx1 and ry0 <= top < bottom <= ry1
    assert max(right - left, bottom - top) <= MAX_ASPECT_RATIO * min(right - left, bottom - top)




# --- how crops are cut: crop_cut, crop_padding, the crops' own budget ------------------------------------------


def _mini_o3_nested_boxes(size, boxes):
    """Mini-o3's arithmetic (function_tools.py @ 8654dbf, `prepare_grounding_inputs_multi_turn` then
    `crop_image(..., resize=1)`), as an oracle: each level keeps the full-resolution cut; a relative box times
    the kept image's size is truncated with int(), its far edge kept below the last row and column."""
    left, top, (width, height) = 0, 0, size
    out = []
    for x0, y0, x1, y1 in boxes:
        b = [int(x0 * width), int(y0 * height), int(x1 * width), int(y1 * height)]
        b = [max(b[0], 0), max(b[1], 0), min(b[2], width - 1), min(b[3], height - 1)]
        left, top, width, height = left + b[0], top + b[1], b[2] - b[0], b[3] - b[1]
        out.append((left, top, left + width, top + height))
    return out


def test_whole_pixel_cuts_land_where_mini_o3s_nested_zooms_land():

    rng = random.Random(7)
    mismatched_composed = 0
    for _ in range(20):
        size = (rng.randint(600, 2000), rng.randint(600, 2000))
        boxes = []
        for _depth in range(5):
            x0, y0 = rng.uniform(0, 0.5), rng.uniform(0, 0.5)
            boxes.append((x0, y0, rng.uniform(x0 + 0.3, 1.0), rng.uniform(y0 + 0.3, 1.0)))
        expected = _mini_o3_nested_boxes(size, boxes)
        for cut, compare in (("whole_pixels", True), ("composed", False)):
            session = ImageSession(original=Image.new("RGB", size))
            source = ORIGINAL_IMAGE
            for box, want in zip(boxes, expected):
                result = crop(session, {"bbox_2d": list(box), "source": source},
                              PixelBudget(3136, 200704, crop_cut=cut))
                assert isinstance(result, CropResult)
                if compare:
                    assert result.region_px == want
                else:
                    mismatched_composed += result.region_px != want
                source = session.add_observation(result.image, result.region)
    assert mismatched_composed > 0  # Loupe's own arithmetic differs from Mini-o3's, which is why the setting exists


def test_whole_pixel_cuts_refuse_a_box_under_one_whole_pixel():
    session = ImageSession(original=Image.new("RGB", (100, 100)))
    result = crop(session, {"bbox_2d": [0.5, 0.5, 0.509, 0.9]}, PixelBudget(3136, 50176, crop_cut="whole_pixels"))
    assert isinstance(result, ToolError) and result.kind == ToolErrorKind.DEGENERATE_BOX


def test_shown_cuts_come_from_the_image_as_shown_with_padding_and_their_own_budget():
    original = Image.new("RGB", (2000, 1000))
    original.paste((255, 0, 0), (1000, 500, 2000, 1000))  # the bottom-right quarter is red
    budget = PixelBudget(3136, 200704, min_crop_side=29, crop_max_pixels=50176, crop_padding=0.1, crop_cut="shown")
    session = ImageSession(original=original)
    result = crop(session, {"bbox_2d": [0.6, 0.6, 0.9, 0.9]}, budget)
    assert isinstance(result, CropResult)
    shown = session.shown(ORIGINAL_IMAGE, budget)
    assert shown.width * shown.height <= 200704 < original.width * original.height
    # 0.1 of the shown image's side on each side: [0.5, 0.5, 1.0, 1.0] of it, cut from its pixels.
    assert result.box_px == (round(0.5 * shown.width), round(0.5 * shown.height), shown.width, shown.height)
    assert result.image.width * result.image.height <= 50176
    assert result.image.getpixel((result.image.width // 2, result.image.height // 2)) == (255, 0, 0)
    # A crop of a crop is cut from the crop as shown, and its region maps back onto the original.
    again = crop(session, {"bbox_2d": [0.2, 0.2, 0.7, 0.7], "source": session.add_observation(result.image, result.region)},
                 budget)
    assert isinstance(again, CropResult)
    assert 1000 <= again.region[0] < again.region[2] <= 2000


def test_shown_cuts_refuse_a_cut_under_min_crop_side_of_the_image_shown():
    budget = PixelBudget(3136, 40000, min_crop_side=29, crop_cut="shown")
    session = ImageSession(original=Image.new("RGB", (4000, 4000)))  # shown at 196 x 196
    result = crop(session, {"bbox_2d": [0.1, 0.1, 0.2, 0.2]}, budget)  # 20 px of the image shown
    assert isinstance(result, ToolError) and "of the image shown" in result.detail


@pytest.mark.parametrize("bad", [{"crop_padding": -0.1}, {"crop_padding": 1.0}, {"crop_cut": "nearest"},
                                 {"crop_min_pixels": 90000, "crop_max_pixels": 40000}])
def test_a_bad_crop_setting_is_refused(bad):
    with pytest.raises(ValueError):
        PixelBudget(3136, 50176, **bad)
