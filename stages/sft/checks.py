"""Pre-flight checks: every reason LLaMA-Factory would reject, skip or crash on the input, found before training.

LLaMA-Factory meets bad data late and quietly: a sample whose roles do not alternate is skipped with a
warning, a missing image fails mid-preprocessing, and a sample longer than `cutoff_len` is truncated through
its image tokens, which crashes the forward pass with "Image features and image tokens do not match" (the
most asked question about fine-tuning Qwen2-VL). These checks read the same files by LLaMA-Factory's rules and
fail in seconds with the file, the sample and the fix named:

- the base model directory (config, weights, tokenizer, processor);
- `dataset_info.json` declares the dataset as sharegpt with its columns and tags, and its file exists;
- each sample's roles: optional system first, then user/assistant alternating, ending on the assistant;
- each sample's `<image>` placeholders match its `images` list, and every image file opens;
- each sample's token count, text plus image tokens, fits `cutoff_len`.

Image tokens are computed from the image's header only, the way the training run will count them:
LLaMA-Factory first scales the image into `image_min_pixels..image_max_pixels` (truncating sides), then the
model's image processor applies Qwen's `smart_resize` within its own budget; each (patch x merge)^2 block of
the result is one token. Text tokens come from the model's tokenizer on the `qwen2_vl` template's layout,
each turn encoded on its own as LLaMA-Factory does. tests/test_sft_checks.py checks both counts against
LLaMA-Factory's own encoding.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean
from typing import Any

from PIL import Image

from loupe.protocol import IMAGE_PLACEHOLDER
from loupe.tools import PixelBudget, smart_resize

DEFAULT_SYSTEM = "You are a helpful assistant."
"""What the qwen2_vl template puts in the system turn when a sample has none."""
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
SHAREGPT_TAGS = {
    "role_tag": "from",
    "content_tag": "value",
    "user_tag": "human",
    "assistant_tag": "gpt",
    "observation_tag": "observation",
    "function_tag": "function_call",
    "system_tag": "system",
}
"""LLaMA-Factory's defaults for a sharegpt dataset's tags (llamafactory.data.parser.DatasetAttr)."""
ID_FIELDS = ("id", "traj_id", "doc_id", "sample_index")


class InputError(ValueError):
    """Input that would make training fail or go wrong; the message names the file, the sample and the fix."""


@dataclass(frozen=True)
class DatasetSpec:
    """A dataset as dataset_info.json declares it."""

    name: str
    folder: Path
    file: Path
    messages: str
    images: str | None
    tags: dict[str, str]


@dataclass(frozen=True)
class ImageBudget:
    """How the training run sizes images: LLaMA-Factory's pre-resize, then the processor's smart_resize."""

    image_min_pixels: int
    image_max_pixels: int
    processor_budget: PixelBudget
    factor: int
    """Pixels per token side: patch size x spatial merge size (28 for Qwen2-VL and Qwen2.5-VL)."""

    def tokens(self, width: int, height: int) -> int:
        """Image tokens of one width x height image in a training sample."""
        width, height = self.pre_resize(width, height)
        h, w = smart_resize(height, width, self.processor_budget, factor=self.factor)
        return (h // self.factor) * (w // self.factor)

    def pre_resize(self, width: int, height: int) -> tuple[int, int]:
        """LLaMA-Factory's `_preprocess_image` for Qwen2-VL: scale into the budget, sides truncated."""
        if width * height > self.image_max_pixels:
            scale = math.sqrt(self.image_max_pixels / (width * height))
            width, height = int(width * scale), int(height * scale)
        if width * height < self.image_min_pixels:
            scale = math.sqrt(self.image_min_pixels / (width * height))
            width, height = int(width * scale), int(height * scale)
        if min(width, height) < 28:
            width, height = max(width, 28), max(height, 28)
        if width / height > 200:
            width = height * 180
        if height / width > 200:
            height = width * 180
        return width, height

    def with_max_pixels(self, image_max_pixels: int) -> ImageBudget:
        return ImageBudget(self.image_min_pixels, image_max_pixels, self.processor_budget, self.factor)


@dataclass
class SampleTokens:
    text: int
    images: list[int]

    @property
    def total(self) -> int:
        return self.text + sum(self.images)


@dataclass
class PreflightReport:
    """What the checks saw: sizes for the summary and metrics.json."""

    samples: int
    images: int
    assistant_turns: int
    max_tokens: int
    mean_tokens: float
    mean_image_tokens: float
    spec: DatasetSpec
    records: list[Any] = field(repr=False)
    image_sizes: dict[Path, tuple[int, int]] = field(repr=False)
    """(width, height) of every image file the dataset uses."""


