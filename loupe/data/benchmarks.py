"""Benchmark readers: turn local copies of the published evaluation sets into Loupe task records.

    benchmark = load_benchmark("vstar", "/data/vstar_bench", cache_dir="cache/benchmarks")
    image_path = benchmark.image_root / benchmark.tasks[0].images[0]

Each reader takes the folder (or file) exactly as its publisher ships it; nothing is downloaded here. The
layouts, and the upstream code each was confirmed against, are in docs/benchmarks.md:
- `synthetic`: a folder holding `test.jsonl` (Loupe's generator output), or a JSONL file of task records.
- `vstar` (V* Bench, craigwu/vstar_bench): `test_questions.jsonl` (`image`, `text` with "(A) ..." option lines,
  `category`, `question_id`, `label`), else the per-question layout V*'s own `vstar_bench_eval.py` reads:
  `direct_attributes/` and `relative_position/`, each image beside a same-named `.json` whose `options[0]` is right.
- `hrbench4k`, `hrbench8k` (DreamMr/HR-Bench): `hr_bench_4k.tsv`/`.parquet` (`index, question, A-D, answer,
  category, cycle_category, image` base64).
- `mme_realworld_lite` (yifanzhang114/MME-RealWorld-Base64): `mme_realworld_lite.tsv` (VLMEvalKit keeps it as
  `MME-RealWorld-Lite.tsv`): `multi-choice options` is a Python-literal list of "(A) text" strings, `answer` A-E.
- `visualprobe_easy`, `_medium`, `_hard` (Mini-o3/VisualProbe_*): a folder holding `val.json`, a JSON list of
  Mini-o3 task records whose image paths are relative to the folder ABOVE it (Mini-o3's BASE_IMAGE_DIR) and whose
  `problem` starts with "<image>\\n". Free-form answers.
Table images are base64, decoded into `cache_dir/<benchmark>/<index>.<ext>`; a file already holding the same
bytes is left alone.

Policies:
- The protocol puts one image placeholder per image before the question itself, so every "<image>" already in a
  question or option text is removed (a line holding nothing else goes with it): the model never sees two.
- A path one level off (the parent of the benchmark's folder, or a folder inside it) fails with the path to give.
- Image paths must stay under their root as written: no absolute path, no `..`. Symlinks are followed, because
  the Hugging Face cache stores every file as a symlink into its blob store.
- A missing path, an unknown name or a malformed row fails at once, naming the file, the row or line and the
  field; no reader lets a raw decoding exception out.
"""

from __future__ import annotations

import ast
import base64
import binascii
import csv
import io
import logging
import math
import os
import random
import re
import zlib
from collections.abc import Callable, Iterator
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
    read_tasks,
)
from loupe.images import IMAGE_FORMATS, is_image_name
from loupe.io import atomic_write_bytes
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


# ---------------------------------------------------------------------------------------------------------------
# JSON readers: synthetic, V* Bench, VisualProbe


def _json_lines(file: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, record) for each non-blank line of a JSONL file of objects; `where` is `file:line`."""
    # Split on LF only, as read_tasks does: U+2028 and other Unicode line breaks may stand inside a JSON string.
    for line_no, line in enumerate(_read_text(file).split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{file}:{line_no}"
        record = _parse_json(line, where)
        if not isinstance(record, dict):
            raise BenchmarkFormatError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
        yield where, record


def _read_synthetic(name: str, path: Path, cache_dir: Path) -> Benchmark:
    file = _file_in(name, path, ("test.jsonl",))
    try:
        tasks = read_tasks(file, check_images=True)
    except TaskRecordError as err:
        raise BenchmarkFormatError(str(err)) from None
    # Synthetic records carry their own doc ids; only the source is set, so reports group by benchmark name.
    out = []
    for task in tasks:
        problem = _without_placeholders(task.problem)
        if not problem:
            raise BenchmarkFormatError(f"{file}: doc_id {task.doc_id!r}: field 'problem': no question text")
        out.append(task.model_copy(update={"data_source": name, "problem": problem}))
    return Benchmark(name, out, file.parent)


VSTAR_CATEGORIES = ("direct_attributes", "relative_position")
"""The folders V*'s vstar_bench_eval.py evaluates, in its order (the copy also holds GPT4V-hard/ and OCR/)."""


