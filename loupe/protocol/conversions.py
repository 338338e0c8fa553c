"""Conversions of a finished trajectory: chat messages (images split out of the text) and LLaMA-Factory's
ShareGPT record.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from loupe.data.tasks import IMAGE_PLACEHOLDER

if TYPE_CHECKING:
    from loupe.trajectory import Trajectory


def split_on_images(text: str, images: list[Any]) -> list[dict[str, Any]]:
    pieces = text.split(IMAGE_PLACEHOLDER)
    if len(pieces) - 1 != len(images):
        raise ValueError(f"turn holds {len(pieces) - 1} image placeholders but {len(images)} images: {text[:80]!r}")
    content: list[dict[str, Any]] = []
    for i, piece in enumerate(pieces):
        if piece:
            content.append({"type": "text", "text": piece})
        if i < len(images):
            content.append({"type": "image", "image": images[i]})
    return content


def to_chat_messages(trajectory: "Trajectory") -> list[dict[str, Any]]:
    """Hugging Face chat messages (`processor.apply_chat_template` input); images as PIL images or paths."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": [{"type": "text", "text": trajectory.system}]}]
    for turn in trajectory.turns:
        images = [trajectory.pending.get(i) or str(trajectory.image_path(i)) for i in turn.images]
        messages.append({"role": turn.role, "content": split_on_images(turn.text, images)})
    return messages


def to_sharegpt(trajectory: "Trajectory") -> dict[str, Any]:
    """A LLaMA-Factory sharegpt record: system/human/gpt turns, `<image>` placeholders, image paths in order.

    Observations (crops and error messages alike) are human turns, as in Mini-o3's cold-start set. The
    record must end on the model's turn, so only finished trajectories convert; crops must be saved first.
    """
    if not trajectory.turns or trajectory.turns[-1].role != "assistant":
        raise ValueError(f"trajectory {trajectory.traj_id} does not end on an assistant turn")
    roles = {"user": "human", "assistant": "gpt"}
    conversations = [{"from": "system", "value": trajectory.system}]
    images: list[str] = []
    for turn in trajectory.turns:
        if turn.text.count(IMAGE_PLACEHOLDER) != len(turn.images):
            raise ValueError(
                f"trajectory {trajectory.traj_id}: a {turn.role} turn holds {turn.text.count(IMAGE_PLACEHOLDER)} "
                f"image placeholders but {len(turn.images)} images"
            )
        conversations.append({"from": roles[turn.role], "value": turn.text})
        images += [str(trajectory.image_path(i)) for i in turn.images]
    return {"conversations": conversations, "images": images}
