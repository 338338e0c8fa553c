"""R1-V's reward rules (Deep-Agent/R1-V, `src/r1-v/src/open_r1/grpo.py`)."""

from __future__ import annotations

import re

R1V_FORMAT = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
"""R1-V's format: the whole final turn is a think block then an answer block (`src/r1-v/src/open_r1/grpo.py`,
`format_reward`, applied there with `re.fullmatch` and DOTALL)."""


def r1v_format(end_reason: str, final_text: str | None) -> float:
    """1.0 when the trajectory answered and its final turn full-matches `R1V_FORMAT`, else 0.0."""
    return 1.0 if end_reason == "answered" and final_text and R1V_FORMAT.fullmatch(final_text.strip()) else 0.0
