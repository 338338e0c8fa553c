"""Task records: the one question format every stage reads (Mini-o3's fields, JSONL).

A record asks one question about one or more images (or none: a text-only question)::

    {"doc_id": "synth-train-000001", "images": ["images/000001.png"], "problem": "What colour is ...?",
     "solution": "B", "data_source": "synthetic", "options": ["red", "green", "blue"],
     "category": "colour", "bbox": [0.41, 0.12, 0.44, 0.15]}

`images` are relative to a base directory (the JSONL file's folder unless told otherwise). For choice
questions `options` lists the option texts in letter order (A, B, C, ...) and `solution` is the letter.
`bbox` is the target's ground-truth box, relative [x0, y0, x1, y1] on the first image (synthetic tasks only).
Any bad record fails with a `TaskRecordError` naming the file, the line and the field; no other exception
type leaves `read_tasks`, `parse_json` or `parse_task`.

Policies, one line each:

- Encoding: UTF-8 only; other bytes fail as "file:line: not UTF-8 (byte 0x.. at column N)" (column in bytes).
- A UTF-8 byte-order mark at the start of the file is skipped; CRLF line ends are accepted (lines split on
  LF only, a trailing CR dropped, so U+2028 and other Unicode line breaks inside strings stay text).
- Blank lines are skipped. A file with no records (empty, or blank lines only) reads as an empty list: that is
  what `write_tasks` writes for an empty split (the synthetic generator's `test=0`); a stage that needs records
  refuses an empty list itself (the synth stage does).
- JSON is strict (`parse_json`): NaN, Infinity and -Infinity are refused, and so are numbers that overflow a
  float (1e400); integers longer than MAX_INT_DIGITS (100) digits are refused before Python's int() sees
  them; nesting deeper than MAX_JSON_DEPTH (64) arrays/objects is refused; a key repeated in one object is
  refused naming the key (JSON leaves it undefined and Python would silently keep the last); strings (and
  keys) holding lone UTF-16 surrogates (an escaped "\\ud800") are refused, as they are not Unicode text.
- A record must be a JSON object; fields are validated by `TaskRecord` (pydantic), wrong types and values
  named by field (e.g. `bbox.0`, `images.1`).
- A `doc_id` that repeats an earlier record is refused, naming both lines.
- Image paths (always checked, whether or not `check_images`): an absolute path is refused; then the shared
  rule of `loupe.images.resolve_image_path` applies: an image suffix (case-insensitive), and the path,
  resolved through every symlink (file or folder), must stay inside the base directory. `check_images`
  adds that each file exists. Each failure names the field `images.N`.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from loupe.images import ImageError, resolve_image_path

OPTION_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
IMAGE_PLACEHOLDER = "<image>"
"""Where an image goes in a turn's text (LLaMA-Factory's placeholder; chat templates expand it)."""
MAX_JSON_DEPTH = 64
"""Arrays and objects nested deeper than this are refused (a record needs 3; json itself fails near 1,000)."""
MAX_INT_DIGITS = 100
"""Integers with more digits are refused (any real id or count fits; Python's int() refuses over 4,300)."""


class TaskRecordError(ValueError):
    """A task record that cannot be used; the message names file, line and field."""


class Waypoint(BaseModel):
    """One place a search must look at on its way to the answer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bbox: list[float]
    """Where, relative [x0, y0, x1, y1] on the first image."""
    seen: str = Field(min_length=1)
    """What a look there shows, in words a teacher can say ("a purple pointer to the frame on the left")."""

    @field_validator("bbox")
    @classmethod
    def _relative_box(cls, box: list[float]) -> list[float]:
        if len(box) != 4 or not all(math.isfinite(v) and 0.0 <= v <= 1.0 for v in box) or box[2] <= box[0] \
                or box[3] <= box[1]:
            raise ValueError("must be four numbers in [0, 1] with x0 < x1 and y0 < y1")
        return box


class TaskRecord(BaseModel):
    """One question about one or more images, or about none (text-only)."""

    model_config = ConfigDict(extra="allow", use_attribute_docstrings=True, frozen=True)

    doc_id: str = Field(min_length=1)
    """Unique id of the question within its file."""
    images: list[str] = Field(default_factory=list)
    """Image paths relative to the base directory; the first is the one the question is about. Empty for a
    text-only question (a math word problem, LMM-R1's FRE stage): the model answers from the text alone, and a
    tool call has nothing to crop."""
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
    video: str | None = None
    """A clip the question is about, relative to the base directory: a video file (decoded with PyAV) or a
    folder of frame images. The rollout samples at most `protocol.video_max_frames` frames evenly over it
    (`loupe.video.read_clip`) and shows them as the question's images, one placeholder each, so a video task
    lists no `images` and its `problem` holds no placeholder; `select_frames` and `track_object` work on them.
    A video task's `bbox` is on its first frame."""
    waypoints: list["Waypoint"] | None = None
    """Places to look at, in order, before `bbox` (a pointer task's pointer, loupe.data.zoom_tasks): the search
    path the oracle teacher follows, each with what it shows; None: `bbox` is the only place."""
    tools: bool = True
    """Whether the dialogue offers the tool. False makes the question single-turn, its first turn the last (a call
    in it is not run), as DeepEyes' rows with an empty `env_name` are (verl/workers/agent/parallel_env.py:320-322,
    480-495: no tool is made, and the episode ends after one response); the oracle teacher answers it directly."""
    operation: str | None = None
    """The visual operation that answers the question (a name in loupe.visual_ops: `read_text`, `segment_at`,
    `track_object`), for the oracle teacher, which calls it on `bbox`; None: a crop answers it, or nothing."""
    system: str | None = None
    """The dialogue's system prompt as the publisher's data writes it (DeepEyes' and LMM-R1's chat rows hold
    one), shown instead of the protocol's while `protocol.record_prompts` is on; None: the protocol's."""
    prompt: str | None = None
    """The question turn as the publisher's data writes it, one image placeholder per image (DeepEyes' user
    message: the question and its format instructions), shown verbatim instead of the protocol's rendering of
    `problem` while `protocol.record_prompts` is on. `problem` stays what a judge is asked."""
    source_id: str | None = None
    """The publisher's own id of the question (Mini-o3's doc_id, DeepEyes' extra_info.index, Pixel-Reasoner's
    qid), kept by `loupe data import`, whose `doc_id`s are its own (unique in the folder)."""

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
    def _placeholders_match_the_images(self) -> "TaskRecord":
        # The protocol puts one placeholder per image before a problem holding none, and keeps a problem holding
        # exactly one per image as it is (Mini-o3's records start with "<image>\n"); any other count cannot be
        # matched to the images.
        found = self.problem.count(IMAGE_PLACEHOLDER)
        if found not in (0, len(self.images)) and self.video is None:  # a video's frames: its own check
            raise ValueError(f"problem: holds {found} {IMAGE_PLACEHOLDER} placeholders for {len(self.images)} images; "
                             "give none (one per image is added) or exactly one per image")
        if any(IMAGE_PLACEHOLDER in option for option in self.options or []):
            raise ValueError(f"options: an option may not hold the image placeholder {IMAGE_PLACEHOLDER}")
        return self

    @model_validator(mode="after")
    def _own_prompt_places_every_image(self) -> "TaskRecord":
        if self.prompt is None:
            return self
        if not self.prompt.strip():
            raise ValueError("prompt: an empty question turn")
        if self.video is not None:
            raise ValueError("prompt: a video task's frame count is known only once it is read, so its question "
                             "turn is the protocol's")
        if self.prompt.count(IMAGE_PLACEHOLDER) != len(self.images):
            raise ValueError(f"prompt: holds {self.prompt.count(IMAGE_PLACEHOLDER)} {IMAGE_PLACEHOLDER} placeholders "
                             f"for {len(self.images)} images; a record's own question turn places every image itself")
        return self

    @model_validator(mode="after")
    def _a_video_task_shows_its_frames(self) -> "TaskRecord":
        if self.video is None:
            return self
        if not self.video.strip():
            raise ValueError("video: an empty path")
        if self.images:
            raise ValueError("video: a video task shows its sampled frames as its images; list no 'images'")
        if IMAGE_PLACEHOLDER in self.problem:
            raise ValueError(f"problem: a video task's frame count is known only once it is read; give no "
                             f"{IMAGE_PLACEHOLDER} placeholder (one per frame is added)")
        return self

    @model_validator(mode="after")
    def _bbox_needs_an_image(self) -> "TaskRecord":
        if self.bbox is not None and not self.images and self.video is None:
            raise ValueError("bbox: a text-only task (no images) has no box to hold")
        return self

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
        field = ".".join(str(p) for p in e["loc"])
        message = e["msg"].removeprefix("Value error, ")
        if not field:  # a check across fields says which field it faults as "<field>: ..."
            field, _, message = message.partition(": ") if ": " in message else ("record", "", message)
        parts.append(f"field '{field}': {message}")
    return "; ".join(parts)


def parse_task(data: Any, where: str) -> TaskRecord:
    """Validate one decoded record; `where` is `file:line` for the error message."""
    if not isinstance(data, dict):
        raise TaskRecordError(f"{where}: a task record must be a JSON object, got {type(data).__name__}")
    try:
        return TaskRecord.model_validate(data)
    except ValidationError as err:
        raise TaskRecordError(f"{where}: {_describe(err)}") from None


class _Refused:
    """Stands in for a JSON value parse_json refuses, so the walk after decoding can name its field."""

    def __init__(self, problem: str):
        self.problem = problem


class _ObjectWithRepeatedKey(dict):
    """A decoded JSON object in which `key` appeared more than once."""

    def __init__(self, pairs: list[tuple[str, Any]], key: str):
        super().__init__(pairs)
        self.key = key


def _integer(text: str) -> int | _Refused:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        return _Refused(f"an integer of {digits} digits (at most {MAX_INT_DIGITS} are accepted)")
    return int(text)


def _float(text: str) -> float | _Refused:
    value = float(text)
    return value if math.isfinite(value) else _Refused(f"the number {_short(text)} is out of range")


def _constant(text: str) -> _Refused:
    return _Refused(f"{text} is not a JSON number")


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            return _ObjectWithRepeatedKey(pairs, key)
        seen.add(key)
    return dict(pairs)


def _short(text: str, limit: int = 60) -> str:
    """`text` cut to `limit` characters, so a hostile value cannot flood an error message."""
    return text if len(text) <= limit else text[:limit] + f"... ({len(text):,} characters)"


def _is_unicode(text: str) -> bool:
    """False when `text` holds a lone UTF-16 surrogate (JSON's "\\ud800" escape decodes to one)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _first_problem(value: Any) -> tuple[str, str] | None:
    """(field path, problem) of the first refused part of a decoded JSON value, or None if it is clean."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, _Refused):
            return path, item.problem
        if isinstance(item, str):
            if not _is_unicode(item):
                return path, "text holds a lone UTF-16 surrogate, which is not Unicode"
            continue
        if not isinstance(item, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            return path, f"JSON nested deeper than {MAX_JSON_DEPTH} levels"
        if isinstance(item, _ObjectWithRepeatedKey):
            return f"{path}.{item.key}" if path else item.key, "the key appears more than once in one JSON object"
        children = item.items() if isinstance(item, dict) else enumerate(item)
        for key, child in reversed(list(children)):
            if isinstance(key, str) and not _is_unicode(key):
                return path, "a key holds a lone UTF-16 surrogate, which is not Unicode"
            stack.append((child, f"{path}.{key}" if path else str(key), depth + 1))
    return None


def parse_json(text: str, where: str) -> Any:
    """Decode one JSON text strictly, or raise TaskRecordError naming `where` (and the field, when known).

    Stricter than `json.loads`: NaN, Infinity and numbers overflowing a float are refused; integers over
    MAX_INT_DIGITS digits are refused before int() sees them (it raises ValueError over 4,300); nesting over
    MAX_JSON_DEPTH is refused (json raises RecursionError only near 1,000); a key repeated within one object
    is refused naming it; lone surrogates in strings or keys are refused. Refused numbers and objects are
    decoded to placeholders first and then found by a walk, so the error names their field (`bbox.0`).
    Written on the standard json module's hooks: no well-kept library offers these checks together.
    """
    try:
        value = json.loads(text, parse_int=_integer, parse_float=_float, parse_constant=_constant,
                           object_pairs_hook=_object)
    except json.JSONDecodeError as err:
        raise TaskRecordError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    except RecursionError:
        raise TaskRecordError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    problem = _first_problem(value)
    if problem is not None:
        field, detail = problem
        raise TaskRecordError(f"{where}: field '{_short(field)}': {detail}" if field else f"{where}: {detail}")
    return value


def decode_utf8(data: bytes, where: str) -> str:
    """`data` as text, a leading UTF-8 byte-order mark dropped, or TaskRecordError naming line and column.

    The error reads "`where`:LINE: not UTF-8 (byte 0xNN at column N)", lines and columns counted from 1,
    columns in bytes.
    """
    bom = b"\xef\xbb\xbf"
    skipped = len(bom) if data.startswith(bom) else 0
    try:
        return data[skipped:].decode("utf-8")
    except UnicodeDecodeError as err:
        offset = skipped + err.start
        line = data.count(b"\n", 0, offset) + 1
        column = offset - (data.rfind(b"\n", 0, offset) + 1) + 1
        raise TaskRecordError(f"{where}:{line}: not UTF-8 (byte 0x{data[offset]:02x} at column {column})") from None


def check_image_paths(
    task: TaskRecord, root: str | Path, where: str, must_exist: bool = False, field_name: str | None = None
) -> list[Path]:
    """The resolved files of `task.images` under `root`, or TaskRecordError naming `where` and `images.N`
    (or `field_name`, a reader's own column for a one-image record).

    Refuses absolute paths (a record's paths are relative to its image root), then applies
    `loupe.images.resolve_image_path`: an image suffix, and no escape from `root` by `..` or by a symlink
    (file or folder). With `must_exist`, each file must exist.
    """
    files = []
    for i, image in enumerate(task.images):
        field = field_name or f"images.{i}"
        if Path(image).is_absolute():
            raise TaskRecordError(f"{where}: field '{field}': {_short(image)} is an absolute path; image paths "
                                  f"in a record are relative to the image root {root}")
        try:
            resolved = resolve_image_path(root, image)
        except ImageError as err:
            raise TaskRecordError(f"{where}: field '{field}': {err}") from None
        if must_exist:
            try:
                exists = resolved.is_file()
            except OSError as err:  # e.g. a name too long for the file system, a folder we may not read
                raise TaskRecordError(f"{where}: field '{field}': {_short(image)} cannot be checked "
                                      f"({err.strerror})") from None
            if not exists:
                raise TaskRecordError(f"{where}: field '{field}': {Path(root) / image} does not exist")
        files.append(resolved)
    return files


def read_tasks(path: str | Path, check_images: bool = False, base_dir: str | Path | None = None) -> list[TaskRecord]:
    """Read a JSONL file of task records; image paths must stay inside `base_dir` (default: the file's folder).

    With `check_images`, every image must also exist. The module docstring lists the policies.
    """
    path = Path(path)
    if not path.is_file():
        raise TaskRecordError(f"{path}: task file not found")
    base = Path(base_dir) if base_dir is not None else path.parent
    try:
        data = path.read_bytes()
    except OSError as err:
        raise TaskRecordError(f"{path}: cannot read the task file ({err.strerror})") from None
    records: list[TaskRecord] = []
    seen: dict[str, int] = {}
    # Lines end at LF alone (a CR before it is dropped): str.splitlines would also split inside strings
    # holding U+2028 or U+0085, which JSON allows unescaped.
    for line_no, line in enumerate(decode_utf8(data, str(path)).split("\n"), start=1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        where = f"{path}:{line_no}"
        record = parse_task(parse_json(line, where), where)
        if record.doc_id in seen:
            raise TaskRecordError(
                f"{where}: field 'doc_id': {_short(record.doc_id)!r} repeats the record on line {seen[record.doc_id]}"
            )
        seen[record.doc_id] = line_no
        check_image_paths(record, base, where, must_exist=check_images)
        records.append(record)
    return records


def write_tasks(records: list[TaskRecord], path: str | Path) -> None:
    """Write task records as JSONL atomically (a temporary file renamed into place)."""
    from loupe.io import atomic_write_text

    lines = [json.dumps(r.model_dump(exclude_none=True), ensure_ascii=False) for r in records]
    atomic_write_text(Path(path), "".join(line + "\n" for line in lines))


def chance_rate(records: Sequence[TaskRecord]) -> float:
    """Accuracy of guessing without looking: for free-form records the commonest answer's share within their
    category (the best constant guess for each kind of question, which the question's words tell apart), for
    choice records 1 / option count; averaged over the records."""
    if not records:
        return 0.0
    by_category: dict[str | None, Counter] = {}
    for r in records:
        if not r.is_choice:
            by_category.setdefault(r.category, Counter())[r.solution] += 1
    best_constant = sum(max(answers.values()) for answers in by_category.values())
    choice = sum(1.0 / len(r.options or []) for r in records if r.is_choice)
    return (best_constant + choice) / len(records)
