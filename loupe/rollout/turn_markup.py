"""A user turn's markup learnt from the model's own chat template, for engines that append turns as tokens.

Rendering two small dialogues and taking their difference gives what the template writes after an assistant
message, around a user turn and for one image, so no model's template is hard-coded (the transformers engine,
hf.py, appends every turn after the first this way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_MARK = "\x00LOUPE\x00"


@dataclass(frozen=True)
class TurnMarkup:
    """Text the chat template puts around a user turn once the dialogue has started."""

    close_assistant: str
    """What follows an assistant message's text (e.g. '<|im_end|>\\n')."""
    user_prefix: str
    """From the start of a user turn to its content (e.g. '<|im_start|>user\\n')."""
    user_suffix: str
    """From the end of the user content through the next assistant turn's opening."""
    image: str
    """How one image renders inside a message (e.g. '<|vision_start|><|image_pad|><|vision_end|>')."""


def learn_turn_markup(processor: Any) -> TurnMarkup:
    """Derive the per-turn markup from the processor's chat template."""

    def render(messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def text(t: str) -> dict[str, Any]:
        return {"type": "text", "text": t}

    base = [
        {"role": "system", "content": [text("S")]},
        {"role": "user", "content": [text("Q")]},
        {"role": "assistant", "content": [text(_MARK)]},
    ]
    closed = render(base, False)
    close_assistant = closed[closed.rindex(_MARK) + len(_MARK) :]
    extended = render(base + [{"role": "user", "content": [text(_MARK)]}], True)
    if not extended.startswith(closed):
        raise ValueError("the chat template re-renders earlier turns; token-in/token-out needs a prefix-stable template")
    user_prefix, user_suffix = extended[len(closed) :].split(_MARK)
    with_image = render(base + [{"role": "user", "content": [{"type": "image"}, text(_MARK)]}], True)
    image = with_image[len(closed) + len(user_prefix) : with_image.rindex(_MARK)]
    if not image:
        raise ValueError("the chat template renders no image marker")
    return TurnMarkup(close_assistant, user_prefix, user_suffix, image)
