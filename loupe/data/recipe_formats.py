"""The seeds' published data sets, read into a Loupe task folder (`loupe data import`).

Each reader follows the publisher's own loader, not a reading of a sample:

- `r1v`: R1-V's training sets on the Hugging Face hub (`leonardPKU/clevr_cogen_a_train`,
  `leonardPKU/GEOQA_R1V_Train_8K`): parquet with an `image` column (the `datasets` Image feature: a struct of
  `bytes` and `path`), `problem`, and `solution` written `<answer> 3 </answer>`; R1-V's
  `src/r1-v/src/open_r1/grpo.py` branches on whether `image` is a column (text-only sets have none) and its
  `accuracy_reward` strips the tags from the solution.
- `r1v_eval`: R1-V's test prompts (`src/eval/prompts/superclevr_test200_counting_problems.jsonl`,
  `geoqa_test_prompts.jsonl`): JSONL of `image_path` (relative to the file's folder, as its
  `src/eval/test_qwen2vl_*.py` scripts open it), `question`, `ground_truth` (an int for counting, text like
  `140°` for GeoQA).
- `easyr1`: EasyR1's data sets (`hiyouga/geometry3k`): parquet or JSON(L) rows with `problem` (holding one
  `<image>` per image), `answer` and `images`, a list of the `datasets` Image struct or of paths relative to the
  file (`verl/utils/dataset.py`, `RLHFDataset` with its `prompt_key`, `answer_key` and `image_key` defaults).
- `lmm_r1`: LMM-R1's JSONL (`examples/data/test_message.jsonl`): `message`, an OpenAI message list *stringified*
  (README: "message is a stringfied list"), with images as `{"type": "image", "image": "file:///path"}` or a
  bare path, and `answer` (`$\\boxed{60}$`); its `openrlhf/models/lmm_kits/base/data_processor.py` parses the
  string with `json.loads`. A system message is kept on the record (`system`) for the record's own prompt.

Images inside a file (parquet bytes) are written out; images named by path are copied; both land under
`<out>/images/<split>/`, so the folder is self-contained like every task folder (loupe.data.tasks refuses
paths outside it). A path that does not exist where written (LMM-R1's example names
`/root/projects/OpenRLHF/data/test//images/1.jpg`) is looked for by its trailing components beside the data
file. A row that cannot be read fails with the file, the row and the field named.
"""

from __future__ import annotations

import io
import json
import random
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from PIL import Image

from loupe.data.tasks import IMAGE_PLACEHOLDER, TaskRecord, TaskRecordError, write_tasks
from loupe.images import image_cell
from loupe.io import atomic_directory

RecipeFormat = Literal["r1v", "r1v_eval", "easyr1", "lmm_r1"]
FORMATS: tuple[str, ...] = ("r1v", "r1v_eval", "easyr1", "lmm_r1")


@dataclass
class RawTask:
    """One row, before its images are written into the task folder."""

    problem: str
    solution: str
    images: list[bytes | Path] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


class RecipeFormatError(TaskRecordError):
    """A row of a published data set that cannot be read; the message names file, row and field."""


def _rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row number, row) of a parquet, JSON-list or JSONL file; rows count from 1."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        number = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=256):
            for row in batch.to_pylist():
                number += 1
                yield number, row
        return
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        for number, row in enumerate(json.loads(text), 1):
            yield number, row
        return
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as err:
                raise RecipeFormatError(f"{path}:{number}: not JSON ({err.msg} at column {err.colno})") from None


def _field(path: Path, number: int, row: dict[str, Any], name: str, kinds: tuple[type, ...] = (str,)) -> Any:
    if not isinstance(row, dict):
        raise RecipeFormatError(f"{path}:{number}: a row must be an object, not {type(row).__name__}")
    if name not in row or row[name] is None:
        raise RecipeFormatError(f"{path}:{number}: field {name!r} is missing (fields: {sorted(row)})")
    value = row[name]
    if not isinstance(value, kinds) or isinstance(value, bool):
        raise RecipeFormatError(f"{path}:{number}: field {name!r} is {type(value).__name__}, expected "
                                f"{' or '.join(k.__name__ for k in kinds)}")
    return value


def _image(path: Path, number: int, name: str, value: Any) -> bytes | Path:
    """An image cell (`loupe.images.image_cell`): its bytes, or the file its path names (relative to the file)."""
    value = image_cell(value)
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return _local_path(path, number, name, value)
    raise RecipeFormatError(f"{path}:{number}: field {name!r} holds no image (neither bytes nor a path)")


def _local_path(path: Path, number: int, name: str, text: str) -> Path:
    """The file an image path names: as written, else relative to the data file, else its trailing components
    beside the data file (paths written on the publisher's machine)."""
    text = text.removeprefix("file://")
    written = Path(text)
    candidates = [written] if written.is_absolute() else [path.parent / written]
    parts = [p for p in written.parts if p not in ("/", "", ".")]
    candidates += [path.parent.joinpath(*parts[k:]) for k in range(1, len(parts))]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise RecipeFormatError(f"{path}:{number}: field {name!r}: image {text!r} not found (looked for "
                            f"{candidates[0]} and its trailing parts under {path.parent})")


def read_r1v(path: Path) -> Iterator[RawTask]:
    for number, row in _rows(path):
        problem = _field(path, number, row, "problem")
        solution = _field(path, number, row, "solution", (str, int, float))
        images = [_image(path, number, "image", row["image"])] if row.get("image") is not None else []
        yield RawTask(problem, str(solution), images)


