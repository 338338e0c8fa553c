"""Give the embedded tiny model eyes: a short perception pretraining on generic "what colour is the square" images.

A real base model (Qwen2.5-VL-7B) already sees: it names colours, reads text, points at things. What it lacks
at high resolution is detail, which is why zooming helps. A tiny model with random weights sees nothing, and
teaching it to see, to follow the protocol and to search, all in one cold-start SFT of a few minutes on a CPU,
does not work: measured in docs/learning.md, the SFT model learns the protocol and stays at chance on the
colour it should read. So the data stage gives the tiny model what a real base model brings, on images that
are not the task's: small pictures of a textured background with one solid square (often inside a frame of
another colour), each at its own size and place, and the single question "What colour is the small square?"
answered "It is <colour>." over all ten palette colours. No protocol, no zoom, no task canvas is seen.

The loop is written out here, not handed to transformers' `Trainer`: it is one loss on one answer span, a few
hundred steps, and must run inside the data stage in seconds without a dataset library or an output folder.

    from loupe.models.tiny_perception import pretrain_perception
    report = pretrain_perception("work/models/tiny", steps=300, seed=0)
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from loupe.data.synthetic_draw import PALETTE, textured_background

QUESTION = "What colour is the small square?"
COLOURS = tuple(PALETTE)


@dataclass(frozen=True)
class PerceptionReport:
    steps: int
    """Optimiser steps taken."""
    first_loss: float
    """Loss of the first batch."""
    final_loss: float
    """Mean loss of the last 20 steps."""
    held_out_accuracy: float
    """Share of held-out pictures whose colour word the model ranks first among the ten."""


def perception_picture(rng: np.random.Generator, grid: int = 28) -> tuple[Image.Image, str]:
    """One picture (2-4 grid cells a side: 56-112 px on Qwen2.5-VL's 28-px grid) and the colour of its square."""
    width, height = (int(v) for v in rng.integers(2, 5, size=2) * grid)
    image = textured_background(rng, width, height)
    draw = ImageDraw.Draw(image)
    colour = COLOURS[int(rng.integers(len(COLOURS)))]
    short = min(width, height)
    side = int(rng.integers(short // 4, short * 2 // 3))
    x0, y0 = int(rng.integers(0, width - side)), int(rng.integers(0, height - side))
    if rng.random() < 0.3:  # a frame of another colour around it, as zoom tasks draw
        frame = COLOURS[int(rng.integers(len(COLOURS)))]
        while frame == colour:
            frame = COLOURS[int(rng.integers(len(COLOURS)))]
        pad = max(2, side // 3)
        draw.rectangle([x0 - pad, y0 - pad, x0 + side + pad - 1, y0 + side + pad - 1], outline=PALETTE[frame],
                       width=max(2, pad // 2))
    draw.rectangle([x0, y0, x0 + side - 1, y0 + side - 1], fill=PALETTE[colour])
    return image, colour


def _batch(processor, pictures: list[tuple[Image.Image, str]]):
    """Tokenised pictures with labels on the answer span only."""
    import torch

    prompts, fulls = [], []
    for _, colour in pictures:
        user = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
        prompts.append(processor.apply_chat_template(user, tokenize=False, add_generation_prompt=True))
        answer = [{"role": "assistant", "content": [{"type": "text", "text": f"It is {colour}."}]}]
        fulls.append(processor.apply_chat_template(user + answer, tokenize=False))
    images = [[image] for image, _ in pictures]
    processor.tokenizer.padding_side = "right"  # labels are masked from the left, by prompt length
    encoded = processor(text=fulls, images=images, return_tensors="pt", padding=True)
    prompt_lengths = [len(ids) for ids in processor(text=prompts, images=images)["input_ids"]]
    labels = encoded["input_ids"].clone()
    for row, length in enumerate(prompt_lengths):
        labels[row, :length] = -100
    labels[encoded["attention_mask"] == 0] = -100
    encoded["labels"] = labels
    return encoded, torch.tensor(prompt_lengths)


def _accuracy(model, processor, pictures: list[tuple[Image.Image, str]]) -> float:
    """Share of pictures whose colour's first token ranks first among the ten colours' first tokens."""
    import torch

    first_ids = [processor.tokenizer.encode(f" {c}", add_special_tokens=False)[0] for c in COLOURS]
    lead = len(processor.tokenizer.encode("It is", add_special_tokens=False))
    right = 0
    with torch.no_grad():
        for start in range(0, len(pictures), 16):
            chunk = pictures[start:start + 16]
            encoded, prompt_lengths = _batch(processor, chunk)
            encoded.pop("labels")
            logits = model(**encoded).logits
            for row, (_, colour) in enumerate(chunk):
                position = int(prompt_lengths[row]) + lead - 1  # the token before the colour word
                scores = logits[row, position, first_ids]
                right += COLOURS[int(scores.argmax())] == colour
    return right / len(pictures)


def _train_seen_words_only(model, processor, pictures: list[tuple[Image.Image, str]]) -> None:
    """Let the pretraining move only the embeddings of tokens its texts hold (the question, the template, "It is",
    the colour words), and leave every other word where its random initialisation put it.

    The embeddings are tied, so the answer span's language-model loss reaches every row of the vocabulary through
    the output layer: each word the pretraining never answers with gets the same small push away from the same
    hidden states, and Adam scales those identical pushes into full steps. After 2,400 steps the words the task
    is about were one vector: "left" and "right" at cosine 0.96, "middle", "on", "at", "in" and "centre" with
    them, and an SFT model built on that base could not tell the left cell from the right one (its
    left-versus-right logit did not move with the question's word; docs/learning.md, "Words the base model
    could not tell apart"). A real base model comes to SFT with its words distinct; so does this one.
    """
    import torch

    encoded, _ = _batch(processor, [(image, colour) for image, _ in pictures[:1] for colour in COLOURS])
    seen = torch.zeros(model.get_input_embeddings().weight.shape[0], 1)
    seen[encoded["input_ids"].unique()] = 1.0
    model.get_input_embeddings().weight.register_hook(lambda grad: grad * seen)


def pretrain_perception(model_dir: str | Path, steps: int = 300, seed: int = 0, batch_size: int = 8,
                        lr: float = 1e-3, held_out: int = 100, progress: bool = False) -> PerceptionReport:
    """Train every weight of the model at `model_dir` on `steps` batches of fresh pictures, save it in place.

    Pictures come from the stream `seed`; the same seed gives the same weights (CPU, one thread is not
    required: the loop is deterministic under torch's default CPU kernels for these sizes).
    """
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from loupe.models.family import processor_grid

    model_dir = Path(model_dir)
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    grid = processor_grid(processor) or 28  # pictures on the model's own grid, as every image it is shown
    rng = np.random.default_rng([seed, 7_001])
    test_rng = np.random.default_rng([seed, 7_002])
    tests = [perception_picture(test_rng, grid) for _ in range(held_out)]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        random.seed(seed)
        optimiser = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        _train_seen_words_only(model, processor, tests)
        model.train()
        losses = []
        first_ids = torch.tensor([processor.tokenizer.encode(f" {c}", add_special_tokens=False)[0] for c in COLOURS])
        lead = len(processor.tokenizer.encode("It is", add_special_tokens=False))
        for _ in tqdm(range(steps), desc="tiny model: perception", unit="step", disable=not progress):
            pictures = [perception_picture(rng, grid) for _ in range(batch_size)]
            encoded, prompt_lengths = _batch(processor, pictures)
            output = model(**encoded)
            # The colour word's score among the ten colour words: the whole gradient goes to seeing. The LM loss
            # over the answer span alone spends hundreds of steps on the template first (docs/learning.md).
            rows = torch.arange(len(pictures))
            scores = output.logits[rows, prompt_lengths + lead - 1][:, first_ids]
            target = torch.tensor([COLOURS.index(colour) for _, colour in pictures])
            loss = torch.nn.functional.cross_entropy(scores, target) + output.loss
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            losses.append(loss.item())
        model.eval()
        accuracy = _accuracy(model, processor, tests)
    model.save_pretrained(model_dir)
    from loupe.models.family import write_published_layout

    write_published_layout(model_dir)
    return PerceptionReport(steps=steps, first_loss=losses[0] if losses else float("nan"),
                            final_loss=float(np.mean(losses[-20:])) if losses else float("nan"),
                            held_out_accuracy=accuracy)