def _is_vstar_home(folder: Path) -> bool:
    return (folder / "test_questions.jsonl").is_file() or all((folder / c).is_dir() for c in VSTAR_CATEGORIES)


def _read_vstar(name: str, path: Path, cache_dir: Path) -> Benchmark:
    if path.is_file():
        return _read_vstar_jsonl(name, path)
    home = _home(name, path, _is_vstar_home, f"test_questions.jsonl or {' and '.join(VSTAR_CATEGORIES)} folders")
    if (home / "test_questions.jsonl").is_file():
        return _read_vstar_jsonl(name, home / "test_questions.jsonl")
    return _read_vstar_folders(name, home)


def _read_vstar_jsonl(name: str, file: Path) -> Benchmark:
    """`test_questions.jsonl`: the question, its "(A) ..." lines and an instruction in `text`; the letter in `label`."""
    tasks: list[TaskRecord] = []
    seen: dict[str, str] = {}
    for where, row in _json_lines(file):
        image, text = _required(row, "image", where), _required(row, "text", where)
        question_id = _identifier(_required(row, "question_id", where), where, "question_id")
        if not isinstance(image, str) or not isinstance(text, str):
            field = "image" if not isinstance(image, str) else "text"
            raise BenchmarkFormatError(f"{where}: field '{field}': expected a string")
        lines = [line.strip() for line in text.splitlines()]
        first, options = _option_lines(lines, where, "text")
        problem = "\n".join(lines[:first]).strip()
        if not problem:
            raise BenchmarkFormatError(f"{where}: field 'text': no question before the options")
        data = {
            "doc_id": f"{name}-{question_id}",
            "images": [image],
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


def _read_vstar_folders(name: str, home: Path) -> Benchmark:
    """The per-question layout V*'s `vstar_bench_eval.py` (eval_model) reads: in each category folder, every file
    that is not `.json` is an image and `<stem>.json` holds its `question` and `options`, the right one first.

    V* scores each option's likelihood, so its order does not matter there; asked for a letter, a model would find
    the answer always at (A). So the options are put in an order drawn from the question's id (crc32 seed): the
    same on every run and machine, the right letter spread over A-D.
    """
    tasks: list[TaskRecord] = []
    seen: dict[str, str] = {}
    for category in VSTAR_CATEGORIES:
        folder = home / category
        # Every image of the folder, by the shared rule of what an image file is (a notes.txt is not one).
        images = sorted(p for p in folder.iterdir() if p.is_file() and is_image_name(p) and not p.name.startswith("."))
        for image in images:
            annotation = image.with_suffix(".json")
            where = str(annotation)
            if not annotation.is_file():
                raise BenchmarkFormatError(f"{image}: no annotation {annotation.name} beside this image")
            record = _parse_json(_read_text(annotation), where)
            if not isinstance(record, dict):
                raise BenchmarkFormatError(f"{where}: the annotation must be a JSON object")
            question = _required(record, "question", where)
            options = record.get("options")
            if not isinstance(question, str):
                raise BenchmarkFormatError(f"{where}: field 'question': expected a string")
            if not isinstance(options, list) or len(options) < 2 or not all(isinstance(o, str) for o in options):
                raise BenchmarkFormatError(f"{where}: field 'options': expected a list of at least 2 option texts")
            question_id = f"{category}-{image.stem}"
            order = list(range(len(options)))
            random.Random(zlib.crc32(question_id.encode())).shuffle(order)
            data = {
                "doc_id": f"{name}-{question_id}",
                "images": [f"{category}/{image.name}"],
                "problem": question,
                "options": [options[i] for i in order],
                "solution": OPTION_LETTERS[order.index(0)],
                "data_source": name,
                "category": category,
            }
            tasks.append(_make_task(data, where, seen))
    return Benchmark(name, tasks, home)


_VISUALPROBE_SOURCES = {"visual_probe_easy", "visual_probe_medium", "visual_probe_hard"}


def _read_visualprobe(name: str, path: Path, cache_dir: Path) -> Benchmark:
    """Mini-o3's `val.json` (a JSON list, read with json.load in MultiModalDataset._read_files_and_tokenize); each
    image path is joined to BASE_IMAGE_DIR, the folder above the data set's folder (make_conversation_multimodal)."""
    file = path if path.is_file() else _home(name, path, lambda d: (d / "val.json").is_file(), "val.json") / "val.json"
    image_root = file.parent.parent
    records = _parse_json(_read_text(file), str(file))
    if not isinstance(records, list):
        raise BenchmarkFormatError(f"{file}: expected a JSON list of task records, got {type(records).__name__}")
    difficulty = name.removeprefix("visualprobe_")
    hint = f" (Mini-o3 joins val.json's image paths to the folder above the data set's folder, {image_root})"
    tasks: list[TaskRecord] = []
    seen: dict[str, str] = {}
    for n, record in enumerate(records, start=1):
        where = f"{file}: record {n}"
        if not isinstance(record, dict):
            raise BenchmarkFormatError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
        data = dict(record)
        source = data.get("data_source")
        # A hard copy read as easy would report a wrong number without a word; the records say which they are.
        if isinstance(source, str) and source in _VISUALPROBE_SOURCES and source != f"visual_probe_{difficulty}":
            raise BenchmarkFormatError(
                f"{where}: field 'data_source': {source!r} records, but this is benchmark {name!r}: "
                f"name the benchmark visualprobe_{source.removeprefix('visual_probe_')} or give the {difficulty} copy"
            )
        data["doc_id"] = f"{name}-{_identifier(_required(data, 'doc_id', where), where, 'doc_id')}"
        if isinstance(data.get("images"), str):
            data["images"] = [data["images"]]
        if isinstance(data.get("solution"), int) and not isinstance(data["solution"], bool):
            data["solution"] = str(data["solution"])
        data["data_source"] = name
        task = _make_task(data, where, seen)
        _check_images(task, image_root, where, hint=hint)
        tasks.append(task)
    return Benchmark(name, tasks, image_root)


# ---------------------------------------------------------------------------------------------------------------
# Table readers with base64 images: HR-Bench, MME-RealWorld-Lite


def _tsv_rows(file: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Rows of a tab-separated file with a header (what pandas' to_csv(sep="\\t") writes and read_csv reads)."""
    # One cell holds a whole base64 image, far past csv's 128 KiB default; 2**31 - 1 fits a C long everywhere.
    old_limit = csv.field_size_limit(2**31 - 1)
    n, line = 0, 0
    try:
        with file.open("rb") as f:
            reader = csv.DictReader(_utf8_lines(f, file), delimiter="\t")
            for n, row in enumerate(reader, start=1):
                line = reader.line_num
                where = f"{file}: row {n} (line {line})"
                if None in row:
                    raise BenchmarkFormatError(f"{where}: more cells than the header has columns")
                yield where, row
    except csv.Error as err:
        raise BenchmarkFormatError(f"{file}: row {n + 1} (after line {line}): not a readable TSV row ({err})") from None
    except OSError as err:
        raise BenchmarkFormatError(f"{file}: cannot be read ({err.strerror or err})") from None
    finally:
        csv.field_size_limit(old_limit)


def _utf8_lines(f: io.BufferedReader, file: Path) -> Iterator[str]:
    """The file's lines, line ends kept (as csv wants), decoded one by one so a bad byte is named by its line."""
    for line_no, raw in enumerate(f, start=1):
        try:
            yield raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
        except UnicodeDecodeError as err:
            raise BenchmarkFormatError(f"{file}: line {line_no}: not UTF-8 text (bad byte at column {err.start + 1})") from None


def _parquet_rows(file: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"{file}: reading parquet needs pyarrow (pip install pyarrow); or use the TSV") from None
    n = 0
    try:
        parquet = pq.ParquetFile(file)
        for batch in parquet.iter_batches(batch_size=32):  # batches keep a multi-GB file out of memory
            for row in batch.to_pylist():
                n += 1
                yield f"{file}: row {n}", row
    except (OSError, pa.ArrowException) as err:
        raise BenchmarkFormatError(f"{file}: row {n + 1}: not a readable parquet file ({err})") from None


_TABLE_FILES = {
    # The published names, then the name VLMEvalKit's ImageBaseDataset.prepare_tsv stores the file under
    # (`$LMUData/<dataset name>.tsv`), so a VLMEvalKit user's copy is found too.
    "hrbench4k": ("hr_bench_4k.parquet", "hr_bench_4k.tsv", "HRBench4K.tsv"),
    "hrbench8k": ("hr_bench_8k.parquet", "hr_bench_8k.tsv", "HRBench8K.tsv"),
    "mme_realworld_lite": ("mme_realworld_lite.tsv", "MME-RealWorld-Lite.tsv"),
}
_TABLE_COLUMNS = ("index", "question", "answer", "image")
_EXTRA_COLUMNS = {"cycle_category": "cycle_category", "l2-category": "l2_category"}
_SAFE_INDEX = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def _table_options(row: dict[str, Any], where: str) -> list[str]:
    """Option texts from `multi-choice options` (a Python-literal list, or "(A) ..." lines) when the row has that
    column, else from the A, B, ... columns (trailing empty cells dropped)."""
    if "multi-choice options" in row:
        text = _text_cell(row["multi-choice options"])
        if text.startswith("["):
            return _literal_options(text, where, "multi-choice options")
        return _option_lines([line.strip() for line in text.splitlines()], where, "multi-choice options")[1]
    letters = ""
    for letter in OPTION_LETTERS:
        if letter not in row:
            break
        letters += letter
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

    VLMEvalKit's TSVs store a repeated image once and put the owning row's index (64 characters at most) in the
    other rows' cells (ImageBaseDataset.__init__).
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
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:  # the header only; formats open_image reads
            kind = image.format or ""
    except Exception as err:  # PIL raises many types for data that is not an image
        raise BenchmarkFormatError(f"{where}: field 'image': decoded bytes are not an image ({err})") from None
    return {"JPEG": "jpg", "TIFF": "tif", "JPEG2000": "jp2"}.get(kind, kind.lower())


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
    others = tuple(f for other, files in _TABLE_FILES.items() if other != name for f in files)
    file = _file_in(name, path, _TABLE_FILES.get(name, ()), suffixes=(".tsv", ".parquet"), not_these=others)
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


def _read_r1v_eval(name: str, path: Path, cache_dir: Path) -> Benchmark:
    """R1-V's test prompts (`src/eval/prompts/superclevr_test200_counting_problems.jsonl`,
    `geoqa_test_prompts.jsonl`): JSONL of `image_path`, `question`, `ground_truth`, read by
    loupe.data.published.r1v.read_r1v_eval, the reader `loupe data import r1v_eval` uses. The images lie beside
    the file or, as R1-V's README lays them out, in the prompts folder's parent (`src/eval/images/...`, where its
    test scripts run), which is then the image root."""
    from loupe.data.published import RecipeFormatError
    from loupe.data.published.r1v import read_r1v_eval

    default = {"superclevr": "superclevr_test200_counting_problems.jsonl", "geoqa": "geoqa_test_prompts.jsonl"}
    file = _file_in(name, path, (default.get(name, ""),), (".jsonl",))
    try:
        raws = list(read_r1v_eval(file))
    except RecipeFormatError as err:
        raise BenchmarkFormatError(str(err)) from None
    root = file.parent if all(Path(r.images[0]).is_relative_to(file.parent) for r in raws) else file.parent.parent
    tasks: list[TaskRecord] = []
    seen: dict[str, str] = {}
    for index, raw in enumerate(raws):
        image = Path(os.path.relpath(Path(raw.images[0]), root)).as_posix()  # type: ignore[arg-type]
        record = {"doc_id": f"{name}-{index:05d}", "images": [image], "problem": raw.problem,
                  "solution": raw.solution, "data_source": name}
        task = _make_task(record, f"{file}:{index + 1}", seen)
        _check_images(task, root, f"{file}:{index + 1}", "image_path")
        tasks.append(task)
    return Benchmark(name, tasks, root)


BENCHMARKS: dict[str, BenchmarkReader] = {
    "synthetic": _read_synthetic,
    "tasks": _read_synthetic,
    "superclevr": _read_r1v_eval,
    "geoqa": _read_r1v_eval,
    "vstar": _read_vstar,
    "hrbench4k": _read_base64_table,
    "hrbench8k": _read_base64_table,
    "mme_realworld_lite": _read_base64_table,
    "visualprobe_easy": _read_visualprobe,
    "visualprobe_medium": _read_visualprobe,
    "visualprobe_hard": _read_visualprobe,
}
"""Benchmark name -> reader. `load_benchmark` also accepts names with dashes for underscores, in any case."""
