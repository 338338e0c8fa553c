"""The dialogue protocol: Mini-o3's grammar and strings, its typed format errors, the parser policy, the other
variants, and the converters."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from loupe.data.tasks import TaskRecord
from loupe.protocol import (
    IMAGE_PLACEHOLDER,
    MAX_ERROR_DETAIL,
    MINI_O3_ERROR_PROMPT,
    MINI_O3_IMAGE_MARKUP,
    MINI_O3_OBSERVATION_TEMPLATE,
    MINI_O3_SYSTEM_PROMPT,
    MINI_O3_TOOL_ERROR_TEMPLATE,
    ORIGINAL_IMAGE,
    PROTOCOLS,
    Action,
    DeepEyesProtocol,
    FormatErrorKind,
    LoupeProtocol,
    MiniO3Protocol,
    SingleTurnProtocol,
    ToolCall,
    extract_answer,
    get_protocol,
    to_chat_messages,
    to_sharegpt,
)
from loupe.tools import ImageSession, PixelBudget, ToolError, ToolErrorKind, run_tool
from loupe.trajectory import Trajectory, Turn, write_trajectories

FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])

MINI = get_protocol("mini_o3")
LOUPE = get_protocol("loupe")
DEEPEYES = get_protocol("deepeyes")
SINGLE = get_protocol("single_turn")

TOLERANCE = 1e-3
"""The documented slack outside [0, 1] that is clamped (docs/architecture.md, Parser policy); written here, not
imported, so a change to the parser's constant shows up as a failing test."""
HAIR_OUTSIDE = [-1e-9, -0.0005, -0.001, 1.0000001, 1.0005, 1.001]


def grounding(payload: str, think: str = "the sign is small") -> str:
    return f"<think>{think}</think>\n<grounding>{payload}</grounding>"


def call_payload(box: Any, source: Any = ORIGINAL_IMAGE) -> str:
    return json.dumps({"bbox_2d": box, "source": source})


def assert_well_typed(action: Action) -> None:
    """An Action has exactly the field set its kind says."""
    assert action.kind in ("call", "answer", "error")
    if action.kind == "call":
        assert action.call is not None and action.answer is None and action.error is None
    elif action.kind == "answer":
        assert action.answer is not None and action.call is None and action.error is None
    else:
        assert action.error is not None and action.call is None and action.answer is None
        assert isinstance(action.error.kind, FormatErrorKind)
        assert isinstance(action.error.detail, str) and action.error.detail.strip()


# --- Mini-o3: well-formed turns --------------------------------------------------------------------------


def test_mini_o3_parses_a_relative_box_on_the_original_image():
    action = MINI.parse(grounding(call_payload([0.1, 0.2, 0.5, 0.6])), num_observations=0)
    assert action.kind == "call"
    assert action.call == ToolCall("crop", {"bbox_2d": [0.1, 0.2, 0.5, 0.6], "source": ORIGINAL_IMAGE, "frame": "relative"})
    assert action.think == "the sign is small"
    assert action.answer is None and action.error is None


def test_mini_o3_accepts_integer_coordinates_and_the_full_image():
    action = MINI.parse(grounding(call_payload([0, 0, 1, 1])))
    assert action.kind == "call"
    assert action.call.arguments["bbox_2d"] == [0.0, 0.0, 1.0, 1.0]
    assert all(isinstance(v, float) for v in action.call.arguments["bbox_2d"])


@pytest.mark.parametrize("index", [1, 2, 3])
def test_mini_o3_accepts_every_existing_observation_as_source(index):
    action = MINI.parse(grounding(call_payload([0.2, 0.2, 0.4, 0.4], f"observation_{index}")), num_observations=3)
    assert action.kind == "call"
    assert action.call.arguments["source"] == f"observation_{index}"


@pytest.mark.parametrize("num_observations", [0, 4])
def test_mini_o3_reads_observation_0_as_the_original_image(num_observations):
    action = MINI.parse(grounding(call_payload([0.2, 0.2, 0.4, 0.4], "observation_0")), num_observations)
    assert action.kind == "call"
    assert action.call.arguments["source"] == ORIGINAL_IMAGE


def test_mini_o3_parses_an_answer_and_strips_it():
    action = MINI.parse("<think>It reads 42.</think>\n<answer>  42 \n</answer>\n")
    assert action.kind == "answer"
    assert action.answer == "42"
    assert action.think == "It reads 42."
    assert action.call is None and action.error is None


def test_mini_o3_answer_without_think_has_no_think():
    action = MINI.parse("<answer>B</answer>")
    assert action.kind == "answer" and action.answer == "B" and action.think is None


def test_think_spans_are_joined_in_order():
    action = MINI.parse("<think> first </think> then <think>second</think><answer>A</answer>")
    assert action.think == "first\nsecond"


def test_think_survives_a_format_error():
    action = MINI.parse("<think>I will zoom</think><grounding>{oops}</grounding>")
    assert action.kind == "error"
    assert action.think == "I will zoom"


