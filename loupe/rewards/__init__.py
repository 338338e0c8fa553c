"""Rewards: accuracy (choice letter, free-form exact match, LLM judge), format, and tool use.

One entry point, `score(...)`, turns a finished trajectory's facts (its answer, end reason, tool calls, format
errors, whether it reasoned in `<think>`) into `RewardParts`; RL sums them into a scalar, eval reads the accuracy.

- **Choice questions**: `extract_choice` runs a letter cascade on the answer text (lone letter, "answer is X",
  "X is correct", "(X)", "X." at the start, then a unique option-text match) and compares the letter with the
  solution; an answer that merely repeats the option list names no letter.
- **Free-form questions**: `exact_match` after `normalize_answer` (case, punctuation, articles, number words;
  never erasing a whole answer, so "A" matches "A"); when configured, an `LLMJudge` decides the answers exact
  match could not confirm; with `free_form_match: math`, `loupe.rewards.math_grading.math_equal` compares by value.
- **Format**: one of three rules (`RewardConfig.format_rule`): Loupe's graded one, R1-V's think-then-answer
  match, DeepEyes' penalty for a broken turn.
- **Invalid, never zero**: a judge that still fails after its retries makes the reward *invalid*
  (`valid=False`, `accuracy=None`, `total=None`). Callers drop or retry invalid rewards; scoring an outage as
  a wrong answer would teach the policy (and report in eval) something that never happened.
- `load_custom_reward("path/to/file.py:fn")` loads a user's reward function for the rl stage.

The package is laid out by role, one module each: `config` (RewardConfig, JudgeConfig), `choice` (the letter
cascade), `text` (exact match), `math_grading` (answers equal by value), `judge` (the LLM judge), `format` (the
format rule dispatch), one module per recipe's own rules (`r1v`, `easyr1`, `deepeyes`), `parts` (RewardParts),
`score` (putting them together) and `custom` (user functions). Importing from `loupe.rewards` reaches them all.

The judge talks to any OpenAI-compatible server through the official `openai` client; see `LLMJudge` for its
retries, cache and key handling.
"""


from loupe.rewards.choice import extract_choice
from loupe.rewards.config import JudgeConfig, RewardConfig
from loupe.rewards.custom import SCORE_ARGUMENTS, CustomRewardError, load_custom_reward
from loupe.rewards.deepeyes import DEEPEYES_MAX_ANSWER_CHARS
from loupe.rewards.easyr1 import EASYR1_FORMAT
from loupe.rewards.format import format_reward
from loupe.rewards.judge import (
    JUDGE_PROMPT_VERSION,
    JudgeItem,
    JudgeResult,
    LLMJudge,
    parse_judge_score,
)
from loupe.rewards.math_grading import (
    MAX_ANSWER_CHARS,
    grade_answer,
    math_equal,
    strip_answer_tags,
)
from loupe.rewards.parts import RewardParts
from loupe.rewards.r1v import R1V_FORMAT
from loupe.rewards.score import build_judge, score, score_trajectory, tool_reward
from loupe.rewards.text import exact_match, normalize_answer

__all__ = [
    "DEEPEYES_MAX_ANSWER_CHARS", "EASYR1_FORMAT", "JUDGE_PROMPT_VERSION", "MAX_ANSWER_CHARS", "R1V_FORMAT",
    "SCORE_ARGUMENTS", "CustomRewardError", "JudgeConfig", "JudgeItem", "JudgeResult", "LLMJudge", "RewardConfig",
    "RewardParts", "build_judge", "exact_match", "extract_choice", "format_reward", "grade_answer", "load_custom_reward",
    "math_equal", "normalize_answer", "parse_judge_score", "score", "score_trajectory", "strip_answer_tags",
    "tool_reward",
]
