"""Rewards: the letter cascade, normalisation and free-form matching, and DeepEyes' scorers for its ThinkLite and
geoguessr rows (the judge, score() and custom rewards: tests/test_reward_scoring.py)."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loupe.data.tasks import OPTION_LETTERS, TaskRecord
from loupe.rewards import (
    RewardConfig,
    exact_match,
    extract_choice,
    normalize_answer,
    score,
)

COLOURS = ["red car", "blue car", "green car", "yellow car"]


# --- the letter cascade -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prediction, options, expected",
    [
        # (a) the whole answer is one letter
        ("B", COLOURS, "B"),
        ("(C)", COLOURS, "C"),
        (" d. ", COLOURS, "D"),
        ("b", COLOURS, "B"),
        ("[A]", COLOURS, "A"),
        ("E", COLOURS, None),  # out of range, and no other rule names a letter
        # (b) "answer is X" and friends; the last one counts
        ("The answer is C.", COLOURS, "C"),
        ("Answer: (B)", COLOURS, "B"),
        ("the answer is option D", COLOURS, "D"),
        ("Final answer: **B**", COLOURS, "B"),
        ("The answer is not A; the answer is B", COLOURS, "B"),
        ("The answer is A because the car is red", COLOURS, "A"),
        ("\\boxed{C}", COLOURS, "C"),
        ("I pick option C", COLOURS, "C"),
        ("The correct choice is (D).", COLOURS, "D"),
        ("The answer is E", COLOURS, None),
        # "Answer: A red car" is the article, not option A: the option text decides
        ("Answer: A red car", ["green", "red car"], "B"),
        # (c) "(X)" anywhere, only when one letter appears so
        ("I think (B) is the one", COLOURS, "B"),
        ("(A) or (B), hard to say", ["cat", "dog"], None),
        ("It is (F)", COLOURS, None),
        # (d) "X." / "X)" at the start
        ("C. the green one", COLOURS, "C"),
        ("D) yellow", COLOURS, "D"),
        # (e) option text
        ("It is the blue car.", COLOURS, "B"),
        ("Green Car", COLOURS, "C"),
        ("dark red", ["red", "dark red"], "B"),  # exact equality before containment
        ("red", ["red", "dark red"], "A"),
        ("a red and green flag", ["red", "green"], None),  # two options appear: ambiguous
        ("a dog", ["cat", "dog"], "B"),  # lowercase "a" in running text is not option A
        ("twelve", ["10", "12"], "B"),
        ("no idea", COLOURS, None),
        ("", COLOURS, None),
        # wrappers
        ("<think>hmm</think><answer>C</answer>", COLOURS, "C"),
        # letters as models write them (docs/architecture.md, Parser policy)
        ("option b", COLOURS, "B"),
        ("I pick option c.", COLOURS, "C"),
        ("Option (B)", COLOURS, "B"),
        ("the answer is b because it is blue", COLOURS, "B"),
        ("B is correct", COLOURS, "B"),
        ("(b) is the right one", COLOURS, "B"),
        ("I believe d is correct.", COLOURS, "D"),
        ("(b)", COLOURS, "B"),
        ("B.", COLOURS, "B"),
        ("I choose (c) here", COLOURS, "C"),
        ("the answer is a red car", ["blue car", "red car"], "B"),  # the article again, option text decides
        ("the answer is e.g. the red car", COLOURS, "A"),  # "e.g." is no letter E
        ("the car(s) in the (b) corner", COLOURS, "B"),  # "(s)" inside a word is no option S
        # merely repeating the option list is no choice
        ("(A) red car (B) blue car (C) green car (D) yellow car", COLOURS, None),
        ("(A) red (B) green (C) blue", ["red", "green", "blue"], None),
        ("A, B, C or D", COLOURS, None),
        ("a or b", COLOURS, None),
        ("A/B", COLOURS, None),
        ("The answer is A, B, C or D.", COLOURS, None),
        ("Answer: (A) or (B)", COLOURS, None),
        ("A or B is correct", COLOURS, None),
        ("A. red car B. blue car", ["red", "blue"], None),
        # ... but a list word after a letter is not always a list
        ("Answer: A, because the car is red", COLOURS, "A"),
        ("The answer is B and A is wrong", COLOURS, "B"),
    ],
)
def test_extract_choice_cascade(prediction, options, expected):
    assert extract_choice(prediction, options) == expected


def test_extract_choice_rejects_non_text_and_empty_options():
    assert extract_choice(None, COLOURS) is None  # type: ignore[arg-type]
    assert extract_choice("A", []) is None


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=200), n_options=st.integers(min_value=2, max_value=26), option_text=st.text(max_size=20))
def test_extract_choice_never_raises_and_returns_a_valid_letter(text, n_options, option_text):
    options = [f"{option_text} {i}" for i in range(n_options)]
    found = extract_choice(text, options)
    assert found is None or found in OPTION_LETTERS[:n_options]


CASCADE_WORDS = [
    "answer",
    "Answer:",
    "is",
    "option",
    "(",
    ")",
    "A",
    "B",
    "C",
    "Z",
    "a",
    "b",
    ".",
    ":",
    " ",
    "\n",
    "\\boxed{",
    "}",
    "red car",
    "the",
    "*",
    "<answer>",
    "</answer>",
    "12",
    "twelve",
]


@settings(max_examples=300, deadline=None)
@given(words=st.lists(st.sampled_from(CASCADE_WORDS), max_size=30), n_options=st.integers(min_value=2, max_value=4))
def test_extract_choice_on_cascade_vocabulary_returns_a_valid_letter(words, n_options):
    found = extract_choice(" ".join(words), COLOURS[:n_options])
    assert found is None or found in OPTION_LETTERS[:n_options]


def test_extract_choice_is_fast_on_degenerate_output():
    # Adjacent `\s*` patterns backtrack for minutes on long whitespace runs; the cascade must stay linear.
    started = time.monotonic()
    for text in [
        "answer" + " " * 50_000 + "!",
        " " * 50_000 + "!",
        "answer is " * 5_000,
        "\\boxed{" + " " * 50_000,
        "(" * 50_000,
        " \t\n" * 20_000 + "B",
    ]:
        extract_choice(text, COLOURS)
    assert time.monotonic() - started < 2.0
    assert extract_choice(" \t\n" * 20_000 + "B", COLOURS) == "B"


@settings(max_examples=100, deadline=None)
@given(
    letter_index=st.integers(min_value=0, max_value=3),
    wrapper=st.sampled_from(["{}", "({})", "{}.", "The answer is {}.", "Answer: {}"]),
)
def test_extract_choice_finds_every_wrapped_letter(letter_index, wrapper):
    letter = "ABCD"[letter_index]
    assert extract_choice(wrapper.format(letter), COLOURS) == letter


# --- free-form ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, normalised",
    [
        ("The Red Car!", "red car"),
        ("  an   apple. ", "apple"),
        ("Twelve", "12"),
        ("1,000", "1000"),
        ("3.50", "3.5"),
        ("007", "7"),
        ("don't", "dont"),
        ("left-hand side", "left hand side"),
        ("Ｂｌｕｅ", "blue"),  # full-width letters fold under NFKC
        ("", ""),
        # never erase a whole answer
        ("A", "a"),
        ("The A.", "a"),
        ("an", "an"),
        ("?!", "?!"),
        ("  - ", "-"),
    ],
)
def test_normalize_answer(raw, normalised):
    assert normalize_answer(raw) == normalised


def test_exact_match():
    assert exact_match("The number is twelve.", "the number is 12")
    assert exact_match("Blue", "blue.")
    assert not exact_match("blue", "dark blue")
    assert not exact_match("", "")  # an empty prediction never matches
    assert not exact_match(None, "blue")
    assert exact_match("A", "A") and exact_match("a", "A.") and exact_match("The", "the")
    assert not exact_match("A", "B") and not exact_match("a", "an")
    assert not exact_match("a dog", "a")  # articles still go when other words remain


def test_free_form_answer_a_against_solution_a_scores_one():
    task = TaskRecord(doc_id="f-a", images=["a.png"], problem="Which label is on the box?", solution="A")
    assert score(task, "A", "answered", 0, 0, True, RewardConfig()).accuracy == 1.0
    assert score(task, "B", "answered", 0, 0, True, RewardConfig()).accuracy == 0.0


def test_an_answer_repeating_the_option_list_scores_wrong():
    task = TaskRecord(doc_id="c-list", images=["a.png"], problem="Which car?", solution="A", options=COLOURS)
    for answer in ("(A) red car (B) blue car (C) green car (D) yellow car", "A, B, C or D", "The answer is A or B"):
        parts = score(task, answer, "answered", 0, 0, True, RewardConfig())
        assert parts.accuracy == 0.0 and parts.extracted is None, answer
    assert score(task, "option a", "answered", 0, 0, True, RewardConfig()).accuracy == 1.0


@settings(max_examples=200, deadline=None)
@given(answer=st.text(min_size=1, max_size=60).filter(lambda s: any(ch.isalnum() for ch in s)))
def test_normalisation_never_erases_an_answer_with_a_letter_or_digit(answer):
    assert normalize_answer(answer)
    assert exact_match(answer, answer)


@settings(max_examples=200, deadline=None)
@given(
    letters=st.lists(st.integers(0, 3), min_size=2, max_size=4, unique=True),
    joiner=st.sampled_from([", ", " or ", "/", " and ", ", or ", " "]),
    style=st.sampled_from(["{}", "({})", "{}.", "[{}]"]),
    with_text=st.booleans(),
)
def test_any_repetition_of_the_option_list_names_no_letter(letters, joiner, style, with_text):
    items = [style.format("ABCD"[i]) + (f" {COLOURS[i]}" if with_text else "") for i in letters]
    assert extract_choice(joiner.join(items), COLOURS) is None


# --- DeepEyes' scorers for its ThinkLite and geoguessr rows ----------------------------------------------------


class _AskRecorder:
    def __init__(self, score):
        self.score, self.asked = score, []

    def __call__(self, answer):
        from loupe.rewards.judge import JudgeResult

        self.asked.append(answer)
        return JudgeResult(score=self.score, valid=self.score is not None)


def test_deepeyes_math_reads_the_last_box_after_thinking_and_asks_the_judge_only_when_math_verify_disagrees():
    from loupe.rewards.deepeyes import deepeyes_math

    ask = _AskRecorder(0.0)
    assert deepeyes_math("<think>3 x 4</think> so \\boxed{12}.", "12", ask) == (1.0, 0.0, "12")
    assert ask.asked == []
    assert deepeyes_math("<think>x</think> \\boxed{11} or \\boxed{13}", "12", ask) == (0.0, -1.0, "13")
    assert ask.asked == ["13"]  # two boxes: a format error, the last one judged
    assert deepeyes_math("<think>x</think> twelve", "12", ask) == (0.0, -1.0, "")
    assert deepeyes_math("<think>\\boxed{12}</think> no box after thinking", "12", ask)[0] == 0.0
    assert deepeyes_math("<think>x</think> \\boxed{a dozen}", "12", _AskRecorder(1.0))[0] == 1.0
    assert deepeyes_math("<think>x</think> \\boxed{a dozen}", "12", _AskRecorder(None))[0] is None


def test_deepeyes_common_judges_the_first_answer_after_thinking():
    from loupe.rewards.deepeyes import deepeyes_common

    ask = _AskRecorder(1.0)
    assert deepeyes_common("<think>tower</think> <answer> Paris </answer>", "Paris", ask) == (1.0, 0.0, "Paris")
    assert deepeyes_common("<think>tower</think> It is Paris.", "Paris", ask) == (0.0, -1.0, "")
    assert deepeyes_common("<think>a</think><answer>Paris</answer><answer>Rome", "Paris", ask)[1] == -1.0
    assert ask.asked == ["Paris", "Paris"]


@pytest.mark.parametrize(("reply", "score"), [
    ("## Equivalence Judgement\nTRUE", 1.0), ("## Equivalence Judgement\nFALSE", 0.0),
    ("## Equivalence Judgement\nTRUE or FALSE", None), ("I think so", None),
    ("false at first... ## Equivalence Judgement\nTrue", 1.0),
])
def test_equivalence_verdicts_read_the_text_after_the_last_heading(reply, score):
    from loupe.rewards.judge import parse_equivalence

    assert parse_equivalence(reply) == score


def test_a_data_source_may_name_its_own_judge_and_its_rows_use_it():
    from loupe.rewards.config import RewardConfig

    judge = {"base_url": "http://127.0.0.1:9/v1", "api_key_env": None}
    cfg = RewardConfig(free_form_match="judge", judge=judge,
                       by_data_source={"geo": {"free_form_match": "deepeyes_common",
                                               "judge": {**judge, "verdict": "equivalence", "system_prompt": ""}}})
    assert cfg.for_source("geo").judge.verdict == "equivalence"
    assert cfg.for_source("other").judge.verdict == "score"
    with pytest.raises(ValueError, match="by_data_source.geo"):
        RewardConfig(by_data_source={"geo": {"free_form_match": "deepeyes_math"}})  # no judge anywhere


def test_an_empty_judge_system_prompt_sends_the_user_message_alone():
    from loupe.rewards.config import JudgeConfig
    from loupe.rewards.judge import JudgeItem, LLMJudge

    config = JudgeConfig(api_key_env=None, system_prompt="", verdict="equivalence",
                         prompt_template="params/templates/judge_deepeyes_common.jinja")
    messages = LLMJudge(config)._messages(JudgeItem("Where?", "Paris", "Rome"))
    assert [m["role"] for m in messages] == ["user"]
    assert "## Equivalence Judgement" in messages[0]["content"] and messages[0]["content"].endswith("Rome")