def test_extract_answer_takes_the_last_answer():
    assert extract_answer("<answer>A</answer> no, <answer> C </answer>") == "C"
    assert extract_answer("no answer here") is None
    assert extract_answer(None) is None


# --- Mini-o3: every malformed kind -----------------------------------------------------------------------

K = FormatErrorKind
MALFORMED = [
    # (id, text, num_observations, kind, words the detail must hold)
    ("bad_json_truncated", grounding('{"bbox_2d": [0.1, 0.2'), 0, K.BAD_JSON, "not valid JSON"),
    ("bad_json_prose", grounding("the top left corner"), 0, K.BAD_JSON, "not valid JSON"),
    ("bad_json_single_quotes", grounding("{'bbox_2d': [0, 0, 1, 1], 'source': 'original_image'}"), 0, K.BAD_JSON, "JSON"),
    ("json_not_object", grounding("[0.1, 0.2, 0.3, 0.4]"), 0, K.WRONG_TYPE, "JSON object"),
    ("missing_bbox", grounding('{"source": "original_image"}'), 0, K.MISSING_KEY, "'bbox_2d'"),
    ("missing_source", grounding('{"bbox_2d": [0.1, 0.2, 0.3, 0.4]}'), 0, K.MISSING_KEY, "'source'"),
    ("extra_key", grounding('{"bbox_2d": [0.1, 0.2, 0.3, 0.4], "source": "original_image", "zoom": 2}'), 0,
     K.WRONG_TYPE, "zoom"),
    ("bbox_string", grounding(call_payload("0.1, 0.2, 0.3, 0.4")), 0, K.WRONG_TYPE, "bbox_2d"),
    ("bbox_of_strings", grounding(call_payload(["0.1", "0.2", "0.3", "0.4"])), 0, K.WRONG_TYPE, "numbers"),
    ("bbox_of_bools", grounding(call_payload([False, False, True, True])), 0, K.WRONG_TYPE, "numbers"),
    ("bbox_nested", grounding(call_payload([[0.1, 0.2], [0.3, 0.4]])), 0, K.WRONG_TYPE, "bbox_2d"),
    ("bbox_nested_four", grounding(call_payload([[0.1], [0.2], [0.3], [0.4]])), 0, K.WRONG_TYPE, "numbers"),
    ("bbox_three", grounding(call_payload([0.1, 0.2, 0.3])), 0, K.WRONG_TYPE, "four numbers"),
    ("bbox_five", grounding(call_payload([0.1, 0.2, 0.3, 0.4, 0.5])), 0, K.WRONG_TYPE, "four numbers"),
    ("bbox_null", grounding(call_payload(None)), 0, K.WRONG_TYPE, "bbox_2d"),
    ("bbox_object", grounding(call_payload({"x0": 0.1})), 0, K.WRONG_TYPE, "bbox_2d"),
    ("source_number", grounding(call_payload([0.1, 0.2, 0.3, 0.4], 1)), 0, K.WRONG_TYPE, "'source'"),
    ("nan", grounding('{"bbox_2d": [0.1, NaN, 0.3, 0.4], "source": "original_image"}'), 0, K.NOT_FINITE, "NaN"),
    ("infinity", grounding('{"bbox_2d": [0.1, 0.2, Infinity, 0.4], "source": "original_image"}'), 0,
     K.NOT_FINITE, "Infinity"),
    ("minus_infinity", grounding('{"bbox_2d": [-Infinity, 0.2, 0.3, 0.4], "source": "original_image"}'), 0,
     K.NOT_FINITE, "Infinity"),
    ("overflowing_float", grounding('{"bbox_2d": [0.1, 0.2, 1e999, 0.4], "source": "original_image"}'), 0,
     K.NOT_FINITE, "not finite"),
    ("negative", grounding(call_payload([-0.1, 0.2, 0.3, 0.4])), 0, K.OUT_OF_RANGE, "[0, 1]"),
    ("above_one", grounding(call_payload([0.1, 0.2, 1.5, 0.4])), 0, K.OUT_OF_RANGE, "[0, 1]"),
    ("pixels_in_relative_grammar", grounding(call_payload([10, 20, 300, 400])), 0, K.OUT_OF_RANGE, "[0, 1]"),
    ("x1_below_x0", grounding(call_payload([0.5, 0.2, 0.3, 0.4])), 0, K.EMPTY_BOX, "x0 < x1"),
    ("x1_equals_x0", grounding(call_payload([0.3, 0.2, 0.3, 0.4])), 0, K.EMPTY_BOX, "x0 < x1"),
    ("y1_equals_y0", grounding(call_payload([0.1, 0.4, 0.3, 0.4])), 0, K.EMPTY_BOX, "y0 < y1"),
    ("observation_beyond_count", grounding(call_payload([0.1, 0.2, 0.3, 0.4], "observation_5")), 2,
     K.UNKNOWN_SOURCE, "observation_5"),
    ("observation_before_any", grounding(call_payload([0.1, 0.2, 0.3, 0.4], "observation_1")), 0,
     K.UNKNOWN_SOURCE, "observation_1"),
    ("source_foo", grounding(call_payload([0.1, 0.2, 0.3, 0.4], "foo")), 2, K.UNKNOWN_SOURCE, "'foo'"),
    ("source_case", grounding(call_payload([0.1, 0.2, 0.3, 0.4], "Original_Image")), 2, K.UNKNOWN_SOURCE, "known"),
    ("source_negative_index", grounding(call_payload([0.1, 0.2, 0.3, 0.4], "observation_-1")), 2,
     K.UNKNOWN_SOURCE, "observation_-1"),
    ("source_non_ascii_digit", grounding(call_payload([0.1, 0.2, 0.3, 0.4], "observation_\u0661")), 2,
     K.UNKNOWN_SOURCE, "known"),
    ("source_thousands_of_digits", grounding(call_payload([0.1, 0.2, 0.3, 0.4], "observation_" + "9" * 5000)), 2,
     K.UNKNOWN_SOURCE, "known"),
    ("two_opens_one_close", "<think>x</think><grounding><grounding>" + call_payload([0.1, 0.2, 0.3, 0.4])
     + "</grounding>", 0, K.MULTIPLE_CALLS, "only one"),
    ("just_below_zero", grounding(call_payload([-0.0011, 0.2, 0.3, 0.4])), 0, K.OUT_OF_RANGE, "[0, 1]"),
    ("just_above_one", grounding(call_payload([0.1, 0.2, 0.3, 1.0011])), 0, K.OUT_OF_RANGE, "[0, 1]"),
    ("clamped_to_nothing", grounding(call_payload([1.0002, 0.2, 1.0008, 0.4])), 0, K.EMPTY_BOX, "x0 < x1"),
    ("answer_then_call", "<think>x</think><answer>A</answer><grounding>" + call_payload([0.1, 0.2, 0.3, 0.4])
     + "</grounding>", 0, K.CALL_AND_ANSWER, "not both"),
    ("unclosed_grounding", "<think>x</think><grounding>" + call_payload([0.1, 0.2, 0.3, 0.4]), 0,
     K.UNCLOSED_TAG, "</grounding>"),
    ("unclosed_answer", "<think>x</think><answer>B", 0, K.UNCLOSED_TAG, "</answer>"),
    ("empty_answer", "<think>x</think><answer></answer>", 0, K.EMPTY_ANSWER, "empty"),
    ("blank_answer", "<think>x</think><answer> \n\t </answer>", 0, K.EMPTY_ANSWER, "empty"),
    ("text_after_answer", "<answer>B</answer> because it is blue", 0, K.TRAILING_TEXT, "</answer>"),
    ("two_answers", "<answer>A</answer><answer>B</answer>", 0, K.MULTIPLE_CALLS, "<answer>"),
    ("no_action", "<think>I think it is red.</think> It is red.", 0, K.NO_ACTION, "neither"),
    ("empty_turn", "", 0, K.NO_ACTION, "neither"),
    ("wrong_grammar_tool_call", '<tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [1, 2, 3, 4]}}'
     "</tool_call>", 0, K.NO_ACTION, "neither"),
]


