"""Pixel-Reasoner's accuracy rule (TIGER-AI-Lab/Pixel-Reasoner @ a3a6c3a, curiosity_driven_rl/openrlhf/trainer/
ppo_utils/experience_maker.py: `rule_reward`, `handle_boxed`, `do_verify`, `normalize_answer`), read there and
written here in Loupe's words.

What it reads is the whole response after the question, lowercased: every assistant turn with its `<|im_end|>`
and every turn given back (crops as vision tokens), as its `separate_qa` cuts the decoded dialogue after the
first assistant header. The reference, lowercased and normalised, is read by math-verify as `\\boxed{reference}`;
then, in order, the response's last `\\boxed` to its end, and its first `<answer>…</answer>` (one line), are
verified against it; a match pays 1.0 and stops. When neither matches, the whole response is verified. A
prediction math-verify cannot read at all scores **-1.0**, as does a reference it cannot read; a reference
holding commas also passes when every comma-separated part (after dropping its first seven characters and its
last, as upstream's multi-span fallback does) appears in the text from the last `boxed` on.

Upstream's quirks kept, since a preset trains on them: the "Answer:" cue and the multiple-choice letter branch
can never fire (the text is lowercased first), and `requires_box` reaches `rule_reward` in the slot of the code
executor, so an answer without a box is graded too. math-verify's timeouts are off (`parsing_timeout=None`,
`timeout_seconds=None`): Loupe scores from threads, where its signal-based timeouts cannot run.
"""

from __future__ import annotations

import re

_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>")
_CHOICE_LETTERS = "ABCDEFGHIJK"


def _normalize(text: str) -> str:
    """Upstream's `normalize_answer`: dfrac to frac, `\\text` dropped, varnothing to emptyset, units dropped."""
    text = text.replace("dfrac", "frac").replace("\\text", "").replace("\\varnothing", "\\emptyset")
    return text.replace("minutes", "").replace("cm", "")


def _verify(prediction: str, gold: list) -> float:
    """Upstream's `do_verify`: 1.0 / 0.0 by math-verify, -1.0 when the prediction does not parse or it raises."""
    from math_verify import parse, verify

    try:
        parsed = parse(prediction, parsing_timeout=None)
        if len(gold) > 1 and isinstance(gold[1], str) and gold[1] in _CHOICE_LETTERS:
            return float(prediction[len("\\boxed{"):].startswith(gold[1]))
        if len(parsed) == 0:
            return -1.0
        return float(verify(parsed, gold, timeout_seconds=None))
    except Exception:  # noqa: BLE001 - upstream scores any failure of the check as unparsable
        return -1.0


def _handle_boxed(response: str, reference: str) -> float:
    from math_verify import parse

    reference = _normalize(reference)
    try:
        gold = parse(reference if "\\boxed" in reference else f"\\boxed{{{reference}}}", parsing_timeout=None)
    except Exception:  # noqa: BLE001
        return -1.0
    if len(gold) == 0:
        return -1.0
    result = 0.0
    for cue in ("\\boxed", "<answer>"):
        if cue not in response:
            continue
        if cue == "<answer>":
            found = _ANSWER_BLOCK.search(response)
            if not found:
                continue
            prediction = f"\\boxed{{{found.group(1)}}}"
        else:
            prediction = response[response.rindex(cue):].strip()
        result = _verify(_normalize(prediction), gold)
        if result > 0.99:
            return result
    return _verify(_normalize(response), gold)


def pixel_reasoner_accuracy(response: str, solution: str) -> float:
    """1.0, 0.0 or -1.0 for `response` (the decoded dialogue after the question) against `solution`."""
    reference = str(solution).lower()
    text = response.lower()
    result = _handle_boxed(text, reference)
    if result > 0.5 or "," not in reference:
        return result
    parts = [part.lower().strip() for part in reference[len("\\boxed{"):-1].split(",")]
    start = text.rfind("boxed")
    if start == -1:
        return result
    tail = "\\" + text[start:]
    return 1.0 if all(part in tail for part in parts) else result


def pixel_reasoner_response(decoded: str) -> str:
    """The response as `separate_qa` yields it: the decoded dialogue with every assistant header cut out."""
    return decoded.replace("<|im_start|>assistant\n", "")
