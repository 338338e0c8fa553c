"""EasyR1's math reward rules (hiyouga/EasyR1, `examples/reward_function/math.py`)."""

from __future__ import annotations

import re

EASYR1_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)
"""EasyR1's math format, matched after its whitespace normalisation around `<`, `>` and `/`
(`examples/reward_function/math.py`, `format_reward`)."""
_EASYR1_SPACES = re.compile(r"\s*(<|>|/)\s*")


def easyr1_format(final_text: str | None) -> float:
    """1.0 when the final turn full-matches `EASYR1_FORMAT` after EasyR1's space normalisation, else 0.0.
    EasyR1 scores every response, cut at the token budget or not, so the end reason does not enter."""
    normalised = _EASYR1_SPACES.sub(r"\1", final_text or "")
    return 1.0 if EASYR1_FORMAT.fullmatch(normalised) else 0.0