@pytest.mark.parametrize(
    "text, num_observations, kind, words", [case[1:] for case in MALFORMED], ids=[case[0] for case in MALFORMED]
)
def test_mini_o3_malformed_turn_gives_its_typed_error_and_readable_detail(text, num_observations, kind, words):
    action = MINI.parse(text, num_observations)
    assert_well_typed(action)
    assert action.kind == "error"
    assert action.error.kind == kind, action.error.detail
    assert words in action.error.detail
    assert "Traceback" not in action.error.detail


def test_unknown_source_detail_lists_the_sources_that_exist():
    action = MINI.parse(grounding(call_payload([0.1, 0.2, 0.3, 0.4], "observation_5")), num_observations=2)
    for known in ("original_image", "observation_1", "observation_2"):
        assert known in action.error.detail
    assert "observation_3" not in action.error.detail


def test_integer_too_large_for_a_float_is_out_of_range_not_unreadable():
    action = MINI.parse(grounding('{"bbox_2d": [0, 0, 1' + "0" * 400 + ', 1], "source": "original_image"}'))
    assert action.error is not None
    assert action.error.kind == K.OUT_OF_RANGE
    assert action.think == "the sign is small"


def test_error_text_carries_the_detail_and_no_image():
    action = MINI.parse(grounding(call_payload([0.5, 0.2, 0.3, 0.4])))
    text = MINI.error_text(action.error.detail)
    assert action.error.detail in text
    assert IMAGE_PLACEHOLDER not in text


