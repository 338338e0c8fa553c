"""DeepEyes' reward rules (Visual-Agent/DeepEyes, `verl/utils/reward_score/vl_agent.py`): `compute_score` for its
visual rows, `compute_score_math` and `compute_common_reasoning` for the rows its dispatcher sends there."""

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


# --- DeepEyes' compute_score on the whole response (`free_form_match: deepeyes`) ------------------------------

IMAGE_TOKENS = "<|vision_start|><|image_pad|><|vision_end|>"
"""An image as it reads in a decoded Qwen2.5-VL response with special tokens kept (one pad stands for many)."""


def decoded_response(turns: list[tuple[str, str, bool]]) -> str:
    """The response DeepEyes' reward reads, rebuilt from the dialogue after the question: its reward manager
    decodes the response tokens with special tokens kept (`verl/workers/reward_manager/naive.py`), so each
    assistant turn ends in `<|im_end|>` and each turn given back (a crop inside the tool-response template, or
    an error) sits in its own ChatML user block with its images as vision tokens. `turns` are (role, text,
    finished) triples: a turn cut at the token budget has no `<|im_end|>`; `<image>` in a user turn is an image."""
    from loupe.protocol import IMAGE_PLACEHOLDER

    parts = []
    for role, text, finished in turns:
        if role == "assistant":
            parts.append(text + ("<|im_end|>" if finished else ""))
        else:
            body = text.replace(IMAGE_PLACEHOLDER, IMAGE_TOKENS)
            parts.append(f"\n<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n")
    return "".join(parts)


def deepeyes_answer_text(response: str) -> str:
    """What DeepEyes judges: the text of the last `<answer>` anywhere in the response, up to its `</answer>`
    (the whole response when it holds none), stripped."""
    return response.split("<answer>")[-1].split("</answer>")[0].strip()


def deepeyes_crops(response: str) -> int:
    """Crops the tool returned: images in the response (the question's image is in the prompt, not here)."""
    return response.count("<|vision_start|><|image_pad|>")


def deepeyes_format_broken(response: str) -> bool:
    """DeepEyes' format error: `<think>` and `</think>` counts differ, or the vision tokens' opening and closing
    counts do, or `<answer>` and `</answer>` counts differ after the last `</think>`, or the answer text is
    `DEEPEYES_MAX_ANSWER_CHARS` long or longer."""
    tail = response.split("</think>")[-1]
    return (response.count("<think>") != response.count("</think>")
            or response.count("<|vision_start|><|image_pad|>") != response.count("<|image_pad|><|vision_end|>")
            or tail.count("<answer>") != tail.count("</answer>")
            or len(deepeyes_answer_text(response)) >= DEEPEYES_MAX_ANSWER_CHARS)


# --- DeepEyes' other scorers, picked by data_source (`verl/utils/reward_score/__init__.py`) --------------------


def _think_unbalanced(response: str) -> bool:
    return response.count("<think>") != response.count("</think>")


def deepeyes_math(response: str, solution: str, ask) -> tuple[float | None, float, str]:
    """`compute_score_math` (its ThinkLite and xince rows): the `\\boxed{…}` contents (no nested braces) after
    the last `</think>`; none is wrong and a format error, several a format error; the last is right when
    math-verify finds the reference equal to it (reference first), else when the judge (`ask(answer)`, a
    JudgeResult) says so. Returns (accuracy, format, answer); accuracy None when the judge failed."""
    import re

    from math_verify import parse, verify

    broken = _think_unbalanced(response)
    tail = response.split("</think>")[-1].strip()
    answers = re.findall(r"\\boxed{([^}]+)}", tail, flags=re.DOTALL)
    if not answers:
        return 0.0, -1.0, ""
    broken = broken or len(answers) > 1
    answer = answers[-1]
    try:
        equal = bool(verify(parse(solution, parsing_timeout=None), parse(answer, parsing_timeout=None),
                            timeout_seconds=None))
    except Exception:  # noqa: BLE001 - a failed check is "not equal", and the judge decides
        equal = False
    fmt = -1.0 if broken else 0.0
    if equal:
        return 1.0, fmt, answer
    verdict = ask(answer)
    return (float(verdict.score or 0.0) if verdict.valid else None), fmt, answer


def deepeyes_common(response: str, solution: str, ask) -> tuple[float | None, float, str]:
    """`compute_common_reasoning` (its geoguessr rows): DeepEyes' format checks on the whole response, the
    first `<answer>…</answer>` (across lines) after the last `</think>`, stripped; none, or 1,000 characters
    or more, is wrong and a format error; otherwise the judge (`ask(answer)`) decides. Returns (accuracy,
    format, answer); accuracy None when the judge failed."""
    import re

    tail = response.split("</think>")[-1].strip()
    broken = (_think_unbalanced(response)
              or response.count("<|vision_start|><|image_pad|>") != response.count("<|image_pad|><|vision_end|>")
              or tail.count("<answer>") != tail.count("</answer>"))
    found = re.search(r"<answer>(.*?)</answer>", tail, re.DOTALL)
    answer = found.group(1).strip() if found else ""
    if not answer or len(answer) >= DEEPEYES_MAX_ANSWER_CHARS:
        return 0.0, -1.0, answer
    verdict = ask(answer)
    return (float(verdict.score or 0.0) if verdict.valid else None), (-1.0 if broken else 0.0), answer
