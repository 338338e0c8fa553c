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
