"""The dialogue protocol: Mini-o3's grammar and its typed format errors (the parser's round trips, fuzzing and
policy: tests/test_protocol_parser.py; the other variants, strings, prompts and converters:
tests/test_protocol_variants.py)."""

from __future__ import annotations

import pytest

from loupe.protocol import (
    IMAGE_PLACEHOLDER,
    ORIGINAL_IMAGE,
    ToolCall,
    extract_answer,
)
from tests.protocol_cases import (
    MINI,
    K,
    assert_well_typed,
    call_payload,
    grounding,
)

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