@pytest.mark.parametrize("bad_text", [None, 42, b"<answer>A</answer>", ["<answer>A</answer>"]])
def test_parse_of_a_non_string_is_a_format_error(bad_text):
    action = MINI.parse(bad_text)
    assert_well_typed(action)
    assert action.kind == "error"


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


# --- the other variants and the registry ------------------------------------------------------------------


def test_get_protocol_returns_each_registered_variant():
    assert isinstance(get_protocol("mini_o3"), MiniO3Protocol)
    assert isinstance(get_protocol("loupe"), LoupeProtocol)
    assert isinstance(get_protocol("deepeyes"), DeepEyesProtocol)
    assert isinstance(get_protocol("single_turn"), SingleTurnProtocol)
    assert set(PROTOCOLS) >= {"mini_o3", "loupe", "deepeyes", "single_turn"}
    assert MiniO3Protocol.stop == ("</grounding>",) and DeepEyesProtocol.stop == ("</tool_call>",)
    assert SingleTurnProtocol.multi_turn is False and MiniO3Protocol.multi_turn is True


def test_get_protocol_of_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError) as info:
        get_protocol("mini_o4")
    message = str(info.value)
    assert "mini_o4" in message
    for name in ("mini_o3", "deepeyes", "single_turn"):
        assert name in message


def test_a_new_variant_plugs_in_through_the_registry(monkeypatch):
    class ZoomTagProtocol(MiniO3Protocol):
        name = "zoom_tag"
        stop = ("</zoom>",)
        call_open, call_close = "<zoom>", "</zoom>"

    monkeypatch.setitem(PROTOCOLS, ZoomTagProtocol.name, ZoomTagProtocol)
    protocol = get_protocol("zoom_tag")
    assert isinstance(protocol, ZoomTagProtocol)
    action = protocol.parse('<think>t</think><zoom>{"bbox_2d": [0.1, 0.1, 0.2, 0.2], "source": "original_image"}</zoom>')
    assert action.kind == "call" and action.call.arguments["bbox_2d"] == [0.1, 0.1, 0.2, 0.2]
    call = ToolCall("crop", {"bbox_2d": [0.3, 0.3, 0.6, 0.7], "source": ORIGINAL_IMAGE, "frame": "relative"})
    assert protocol.parse(protocol.render_call("t", call)).call == call
    assert protocol.parse(grounding(call_payload([0.1, 0.1, 0.2, 0.2]))).error.kind == K.NO_ACTION


def test_deepeyes_parses_an_absolute_pixel_box_with_its_tool_name():
    text = ('<think>tiny text</think>\n<tool_call>{"name": "image_zoom_in_tool", '
            '"arguments": {"bbox_2d": [10, 20, 3000, 4000.5]}}</tool_call>')
    action = DEEPEYES.parse(text)
    assert action.kind == "call"
    assert action.call == ToolCall("crop", {"bbox_2d": [10.0, 20.0, 3000.0, 4000.5], "source": ORIGINAL_IMAGE,
                                            "frame": "absolute"})
    assert action.think == "tiny text"


@pytest.mark.parametrize(
    "payload, kind",
    [
        ('{"name": "image_crop_tool", "arguments": {"bbox_2d": [1, 2, 3, 4]}}', K.UNKNOWN_TOOL),
        ('{"name": ["image_zoom_in_tool"], "arguments": {"bbox_2d": [1, 2, 3, 4]}}', K.UNKNOWN_TOOL),
        ('{"arguments": {"bbox_2d": [1, 2, 3, 4]}}', K.MISSING_KEY),
        ('{"name": "image_zoom_in_tool"}', K.MISSING_KEY),
        ('{"name": "image_zoom_in_tool", "arguments": [1, 2, 3, 4]}', K.WRONG_TYPE),
        ('{"name": "image_zoom_in_tool", "arguments": {}}', K.MISSING_KEY),
        ('{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [-1, 2, 3, 4]}}', K.OUT_OF_RANGE),
        ('{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [5, 2, 3, 4]}}', K.EMPTY_BOX),
        ('{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [1, 2, 3, NaN]}}', K.NOT_FINITE),
        ('{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [1, 2, 3]}}', K.WRONG_TYPE),
        ("not json", K.BAD_JSON),
    ],
)
def test_deepeyes_malformed_calls_give_typed_errors(payload, kind):
    action = DEEPEYES.parse(f"<think>t</think><tool_call>{payload}</tool_call>")
    assert_well_typed(action)
    assert action.error is not None and action.error.kind == kind, action


def test_deepeyes_unknown_tool_detail_names_both_tools():
    action = DEEPEYES.parse('<tool_call>{"name": "rotate", "arguments": {"bbox_2d": [1, 2, 3, 4]}}</tool_call>')
    assert "'rotate'" in action.error.detail and "image_zoom_in_tool" in action.error.detail


