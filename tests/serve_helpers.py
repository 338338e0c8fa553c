"""What the `loupe serve` tests share: a server on a free loopback port, and a scripted engine that searches.

`ZoomingEngine` stands in for a trained model where a test is about the server rather than the model: it zooms
into the middle of the original, then into the middle of that crop, and answers with the colour of the middle
pixel of the last image it was shown. Its answer depends on the pixels the server cropped, so a wrong crop gives
a wrong answer. It records how many turns each batch held, which shows requests sharing the engine's batch.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from pathlib import Path
from typing import Any

from PIL import Image

from loupe.rollout.engine import Engine, Generation
from loupe.serve.main import serving_in_thread

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (30, 60, 220), "yellow": (240, 220, 20),
           "white": (245, 245, 245), "black": (10, 10, 10)}


def colour_name(rgb: tuple[int, int, int]) -> str:
    return min(COLOURS, key=lambda name: sum((a - b) ** 2 for a, b in zip(COLOURS[name], rgb)))


def call(box: list[float], source: str) -> str:
    return f'<think>look closer</think>\n<grounding>{json.dumps({"bbox_2d": box, "source": source})}</grounding>'


class ZoomingEngine(Engine):
    """Two zooms into the middle, then the middle pixel's colour as the answer (see the module's docstring)."""

    name = "zooming"

    def __init__(self, batch_size: int = 8, seconds_per_batch: float = 0.0):
        self.batch_size = batch_size
        self.seconds_per_batch = seconds_per_batch
        self.batches: list[int] = []
        """Turns in each generate call, in order."""
        self.lock = threading.Lock()

    def begin(self, system: str, question: str, images: list[Image.Image]) -> dict[str, Any]:
        return {"turn": 0, "last_image": images[-1] if images else None, "tokens": 100 + 16 * len(images)}

    def generate(self, states: list[dict[str, Any]], max_new_tokens: int) -> list[Generation]:
        self.batches.append(len(states))
        if self.seconds_per_batch:
            time.sleep(self.seconds_per_batch)
        out = []
        for state in states:
            state["turn"] += 1
            if state["turn"] == 1:
                text = call([0.35, 0.35, 0.65, 0.65], "original_image")
            elif state["turn"] == 2:
                text = call([0.3, 0.3, 0.7, 0.7], "observation_1")
            else:
                image = state["last_image"]
                pixel = image.getpixel((image.width // 2, image.height // 2))
                text = f"<think>it is {colour_name(pixel)}</think>\n<answer>{colour_name(pixel)}</answer>"
            state["tokens"] += 12
            finish = "stop" if text.endswith("</grounding>") else "eos"
            out.append(Generation(text=text, finish=finish, num_tokens=12))
        return out

    def add_user_turn(self, state: dict[str, Any], text: str, images: list[Image.Image]) -> None:
        if images:
            state["last_image"] = images[-1]
        state["tokens"] += 30 + 16 * len(images)

    def add_assistant_text(self, state: dict[str, Any], text: str) -> None:
        state["tokens"] += len(text) // 3

    def context_length(self, state: dict[str, Any]) -> int:
        return state["tokens"]


def scene(colour: str, size: tuple[int, int] = (900, 700)) -> Image.Image:
    """A grey canvas with a small square of `colour` in its middle (too small to see without zooming)."""
    image = Image.new("RGB", size, (128, 128, 128))
    cx, cy = size[0] // 2, size[1] // 2
    image.paste(COLOURS[colour], (cx - 12, cy - 12, cx + 12, cy + 12))
    return image


def data_url(image: Image.Image | Path | bytes, fmt: str = "PNG") -> str:
    if isinstance(image, Path):
        image = image.read_bytes()
    if isinstance(image, Image.Image):
        buffer = io.BytesIO()
        image.save(buffer, format=fmt)
        image = buffer.getvalue()
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(image).decode("ascii")


def question(image: Image.Image | Path | bytes, text: str = "What colour is the small square?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                         {"type": "text", "text": text}]}]


def running(app: Any):
    """Serve an ASGI app on a free loopback port in a thread; a context manager yielding its base URL (no /v1)."""
    return serving_in_thread(app)
