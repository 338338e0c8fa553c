"""LMM-R1's JSONL (TideDra/lmm-r1, `examples/data/test_message.jsonl`).

`message` is an OpenAI message list *stringified* (README: "message is a stringfied list"), with images as
`{"type": "image", "image": "file:///path"}` or a bare path, and `answer` (`$\\boxed{60}$`); its
`openrlhf/models/lmm_kits/base/data_processor.py` parses the string with `json.loads`. A system message is kept
on the record (`system`): the chat template renders it as the dialogue's system turn, as upstream's does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from loupe.data.published.rows import ImageFinder, RawTask, RecipeFormatError, answer_text, get, image_value, rows
from loupe.data.tasks import IMAGE_PLACEHOLDER


def read_lmm_r1(path: Path, image_dir: Path | None = None, input_key: str = "message",
                label_key: str = "answer") -> Iterator[RawTask]:
    finder = ImageFinder(path, image_dir)
    for number, row in rows(path):
        raw = get(path, number, row, input_key, (str, list))
        try:
            messages = json.loads(raw) if isinstance(raw, str) else raw
        except json.JSONDecodeError as err:
            raise RecipeFormatError(f"{path}:{number}: field {input_key!r} is not a JSON message list "
                                    f"({err.msg})") from None
        answer = answer_text(path, number, row, label_key)
        system, texts, images = None, [], []
        for k, message in enumerate(messages if isinstance(messages, list) else []):
            where = f"{input_key}[{k}]"
            if not isinstance(message, dict) or "role" not in message:
                raise RecipeFormatError(f"{path}:{number}: {where} is not a message with a role")
            content = message.get("content")
            if message["role"] == "system":
                system = content if isinstance(content, str) else " ".join(
                    p.get("text", "") for p in content or [] if isinstance(p, dict))
                continue
            if message["role"] != "user":
                continue
            for part in [{"type": "text", "text": content}] if isinstance(content, str) else content or []:
                if part.get("type") == "text":
                    texts.append(part.get("text", ""))
                elif part.get("type") == "image":
                    images.append(image_value(finder, number, f"{where}.image", part.get("image")))
                    texts.append(IMAGE_PLACEHOLDER)
        if not texts:
            raise RecipeFormatError(f"{path}:{number}: field {input_key!r} holds no user message")
        problem = "".join(texts).strip()
        if images and problem.count(IMAGE_PLACEHOLDER) != len(images):
            problem = problem.replace(IMAGE_PLACEHOLDER, "")
        yield RawTask(problem, answer, images, extra={"system": system} if system else {},
                      image_field=input_key)
