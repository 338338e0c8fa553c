"""What every benchmark reader shares (loupe.data.benchmarks): the errors, the `Benchmark` record, finding the
copy a user pointed at, and reading rows into checked task records (ids, options, image paths, placeholders). The
policies are the readers' own, listed in loupe/data/benchmarks.py's docstring."""

from __future__ import annotations

import ast
import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loupe.data.tasks import (
    OPTION_LETTERS,
    TaskRecord,
    TaskRecordError,
    check_image_paths,
    decode_utf8,
    parse_json,
    parse_task,
)
from loupe.protocol import IMAGE_PLACEHOLDER

log = logging.getLogger(__name__)


class BenchmarkFormatError(ValueError):
    """A benchmark file or row that cannot be read; the message names the file, the row or line and the field."""


class BenchmarkNotFoundError(FileNotFoundError):
    """The local copy of a benchmark is not where it was said to be; the message says where to point instead."""


class UnknownBenchmarkError(ValueError):
    """A benchmark name that no reader knows; the message lists the known ones."""


@dataclass(frozen=True)
class Benchmark:
    """One benchmark's questions; every task's relative `images` resolve against `image_root`."""

    name: str
    tasks: list[TaskRecord]
    image_root: Path

    def image_paths(self, task: TaskRecord) -> list[Path]:
        return [self.image_root / image for image in task.images]


BenchmarkReader = Callable[[str, Path, Path], Benchmark]
"""(canonical name, local path, cache dir) -> Benchmark."""


# ---------------------------------------------------------------------------------------------------------------
# Finding the copy: the path given, or a clear word on which path to give instead


def _home(name: str, path: Path, is_home: Callable[[Path], bool], wanted: str) -> Path:
    """`path` when it is the benchmark's folder (`is_home`); else an error naming the folder to give instead.

    A user who points at the folder above the copy (or at a folder inside it, such as its images) is told which
    path to give rather than that nothing is there.
    """
    if is_home(path):
        return path
    children = sorted(d for d in _subfolders(path) if is_home(d))
    if children:
        preferred = [d for d in children if _squash(d.name) == _squash(name)] or children
        found = ", ".join(str(d) for d in preferred[:3])
        raise BenchmarkNotFoundError(f"benchmark {name!r}: {path} holds no {wanted}, but {found} does: give that path")
    if path.parent != path and is_home(path.parent):
        raise BenchmarkNotFoundError(
            f"benchmark {name!r}: {path} is a folder inside the benchmark's copy; give its parent {path.parent}"
        )
    raise BenchmarkNotFoundError(f"benchmark {name!r}: {path} holds no {wanted}")


def _subfolders(path: Path) -> list[Path]:
    try:
        return [d for d in path.iterdir() if d.is_dir()]
    except OSError:
        return []


def _squash(text: str) -> str:
    """A folder or benchmark name without case, dashes and underscores: VisualProbe_Hard ~ visualprobe_hard."""
    return re.sub(r"[-_\s]", "", text.lower())


def _file_in(name: str, path: Path, file_names: tuple[str, ...], suffixes: tuple[str, ...] = (),
             not_these: tuple[str, ...] = ()) -> Path:
    """`path` itself when it is a file; else the first of `file_names` in the benchmark's folder, else its only
    `suffixes` file that is not one of `not_these` (another benchmark's file, which must never stand in)."""
    if path.is_file():
        return path

    def found_in(folder: Path) -> Path | None:
        for file_name in file_names:
            if (folder / file_name).is_file():
                return folder / file_name
        try:
            candidates = [p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in suffixes]
        except OSError:
            return None
        candidates = [p for p in candidates if p.name not in not_these]
        return candidates[0] if len(candidates) == 1 else None

    wanted = " or ".join(file_names + tuple(f"single *{s} file" for s in suffixes))
    if suffixes and path.is_dir():
        present = sorted(p.name for p in path.iterdir() if p.is_file() and p.suffix.lower() in suffixes)
        wanted += f" (found {', '.join(present)})" if present else ""
    home = _home(name, path, lambda folder: found_in(folder) is not None, wanted)
    return found_in(home) or home  # found_in(home) is a file: _home returned it because it is


def _read_text(file: Path) -> str:
    """The file as UTF-8 text (a byte-order mark is allowed); bad bytes are an error naming the line."""
    try:
        data = file.read_bytes()
    except OSError as err:
        raise BenchmarkFormatError(f"{file}: cannot be read ({err.strerror or err})") from None
    try:
        return decode_utf8(data, str(file))
    except TaskRecordError as err:
        raise BenchmarkFormatError(str(err)) from None


def _parse_json(text: str, where: str) -> Any:
    """The task reader's strict JSON (`loupe.data.tasks.parse_json`), its error as a BenchmarkFormatError."""
    try:
        return parse_json(text, where)
    except TaskRecordError as err:
        raise BenchmarkFormatError(str(err)) from None


