"""The protocol's parser: rendered calls and answers parse back, no text makes it raise or disagree with the
grammar, and its policy (docs/architecture.md, "Parser policy") on text after a call, coordinates a hair
outside the image and boxes under a pixel."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from loupe.protocol import (
    MAX_ERROR_DETAIL,
    ORIGINAL_IMAGE,
    Action,
    ToolCall,
)
from loupe.tools import ImageSession, PixelBudget, ToolError, ToolErrorKind, run_tool
from tests.protocol_cases import (
    DEEPEYES,
    FUZZ,
    HAIR_OUTSIDE,
    LOUPE,
    MINI,
    SINGLE,
    TOLERANCE,
    K,
    assert_well_typed,
    call_payload,
    grounding,
)

# --- round trips ------------------------------------------------------------------------------------------

grid_value = st.integers(min_value=0, max_value=1000)


@st.composite
def grid_boxes(draw):
    """Boxes whose coordinates have at most three decimals (what render_call writes)."""
    x0, x1 = sorted(draw(st.lists(grid_value, min_size=2, max_size=2, unique=True)))
    y0, y1 = sorted(draw(st.lists(grid_value, min_size=2, max_size=2, unique=True)))
    return [x0 / 1000, y0 / 1000, x1 / 1000, y1 / 1000]


@st.composite
def float_boxes(draw):
    """Any valid relative box, down to widths far below 0.001."""
    unit = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)
    x0, x1 = sorted(draw(st.lists(unit, min_size=2, max_size=2, unique=True)))
    y0, y1 = sorted(draw(st.lists(unit, min_size=2, max_size=2, unique=True)))
    return [x0, y0, x1, y1]


plain_text = st.text(alphabet=st.characters(blacklist_characters="<>", blacklist_categories=("Cs",)), max_size=40)


@FUZZ
@given(box=grid_boxes(), source_index=st.integers(0, 5), think=plain_text)
def test_mini_o3_render_call_parses_back_to_the_same_call(box, source_index, think):
    source = ORIGINAL_IMAGE if source_index == 0 else f"observation_{source_index}"
    call = ToolCall("crop", {"bbox_2d": box, "source": source, "frame": "relative"})
    action = MINI.parse(MINI.render_call(think, call), num_observations=5)
    assert action.kind == "call", action.error
    assert action.call == call
    assert action.think == think.strip()


@FUZZ
@given(box=float_boxes())
def test_mini_o3_render_call_of_any_valid_box_stays_a_valid_nearby_call(box):
    call = ToolCall("crop", {"bbox_2d": box, "source": ORIGINAL_IMAGE, "frame": "relative"})
    action = MINI.parse(MINI.render_call("zoom", call))
    assert action.kind == "call", action.error
    parsed = action.call.arguments["bbox_2d"]
    assert all(abs(a - b) <= 5e-4 + 1e-12 for a, b in zip(parsed, box, strict=True))  # three decimals


@FUZZ
@given(answer=plain_text.filter(lambda s: s.strip()), think=plain_text)
def test_render_answer_parses_back_to_the_same_answer(answer, think):
    for protocol in (MINI, DEEPEYES, SINGLE):
        action = protocol.parse(protocol.render_answer(think, answer))
        assert action.kind == "answer", action.error
        assert action.answer == answer.strip()
        assert action.think == think.strip()


@FUZZ
@given(
    xs=st.lists(st.integers(0, 20_000), min_size=2, max_size=2, unique=True),
    ys=st.lists(st.integers(0, 20_000), min_size=2, max_size=2, unique=True),
)
def test_deepeyes_render_call_of_a_pixel_box_parses_back_to_the_same_call(xs, ys):
    x0, x1 = sorted(xs)
    y0, y1 = sorted(ys)
    call = ToolCall("crop", {"bbox_2d": [float(x0), float(y0), float(x1), float(y1)], "source": ORIGINAL_IMAGE,
                             "frame": "absolute"})
    action = DEEPEYES.parse(DEEPEYES.render_call("look closer", call))
    assert action.kind == "call", action.error
    assert action.call == call


def test_deepeyes_render_call_of_a_subpixel_box_is_still_a_valid_call():
    call = ToolCall("crop", {"bbox_2d": [10.2, 5.0, 10.4, 8.0], "source": ORIGINAL_IMAGE, "frame": "absolute"})
    action = DEEPEYES.parse(DEEPEYES.render_call("zoom", call))
    assert action.kind == "call", action.error
    x0, y0, x1, y1 = action.call.arguments["bbox_2d"]
    assert x0 <= 10.2 and x1 >= 10.4 and y0 <= 5.0 and y1 >= 8.0


# --- fuzzing: parse never raises ---------------------------------------------------------------------------


@FUZZ
@given(text=st.text(max_size=300), num_observations=st.integers())
def test_parse_of_any_text_never_raises_and_is_well_typed(text, num_observations):
    for protocol in (MINI, DEEPEYES, SINGLE):
        assert_well_typed(protocol.parse(text, num_observations))


FRAGMENTS = [
    "<think>", "</think>", "<grounding>", "</grounding>", "<answer>", "</answer>", "<tool_call>", "</tool_call>",
    "{", "}", "[", "]", ",", ":", '"bbox_2d"', '"source"', '"original_image"', '"observation_1"', '"name"',
    '"arguments"', '"image_zoom_in_tool"', "0.1", "0.5", "1", "-1", "NaN", "1e999", "null", "true", " ", "\n", "A",
]


@FUZZ
@given(
    pieces=st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=5)), max_size=40),
    num_observations=st.integers(-3, 5),
)
def test_parse_of_tag_soup_never_raises_and_is_well_typed(pieces, num_observations):
    text = "".join(pieces)
    for protocol in (MINI, DEEPEYES, SINGLE):
        action = protocol.parse(text, num_observations)
        assert_well_typed(action)
        if action.kind == "call":
            assert protocol is not SINGLE


json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(),  # NaN and infinities included: json.dumps writes them as NaN / Infinity
    st.sampled_from([0, 1, 0.0, 1.0, 0.25, 0.75, 1e-300, 1 - 1e-16]),
    st.text(max_size=8),
)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=12)
coordinate = st.one_of(
    st.floats(min_value=0.0, max_value=1.0), st.floats(), st.integers(-2, 3), st.booleans(), st.text(max_size=3),
    st.none(),
)


@st.composite
def near_valid_boxes(draw):
    """Four numbers around [0, 1], in corner order most of the time: valid, out of range, or empty."""
    unit = st.one_of(st.floats(-0.05, 1.05), st.sampled_from([0, 1, 0.0, 1.0, 0.5]), st.sampled_from(HAIR_OUTSIDE))
    a, b = draw(st.lists(unit, min_size=2, max_size=2, unique=True))
    c, d = draw(st.lists(unit, min_size=2, max_size=2, unique=True))
    if draw(st.integers(0, 5)):
        a, b, c, d = min(a, b), min(c, d), max(a, b), max(c, d)
    return [a, b, c, d]


bbox_values = st.one_of(
    near_valid_boxes(), st.lists(coordinate, min_size=4, max_size=4), st.lists(coordinate, max_size=6), json_values
)
source_values = st.one_of(
    st.sampled_from(["original_image", "observation_0", "observation_1", "observation_2", "observation_3",
                     "observation_4", "foo", "", "observation_\u0661", "observation_" + "9" * 5000]),
    json_values,
)


def clamped(box: list[Any]) -> list[float]:
    return [min(max(float(v), 0.0), 1.0) for v in box]


def oracle_accepts(obj: Any, num_observations: int) -> bool:
    """What the Mini-o3 grammar accepts, written independently of the parser."""
    if not isinstance(obj, dict) or set(obj) != {"bbox_2d", "source"}:
        return False
    box, source = obj["bbox_2d"], obj["source"]
    if not (isinstance(box, list) and len(box) == 4):
        return False
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in box):
        return False
    if any(isinstance(v, float) and not math.isfinite(v) for v in box):
        return False
    if not all(-TOLERANCE <= v <= 1 + TOLERANCE for v in box):
        return False
    x0, y0, x1, y1 = clamped(box)
    if not (x0 < x1 and y0 < y1):
        return False
    allowed = {"original_image"} | {f"observation_{i}" for i in range(max(num_observations, -1) + 1)}
    return isinstance(source, str) and source in allowed


def check_against_the_grammar(obj: Any, num_observations: int) -> Action:
    action = MINI.parse(grounding(json.dumps(obj)), num_observations)
    assert_well_typed(action)
    assert (action.kind == "call") == oracle_accepts(obj, num_observations), action
    if action.kind == "call":
        x0, y0, x1, y1 = action.call.arguments["bbox_2d"]
        assert 0 <= x0 < x1 <= 1 and 0 <= y0 < y1 <= 1
        assert [x0, y0, x1, y1] == clamped(obj["bbox_2d"])
        assert action.call.arguments["frame"] == "relative"
        assert action.call.arguments["source"] in {"original_image"} | {
            f"observation_{i}" for i in range(1, num_observations + 1)
        }
    else:
        assert action.error.kind not in (K.NO_ACTION, K.UNCLOSED_TAG, K.MULTIPLE_CALLS, K.EMPTY_ANSWER)
    return action


@FUZZ
@given(
    obj=st.fixed_dictionaries({"bbox_2d": near_valid_boxes(), "source": st.sampled_from(
        ["original_image", "original_image", "observation_0", "observation_1", "observation_2", "observation_4", "x"])}),
    num_observations=st.integers(0, 3),
)
def test_structured_fuzz_of_near_valid_calls_matches_the_grammar(obj, num_observations):
    check_against_the_grammar(obj, num_observations)


@FUZZ
@given(
    obj=st.one_of(
        st.fixed_dictionaries({"bbox_2d": bbox_values, "source": source_values}),
        st.fixed_dictionaries({"bbox_2d": bbox_values}, optional={"source": source_values, "extra": json_values}),
        json_values,
    ),
    num_observations=st.integers(0, 3),
)
def test_structured_fuzz_of_wild_grounding_payloads_matches_the_grammar(obj, num_observations):
    check_against_the_grammar(obj, num_observations)


@FUZZ
@given(payload=st.text(max_size=80), num_observations=st.integers(0, 3))
def test_any_text_inside_grounding_tags_is_a_call_or_a_typed_error(payload, num_observations):
    action = MINI.parse(grounding(payload), num_observations)
    assert_well_typed(action)
    if action.kind == "call":
        x0, y0, x1, y1 = action.call.arguments["bbox_2d"]
        assert 0 <= x0 < x1 <= 1 and 0 <= y0 < y1 <= 1


# --- parser policy (docs/architecture.md, "Parser policy") --------------------------------------------------

FIRST_CALL = grounding(call_payload([0.1, 0.2, 0.3, 0.4]))
DEEPEYES_CALL = (
    '<think>t</think><tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [1, 2, 30, 40]}}</tool_call>'
)


@pytest.mark.parametrize(
    "tail",
    [
        " and then I will answer",
        "<answer>A</answer>",
        "<grounding>" + call_payload([0.5, 0.5, 0.6, 0.6]) + "</grounding>",
        "<grounding>{broken",
        "</grounding></answer>\n<think>more</think>",
    ],
)
def test_text_after_a_complete_call_is_ignored_as_the_stop_string_would_cut_it(tail):
    assert MINI.cut_at_call(FIRST_CALL + tail) == FIRST_CALL
    action = MINI.parse(FIRST_CALL + tail)
    assert action == MINI.parse(FIRST_CALL)
    assert action.kind == "call" and action.call.arguments["bbox_2d"] == [0.1, 0.2, 0.3, 0.4]
    assert action.think == "the sign is small"  # a <think> after the call is not read either


def test_deepeyes_ignores_text_after_its_first_complete_call_too():
    second = '<tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [5, 5, 9, 9]}}</tool_call>'
    assert DEEPEYES.cut_at_call(DEEPEYES_CALL + " done" + second) == DEEPEYES_CALL
    assert DEEPEYES.parse(DEEPEYES_CALL + " done" + second) == DEEPEYES.parse(DEEPEYES_CALL)


@pytest.mark.parametrize(
    "text", ["<answer>B</answer> trailing", "<think>x</think><grounding>{unclosed", "plain text", ""]
)
def test_cut_at_call_leaves_a_turn_without_a_complete_call_unchanged(text):
    assert MINI.cut_at_call(text) == text
    assert SINGLE.cut_at_call(FIRST_CALL + " tail") == FIRST_CALL + " tail"  # no tools: nothing to cut at


@FUZZ
@given(tail=st.text(max_size=120) | st.lists(st.sampled_from(FRAGMENTS), max_size=12).map("".join))
def test_any_tail_after_a_complete_call_leaves_the_call_as_it_is(tail):
    assert MINI.parse(FIRST_CALL + tail) == MINI.parse(FIRST_CALL)
    assert DEEPEYES.parse(DEEPEYES_CALL + tail) == DEEPEYES.parse(DEEPEYES_CALL)


@pytest.mark.parametrize("value", HAIR_OUTSIDE)
@pytest.mark.parametrize("axis", [0, 1])
def test_a_coordinate_a_hair_outside_the_unit_range_is_clamped_into_it(value, axis):
    box = [0.1, 0.2, 0.6, 0.7]
    box[axis if value < 0.5 else axis + 2] = value
    action = MINI.parse(grounding(call_payload(box)))
    assert action.kind == "call", action.error
    assert action.call.arguments["bbox_2d"] == clamped(box)
    assert all(0.0 <= v <= 1.0 for v in action.call.arguments["bbox_2d"])


@pytest.mark.parametrize("value", [-TOLERANCE * 1.01, 1 + TOLERANCE * 1.01, -0.01, 1.01, 2.0])
def test_a_coordinate_beyond_the_tolerance_is_refused(value):
    box = [value, 0.2, 0.9, 0.7] if value < 0.5 else [0.1, 0.2, value, 0.7]
    action = MINI.parse(grounding(call_payload(box)))
    assert action.kind == "error" and action.error.kind == K.OUT_OF_RANGE


@pytest.mark.parametrize("value, accepted", [(-0.4, True), (-1e-9, True), (-0.6, False), (-1, False)])
def test_a_pixel_coordinate_under_half_a_pixel_below_zero_is_clamped_to_zero(value, accepted):
    action = DEEPEYES.parse(
        f'<tool_call>{{"name": "image_zoom_in_tool", "arguments": {{"bbox_2d": [{value}, 2, 30, 40]}}}}</tool_call>'
    )
    assert (action.kind == "call") == accepted
    if accepted:
        assert action.call.arguments["bbox_2d"] == [0.0, 2.0, 30.0, 40.0]
    else:
        assert action.error.kind == K.OUT_OF_RANGE


def test_a_box_under_one_pixel_reaches_the_tool_exactly_and_the_tool_refuses_it():
    box = [0.5, 0.25, 0.5 + 1e-7, 0.25 + 3e-3]  # 64x48 image: 6.4e-6 px wide, 0.144 px high
    action = MINI.parse(grounding(call_payload(box)))
    assert action.kind == "call", action.error
    assert action.call.arguments["bbox_2d"] == box  # the exact floats, not widened to a pixel
    result = run_tool(action.call, ImageSession(original=Image.new("RGB", (64, 48))), PixelBudget())
    assert isinstance(result, ToolError) and result.kind == ToolErrorKind.DEGENERATE_BOX


long_text = st.text(min_size=250, max_size=3000)
long_json_values = st.recursive(
    st.one_of(long_text, st.integers(min_value=10**250, max_value=10**300), json_scalars),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(long_text, inner, max_size=3),
    max_leaves=8,
)


@st.composite
def long_grounding_payloads(draw):
    """JSON a model could write with long or huge parts: sources, keys, numbers, nesting, or plain long text."""
    box = [0.1, 0.2, 0.3, 0.4]
    kind = draw(st.integers(0, 6))
    if kind == 0:
        return call_payload(box, draw(long_text))
    if kind == 1:
        extra = draw(st.dictionaries(long_text, long_json_values, min_size=1, max_size=5))
        return json.dumps({"bbox_2d": box, "source": "original_image", **extra})
    if kind == 2:
        digits = draw(st.integers(250, 6000))
        return '{"bbox_2d": [0, 0, 1' + "0" * digits + ', 1], "source": "original_image"}'
    if kind == 3:
        return json.dumps({"bbox_2d": draw(long_json_values), "source": draw(long_json_values)})
    if kind == 4:
        return "[" * draw(st.integers(1000, 50_000))
    if kind == 5:
        return json.dumps(draw(long_json_values))
    return draw(long_text)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(payload=long_grounding_payloads(), num_observations=st.integers(-5, 10**12))
def test_error_details_stay_short_whatever_the_model_wrote(payload, num_observations):
    for protocol, text in (
        (MINI, grounding(payload)),
        (DEEPEYES, f'<tool_call>{{"name": {json.dumps(payload)}, "arguments": {{"bbox_2d": [1, 2, 3]}}}}</tool_call>'),
        (DEEPEYES, f"<tool_call>{payload}</tool_call>"),
    ):
        action = protocol.parse(text, num_observations)
        assert_well_typed(action)
        if action.error is not None:
            assert len(action.error.detail) <= MAX_ERROR_DETAIL
            assert len(protocol.error_text(action.error.detail)) <= len(protocol.error_text("")) + MAX_ERROR_DETAIL


@settings(max_examples=50, deadline=None)
@given(detail=long_text)
def test_error_text_bounds_any_detail_it_is_given(detail):
    # Tool errors reach error_text without the parser: the bound holds there too.
    for protocol in (MINI, LOUPE, DEEPEYES, SINGLE):
        text = protocol.error_text(detail)
        assert len(text) <= len(protocol.error_text("")) + MAX_ERROR_DETAIL
        assert detail[:50] in text


def test_error_text_takes_a_format_error_or_its_detail_alike():
    error = MINI.parse(grounding("{oops}")).error
    for protocol in (MINI, LOUPE, DEEPEYES):
        assert protocol.error_text(error) == protocol.error_text(error.detail)
        assert error.detail in protocol.error_text(error)


def test_unknown_source_detail_is_short_even_after_many_observations():
    action = MINI.parse(grounding(call_payload([0.1, 0.2, 0.3, 0.4], "observation_99")), num_observations=10**9)
    assert action.error is None  # observation_99 exists after a billion crops
    action = MINI.parse(grounding(call_payload([0.1, 0.2, 0.3, 0.4], "nope")), num_observations=10**9)
    assert action.error.kind == K.UNKNOWN_SOURCE
    assert "observation_1000000000" in action.error.detail and len(action.error.detail) < 120