def test_deepeyes_does_not_read_the_mini_o3_grammar():
    assert DEEPEYES.parse(grounding(call_payload([0.1, 0.2, 0.3, 0.4]))).error.kind == K.NO_ACTION


@pytest.mark.parametrize(
    "text",
    [
        grounding(call_payload([0.1, 0.2, 0.3, 0.4])),
        '<think>t</think><tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [1, 2, 3, 4]}}</tool_call>',
        "<think>t</think><grounding>unclosed",
    ],
)
def test_single_turn_refuses_tool_calls(text):
    action = SINGLE.parse(text)
    assert action.kind == "error"
    assert action.error.kind == K.TOOLS_UNAVAILABLE
    assert "no tools" in action.error.detail


def test_single_turn_parses_an_answer_and_cannot_render_a_call():
    action = SINGLE.parse("<think>blue sky</think><answer>C</answer>")
    assert action.kind == "answer" and action.answer == "C" and action.think == "blue sky"
    with pytest.raises(NotImplementedError):
        SINGLE.render_call("t", ToolCall("crop", {"bbox_2d": [0, 0, 1, 1], "source": ORIGINAL_IMAGE}))


@pytest.mark.parametrize("name", sorted(set(PROTOCOLS) - {"pixel_reasoner"}))
def test_every_variant_has_a_system_prompt_naming_its_answer_tags(name):
    # Pixel-Reasoner's system turn names its tools only; its question turn asks for \boxed{} (tested below).
    prompt = get_protocol(name).system_prompt()
    answer_tag = "\\boxed{}" if name == "boxed" else "<answer>"
    assert answer_tag in prompt and "<think>" in prompt


# --- Mini-o3's own strings ----------------------------------------------------------------------------------
# Copied from github.com/Mini-o3/Mini-o3 at commit 8654dbf: verl/trainer/constants.py (TOOL_CROP_SYSTEM_PROMPT,
# TOOL_CALL_CROP_MULTI_TRUN_PROMPT, ERROR_INFO_MULTI_TURN_PROMPT) and the error line of
# AsyncvLLMEngine.process_tool_call in verl/workers/rollout/vllm_rollout/vllm_async_engine.py. Written out here a
# second time, apart from loupe/protocol.py, so an edit to the constants fails this test.

THEIR_SYSTEM_PROMPT = """You are a helpful assistant. Answer the user's question based on the image provided. Output your thinking process within the <think> and </think> tags. Whenever you find anything unclear, you can zoom in a specific region in the given image to see more clearly by outputing <grounding>{\"bbox_2d\": [x0, y0, x1, y1], \"source\": \"original_image\"}</grounding>, where (x0, y0) and (x1, y1) are the top-left and bottom-right coordinates of the region that you want to zoom in, respectively (suppose the width and height of the image are 1.0), and 'source' refers to the image that you zoom in and could be either 'original_image' or 'observation_i'. Once the final answer is confirmed, put it within <answer> and </answer>."""
THEIR_OBSERVATION = "After the above Action {action_turn}, here is the the zoom-in image (Observation {observation_turn}):\n<|vision_start|><|image_pad|><|vision_end|>.\nContinue your reasoning process inside <think> and </think>. If needed, you can continue to zoom in on the original image or any of the observations, by outputting <grounding> and </grounding> as before. If the final answer is confirmed, put your final answer inside <answer> and </answer>."
THEIR_ERROR_PROMPT = "Please analyze the error information obtained from the function tool and adjust your response. Countinue your reasoning process inside <think> and </think>."
THEIR_TOOL_ERROR = "ERROR occurs during grounding. Error Information: {error_info}.\n"


def test_mini_o3_constants_are_mini_o3s_strings():
    assert MINI_O3_SYSTEM_PROMPT == THEIR_SYSTEM_PROMPT
    assert MINI_O3_OBSERVATION_TEMPLATE == THEIR_OBSERVATION
    assert MINI_O3_ERROR_PROMPT == THEIR_ERROR_PROMPT
    assert MINI_O3_TOOL_ERROR_TEMPLATE == THEIR_TOOL_ERROR
    assert MINI_O3_IMAGE_MARKUP == "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.mark.parametrize("index", [1, 2, 5, 12])
def test_mini_o3_protocol_speaks_with_the_constants_and_numbers_turns_as_mini_o3(index):
    assert MINI.system_prompt() == MINI_O3_SYSTEM_PROMPT
    # Mini-o3 fills the template with action_turn=current_iteration, observation_turn=current_iteration + 1,
    # counting assistant turns from 0: crop 1 answers Action 0. Loupe's turn holds <image> where the chat
    # template writes the vision markup.
    expected = THEIR_OBSERVATION.format(action_turn=index - 1, observation_turn=index)
    text = MINI.observation_text(index)
    assert text.replace(IMAGE_PLACEHOLDER, MINI_O3_IMAGE_MARKUP) == expected
    assert text.count(IMAGE_PLACEHOLDER) == 1 and MINI_O3_IMAGE_MARKUP not in text
    assert MINI.error_text("bad box") == THEIR_TOOL_ERROR.format(error_info="bad box") + THEIR_ERROR_PROMPT


