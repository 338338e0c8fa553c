"""The multi-turn, multi-image dialogue both sides of the prompt check build (no vLLM import here).

It runs in either environment: the project's CPU venv (transformers 5.6, the learner's stack on a laptop) and
`.venv-vllm` (the rl image's vLLM 0.33 + transformers 5.20). Images are fitted to the protocol's pixel budget
the way the rollout loop fits them (`fit_to_budget`), and user turns carry `<image>` placeholders as the loop's
observation turns do. Turn 1 asks about one image, turn 2 shows one crop, turn 3 shows two crops of odd sizes
(one under the minimum pixel budget, one long and thin), so image runs of different lengths sit at different
places in the dialogue.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from PIL import Image

PROTOCOL = "mini_o3"
"""Whose stop string ends a tool call (the engines are built with `get_protocol(PROTOCOL).stop`)."""
SYSTEM = "You look at images, zoom in with a tool when needed, and answer."
QUESTION = "<image>\nWhich colour is the small square?"
TURNS = [
    ("<image>\nThe crop you asked for.", 1),
    ("Two views: <image> and <image>. Answer now.", 2),
]
"""User turns after the first: (text with placeholders, how many images)."""

MAX_NEW_TOKENS = 12
"""Sampled turns: short, so most end by length (the tiny model is random)."""
SCRIPTED_MAX_NEW_TOKENS = 48
"""Scripted turns: room for every scripted ending (the longest, a tool call, is about 40 tokens)."""
SAMPLES = 3
"""Dialogues run side by side (the K samples of one task)."""


def scene() -> Image.Image:
    image = Image.new("RGB", (1400, 1000), (30, 90, 160))
    image.paste((250, 220, 0), (700, 500, 760, 560))
    image.paste((200, 30, 40), (100, 80, 400, 200))
    return image


def turn_images(protocol: Any) -> list[list[Image.Image]]:
    """The images of each user turn, as the model sees them (already fitted to the protocol's budget)."""
    from loupe.tools import fit_to_budget

    full = scene()
    crops = [
        [full],
        [full.crop((600, 400, 860, 660))],
        [full.crop((700, 500, 757, 643)), full.crop((0, 0, 1400, 90))],
    ]
    return [[fit_to_budget(image, protocol.budget) for image in images] for images in crops]


def protocol_params() -> Any:
    from loupe.config import ProtocolParams

    return ProtocolParams(min_pixels=3136, max_pixels=50176, max_turns=3)


def run(engine: Any, generate: Callable[[list[Any], int], list[Any]] | None = None, max_new_tokens: int = MAX_NEW_TOKENS) -> list[Any]:
    """Drive `SAMPLES` dialogues through `engine` (begin, generate, add_user_turn, ...); returns the states.

    `generate(states, max_new_tokens)` defaults to `engine.generate`; the check of the transformers engine's
    contexts across environments passes a scripted one.
    """
    generate = generate or engine.generate
    images = turn_images(protocol_params())
    states = [engine.begin(SYSTEM, QUESTION, images[0]) for _ in range(SAMPLES)]
    generate(states, max_new_tokens)
    for (text, count), turn in zip(TURNS, images[1:]):
        assert len(turn) == count
        for state in states:
            engine.add_user_turn(state, text, turn)
        generate(states, max_new_tokens)
    return states


def scripted_tokens(tokenizer: Any, sample: int, turn: int) -> tuple[list[int], str]:
    """Fixed assistant tokens for the scripted dialogue, and how the turn ends: every way a turn can end.

    Sample 0 closes its turns with <|im_end|> (eos), sample 1 with the protocol's stop string, sample 2 runs
    out of tokens (length, at `SCRIPTED_MAX_NEW_TOKENS`), then they rotate by turn.
    """
    kind = ("eos", "stop", "length")[(sample + turn) % 3]
    if kind == "eos":
        text = f"<think>look at part {turn}</think><answer>A</answer>"
        return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")], kind
    if kind == "stop":
        from loupe.protocol import get_protocol

        protocol = get_protocol(PROTOCOL)
        call = '{"bbox_2d": [0.1, 0.2, 0.5, 0.6], "source": "original_image"}'
        text = f"<think>zoom {sample}</think>{protocol.call_open}{call}{protocol.call_close}"
        assert text.endswith(protocol.stop[0])
        return tokenizer(text, add_special_tokens=False)["input_ids"], kind
    text = " ".join(["the square is yellow and small and sits near the middle of the blue canvas"] * 4)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > SCRIPTED_MAX_NEW_TOKENS
    return ids[:SCRIPTED_MAX_NEW_TOKENS], kind


def scripted_generate(engine: Any) -> Callable[[list[Any], int], list[Any]]:
    """A `generate` that records `scripted_tokens` into each state through the engine's own bookkeeping."""
    turn = {"n": 0}

    def generate(states: list[Any], max_new_tokens: int) -> list[Any]:
        out = []
        for sample, state in enumerate(states):
            ids, finish = scripted_tokens(engine.tokenizer, sample, turn["n"])
            out.append(engine._record(state, ids, [-0.5] * len(ids), finish))
        turn["n"] += 1
        return out

    return generate