def _describe(spec: DatasetSpec, index: int, record: Any) -> str:
    ids = [f"{key}={record[key]!r}" for key in ID_FIELDS if isinstance(record, dict) and key in record]
    return f"{spec.file}: sample {index}" + (f" ({', '.join(ids)})" if ids else "")


def check_base_model(path: Path) -> None:
    """A Hugging Face VLM directory: config, weights, tokenizer and image processor."""
    path = Path(path)
    build_hint = f"pass --model a Hugging Face model directory, or build the embedded one with `loupe model tiny --out {path}`"
    if not path.is_dir():
        raise InputError(f"{path}: base model not found; {build_hint}")
    if not (path / "config.json").is_file():
        raise InputError(f"{path}: not a Hugging Face model directory (no config.json); {build_hint}")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise InputError(f"{path}: the model directory holds no weights (*.safetensors or *.bin); {build_hint}")
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        raise InputError(f"{path}: the model directory holds no tokenizer; save the processor beside the weights")
    if not any((path / name).is_file() for name in ("preprocessor_config.json", "processor_config.json")):
        raise InputError(
            f"{path}: the model directory holds no image processor (preprocessor_config.json or processor_config.json); "
            "save the model's AutoProcessor beside the weights"
        )


def read_dataset_spec(folder: Path, name: str) -> DatasetSpec:
    """The dataset `name` as `folder/dataset_info.json` declares it, checked against what we can train on."""
    folder = Path(folder)
    info_path = folder / "dataset_info.json"
    if not folder.is_dir():
        raise InputError(f"{folder}: dataset folder not found; run the synth stage (python -m stages.synth) first")
    if not info_path.is_file():
        raise InputError(
            f"{info_path}: missing; LLaMA-Factory finds datasets through it. Declare `{name}` there "
            "(formatting sharegpt, columns messages/images, tags from/value/human/gpt/system)"
        )
    try:
        info = json.loads(info_path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise InputError(f"{info_path}: not valid JSON ({err})") from None
    if not isinstance(info, dict) or name not in info:
        known = ", ".join(sorted(info)) if isinstance(info, dict) else "none"
        raise InputError(f"{info_path}: declares no dataset {name!r} (declared: {known}); set sft.dataset to one of them")
    entry = info[name]
    where = f"{info_path}: {name}"
    if not isinstance(entry, dict) or "file_name" not in entry:
        raise InputError(f"{where}: needs a `file_name` (local datasets only; hub and script datasets are not checked)")
    if entry.get("formatting", "alpaca") != "sharegpt":
        raise InputError(f"{where}.formatting: must be sharegpt (got {entry.get('formatting', 'alpaca (the default)')!r})")
    columns = entry.get("columns") or {}
    tags = {**SHAREGPT_TAGS, **{k: v for k, v in (entry.get("tags") or {}).items() if k in SHAREGPT_TAGS}}
    file = folder / entry["file_name"]
    if not file.is_file():
        raise InputError(f"{where}.file_name: {file} not found")
    return DatasetSpec(name, folder, file, columns.get("messages", "conversations"), columns.get("images"), tags)


def read_records(spec: DatasetSpec) -> list[Any]:
    """The dataset file's samples: a JSON list, or JSON lines."""
    text = spec.file.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except ValueError:
        data = []
        for line_no, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    data.append(json.loads(line))
                except ValueError as err:
                    raise InputError(f"{spec.file}:{line_no}: neither a JSON list nor JSON lines ({err})") from None
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list) or not data:
        raise InputError(f"{spec.file}: no samples; the synth stage kept no trajectory (see its metrics.json)")
    return data