def test_loupe_protocol_keeps_loupes_wording_with_the_same_grammar():
    assert LOUPE.system_prompt() != MINI.system_prompt() and "observation_N" in LOUPE.system_prompt()
    assert LOUPE.observation_text(3) != MINI.observation_text(3)
    assert "Observation 3" in LOUPE.observation_text(3) and LOUPE.observation_text(3).count(IMAGE_PLACEHOLDER) == 1
    assert LOUPE.error_text("bad box").startswith("Your last turn could not be carried out: bad box.")
    assert LOUPE.stop == MINI.stop
    call = ToolCall("crop", {"bbox_2d": [0.25, 0.5, 0.75, 1.0], "source": "observation_2", "frame": "relative"})
    assert LOUPE.render_call("t", call) == MINI.render_call("t", call)
    assert LOUPE.parse(MINI.render_call("t", call), num_observations=2).call == call


# --- prompts ------------------------------------------------------------------------------------------------


def test_question_text_renders_one_image_per_task_image_and_lettered_options():
    task = TaskRecord(doc_id="t1", images=["a.png", "b.png"], problem=" What colour is the car? ", solution="B",
                      options=["red", "blue", "green"])
    text = MINI.question_text(task)
    assert text.count(IMAGE_PLACEHOLDER) == 2
    lines = text.splitlines()
    assert lines[0] == IMAGE_PLACEHOLDER * 2
    assert "What colour is the car?" in lines
    assert lines.index("(A) red") < lines.index("(B) blue") < lines.index("(C) green")
    assert "(D)" not in text


def test_question_text_of_a_free_form_question_has_no_options():
    task = TaskRecord(doc_id="t2", images=["a.png"], problem="What does the sign say?", solution="STOP")
    text = DEEPEYES.question_text(task)
    assert text.count(IMAGE_PLACEHOLDER) == 1
    assert "(A)" not in text and "Options" not in text
    assert text.endswith("What does the sign say?")


def test_a_problem_already_holding_its_placeholder_gets_no_second_one():
    # Mini-o3's records (VisualProbe val.json, its demo format) start their problem with "<image>\n", and
    # Mini-o3 sends the problem as the user turn as it is.
    task = TaskRecord(doc_id="vp-1", images=["a.jpg"], problem="<image>\nWhat is written on the red sign?",
                      solution="EXIT")
    assert MINI.question_text(task) == "<image>\nWhat is written on the red sign?"
    assert DEEPEYES.question_text(task).count(IMAGE_PLACEHOLDER) == 1


def test_a_problem_with_one_placeholder_per_image_keeps_them_where_they_are_and_gets_options():
    task = TaskRecord(doc_id="t3", images=["a.png", "b.png"], problem="Compare <image> with <image>.", solution="A",
                      options=["same", "different"])
    text = MINI.question_text(task)
    assert text.count(IMAGE_PLACEHOLDER) == 2
    assert text.splitlines()[:2] == ["Compare <image> with <image>.", "Options:"]
    assert "(A) same" in text and "(B) different" in text


@pytest.mark.parametrize(
    "problem, images", [("<image>\nWhich?", ["a.png", "b.png"]), ("<image><image> Which?", ["a.png"])]
)
def test_a_problem_whose_placeholders_do_not_match_its_images_is_a_named_error(problem, images):
    # Built without validation: the task reader may refuse such a record first; question_text must too.
    task = TaskRecord.model_construct(doc_id="bad-7", images=images, problem=problem, solution="x", options=None)
    with pytest.raises(ValueError) as info:
        MINI.question_text(task)
    message = str(info.value)
    assert "bad-7" in message and "'problem'" in message
    assert f"holds {problem.count(IMAGE_PLACEHOLDER)}" in message and f"has {len(images)} images" in message


@pytest.mark.parametrize("index", [1, 2, 7])
def test_observation_text_holds_exactly_one_image(index):
    text = MINI.observation_text(index)
    assert text.count(IMAGE_PLACEHOLDER) == 1
    assert f"Observation {index}" in text and f"Action {index - 1}" in text
    assert DEEPEYES.observation_text(index).count(IMAGE_PLACEHOLDER) == 1


# --- converters on a hand-built trajectory ----------------------------------------------------------------


