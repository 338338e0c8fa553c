"""Math answers judged equal by value, not by spelling: `math_equal("\\frac{1}{2}", "0.5")` is True; and
EasyR1's stricter grader, `grade_answer` (MathRuler's).

Built on Hugging Face's `math-verify` package (`math_verify.parse` then `math_verify.verify`), the verifier the
seeds' recipes score with: R1-V (`src/r1-v/src/open_r1/grpo.py`, `accuracy_reward`), LMM-R1's reward server
(`openrlhf/models/remote_rm/math_verifier.py`, `verify_math`), Pixel-Reasoner and DeepEyes' math scorer. Using
the same package keeps a recipe's reward what its authors trained with; sympy alone would need a LaTeX parser
of our own (`\\frac`, `\\sqrt`, `\\boxed`, degrees, units), which is what math-verify already maintains.

How a reference and an answer are read (choices, each after a seed):
- the reference is parsed as LaTeX and as a plain expression; a bare reference is wrapped in `$...$` first
  (LMM-R1's `verify_math` does the same: `2\\sqrt{3}` unwrapped parses as `2`);
- the answer is parsed with math-verify's defaults (boxed content first, then any LaTeX or expression);
- a reference math-verify cannot parse falls back to normalised exact match (`loupe.rewards.text.exact_match`).
  LMM-R1 scores such a sample 1.0 whatever was answered; a reward any answer earns teaches nothing and inflates
  the curve, so Loupe compares the text instead;
- R1-V falls back to string equality when verification says no; the same exact match runs here, so a
  non-numeric answer ("blue") still matches its reference.

math-verify guards its parsing with `signal.alarm`, which only works in a main thread; the reward pool scores
from threads, so its timeouts are off and inputs are capped at `MAX_ANSWER_CHARS` instead (answers are one
turn's `<answer>` text; DeepEyes refuses answers of 1,000 characters or more for the same reason).
"""

from __future__ import annotations

import logging
import re

from loupe.rewards.text import exact_match

MAX_ANSWER_CHARS = 1000
"""Longer answers or references are compared by exact match only: sympy on adversarial input can run away."""

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def strip_answer_tags(text: str) -> str:
    """The text inside `<answer>…</answer>` when present (R1-V's references are `<answer> 3 </answer>`)."""
    found = _ANSWER_TAG.search(text)
    return (found.group(1) if found else text).strip()


def _quiet() -> None:
    """math-verify logs a warning on every call made without a timeout; the reason is given above."""
    for name in ("math_verify", "math_verify.parser", "math_verify.grader", "math_verify.utils"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _parse_reference(reference: str) -> list:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    text = reference if ("$" in reference or "\\boxed" in reference) else f"${reference}$"
    parsed = parse(text, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
                   parsing_timeout=None)
    if not parsed:  # "$140°$" style references that LaTeX mode refuses: try the text as written
        parsed = parse(reference, parsing_timeout=None)
    return parsed


_BARE_LATEX = re.compile(r"\\[A-Za-z]+")


def _parse_answer(answer: str) -> list:
    """An answer written as bare LaTeX (`12\\sqrt{2}`, `\\dfrac{3}{4}`, `\\pi/2`: a command, no `$` and no
    `\\boxed`) is read whole as LaTeX, as the reference is. math-verify's default extraction finds no LaTeX
    without delimiters and reads such an answer as an expression up to its first number, so `12\\sqrt{2}` read
    as 12 and `\\sqrt{12}` not at all. Anything else (prose, boxed or delimited answers) gets the defaults."""
    from math_verify import parse

    if _BARE_LATEX.search(answer) and "$" not in answer and "\\boxed" not in answer:
        parsed = _parse_reference(answer)
        if parsed:
            return parsed
    return parse(answer, parsing_timeout=None)


def math_equal(answer: str | None, reference: str) -> bool:
    """Whether `answer` has the value of `reference` (numbers, fractions, radicals, expressions, sets), or,
    failing that, matches it as text (`loupe.rewards.text.exact_match`); see the module docstring."""
    if answer is None or not answer.strip():
        return False
    reference = strip_answer_tags(reference)
    answer = strip_answer_tags(answer)
    if exact_match(answer, reference):
        return True
    if len(answer) > MAX_ANSWER_CHARS or len(reference) > MAX_ANSWER_CHARS:
        return False
    from math_verify import verify

    _quiet()
    gold = _parse_reference(reference)
    if not gold:
        return False
    predicted = _parse_answer(answer)
    if not predicted:
        return False
    return bool(verify(gold, predicted, timeout_seconds=None))


def grade_answer(answer: str | None, reference: str) -> bool:
    """EasyR1's grader: MathRuler's `grade_answer` (hiyouga/MathRuler, `mathruler/grader.py`), which
    `examples/reward_function/math.py` in EasyR1 calls on the last `\\boxed{}`'s content. Stricter than
    `math_equal` by design, and the preset keeps it so that a user trains on EasyR1's signal: an integer reference
    needs an integer answer (`3\\pi` is not 3), and two fractions must be written alike (`\\frac{6}{8}` is not
    `\\frac{3}{4}`, where math-verify says equal); otherwise equal after MathRuler's normalisation or when sympy
    simplifies the difference to 0.

    The `mathruler` package (with `pylatexenc`) is the CPU stack's, the vLLM test venv's and the rl and eval
    images'; an environment without it gets an error saying so, not a silent fallback to another grader."""
    try:
        from mathruler.grader import grade_answer as mathruler_grade_answer
    except ImportError as err:
        raise RuntimeError(
            "free_form_match: mathruler needs the `mathruler` and `pylatexenc` packages "
            "(pip install 'loupe[mathruler]'; requirements/cpu.txt pins them)"
        ) from err
    if answer is None or len(answer) > MAX_ANSWER_CHARS or len(reference) > MAX_ANSWER_CHARS:
        return False
    return bool(mathruler_grade_answer(answer, strip_answer_tags(reference)))
