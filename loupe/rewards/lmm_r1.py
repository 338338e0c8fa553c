"""LMM-R1's reward rules: the math verifier server both of its RL stages score with (TideDra/lmm-r1,
`openrlhf/models/remote_rm/math_verifier.py`: `get_response_from_query`, `verify_format`, `verify_math`, and the
`get_reward` route that adds them), in process, so a run without the server trains on the same numbers.

- The response is the completion with the end-of-sequence markers removed and stripped.
- Format (weighted 0.5 in the preset, as the server does): the response starts with `<think>`, ends with
  `</answer>`, holds exactly one `<think>` and one `<answer>`, and nothing stands between `</think>` and
  `<answer>`.
- Accuracy: the reference, wrapped in `$...$` unless it starts with `$`, is parsed as LaTeX (first match); the
  response is parsed as LaTeX with `\\boxed` tried first and no malformed operators (first match); math-verify
  decides. A reference that does not parse earns 1.0 whatever was answered: upstream's way of skipping the
  sample, which trains on a reward any answer earns. `RewardConfig.upstream_bugs: fix` compares such a
  reference as text instead (`loupe.rewards.text.exact_match`).

Not reproduced: an empty response makes the server read the whole query, system prompt included, whose
example answer is `$\\boxed{2}$`, so an empty response scores 1.0 on a reference of 2. Loupe scores the
response it has, and an empty one earns nothing.
"""

from __future__ import annotations

import re

END_MARKERS = ("<|im_end|>", "<｜end▁of▁sentence｜>", "<|endoftext|>", "<end_of_turn>")
"""What the server deletes from a response before scoring it."""

_FORMAT = re.compile(r"^<think>(?:(?!</think>).)*</think><answer>(?:(?!</answer>).)*</answer>\Z", re.DOTALL)


def response_text(completion: str | None) -> str:
    text = completion or ""
    for marker in END_MARKERS:
        text = text.replace(marker, "")
    return text.strip()


def lmm_r1_format(completion: str | None) -> float:
    """1.0 when the response has LMM-R1's shape (module docstring), else 0.0."""
    text = response_text(completion)
    return 1.0 if _FORMAT.match(text) and text.count("<think>") == 1 and text.count("<answer>") == 1 else 0.0


def lmm_r1_accuracy(completion: str | None, reference: str, fix_unparsable_reference: bool = False) -> float:
    """LMM-R1's `verify_math` on the response (module docstring); math-verify's timeouts are off, as the
    reward pool scores from threads."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    gold_text = reference if reference.startswith("$") else f"${reference}$"
    gold = parse(gold_text, extraction_mode="first_match", extraction_config=[LatexExtractionConfig()],
                 parsing_timeout=None)
    text = response_text(completion)
    if not gold:
        if fix_unparsable_reference:
            from loupe.rewards.text import exact_match

            return float(exact_match(text, reference))
        return 1.0
    normalisation = NormalizationConfig(nits=False, malformed_operators=False, basic_latex=True, boxed="all",
                                        units=True)
    extraction = LatexExtractionConfig(normalization_config=normalisation, boxed_match_priority=0,
                                       try_extract_without_anchor=False)
    answer = parse(text, extraction_config=[extraction], extraction_mode="first_match", parsing_timeout=None)
    try:
        return float(verify(answer, gold, timeout_seconds=None))
    except Exception:  # noqa: BLE001 - upstream scores a failed verification 0
        return 0.0
