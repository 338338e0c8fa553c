"""The SFT sets the import teacher reads, one reader per publisher: each row becomes a `Dialogue`, the messages
and image bytes stages/synth/importer.py turns into a trajectory.

- `mini_o3`: Mini-o3-Coldstart-Dataset (parquet): `conversations`, a list of `{"from": system|human|gpt,
  "value"}` stored as a *string* (the printed Python list, which Mini-o3's `scripts/preprocess_coldstart.py`
  turns back into data with `eval()`; read here as JSON, else with `ast.literal_eval`, literals only: a row
  holding code fails with its row and field named instead of running), `images` (image structs),
  `image_names`, `data_source`, `sample_index`, `rollout_index`.
- `pixel_reasoner`: PixelReasoner-SFT-Data (a JSON list, `instruction_tuning/sft_tool.py` `SFT_DATASET`):
  `message_list`, the Qwen chat the trainer renders with the processor's chat template
  (`sft_tooltrainer.py:372-380`, `vlm_modules/qwen_module.py` `prepare_from_msg_2_vlm_inputs`): messages of
  `role` system / user / assistant, `content` a string or a list of parts (`{"type": "text", "text"}`,
  `{"type": "image", "image": path}`, `{"video": [frame paths]}`; qwen-vl-utils' keys without `type` too).
  Tool results come back as user turns holding the crop. A video part's frames become one image each, as
  Loupe shows a clip. `question_image_path` is read by upstream's evaluation step only
  (`sft_tooltrainer.py:424-429`), not by training.
- `r1v_cot`: R1-V's R1-distilled chain-of-thought set (`src/r1-v/src/open_r1/sft.py`, `convert_example`):
  `image`, `problem`, `thinking`, `solution` and an optional `system` (else R1-V's SYSTEM_PROMPT, sft.py:113-118);
  the user turn is the problem, then the image; the assistant turn `f"{thinking}\\n\\n{solution}"`.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loupe.data.published.rows import ArchiveMember, ImageFinder, RecipeFormatError, image_value
from loupe.images import image_cell
from loupe.protocol import IMAGE_PLACEHOLDER

R1V_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. The assistant "
    "first thinks about the reasoning process in the mind and then provides the user with the answer. The reasoning "
    "process and answer are enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., "
    "<think> reasoning process here </think><answer> answer here </answer>"
)
"""R1-V's default system prompt of its SFT (src/r1-v/src/open_r1/sft.py:113-118)."""


class ImportFormatError(ValueError):
    """A file or row that is not in the import format; names the file, row and field."""


@dataclass
class Dialogue:
    """One imported row: messages in LLaMA-Factory's sharegpt roles, one image placeholder per image."""

    messages: list[dict[str, str]]
    images: list[bytes]
    names: list[str] = field(default_factory=list)
    data_source: str = ""
    sample_index: Any = None
    rollout_index: Any = None


