"""The grammars without tools: `single_turn` (R1-V's `<think>…</think><answer>…</answer>`) and `boxed` (EasyR1's
single turn, the answer in `\boxed{}`).
"""

from __future__ import annotations

from loupe.protocol.core import (
    Action,
    FormatErrorKind,
    Protocol,
    _Invalid,
    extract_think,
)


class SingleTurnProtocol(Protocol):
    """R1-V style: think, then answer, in one turn; any tool call is a format error."""

    name = "single_turn"
    multi_turn = False

    def default_system_prompt(self) -> str:
        return "Think about the question inside <think> and </think>, then give the final answer inside <answer> and </answer>."

    def observation_text(self, index: int, size: tuple[int, int] | None = None) -> str:
        raise RuntimeError("the single_turn protocol has no observations")

    def _parse(self, text: str, num_observations: int) -> Action:
        if "<grounding>" in text or "<tool_call>" in text:
            raise _Invalid(FormatErrorKind.TOOLS_UNAVAILABLE, "this protocol has no tools; answer directly")
        return self._parse_answer_or_nothing(text)


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{…}` with its braces matched, or None (what MathRuler's
    `extract_boxed_content`, EasyR1's answer reader, takes; it returns the string "None" where this returns None)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            if depth == 0:
                return text[begin:index]
            depth -= 1
    return None


class BoxedProtocol(SingleTurnProtocol):
    """EasyR1's math answers: think, then the final answer in `\\boxed{}` anywhere after (its
    `examples/format_prompt/math.jinja` asks for it; `examples/reward_function/math.py` reads the last box)."""

    name = "boxed"

    def default_system_prompt(self) -> str:
        return "Think about the question inside <think> and </think>, then put the final answer in \\boxed{}."

    def _parse(self, text: str, num_observations: int) -> Action:
        if "<grounding>" in text or "<tool_call>" in text:
            raise _Invalid(FormatErrorKind.TOOLS_UNAVAILABLE, "this protocol has no tools; answer directly")
        answer = last_boxed(text)
        if answer is None:
            raise _Invalid(FormatErrorKind.NO_ACTION, "the turn holds no \\boxed{…} answer")
        if not answer.strip():
            raise _Invalid(FormatErrorKind.EMPTY_ANSWER, "the answer is empty")
        return Action(think=extract_think(text), answer=answer.strip())

    def render_answer(self, think: str, answer: str) -> str:
        return f"<think>{think}</think>\nThe answer is \\boxed{{{answer}}}."