def check_conversation(spec: DatasetSpec, index: int, record: Any) -> tuple[str | None, list[dict[str, str]]]:
    """(system, turns) of one sample, by the rules of LLaMA-Factory's sharegpt converter, or InputError."""
    where = _describe(spec, index, record)
    tags = spec.tags
    if not isinstance(record, dict):
        raise InputError(f"{where}: must be a JSON object, got {type(record).__name__}")
    messages = record.get(spec.messages)
    if not isinstance(messages, list) or not messages:
        raise InputError(f"{where}: `{spec.messages}` must be a non-empty list of turns")
    system = None
    turns: list[dict[str, str]] = []
    for position, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get(tags["content_tag"]), str):
            raise InputError(
                f"{where}: {spec.messages}[{position}] must be an object with a string `{tags['content_tag']}`"
            )
        role = message.get(tags["role_tag"])
        content = message[tags["content_tag"]]
        if position == 0 and role == tags["system_tag"]:
            system = content
            if IMAGE_PLACEHOLDER in content:
                raise InputError(f"{where}: the system turn holds {IMAGE_PLACEHOLDER}; images go in human turns")
            continue
        expected = (
            (tags["user_tag"], tags["observation_tag"]) if len(turns) % 2 == 0 else (tags["assistant_tag"], tags["function_tag"])
        )
        if role not in expected:
            known = (tags["user_tag"], tags["assistant_tag"], tags["observation_tag"], tags["function_tag"])
            if role not in known:
                fix = (f"{role!r} is not a role of this dataset; its tags in dataset_info.json name "
                       f"{tags['user_tag']!r}, {tags['assistant_tag']!r} and {tags['system_tag']!r} (first turn only)")
            elif len(turns) % 2 == 1:
                fix = "observations are human turns; merge two human turns in a row into one"
            else:
                fix = f"every {tags['assistant_tag']} turn must follow a {tags['user_tag']} turn"
            raise InputError(
                f"{where}: {spec.messages}[{position}] has role {role!r} where {expected[0]!r} was expected "
                f"(LLaMA-Factory would silently skip this sample); {fix}"
            )
        kind = {tags["user_tag"]: "user", tags["observation_tag"]: "observation"}.get(role, "assistant")
        turns.append({"role": kind, "content": content})
    if not turns or len(turns) % 2:
        raise InputError(
            f"{where}: must end on a {tags['assistant_tag']!r} turn (the model's), after alternating "
            f"{tags['user_tag']}/{tags['assistant_tag']} turns; LLaMA-Factory would silently skip it"
        )
    return system, turns


def _image_paths(spec: DatasetSpec, index: int, record: dict, turns: list[dict[str, str]]) -> list[Path]:
    where = _describe(spec, index, record)
    images = record.get(spec.images, []) if spec.images else []
    if images is None:
        images = []
    if isinstance(images, str):
        images = [images]
    if not isinstance(images, list) or not all(isinstance(p, str) for p in images):
        raise InputError(f"{where}: `{spec.images}` must be a list of image paths")
    placeholders = sum(turn["content"].count(IMAGE_PLACEHOLDER) for turn in turns)
    if placeholders != len(images):
        column = f"`{spec.images}`" if spec.images else "an images column (none is declared in dataset_info.json)"
        raise InputError(
            f"{where}: {placeholders} {IMAGE_PLACEHOLDER} placeholders but {len(images)} images in {column}; "
            f"each {IMAGE_PLACEHOLDER} needs exactly one image path, in order"
        )
    return [Path(p) if Path(p).is_absolute() else spec.folder / p for p in images]


def _image_size(path: Path, where: str, cache: dict[Path, tuple[int, int]]) -> tuple[int, int]:
    if path not in cache:
        if not path.is_file():
            raise InputError(f"{where}: image {path} not found (paths are relative to the dataset folder {path.parent})")
        try:
            with Image.open(path) as img:
                cache[path] = img.size
        except (OSError, SyntaxError, ValueError) as err:
            raise InputError(f"{where}: image {path} cannot be read ({err})") from None
    return cache[path]


def image_budget(processor: Any, image_min_pixels: int, image_max_pixels: int) -> ImageBudget:
    """The budget of a loaded AutoProcessor's image processor, with LLaMA-Factory's pre-resize limits."""
    image_processor = processor.image_processor
    size = getattr(image_processor, "size", None) or {}
    get = size.get if isinstance(size, dict) else (lambda key, default=None: getattr(size, key, default))
    low = get("shortest_edge") or getattr(image_processor, "min_pixels", None) or 56 * 56
    high = get("longest_edge") or getattr(image_processor, "max_pixels", None) or 28 * 28 * 1280
    factor = int(image_processor.patch_size) * int(getattr(image_processor, "merge_size", 2))
    return ImageBudget(image_min_pixels, image_max_pixels, PixelBudget(int(low), int(high)), factor)


