"""Task records: the one question format every stage reads (Mini-o3's fields, JSONL).

A record asks one question about one or more images::

    {"doc_id": "synth-train-000001", "images": ["images/000001.png"], "problem": "What colour is ...?",
     "solution": "B", "data_source": "synthetic", "options": ["red", "green", "blue"],
     "category": "colour", "bbox": [0.41, 0.12, 0.44, 0.15]}

`images` are relative to a base directory (the JSONL file's folder unless told otherwise). For choice
questions `options` lists the option texts in letter order (A, B, C, ...) and `solution` is the letter.
`bbox` is the target's ground-truth box, relative [x0, y0, x1, y1] on the first image (synthetic tasks only).
Any bad record fails with the file, the line and the field named.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

OPTION_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


class TaskRecordError(ValueError):
    """A task record that cannot be used; the message names file, line and field."""


class TaskRecord(BaseModel):
    """One question about one or more images."""

    model_config = ConfigDict(extra="allow", use_attribute_docstrings=True, frozen=True)

    doc_id: str = Field(min_length=1)
    """Unique id of the question within its file."""
    images: list[str] = Field(min_length=1)
    """Image paths relative to the base directory; the first is the one the question is about."""
    problem: str = Field(min_length=1)
    """The question as the model reads it (without the option list; the protocol renders options)."""
    solution: str = Field(min_length=1)
    """The right answer: an option letter for choice questions, else the free-form answer text."""
    data_source: str = "unknown"
    """Where the question comes from (a benchmark name, `synthetic`)."""
    options: list[str] | None = None
    """Option texts in letter order A, B, C, ...; None for free-form questions."""
    category: str | None = None
    """A benchmark's category, for per-category accuracy."""
    bbox: list[float] | None = None
    """Ground-truth target box, relative [x0, y0, x1, y1] on the first image, when known."""

    @field_validator("bbox")
    @classmethod
    def _bbox_is_a_relative_box(cls, box: list[float] | None) -> list[float] | None:
        if box is None:
            return None
        if len(box) != 4 or not all(math.isfinite(v) and 0.0 <= v <= 1.0 for v in box):
            raise ValueError("must be four finite numbers in [0, 1]")
        if box[2] <= box[0] or box[3] <= box[1]:
            raise ValueError("must satisfy x0 < x1 and y0 < y1")
        return box

    @model_validator(mode="after")
    def _solution_names_an_option(self) -> "TaskRecord":
        if self.options is not None:
            if not 2 <= len(self.options) <= len(OPTION_LETTERS):
                raise ValueError("options: a choice question needs at least 2 options")
            letters = OPTION_LETTERS[: len(self.options)]
            if self.solution not in letters:
                raise ValueError(f"solution: {self.solution!r} is not one of the option letters {letters}")
        return self

    @property
    def is_choice(self) -> bool:
        return self.options is not None

    @property
    def option_letters(self) -> str:
        return OPTION_LETTERS[: len(self.options or [])]

    def answer_text(self) -> str:
        """The right answer in words: the option text for choice questions, the solution otherwise."""
        if self.options is not None:
            return self.options[OPTION_LETTERS.index(self.solution)]
        return self.solution


def _describe(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "record"
        parts.append(f"field '{field}': {e['msg']}")
    return "; ".join(parts)


def parse_task(data: Any, where: str) -> TaskRecord:
    """Validate one decoded record; `where` is `file:line` for the error message."""
    if not isinstance(data, dict):
        raise TaskRecordError(f"{where}: a task record must be a JSON object, got {type(data).__name__}")
    try:
        return TaskRecord.model_validate(data)
    except ValidationError as err:
        raise TaskRecordError(f"{where}: {_describe(err)}") from None


def read_tasks(path: str | Path, check_images: bool = False, base_dir: str | Path | None = None) -> list[TaskRecord]:
    """Read a JSONL file of task records; with `check_images`, every image must exist under `base_dir`."""
    path = Path(path)
    if not path.is_file():
        raise TaskRecordError(f"{path}: task file not found")
    base = Path(base_dir) if base_dir is not None else path.parent
    records: list[TaskRecord] = []
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                data = json.loads(line)
            except json.JSONDecodeError as err:
                raise TaskRecordError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
            record = parse_task(data, where)
            if record.doc_id in seen:
                raise TaskRecordError(
                    f"{where}: field 'doc_id': {record.doc_id!r} repeats the record on line {seen[record.doc_id]}"
                )
            seen[record.doc_id] = line_no
            if check_images:
                for i, image in enumerate(record.images):
                    if not (base / image).is_file():
                        raise TaskRecordError(f"{where}: field 'images.{i}': {base / image} does not exist")
            records.append(record)
    return records


def write_tasks(records: list[TaskRecord], path: str | Path) -> None:
    """Write task records as JSONL atomically (a temporary file renamed into place)."""
    from loupe.io import atomic_write_text

    lines = [json.dumps(r.model_dump(exclude_none=True), ensure_ascii=False) for r in records]
    atomic_write_text(Path(path), "".join(line + "\n" for line in lines))