@pytest.fixture
def finished_trajectory(tmp_path) -> Trajectory:
    """Question on one file image, a zoom whose crop is still in memory, then an answer."""
    original = tmp_path / "task.png"
    Image.new("RGB", (64, 48), (0, 0, 255)).save(original)
    task = TaskRecord(doc_id="doc-1", images=[str(original)], problem="What colour?", solution="A",
                      options=["blue", "red"])
    trajectory = Trajectory(traj_id="doc-1#0", task=task.model_dump(), protocol="mini_o3", system=MINI.system_prompt())
    first = trajectory.add_image(original)
    trajectory.turns.append(Turn("user", MINI.question_text(task), images=[first]))
    call = ToolCall("crop", {"bbox_2d": [0.0, 0.0, 0.5, 0.5], "source": ORIGINAL_IMAGE, "frame": "relative"})
    trajectory.turns.append(Turn("assistant", MINI.render_call("zoom", call), action="call",
                                 call={"tool": call.tool, "arguments": call.arguments}))
    crop_index = trajectory.add_image(Image.new("RGB", (56, 56), (0, 0, 255)))
    trajectory.turns.append(Turn("user", MINI.observation_text(1), images=[crop_index]))
    trajectory.turns.append(Turn("assistant", MINI.render_answer("it is blue", "A"), action="answer"))
    trajectory.end_reason, trajectory.answer = "answered", "A"
    return trajectory


def test_to_chat_messages_maps_roles_and_splits_text_around_images(finished_trajectory):
    messages = to_chat_messages(finished_trajectory)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[0]["content"] == [{"type": "text", "text": finished_trajectory.system}]
    question = messages[1]["content"]
    assert question[0] == {"type": "image", "image": finished_trajectory.images[0]}
    assert question[1]["type"] == "text" and question[1]["text"].startswith("\nWhat colour?")
    observation = messages[3]["content"]
    assert [part["type"] for part in observation] == ["text", "image", "text"]
    assert observation[1]["image"] is finished_trajectory.pending[1]
    before, after = MINI.observation_text(1).split(IMAGE_PLACEHOLDER)
    assert observation[0]["text"] == before and observation[2]["text"] == after
    images = [part for m in messages for part in m["content"] if part["type"] == "image"]
    assert len(images) == len(finished_trajectory.images) == 2
    texts = "".join(part.get("text", "") for m in messages for part in m["content"])
    assert IMAGE_PLACEHOLDER not in texts


def test_to_chat_messages_refuses_a_turn_whose_placeholders_do_not_match_its_images(finished_trajectory):
    finished_trajectory.turns[2].images = []
    with pytest.raises(ValueError, match="placeholder"):
        to_chat_messages(finished_trajectory)


def test_to_sharegpt_refuses_unsaved_crops_until_they_are_written(finished_trajectory, tmp_path):
    with pytest.raises(ValueError, match="unsaved crop"):
        to_sharegpt(finished_trajectory)
    write_trajectories([finished_trajectory], tmp_path / "out" / "traj.jsonl")
    record = to_sharegpt(finished_trajectory)
    assert [c["from"] for c in record["conversations"]] == ["system", "human", "gpt", "human", "gpt"]
    assert record["conversations"][0]["value"] == finished_trajectory.system
    assert [c["value"] for c in record["conversations"][1:]] == [t.text for t in finished_trajectory.turns]
    placeholders = sum(c["value"].count(IMAGE_PLACEHOLDER) for c in record["conversations"])
    assert placeholders == len(record["images"]) == 2
    crop_file = tmp_path / "out" / finished_trajectory.images[1]
    assert record["images"] == [str(tmp_path / "task.png"), str(crop_file)]
    assert crop_file.is_file()


@pytest.mark.parametrize("cut", [0, 3])
def test_to_sharegpt_refuses_a_trajectory_not_ending_on_an_assistant_turn(finished_trajectory, cut):
    finished_trajectory.turns = finished_trajectory.turns[:cut]
    finished_trajectory.pending.clear()
    with pytest.raises(ValueError, match="assistant turn"):
        to_sharegpt(finished_trajectory)


# --- Pixel-Reasoner's own dialogue ----------------------------------------------------------------------------

PR = get_protocol("pixel_reasoner")


def _pr_call(arguments, name="crop_image_normalized", tail=""):
    return "Let me look. <tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>" + tail