def _text_pieces(system: str | None, turns: list[dict[str, str]]) -> tuple[list[str], int]:
    """The qwen2_vl template's pieces (LLaMA-Factory encodes each on its own) and the sample's image count."""
    image_text = VISION_START + IMAGE_PAD + VISION_END
    pieces = [f"<|im_start|>system\n{system or DEFAULT_SYSTEM}<|im_end|>\n"]
    images = 0
    for turn in turns:
        content = turn["content"]
        images += content.count(IMAGE_PLACEHOLDER)
        content = content.replace(IMAGE_PLACEHOLDER, image_text)
        if turn["role"] == "user":
            pieces.append(f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n")
        elif turn["role"] == "observation":
            pieces.append(f"<|im_start|>user\n<tool_response>\n{content}\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
        else:
            pieces.append(f"{content}<|im_end|>\n")
    return pieces, images


def count_tokens(tokenizer: Any, samples: list[tuple[str | None, list[dict[str, str]], list[tuple[int, int]]]], budget: ImageBudget) -> list[SampleTokens]:
    """Text and image tokens of each (system, turns, image sizes) sample, as the training run will see it."""
    flat: list[str] = []
    spans: list[tuple[int, int, int]] = []
    for system, turns, _ in samples:
        pieces, images = _text_pieces(system, turns)
        spans.append((len(flat), len(flat) + len(pieces), images))
        flat += pieces
    lengths = [len(ids) for ids in tokenizer(flat, add_special_tokens=False)["input_ids"]] if flat else []
    out = []
    for (start, end, images), (_, _, sizes) in zip(spans, samples):
        # Each image was written as one <|image_pad|>: the processor repeats it once per token.
        out.append(SampleTokens(text=sum(lengths[start:end]) - images, images=[budget.tokens(w, h) for w, h in sizes]))
    return out


def _fitting_max_pixels(tokens: SampleTokens, sizes: list[tuple[int, int]], budget: ImageBudget, cutoff: int) -> int | None:
    """The largest image_max_pixels (a multiple of factor^2) at which the sample fits cutoff, or None."""
    unit = budget.factor * budget.factor
    low, high = 1, budget.image_max_pixels // unit
    best = None
    while low <= high:
        middle = (low + high) // 2
        trial = budget.with_max_pixels(max(middle * unit, budget.image_min_pixels))
        if tokens.text + sum(trial.tokens(w, h) for w, h in sizes) <= cutoff:
            best, low = middle * unit, middle + 1
        else:
            high = middle - 1
    return best if best is not None and best >= budget.image_min_pixels else None


def preflight(model_path: Path, dataset_dir: Path, dataset: str, cutoff_len: int, image_min_pixels: int,
              image_max_pixels: int) -> PreflightReport:
    """Run every check; raises InputError at the first problem, else returns what it measured."""
    check_base_model(model_path)
    spec = read_dataset_spec(dataset_dir, dataset)
    records = read_records(spec)
    sizes_cache: dict[Path, tuple[int, int]] = {}
    samples = []
    for index, record in enumerate(records):
        system, turns = check_conversation(spec, index, record)
        paths = _image_paths(spec, index, record, turns)
        where = _describe(spec, index, record)
        samples.append((system, turns, [_image_size(p, where, sizes_cache) for p in paths]))

    from loupe.models import load_processor

    processor = load_processor(model_path)
    budget = image_budget(processor, image_min_pixels, image_max_pixels)
    counts = count_tokens(processor.tokenizer, samples, budget)
    over = [i for i, c in enumerate(counts) if c.total > cutoff_len]
    if over:
        worst = max(over, key=lambda i: counts[i].total)
        tokens, sizes = counts[worst], samples[worst][2]
        fixes = [f"raise sft.cutoff_len to at least {max(counts[i].total for i in over)}"]
        fitting = _fitting_max_pixels(tokens, sizes, budget, cutoff_len)
        if fitting is not None and sizes:
            fixes.append(f"lower protocol.max_pixels to {fitting} or less")
        fixes.append("or drop the longest trajectories (fewer turns in synth)")
        raise InputError(
            f"{_describe(spec, worst, records[worst])}: needs {tokens.total} tokens ({tokens.text} text, "
            f"{sum(tokens.images)} for {len(tokens.images)} images at image_max_pixels={image_max_pixels}) but "
            f"sft.cutoff_len is {cutoff_len}; {len(over)} of {len(records)} samples are over. LLaMA-Factory would "
            f"cut them through their image tokens and fail with 'Image features and image tokens do not match'. "
            f"Fix: {'; '.join(fixes)}"
        )
    return PreflightReport(
        samples=len(records),
        images=sum(len(s[2]) for s in samples),
        assistant_turns=sum(1 for _, turns, _ in samples for t in turns if t["role"] == "assistant"),
        max_tokens=max(c.total for c in counts),
        mean_tokens=mean(c.total for c in counts),
        mean_image_tokens=mean(sum(c.images) for c in counts),
        spec=spec,
        records=records,
        image_sizes=sizes_cache,
    )