def _without_placeholders(text: str) -> str:
    """`text` with every image placeholder removed; a line that held only placeholders is dropped."""
    if IMAGE_PLACEHOLDER not in text:
        return text.strip()
    lines = []
    for line in text.splitlines():
        if IMAGE_PLACEHOLDER in line:
            line = re.sub(r"[ \t]{2,}", " ", line.replace(IMAGE_PLACEHOLDER, " ")).strip()
            if not line:
                continue
        lines.append(line)
    return "\n".join(lines).strip()


def _make_task(data: dict[str, Any], where: str, seen: dict[str, str], id_field: str = "doc_id") -> TaskRecord:
    """Validate one record, its question text without image placeholders, and check its id is new; `seen` maps doc
    ids to where they were read."""
    data = dict(data)
    if isinstance(data.get("problem"), str):
        data["problem"] = _without_placeholders(data["problem"])
        if not data["problem"]:
            raise BenchmarkFormatError(f"{where}: field 'problem': no question text besides the image placeholder")
    if isinstance(data.get("options"), list):
        data["options"] = [_without_placeholders(o) if isinstance(o, str) else o for o in data["options"]]
    try:
        task = parse_task(data, where)
    except TaskRecordError as err:
        raise BenchmarkFormatError(str(err)) from None
    if task.doc_id in seen:
        raise BenchmarkFormatError(f"{where}: field '{id_field}': {task.doc_id!r} repeats {seen[task.doc_id]}")
    seen[task.doc_id] = where
    return task


def _check_images(task: TaskRecord, root: Path, where: str, field: str = "images", hint: str = "") -> None:
    """Every image path passes the task reader's rule under `root` (`check_image_paths`) and names a file there.

    `field` is the publisher's column for a one-image record (errors name it); `hint` is added when a file is
    missing (a copy one folder off).
    """
    try:
        check_image_paths(task, root, where, must_exist=True, field_name=None if field == "images" else field)
    except TaskRecordError as err:
        message = str(err)
        raise BenchmarkFormatError(message + (hint if message.endswith("does not exist") else "")) from None


def _required(row: dict[str, Any], field: str, where: str) -> Any:
    value = row.get(field)
    if value is None or (isinstance(value, str) and not value.strip()):
        raise BenchmarkFormatError(f"{where}: field '{field}' is missing or empty")
    return value


def _identifier(value: Any, where: str, field: str) -> str:
    """An id given as a string or an integer (JSON files hold either), as text."""
    if isinstance(value, bool) or not isinstance(value, (str, int)) or not str(value).strip():
        raise BenchmarkFormatError(f"{where}: field '{field}': {value!r} is not a string or integer id")
    return str(value).strip()


def _letter(value: Any, letters: str, where: str, field: str) -> str:
    """The option letter `value` names ("B" or "(B)"), which must be one of `letters`."""
    letter = _text_cell(value).strip("()").strip().upper()
    if len(letter) != 1 or letter not in letters:
        raise BenchmarkFormatError(f"{where}: field '{field}': {value!r} is not one of the option letters {letters}")
    return letter


def _text_cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):  # pandas writes empty cells as NaN
        return ""
    return str(value).strip()


_OPTION_LINE = re.compile(r"^\(([A-Z])\)\s*(.*)$", re.DOTALL)


def _option_lines(lines: list[str], where: str, field: str) -> tuple[int, list[str]]:
    """(index of the first "(A) ..." line, option texts), reading consecutive option lines in letter order."""
    first = next((i for i, line in enumerate(lines) if _OPTION_LINE.match(line)), None)
    if first is None:
        raise BenchmarkFormatError(f"{where}: field '{field}': no '(A) ...' option lines")
    options: list[str] = []
    for line in lines[first:]:
        match = _OPTION_LINE.match(line)
        if match is None:
            break  # what follows the options is an instruction, not part of the question
        due = OPTION_LETTERS[len(options)]
        if match.group(1) != due or not match.group(2).strip():
            raise BenchmarkFormatError(f"{where}: field '{field}': option line {line!r} where ({due}) <text> was due")
        options.append(match.group(2).strip())
        if len(options) == len(OPTION_LETTERS):
            break
    if len(options) < 2:
        raise BenchmarkFormatError(f"{where}: field '{field}': a choice question needs at least 2 options")
    return first, options


def _literal_options(text: str, where: str, field: str) -> list[str]:
    """Option texts from a Python-literal list of "(A) text" strings, read with `ast.literal_eval` (literals only,
    never run as code; VLMEvalKit's MMERealWorld.load_data reads the same cell with `eval`)."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise BenchmarkFormatError(f"{where}: field '{field}': not a Python list literal of '(A) text' strings") from None
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise BenchmarkFormatError(f"{where}: field '{field}': expected a list of '(A) text' strings")
    lines = [v.strip() for v in value]
    if not all(_OPTION_LINE.match(line) for line in lines):
        raise BenchmarkFormatError(f"{where}: field '{field}': every entry must be an option '(A) text'")
    return _option_lines(lines, where, field)[1]


