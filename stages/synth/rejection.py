"""Rejection sampling: which teacher trajectories are fit to teach the student.

A trajectory is kept only if every check passes; the first failing check names the reason (counted in
metrics.json). In order:

- a teacher's own verdict (`bad_image`, `protocol` from the importer); with `synth.import.keep: trainable` an
  imported row that ends on an assistant turn is kept here, checked no further (Mini-o3 trains every row);
- `not_answered:<end_reason>`: it ended over the turn limit, on a format error, or cut at the token budget;
- `invalid_reward`: the LLM judge failed after its retries (neither right nor wrong: dropped, not counted wrong);
- `wrong_answer`: the rewards module says the final answer is wrong (imported records carry no solution and
  skip this check; Mini-o3 kept only correct ones when it wrote them);
- `format_errors`: it recovered from a malformed turn (kept only with `keep_format_errors`: the bad turn is an
  assistant turn, so training on it teaches the mistake too);
- `protocol`: re-read with the protocol's parser, a turn before the last is not a clean tool call, the last is
  not an answer, a turn lacks <think>…</think> (with `require_think`), or the dialogue's `<image>`
  placeholders do not match its images;
- `too_few_tool_calls`: fewer zooms than `min_tool_calls` (the cold start teaches searching);
- `turn_limit` / `image_limit`: more assistant turns than the limit, more images than `protocol.max_images`;
- `pixel_budget`: an observation larger than `protocol.max_pixels` or smaller than `protocol.min_pixels`.
"""

from __future__ import annotations

from dataclasses import dataclass

from loupe.config import ProtocolParams
from loupe.protocol import IMAGE_PLACEHOLDER, Protocol
from loupe.trajectory import Trajectory


@dataclass(frozen=True)
class RejectionRules:
    """What a kept trajectory must satisfy (from the synth and protocol sections)."""

    max_turns: int
    max_images: int
    min_pixels: int
    max_pixels: int
    keep_format_errors: bool = False
    require_think: bool = True
    min_tool_calls: int = 1
    import_keep: str = "checked"
    """`synth.import.keep`: `trainable` keeps every imported row LLaMA-Factory can train on, checked no further."""

    @classmethod
    def from_params(cls, protocol: ProtocolParams, max_turns: int, keep_format_errors: bool, require_think: bool,
                    min_tool_calls: int, import_keep: str = "checked") -> RejectionRules:
        return cls(max_turns, protocol.max_images, protocol.min_pixels, protocol.max_pixels, keep_format_errors,
                   require_think, min_tool_calls, import_keep)


def protocol_violation(trajectory: Trajectory, protocol: Protocol, require_think: bool) -> str | None:
    """Why the dialogue is not a clean search in the protocol's format, or None when it is."""
    observations = 0
    assistant = [i for i, t in enumerate(trajectory.turns) if t.role == "assistant"]
    if not assistant or assistant[-1] != len(trajectory.turns) - 1:
        return "the dialogue does not end on an assistant turn"
    for index, turn in enumerate(trajectory.turns):
        placeholders = turn.text.count(IMAGE_PLACEHOLDER)
        if placeholders != len(turn.images):
            return f"a {turn.role} turn holds {placeholders} image placeholders for {len(turn.images)} images"
        if turn.role == "user":
            observations += len(turn.images) if index > 0 else 0
            continue
        if require_think and not ("<think>" in turn.text and "</think>" in turn.text):
            return "an assistant turn does not reason inside <think>…</think>"
        action = protocol.parse(turn.text, observations)
        last = index == len(trajectory.turns) - 1
        if action.error is not None:
            return f"{action.error.kind.value}: {action.error.detail}"
        if last and action.answer is None:
            return "the last turn does not answer"
        if not last and action.call is None:
            return "a turn before the last does not call the tool"
    return None


def rejection_reason(trajectory: Trajectory, protocol: Protocol, rules: RejectionRules) -> str | None:
    """The first check the trajectory fails (see the module docstring), or None to keep it."""
    if trajectory.meta.get("reject"):  # a teacher's own verdict (import: an unreadable image, a broken dialogue)
        return str(trajectory.meta["reject"])
    if trajectory.meta.get("imported") and rules.import_keep == "trainable":
        # The importer refused what LLaMA-Factory cannot train (role order, image count); it also needs the
        # dialogue to end on an assistant turn, which it trains as the response.
        ends_on_assistant = bool(trajectory.turns) and trajectory.turns[-1].role == "assistant"
        return None if ends_on_assistant else "protocol"
    if trajectory.end_reason != "answered":
        return f"not_answered:{trajectory.end_reason}"
    imported = bool(trajectory.meta.get("imported"))
    if not imported:
        if not trajectory.rewards.get("valid", False):
            return "invalid_reward"
        if trajectory.rewards.get("accuracy") != 1.0:
            return "wrong_answer"
    if trajectory.num_format_errors and not rules.keep_format_errors:
        return "format_errors"
    if rules.keep_format_errors and trajectory.num_format_errors:
        # Error observations break the call/answer alternation on purpose; only the answer must be clean.
        last = protocol.parse(trajectory.turns[-1].text, 0)
        if last.answer is None:
            return "protocol"
    elif protocol_violation(trajectory, protocol, rules.require_think) is not None:
        return "protocol"
    if trajectory.num_tool_calls < rules.min_tool_calls:
        return "too_few_tool_calls"
    if trajectory.num_turns > rules.max_turns:
        return "turn_limit"
    if len(trajectory.images) > rules.max_images:
        return "image_limit"
    for turn in trajectory.turns:
        if turn.crop is not None:
            width, height = turn.crop["size"]
            if not rules.min_pixels <= width * height <= rules.max_pixels:
                return "pixel_budget"
    return None
