"""Benchmark readers: turn local copies of the published evaluation sets into Loupe task records.

    benchmark = load_benchmark("vstar", "/data/vstar_bench", cache_dir="cache/benchmarks")
    image_path = benchmark.image_root / benchmark.tasks[0].images[0]

Formats, as published (nothing is downloaded here):
- `synthetic`: a folder holding `test.jsonl`, or a JSONL file, of task records (images relative to its folder).
- `vstar` (V* Bench): a folder with `test_questions.jsonl` (`image`, `text`, `category`, `question_id`, `label`);
  the "(A) ..." lines of `text` become the options and the instruction after them is dropped.
- `hrbench4k`, `hrbench8k`: HR-Bench TSV or parquet (`index, question, A-D, answer, category, cycle_category,
  image`); `mme_realworld_lite`: VLMEvalKit's TSV (`A`-`E` or `multi-choice options`, `l2-category`). Images are
  base64, decoded into `cache_dir/<benchmark>/<index>.<ext>`; a file already holding the same bytes is left alone.
- `visualprobe_easy`, `_medium`, `_hard`: a folder with `val.json` (JSON list or JSONL) of Mini-o3 task records.

A missing path, an unknown name or a malformed row fails at once, naming the file, the row or line and the field.
"""

from __future__ import annotations

import base64
import binascii
import csv
import io
import json
import logging
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loupe.data.tasks import OPTION_LETTERS, TaskRecord, TaskRecordError, parse_task, read_tasks
from loupe.io import atomic_write_bytes

log = logging.getLogger(__name__)


class BenchmarkFormatError(ValueError):
    """A benchmark file or row that cannot be read; the message names the file, the row or line and the field."""


class BenchmarkNotFoundError(FileNotFoundError):
    """The local copy of a benchmark is not where it was said to be."""


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


def load_benchmark(name: str, path: str | Path, cache_dir: str | Path) -> Benchmark:
    """Read benchmark `name` from its local copy at `path`; decoded images go under `cache_dir/<name>/`."""
    key = name.strip().lower().replace("-", "_")
    if key not in BENCHMARKS:
        raise UnknownBenchmarkError(f"unknown benchmark {name!r}; known benchmarks: {', '.join(sorted(BENCHMARKS))}")
    path = Path(path)
    if not path.exists():
        raise BenchmarkNotFoundError(f"benchmark {key!r}: {path} does not exist")
    benchmark = BENCHMARKS[key](key, path, Path(cache_dir))
    if not benchmark.tasks:
        raise BenchmarkFormatError(f"benchmark {key!r}: {path} holds no questions")
    log.info("benchmark %s: %d questions from %s", key, len(benchmark.tasks), path)
    return benchmark


# ---------------------------------------------------------------------------------------------------------------
# Shared helpers


def _file_in(name: str, path: Path, file_names: tuple[str, ...], suffixes: tuple[str, ...] = ()) -> Path:
    """`path` itself when it is a file; else the first of `file_names` inside it, else its only `suffixes` file."""
    if path.is_file():
        return path
    for file_name in file_names:
        if (path / file_name).is_file():
            return path / file_name
    candidates = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in suffixes)
    if len(candidates) == 1:
        return candidates[0]
    wanted = " or ".join(file_names + tuple(f"one *{s} file" for s in suffixes))
    found = f" (found {', '.join(p.name for p in candidates)})" if candidates else ""
    raise BenchmarkNotFoundError(f"benchmark {name!r}: {path} holds no {wanted}{found}")


def _make_task(data: dict[str, Any], where: str, seen: dict[str, str], id_field: str = "doc_id") -> TaskRecord:
    """Validate one record and check its id is new; `seen` maps doc ids to where they were read."""
    try:
        task = parse_task(data, where)
    except TaskRecordError as err:
        raise BenchmarkFormatError(str(err)) from None
    if task.doc_id in seen:
        raise BenchmarkFormatError(f"{where}: field '{id_field}': {task.doc_id!r} repeats {seen[task.doc_id]}")
    seen[task.doc_id] = where
    return task


