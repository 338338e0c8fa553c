"""The table benchmarks (loupe.data.benchmarks): HR-Bench and MME-RealWorld as TSV or parquet files with base64
images (VLMEvalKit's layout), each image decoded once into the cache folder. The layouts and the upstream code
they were checked against are in docs/benchmarks.md."""

from __future__ import annotations

import base64
import binascii
import csv
import io
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loupe.data.tasks import (
    OPTION_LETTERS,
)
from loupe.images import IMAGE_FORMATS
from loupe.io import atomic_write_bytes

log = logging.getLogger(__name__)
from loupe.data.benchmark_rows import (
    Benchmark,
    BenchmarkFormatError,
    _file_in,
    _letter,
    _literal_options,
    _make_task,
    _option_lines,
    _required,
    _text_cell,
)

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


