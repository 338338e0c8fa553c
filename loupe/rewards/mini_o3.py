"""Mini-o3's reward rule (Mini-o3/Mini-o3: its hybrid reward manager calls the GPT judge for every answer,
`general_qa_tool`; the multiple-choice rule it configures is bypassed on that path).

- The answer judged is the first `<answer>…</answer>` in the assistant turns joined by spaces (its
  `extract_answer_tags="strict"`: `re.search(r'<answer>(.*?)</answer>', ..., re.DOTALL)`,
  verl/utils/reward_score/general_qa_tool.py:289-290, `inner_acc_reward`, so an answer spanning lines is found),
  tool-call turns included, unstripped. None found: accuracy 0, the judge is not asked.
- Every task goes to the judge, multiple-choice included; the total is the accuracy.
"""

from __future__ import annotations

import re

_FIRST_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def mini_o3_answer(assistant_turns: list[str]) -> str | None:
    """The text Mini-o3's judge reads, or None when no answer block is found."""
    found = _FIRST_ANSWER.search(" ".join(assistant_turns))
    return found.group(1) if found else None
