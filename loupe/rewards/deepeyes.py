"""DeepEyes' reward rules (Visual-Agent/DeepEyes, `verl/utils/reward_score/vl_agent.py`, `compute_score`)."""

from __future__ import annotations

DEEPEYES_MAX_ANSWER_CHARS = 1000
"""DeepEyes scores an answer this long or longer as wrong and a format error (its guard against answers that
list every option)."""


def deepeyes_format(end_reason: str, num_format_errors: int, answer: str | None) -> float:
    """-1.0 after a format error (a malformed turn, a turn cut at the token budget, or an answer of
    `DEEPEYES_MAX_ANSWER_CHARS` or more), else 0.0. DeepEyes counts unbalanced tags in the whole response;
    Loupe's parser has already refused such a turn as a format error, so the count is the same signal."""
    broken = (num_format_errors > 0 or end_reason in ("format_error", "length")
              or len(answer or "") >= DEEPEYES_MAX_ANSWER_CHARS)
    return -1.0 if broken else 0.0
