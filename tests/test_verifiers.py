"""Math answers compared by value (loupe.rewards.math_grading.math_equal, math-verify underneath) and the reward's format
rules (Loupe's, R1-V's, DeepEyes'), on answers of the kinds the seeds' data sets hold."""

from __future__ import annotations

import threading

import pytest

from loupe.data.tasks import TaskRecord
from loupe.rewards import R1V_FORMAT, RewardConfig, format_reward, score
from loupe.rewards.math_grading import MAX_ANSWER_CHARS, math_equal, strip_answer_tags


@pytest.mark.parametrize(
    ("answer", "reference", "equal"),
    [
        ("\\boxed{60}", "$\\boxed{60}$", True),  # LMM-R1's labels are boxed LaTeX
        ("3", "<answer> 3 </answer>", True),  # R1-V's CLEVR solutions carry their tags
        ("0.5", "\\frac{1}{2}", True),
        ("\\frac{3}{4}", "0.75", True),
        ("140", "140°", True),  # GeoQA's references carry degree signs
        ("\\boxed{2\\sqrt3}", "2\\sqrt{3}", True),  # needs the reference wrapped in $...$: bare, it reads 2
        ("2", "2\\sqrt{3}", False),
        ("x = 3", "3", True),
        ("The answer is 12.", "12", True),
        ("2,000", "2000", True),
        ("blue", "Blue", True),  # not math at all: exact match still decides
        ("8", "7", False),
        ("1/3", "0.333", False),
        ("", "7", False),
        (None, "7", False),
        # Bare LaTeX answers are read whole, as the reference is (math-verify's default stops at the first number).
        ("12\\sqrt{2}", "12", False),
        ("12\\sqrt{2}", "12\\sqrt{2}", True),
        ("\\sqrt{12}", "2\\sqrt{3}", True),
        ("2\\sqrt{3}", "\\sqrt{12}", True),
        ("\\dfrac{3}{4}", "0.75", True),
        ("\\dfrac{3}{4}", "\\frac{3}{4}", True),
        ("\\pi/2", "\\frac{\\pi}{2}", True),
        ("3\\pi", "3", False),
        ("\\boxed{3\\pi}", "3", False),
        ("\\frac{6}{8}", "\\frac{3}{4}", True),  # math-verify compares values: an unreduced fraction is equal
        ("60^\\circ", "60", True),
        ("\\sqrt{2}", "1.414", False),
    ],
)
def test_math_equal(answer, reference, equal):
    assert math_equal(answer, reference) is equal


def test_an_unparsable_reference_is_compared_as_text_not_scored_right():
    assert not math_equal("42", "the red one")  # LMM-R1 would score this 1.0
    assert math_equal("The red one", "the red one")


def test_long_answers_are_not_parsed():
    padded = "1" * (MAX_ANSWER_CHARS + 1)
    assert not math_equal(padded, "1")
    assert math_equal("1", "1")


def test_math_equal_works_off_the_main_thread():
    """math-verify's own timeouts use signal.alarm, which raises in a thread; the reward pool scores in threads."""
    found: list[bool] = []
    worker = threading.Thread(target=lambda: found.append(math_equal("\\frac{1}{2}", "0.5")))
    worker.start()
    worker.join()
    assert found == [True]


def test_strip_answer_tags():
    assert strip_answer_tags("<answer> 3 </answer>") == "3"
    assert strip_answer_tags(" 3 ") == "3"


def _task(solution: str = "12", options: list[str] | None = None) -> TaskRecord:
    return TaskRecord(doc_id="q", images=["x.png"], problem="What is 3 * 4?", solution=solution, data_source="t",
                      options=options)


def test_free_form_math_scores_by_value():
    cfg = RewardConfig(free_form_match="math")
    right = score(_task("\\frac{1}{2}"), "0.5", "answered", 0, 0, True, cfg)
    assert (right.accuracy, right.matched_by) == (1.0, "math")
    wrong = score(_task("\\frac{1}{2}"), "0.4", "answered", 0, 0, True, cfg)
    assert wrong.accuracy == 0.0
    exact = score(_task("\\frac{1}{2}"), "0.5", "answered", 0, 0, True, RewardConfig())
    assert exact.accuracy == 0.0, "exact match does not read fractions"


@pytest.mark.parametrize(
    ("text", "matches"),
    [
        ("<think>3 times 4</think><answer>12</answer>", True),
        ("<think>3 times 4</think>\n\n<answer>12</answer>", True),
        ("<think>a\nb</think> <answer>12</answer>", True),
        ("<answer>12</answer>", False),
        ("<think>x</think><answer>12</answer> trailing", False),
        ("preamble <think>x</think><answer>12</answer>", False),
    ],
)
def test_r1v_format(text, matches):
    assert bool(R1V_FORMAT.fullmatch(text)) is matches
    assert format_reward("answered", True, 0, "r1v", text, "12") == (1.0 if matches else 0.0)


def test_r1v_format_reads_the_completion_as_written_whatever_ended_it():
    """R1-V has no parser: its format reward full-matches every completion, unstripped (grpo.py, format_reward)."""
    assert format_reward("format_error", True, 1, "r1v", "<think>x</think><answer></answer>", None) == 1.0
    assert format_reward("answered", True, 0, "r1v", "\n<think>x</think><answer>1</answer>", "1") == 0.0


def test_r1v_reward_sums_accuracy_and_format():
    cfg = RewardConfig(free_form_match="math", format_rule="r1v", format_weight=1.0)
    good = score(_task(), "12", "answered", 0, 0, True, cfg, final_text="<think>3*4</think><answer>12</answer>")
    assert good.total == 2.0
    bare = score(_task(), "12", "answered", 0, 0, False, cfg, final_text="<answer>12</answer>")
    assert bare.total == 1.0


def test_deepeyes_reward_shape():
    """0.8 accuracy + 0.2 format (0 or -1) + 1.2 when right after a tool call (DeepEyes vl_agent.compute_score)."""
    cfg = RewardConfig.deepeyes()
    assert score(_task(), "12", "answered", 1, 0, True, cfg).total == pytest.approx(2.0)
    assert score(_task(), "12", "answered", 0, 0, True, cfg).total == pytest.approx(0.8)
    assert score(_task(), "13", "answered", 1, 0, True, cfg).total == pytest.approx(0.0)
    assert score(_task(), "12", "answered", 1, 1, True, cfg).total == pytest.approx(1.8)  # a format error cost 0.2
    assert score(_task(), None, "length", 0, 0, True, cfg).total == pytest.approx(-0.2)
    rambling = "12 " + "x" * 1000
    hacked = score(_task(), rambling, "answered", 1, 0, True, RewardConfig.deepeyes(free_form_match="math"))
    assert (hacked.accuracy, hacked.format, hacked.total) == (0.0, -1.0, pytest.approx(-0.2))


def test_unknown_format_rule_is_refused():
    with pytest.raises(ValueError, match="format rule"):
        format_reward("answered", True, 0, "other")
    with pytest.raises(ValueError):
        RewardConfig(format_rule="other")
