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

import logging
import os
import random
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loupe.data.benchmark_rows import (
    Benchmark,
    BenchmarkFormatError,
    BenchmarkNotFoundError,
    BenchmarkReader,
    UnknownBenchmarkError,
    _check_images,
    _file_in,
    _home,
    _identifier,
    _letter,
    _make_task,
    _option_lines,
    _parse_json,
    _read_text,
    _required,
    _text_cell,
    _without_placeholders,
)
from loupe.data.benchmark_tables import (
    _read_base64_table,
)
from loupe.data.tasks import (
    OPTION_LETTERS,
    TaskRecord,
    TaskRecordError,
    read_tasks,
)
from loupe.images import is_image_name

log = logging.getLogger(__name__)

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