def _check_images(task: TaskRecord, base: Path, where: str, field: str = "images") -> None:
    for i, image in enumerate(task.images):
        if not (base / image).is_file():
            name = field if field != "images" else f"images.{i}"
            raise BenchmarkFormatError(f"{where}: field '{name}': {base / image} does not exist")


def _required(row: dict[str, Any], field: str, where: str) -> Any:
    value = row.get(field)
    if value is None or (isinstance(value, str) and not value.strip()):
        raise BenchmarkFormatError(f"{where}: field '{field}' is missing or empty")
    return value


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


_OPTION_LINE = re.compile(r"^\(([A-Z])\)\s*(.*)$")


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
    if len(options) < 2:
        raise BenchmarkFormatError(f"{where}: field '{field}': a choice question needs at least 2 options")
    return first, options


# ---------------------------------------------------------------------------------------------------------------
# JSON readers: synthetic, V* Bench, VisualProbe


def _json_records(file: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, record) for a JSON list (`file: record N`) or a JSONL file (`file:N`) of JSON objects."""
    for where, record in _json_values(file):
        if not isinstance(record, dict):
            raise BenchmarkFormatError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
        yield where, record


def _json_values(file: Path) -> Iterator[tuple[str, Any]]:
    text = file.read_text(encoding="utf-8-sig")
    if file.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as err:
            raise BenchmarkFormatError(f"{file}:{err.lineno}: not valid JSON ({err.msg})") from None
        for n, record in enumerate(records, start=1):
            yield f"{file}: record {n}", record
        return
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as err:
            raise BenchmarkFormatError(f"{file}:{line_no}: not valid JSON ({err.msg} at column {err.colno})") from None
        yield f"{file}:{line_no}", value


def _read_synthetic(name: str, path: Path, cache_dir: Path) -> Benchmark:
    file = _file_in(name, path, ("test.jsonl",))
    try:
        tasks = read_tasks(file, check_images=True)
    except TaskRecordError as err:
        raise BenchmarkFormatError(str(err)) from None
    # Synthetic records carry their own doc ids; only the source is set, so reports group by benchmark name.
    return Benchmark(name, [task.model_copy(update={"data_source": name}) for task in tasks], file.parent)


def _read_vstar(name: str, path: Path, cache_dir: Path) -> Benchmark:
    file = _file_in(name, path, ("test_questions.jsonl",))
    tasks: list[TaskRecord] = []
    seen: dict[str, str] = {}
    for where, row in _json_records(file):
        image, text = _required(row, "image", where), _required(row, "text", where)
        question_id = _required(row, "question_id", where)
        lines = [line.strip() for line in str(text).splitlines()]
        first, options = _option_lines(lines, where, "text")
        problem = "\n".join(lines[:first]).strip()
        if not problem:
            raise BenchmarkFormatError(f"{where}: field 'text': no question before the options")
        data = {
            "doc_id": f"{name}-{question_id}",
            "images": [str(image)],
            "problem": problem,
            "options": options,
            "solution": _letter(row.get("label"), OPTION_LETTERS[: len(options)], where, "label"),
            "data_source": name,
            "category": _text_cell(row.get("category")) or None,
        }
        task = _make_task(data, where, seen, id_field="question_id")
        _check_images(task, file.parent, where, field="image")
        tasks.append(task)
    return Benchmark(name, tasks, file.parent)


def _read_visualprobe(name: str, path: Path, cache_dir: Path) -> Benchmark:
    file = _file_in(name, path, ("val.json", "val.jsonl"), suffixes=(".json", ".jsonl"))
    tasks: list[TaskRecord] = []
    seen: dict[str, str] = {}
    for where, record in _json_records(file):
        data = dict(record)
        # Mini-o3's files may hold numeric ids and answers and a bare image path; records want strings and a list.
        data["doc_id"] = f"{name}-{_required(data, 'doc_id', where)}"
        if isinstance(data.get("images"), str):
            data["images"] = [data["images"]]
        if isinstance(data.get("solution"), (int, float)) and not isinstance(data["solution"], bool):
            data["solution"] = str(data["solution"])
        data["data_source"] = name
        task = _make_task(data, where, seen)
        _check_images(task, file.parent, where)
        tasks.append(task)
    return Benchmark(name, tasks, file.parent)


# ---------------------------------------------------------------------------------------------------------------
# Table readers with base64 images: HR-Bench, MME-RealWorld-Lite


def _tsv_rows(file: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    # One cell holds a whole base64 image, far past csv's 128 KiB default; 2**31 - 1 fits a C long everywhere.
    old_limit = csv.field_size_limit(2**31 - 1)
    try:
        with file.open(encoding="utf-8-sig", newline="") as f:
            reader = csv.DictReader(f, delimiter="\t")
            for n, row in enumerate(reader, start=1):
                where = f"{file}: row {n} (line {reader.line_num})"
                if None in row:
                    raise BenchmarkFormatError(f"{where}: more cells than the header has columns")
                yield where, row
    finally:
        csv.field_size_limit(old_limit)


def _parquet_rows(file: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"{file}: reading parquet needs pyarrow (pip install pyarrow); or use the TSV") from None
    try:
        parquet = pq.ParquetFile(file)
    except Exception as err:  # pyarrow's own error types; the file name is what the reader needs
        raise BenchmarkFormatError(f"{file}: not a readable parquet file ({err})") from None
    n = 0
    for batch in parquet.iter_batches(batch_size=32):  # batches keep a multi-GB file out of memory
        for row in batch.to_pylist():
            n += 1
            yield f"{file}: row {n}", row


_TABLE_FILES = {
    "hrbench4k": ("hr_bench_4k.parquet", "hr_bench_4k.tsv"),
    "hrbench8k": ("hr_bench_8k.parquet", "hr_bench_8k.tsv"),
    "mme_realworld_lite": ("MME-RealWorld-Lite.tsv",),
}
_TABLE_COLUMNS = ("index", "question", "answer", "image")
_EXTRA_COLUMNS = {"cycle_category": "cycle_category", "l2-category": "l2_category"}
_SAFE_INDEX = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def _table_options(row: dict[str, Any], where: str) -> list[str]:
    """Option texts from the A, B, ... columns (trailing empty cells dropped), else from `multi-choice options`."""
    letters = ""
    for letter in OPTION_LETTERS:
        if letter not in row:
            break
        letters += letter
    if not letters:
        text = _text_cell(row.get("multi-choice options"))
        return _option_lines([line.strip() for line in text.splitlines()], where, "multi-choice options")[1]
    cells = [_text_cell(row[letter]) for letter in letters]
    while cells and not cells[-1]:
        cells.pop()
    for letter, cell in zip(letters, cells, strict=False):
        if not cell:
            raise BenchmarkFormatError(f"{where}: field '{letter}' is empty but a later option is not")
    if len(cells) < 2:
        raise BenchmarkFormatError(f"{where}: field '{letters[0]}': a choice question needs at least 2 options")
    return cells


def _image_cell(value: Any, where: str) -> bytes | str:
    """The image bytes in a cell, or (a str) the index of another row whose image this row shares.

    VLMEvalKit's TSVs store a repeated image once and put the owning row's index in the other rows' cells.
    """
    if isinstance(value, dict):  # a Hugging Face Image feature in parquet: {"bytes": ..., "path": ...}
        value = value.get("bytes")
    if isinstance(value, (bytes, bytearray)) and value:
        return bytes(value)
    text = "".join(_text_cell(value).split())
    if not text:
        raise BenchmarkFormatError(f"{where}: field 'image' is missing or empty")
    if len(text) <= 64:
        return text
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as err:
        raise BenchmarkFormatError(f"{where}: field 'image': not valid base64 ({err})") from None


def _image_extension(data: bytes, where: str) -> str:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:  # reads the header only
            kind = image.format or ""
    except Exception as err:  # PIL raises many types for data that is not an image
        raise BenchmarkFormatError(f"{where}: field 'image': decoded bytes are not an image ({err})") from None
    return {"JPEG": "jpg", "TIFF": "tif"}.get(kind, kind.lower())


def _cache_image(data: bytes, target: Path, where: str) -> bool:
    """Write `data` to `target` unless the same bytes are already there; True when it wrote."""
    if target.is_file() and target.stat().st_size == len(data) and target.read_bytes() == data:
        return False
    from PIL import Image

    try:  # checked when written: a cached file holding the same bytes was checked then
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
    except Exception as err:  # PIL raises many types for broken data
        raise BenchmarkFormatError(f"{where}: field 'image': the image does not decode ({err})") from None
    atomic_write_bytes(target, data)
    return True


def _read_base64_table(name: str, path: Path, cache_dir: Path) -> Benchmark:
    file = _file_in(name, path, _TABLE_FILES.get(name, ()), suffixes=(".tsv", ".parquet"))
    rows = _parquet_rows(file) if file.suffix.lower() == ".parquet" else _tsv_rows(file)
    image_root = cache_dir / name
    drafts: list[tuple[dict[str, Any], str]] = []
    shared: list[tuple[dict[str, Any], str, str]] = []  # (draft, index it shares the image of, where)
    image_of_index: dict[str, str] = {}
    row_of_index: dict[str, str] = {}
    written = 0
    for where, row in rows:
        missing = [c for c in _TABLE_COLUMNS if c not in row]
        if "A" not in row and "multi-choice options" not in row:
            missing.append("A")
        if missing:
            raise BenchmarkFormatError(
                f"{file}: column(s) {', '.join(repr(c) for c in missing)} missing (columns: {', '.join(row)})"
            )
        index = _text_cell(row["index"])
        if not _SAFE_INDEX.match(index):  # it becomes a file name
            raise BenchmarkFormatError(f"{where}: field 'index': {index!r} is empty or not usable as a file name")
        if index in row_of_index:
            raise BenchmarkFormatError(f"{where}: field 'index': {index!r} repeats {row_of_index[index]}")
        row_of_index[index] = where
        where = f"{where}, index {index}"
        options = _table_options(row, where)
        draft: dict[str, Any] = {
            "doc_id": f"{name}-{index}",
            "problem": _text_cell(_required(row, "question", where)),
            "options": options,
            "solution": _letter(row["answer"], OPTION_LETTERS[: len(options)], where, "answer"),
            "data_source": name,
            "category": _text_cell(row.get("category")) or None,
        }
        for column, field in _EXTRA_COLUMNS.items():
            if _text_cell(row.get(column)):
                draft[field] = _text_cell(row[column])
        image = _image_cell(row["image"], where)
        if isinstance(image, str):
            shared.append((draft, image, where))
        else:
            file_name = f"{index}.{_image_extension(image, where)}"
            written += _cache_image(image, image_root / file_name, where)
            image_of_index[index] = file_name
            draft["images"] = [file_name]
        drafts.append((draft, where))
    for draft, owner, where in shared:
        if owner not in image_of_index:
            raise BenchmarkFormatError(
                f"{where}: field 'image': {owner!r} is neither base64 image data nor the index of a row holding one"
            )
        draft["images"] = [image_of_index[owner]]
    seen: dict[str, str] = {}
    tasks = [_make_task(draft, where, seen, id_field="index") for draft, where in drafts]
    log.info("benchmark %s: %d images decoded into %s (%d new)", name, len(image_of_index), image_root, written)
    return Benchmark(name, tasks, image_root)


BENCHMARKS: dict[str, BenchmarkReader] = {
    "synthetic": _read_synthetic,
    "vstar": _read_vstar,
    "hrbench4k": _read_base64_table,
    "hrbench8k": _read_base64_table,
    "mme_realworld_lite": _read_base64_table,
    "visualprobe_easy": _read_visualprobe,
    "visualprobe_medium": _read_visualprobe,
    "visualprobe_hard": _read_visualprobe,
}
"""Benchmark name -> reader. `load_benchmark` also accepts names with dashes for underscores, in any case."""