def parse_conversations(value: Any, where: str) -> list[dict[str, str]]:
    """The row's conversation as a list of {"from", "value"}: JSON, a Python literal, or already a list."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            try:
                value = ast.literal_eval(value.strip())
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                raise ImportFormatError(
                    f"{where}: field 'conversations': neither JSON nor a Python literal (never evaluated as code)"
                ) from None
    if not isinstance(value, list) or not value:
        raise ImportFormatError(f"{where}: field 'conversations': expected a non-empty list of messages")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("value"), str):
            raise ImportFormatError(f"{where}: field 'conversations.{i}': expected {{'from': ..., 'value': text}}")
        if message.get("from") not in ("system", "human", "gpt"):
            raise ImportFormatError(
                f"{where}: field 'conversations.{i}.from': {message.get('from')!r} is not system, human or gpt"
            )
        messages.append({"from": message["from"], "value": message["value"]})
    return messages


def _bytes(image: Any, where: str, field_name: str, base_dir: Path) -> bytes:
    """The encoded bytes of a Mini-o3 `images` entry: a {"bytes", "path"} struct, raw bytes, or a file beside."""
    value = image_cell(image)
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        path = (base_dir / value).resolve()
        if not path.is_relative_to(base_dir.resolve()) or not path.is_file():
            raise ImportFormatError(f"{where}: field '{field_name}': {value!r} is neither embedded nor a file beside "
                                    "the data file")
        return path.read_bytes()
    raise ImportFormatError(f"{where}: field '{field_name}': an entry holds no image bytes or path")


def _read(ref: bytes | Path | ArchiveMember) -> bytes:
    return ref if isinstance(ref, bytes) else ref.read() if isinstance(ref, ArchiveMember) else ref.read_bytes()


def mini_o3(file: Path, number: int, row: dict[str, Any], finder: ImageFinder) -> Dialogue:
    where = f"{file}: row {number}"
    messages = parse_conversations(row.get("conversations"), where)
    images = row.get("images")
    if not isinstance(images, list):
        raise ImportFormatError(f"{where}: field 'images': expected a list")
    names = row.get("image_names") if isinstance(row.get("image_names"), list) else []
    data = [_bytes(image, where, f"images.{k}", file.parent) for k, image in enumerate(images)]
    return Dialogue(messages, data, [str(n) for n in names], str(row.get("data_source") or "mini_o3_coldstart"),
                    row.get("sample_index", number), row.get("rollout_index"))


_ROLES = {"system": "system", "user": "human", "tool": "human", "assistant": "gpt"}


def pixel_reasoner(file: Path, number: int, row: dict[str, Any], finder: ImageFinder) -> Dialogue:
    where = f"{file}: row {number}"
    raw = row.get("message_list")
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            raise ImportFormatError(f"{where}: field 'message_list': not a JSON message list") from None
    if not isinstance(raw, list) or not raw:
        raise ImportFormatError(f"{where}: field 'message_list': expected a non-empty list of messages")
    messages, images = [], []
    for k, message in enumerate(raw):
        name = f"message_list.{k}"
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            raise ImportFormatError(f"{where}: field '{name}': expected a message with role system, user, tool or "
                                    "assistant")
        content = message.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(parts, list):
            raise ImportFormatError(f"{where}: field '{name}.content': expected text or a list of parts")
        text = []
        for j, part in enumerate(parts):
            if not isinstance(part, dict):
                raise ImportFormatError(f"{where}: field '{name}.content.{j}': expected a part object")
            kind = part.get("type") or next((key for key in ("text", "image", "video") if key in part), None)
            if kind == "text":
                text.append(str(part.get("text", "")))
            elif kind in ("image", "video"):
                frames = part.get(kind)
                for frame in frames if kind == "video" and isinstance(frames, list) else [frames]:
                    try:
                        ref = image_value(finder, number, f"{name}.content.{j}.{kind}", frame)
                    except RecipeFormatError as err:
                        raise ImportFormatError(str(err)) from None
                    images.append(_read(ref))
                    text.append(IMAGE_PLACEHOLDER)
            else:
                raise ImportFormatError(f"{where}: field '{name}.content.{j}': a part of type {kind!r} (text, image "
                                        "or video)")
        messages.append({"from": _ROLES[message["role"]], "value": "".join(text)})
    return Dialogue(messages, images, [], str(row.get("data_source") or "pixel_reasoner_sft"),
                    row.get("qid", number), None)


def r1v_cot(file: Path, number: int, row: dict[str, Any], finder: ImageFinder) -> Dialogue:
    where = f"{file}: row {number}"
    values = {}
    for name in ("problem", "thinking", "solution"):
        value = row.get(name)
        if not isinstance(value, str) or not value.strip():
            raise ImportFormatError(f"{where}: field '{name}' is missing or not text")
        values[name] = value
    system = row.get("system") if isinstance(row.get("system"), str) else R1V_SYSTEM_PROMPT
    images, question = [], values["problem"]
    if row.get("image") is not None:
        try:
            images.append(_read(image_value(finder, number, "image", row["image"])))
        except RecipeFormatError as err:
            raise ImportFormatError(str(err)) from None
        question += IMAGE_PLACEHOLDER  # sft.py:128-134: the text part, then the image part
    messages = [{"from": "system", "value": system}, {"from": "human", "value": question},
                {"from": "gpt", "value": f"{values['thinking']}\n\n{values['solution']}"}]
    return Dialogue(messages, images, [], str(row.get("data_source") or "r1v_cot"), number, None)


READERS: dict[str, Callable[[Path, int, dict[str, Any], ImageFinder], Dialogue]] = {
    "mini_o3": mini_o3, "pixel_reasoner": pixel_reasoner, "r1v_cot": r1v_cot,
}
SUFFIXES = {"mini_o3": (".parquet",), "pixel_reasoner": (".json", ".jsonl", ".parquet"),
            "r1v_cot": (".parquet", ".json", ".jsonl")}
"""The files each format's folder is read for."""
REQUIRED_COLUMNS = {"mini_o3": ("conversations", "images"), "pixel_reasoner": ("message_list",),
                    "r1v_cot": ("problem", "thinking", "solution")}