def test_pixel_reasoner_system_turn_is_the_nous_tool_block_over_its_two_tools():
    prompt = PR.system_prompt()
    assert prompt.startswith("You are a helpful assistant.\n\n# Tools\n\nYou may call one or more functions")
    tools = prompt.split("<tools>\n")[1].split("\n</tools>")[0].split("\n")
    assert [json.loads(t)["function"]["name"] for t in tools] == ["crop_image_normalized", "select_frames"]
    assert json.loads(tools[0])["function"]["parameters"]["required"] == ["bbox_2d", "target_image"]
    assert prompt.endswith('<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def test_pixel_reasoner_reads_a_call_only_from_a_turn_that_ends_with_it():
    action = PR.parse(_pr_call({"bbox_2d": [0.1, 0.2, 0.5, 0.6], "target_image": 2}), num_observations=1)
    assert action.call == ToolCall("crop", {"bbox_2d": [0.1, 0.2, 0.5, 0.6], "source": "observation_1",
                                            "frame": "relative"})
    assert action.think == "Let me look."
    # A newline after </tool_call> makes the turn final (upstream checks endswith, unstripped): graded as text.
    final = PR.parse(_pr_call({"bbox_2d": [0.1, 0.2, 0.5, 0.6], "target_image": 1}, tail="\n"))
    assert final.call is None and final.answer is not None
    # The last <tool_call> is read.
    two = PR.parse("<tool_call>{}</tool_call> then " + _pr_call({"bbox_2d": [1, 2, 30, 40], "target_image": 1}))
    assert two.call.arguments["frame"] == "absolute" and two.call.arguments["bbox_2d"] == [1, 2, 30, 40]


@pytest.mark.parametrize(("text", "answer"), [("so \\boxed{B}.", "B"), ("the answer is 3", "the answer is 3"),
                                              ("\\boxed{\\frac{1}{2}} or \\boxed{ 7 }", "7")])
def test_pixel_reasoner_answers_with_the_last_box_or_the_text(text, answer):
    assert PR.parse(text).answer == answer


@pytest.mark.parametrize(("arguments", "name", "kind"), [
    ({"bbox_2d": [0.1, 0.1, 0.5, 0.5]}, "crop_image_normalized", FormatErrorKind.MISSING_KEY),
    ({"bbox_2d": [0.1, 0.1, 0.5, 0.5], "target_image": 0}, "crop_image_normalized", FormatErrorKind.UNKNOWN_SOURCE),
    ({"bbox_2d": [0.1, 0.1, 0.5, 0.5], "target_image": 1.5}, "crop_image_normalized", FormatErrorKind.WRONG_TYPE),
    ({"bbox_2d": [0.1, 0.1, 0.5], "target_image": 1}, "crop_image_normalized", FormatErrorKind.WRONG_TYPE),
    ({"bbox_2d": [0.1, 0.1, 0.5, 0.5], "target_image": 1}, "zoom", FormatErrorKind.UNKNOWN_TOOL),
])
def test_pixel_reasoner_refuses_malformed_calls(arguments, name, kind):
    action = PR.parse(_pr_call(arguments, name))
    assert action.error is not None and action.error.kind == kind


def test_pixel_reasoner_passes_a_missing_image_and_select_frames_to_the_tools_which_fail_them():
    from loupe.tools import ImageSession, PixelBudget, ToolError, run_tool

    session = ImageSession(original=Image.new("RGB", (200, 100)))
    far = PR.parse(_pr_call({"bbox_2d": [0.1, 0.1, 0.5, 0.5], "target_image": 4}), num_observations=1).call
    frames = PR.parse(_pr_call({"target_frames": [1, 2]}, "select_frames")).call
    for call in (far, frames):
        assert isinstance(run_tool(call, session, PixelBudget(3136, 50176)), ToolError)


def test_pixel_reasoner_turns_are_upstreams():
    assert PR.observation_turn(1, (504, 392)) == "\nHere is the cropped image (Image Size: 504x392):" + IMAGE_PLACEHOLDER
    assert PR.error_turn("bad box") == "\nExecution error:\nbad box\n"


def test_pixel_reasoner_renders_calls_it_reads_back():
    call = ToolCall("crop", {"bbox_2d": [0.25, 0.5, 1.0, 1.0], "source": "observation_2", "frame": "relative"})
    back = PR.parse(PR.render_call("zoom", call), num_observations=2).call
    assert back.arguments["source"] == "observation_2" and back.arguments["frame"] == "relative"
    assert back.arguments["bbox_2d"] == [0.25, 0.5, 0.999, 0.999]
    assert PR.parse(PR.render_answer("so", "B")).answer == "B"


def test_out_of_range_boxes_are_refused_or_clamped_as_the_protocol_says():
    from loupe.config import ProtocolParams
    from loupe.protocol import make_protocol

    turn = '<think>x</think>\n<tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [-40, 300, 1180, 640]}}</tool_call>'
    refusing = make_protocol(ProtocolParams(name="deepeyes"))
    clamping = make_protocol(ProtocolParams(name="deepeyes", out_of_range_boxes="clamp"))
    assert refusing.parse(turn).error.kind == FormatErrorKind.OUT_OF_RANGE
    assert clamping.parse(turn).call.arguments["bbox_2d"] == [0.0, 300.0, 1180.0, 640.0]
    relative = make_protocol(ProtocolParams(name="mini_o3", out_of_range_boxes="clamp"))
    call = relative.parse('<grounding>{"bbox_2d": [-0.3, 0.2, 1.4, 0.6], "source": "original_image"}</grounding>').call
    assert call.arguments["bbox_2d"] == [0.0, 0.2, 1.0, 0.6]
    outside = relative.parse('<grounding>{"bbox_2d": [1.2, 0.2, 1.4, 0.6], "source": "original_image"}</grounding>')
    assert outside.error.kind == FormatErrorKind.EMPTY_BOX  # clamped to nothing
