"""The format part of a reward, by rule (`RewardConfig.format_rule`); each recipe's rule lives in its module."""

from __future__ import annotations

from loupe.rewards.deepeyes import deepeyes_format
from loupe.rewards.easyr1 import easyr1_format
from loupe.rewards.lmm_r1 import lmm_r1_format
from loupe.rewards.r1v import r1v_format

FORMAT_RULES = ("loupe", "r1v", "easyr1", "deepeyes", "lmm_r1")


def format_reward(
    end_reason: str,
    has_think: bool,
    num_format_errors: int,
    rule: str = "loupe",
    final_text: str | None = None,
    answer: str | None = None,
) -> float:
    """The format part of the reward under `rule` (RewardConfig.format_rule).

    - `loupe`: 1.0 for a clean answer; 0.5 for an answer without `<think>` or after format errors; 0.0 for no
      answer. A trajectory that did not end by answering (over_turn, format_error, length) earns nothing: its
      last turn was not a well-formed answer. Over-turn masking is the learner's business, not this function's.
    - `r1v`: `loupe.rewards.r1v.r1v_format` (the final turn, as written, is exactly think then answer;
      R1-V scores every completion, answered or not).
    - `easyr1`: `loupe.rewards.easyr1.easyr1_format` (think, then a `\\boxed{}`).
    - `deepeyes`: `loupe.rewards.deepeyes.deepeyes_format` (-1 after a broken turn, else 0).
    - `lmm_r1`: `loupe.rewards.lmm_r1.lmm_r1_format` (LMM-R1's server, on the raw completion).
    """
    if rule == "r1v":
        return r1v_format(final_text)
    if rule == "easyr1":
        return easyr1_format(final_text)
    if rule == "lmm_r1":
        return lmm_r1_format(final_text)
    if rule == "deepeyes":
        return deepeyes_format(end_reason, num_format_errors, answer)
    if rule != "loupe":
        raise ValueError(f"unknown format rule {rule!r}; expected one of {', '.join(FORMAT_RULES)}")
    if end_reason != "answered":
        return 0.0
    return 1.0 if has_think and num_format_errors == 0 else 0.5
