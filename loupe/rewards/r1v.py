"""R1-V's reward rules (Deep-Agent/R1-V, `src/r1-v/src/open_r1/grpo.py`, `accuracy_reward` and `format_reward`).

Both read the whole completion as the model wrote it, whatever its shape: R1-V has no parser, so a bare `3`, a
completion cut at the token budget, or text after `</answer>` is scored like any other. `free_form_match: r1v`
and `format_rule: r1v` score the final turn's raw text the same way, answered or not.
"""

from __future__ import annotations

import re

R1V_FORMAT = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
"""R1-V's format: the whole completion is a think block then an answer block (`grpo.py`, `format_reward`,
applied with `re.fullmatch` and DOTALL, on the completion unstripped)."""

_FIRST_ANSWER = re.compile(r"<answer>(.*?)</answer>")
"""R1-V's string fallback reads the first answer block, without DOTALL: an answer spanning lines is not read."""


def r1v_format(final_text: str | None) -> float:
    """1.0 when the completion full-matches `R1V_FORMAT`, else 0.0."""
    return 1.0 if final_text is not None and R1V_FORMAT.fullmatch(final_text) else 0.0


def r1v_accuracy(completion: str | None, solution: str) -> float:
    """R1-V's `accuracy_reward`: 1.0 when math-verify finds the completion's value equal to the solution's
    (`verify(parse(completion), parse(solution))`, the whole completion, reasoning included, in that argument
    order), else when the first `<answer>` block's text (or, with none, the whole completion), stripped, equals
    the solution's, stripped of its own tags; 0.0 otherwise. Any exception in either step counts as no match.
    math-verify's timeouts are off (`parsing_timeout=None`): the reward pool scores from threads."""
    if not completion:
        return 0.0
    from math_verify import parse, verify

    try:
        if float(verify(parse(completion, parsing_timeout=None), parse(solution, parsing_timeout=None),
                        timeout_seconds=None)) > 0:
            return 1.0
    except Exception:  # noqa: BLE001 - R1-V counts any failure of the check as "not verified"
        pass
    gold = _FIRST_ANSWER.search(solution)
    given = _FIRST_ANSWER.search(completion)
    truth = gold.group(1).strip() if gold else solution.strip()
    student = given.group(1).strip() if given else completion.strip()
    return 1.0 if student == truth else 0.0