def read_r1v_eval(path: Path) -> Iterator[RawTask]:
    for number, row in _rows(path):
        question = _field(path, number, row, "question")
        truth = _field(path, number, row, "ground_truth", (str, int, float))
        image = _local_path(path, number, "image_path", _field(path, number, row, "image_path"))
        yield RawTask(question, str(truth), [image])


def read_easyr1(path: Path, prompt_key: str = "problem", answer_key: str = "answer",
                image_key: str = "images") -> Iterator[RawTask]:
    for number, row in _rows(path):
        problem = _field(path, number, row, prompt_key)
        answer = _field(path, number, row, answer_key, (str, int, float))
        cells = row.get(image_key) or []
        if not isinstance(cells, list):
            cells = [cells]
        images = [_image(path, number, f"{image_key}.{k}", cell) for k, cell in enumerate(cells)]
        yield RawTask(problem, str(answer), images)


def read_lmm_r1(path: Path, input_key: str = "message", label_key: str = "answer") -> Iterator[RawTask]:
    for number, row in _rows(path):
        raw = _field(path, number, row, input_key, (str, list))
        try:
            messages = json.loads(raw) if isinstance(raw, str) else raw
        except json.JSONDecodeError as err:
            raise RecipeFormatError(f"{path}:{number}: field {input_key!r} is not a JSON message list "
                                    f"({err.msg})") from None
        answer = _field(path, number, row, label_key, (str, int, float))
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
                    images.append(_image(path, number, f"{where}.image", part.get("image")))
                    texts.append(IMAGE_PLACEHOLDER)
        if not texts:
            raise RecipeFormatError(f"{path}:{number}: field {input_key!r} holds no user message")
        problem = "".join(texts).strip()
        if images and problem.count(IMAGE_PLACEHOLDER) != len(images):
            problem = problem.replace(IMAGE_PLACEHOLDER, "")
        yield RawTask(problem, str(answer), images, {"system": system} if system else {})


READERS = {"r1v": read_r1v, "r1v_eval": read_r1v_eval, "easyr1": read_easyr1, "lmm_r1": read_lmm_r1}


def _image_suffix(data: bytes) -> str:
    with Image.open(io.BytesIO(data)) as image:
        return {"PNG": ".png", "JPEG": ".jpg", "WEBP": ".webp", "GIF": ".gif", "BMP": ".bmp"}.get(image.format, ".png")


def held_out_count(val_size: float, rows: int) -> int:
    """Rows a `val_size` holds out of `rows`: a share when below 1 (at least one row), else a count."""
    if val_size < 0:
        raise ValueError(f"val size {val_size}: give a share in [0, 1) or a row count")
    count = max(1, round(val_size * rows)) if 0 < val_size < 1 else int(val_size)
    if count >= rows:
        raise ValueError(f"val size {val_size}: {count} rows held out of {rows} leaves no training rows")
    return count


def import_tasks(format: str, sources: dict[str, Path], out_dir: Path, data_source: str | None = None,
                 limit: int | None = None, val_size: float = 0.0, seed: int = 0) -> dict[str, Path]:
    """Read each split's published file with `format`'s reader into the task folder `out_dir`
    (`<split>.jsonl` and `images/<split>/`), replaced whole and atomically; returns {split: jsonl path}.

    Without a `val` source, `val_size` rows of the train split (a share below 1, else a count) are held out as
    `val.jsonl`, drawn with `random.Random(seed)`: the rl stage validates on it. The held-out records keep
    their `train-NNNNNN` ids and images, so each still names its source row."""
    if format not in READERS:
        raise ValueError(f"unknown data format {format!r}; known: {', '.join(FORMATS)}")
    written: dict[str, Path] = {}
    with atomic_directory(Path(out_dir)) as tmp:
        for split, source in sources.items():
            source = Path(source)
            if not source.is_file():
                raise FileNotFoundError(f"{split}: {source} is not a file")
            folder = tmp / "images" / split
            folder.mkdir(parents=True)
            records = []
            for index, raw in enumerate(READERS[format](source)):
                if limit is not None and index >= limit:
                    break
                names = []
                for k, image in enumerate(raw.images):
                    if isinstance(image, bytes):
                        name = f"{index:06d}_{k}{_image_suffix(image)}"
                        (folder / name).write_bytes(image)
                    else:
                        name = f"{index:06d}_{k}{image.suffix.lower() or '.png'}"
                        shutil.copyfile(image, folder / name)
                    names.append(f"images/{split}/{name}")
                try:
                    records.append(TaskRecord(doc_id=f"{split}-{index:06d}", images=names, problem=raw.problem,
                                              solution=raw.solution, data_source=data_source or format,
                                              **raw.extra))
                except ValueError as err:
                    raise RecipeFormatError(f"{source}: row {index + 1}: {err}") from None
            if split == "train" and "val" not in sources and val_size:
                held = set(random.Random(seed).sample(range(len(records)), held_out_count(val_size, len(records))))
                write_tasks([r for i, r in enumerate(records) if i in held], tmp / "val.jsonl")
                written["val"] = Path(out_dir) / "val.jsonl"
                records = [r for i, r in enumerate(records) if i not in held]
            write_tasks(records, tmp / f"{split}.jsonl")
            written[split] = Path(out_dir) / f"{split}.jsonl"
    return written
