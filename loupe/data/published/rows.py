"""What every reader of a published data set shares: a split's files, their rows, typed fields, image cells.

A reader (one module per publisher in this package) turns each row of the publisher's files into a `RawTask`:
the question, the answer, where its images are (bytes inside the file, a file on disk, or a member of a zip
archive the publisher ships beside its table) and the fields upstream's training or reward reads.
`loupe.data.recipe_formats.import_tasks` then writes the task folder. Nothing here decodes an image or writes a
file.

Policies:
- A split is one or more paths, each a file or a folder. A folder gives its data files in name order, those
  named for the split when some are (the hub's `train-00000-of-00003.parquet`, `data/train-*.parquet`, a
  `train/` folder), else all of them: sharded sets import as one split.
- Rows count from 1 in each file; every error names `file:row` and the field (`reward_model.ground_truth`).
- An image path is looked for, in order, under the image folder given (`--image-dir`), beside the data file,
  one folder above it (R1-V's test scripts run from `src/eval` and name `./images/...` from the prompts'
  parent), and inside the archive given (Pixel-Reasoner's `images.zip`); a path written on the publisher's
  machine (absolute, or `file://`) is also looked for by its trailing components under those folders.
- A relative path that climbs out of the folder it is read from (`../..`), and a zip member whose own name
  does, is refused: an import never reads a file the data set does not hold.
"""

from __future__ import annotations

import json
import posixpath
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loupe.data.tasks import TaskRecordError
from loupe.images import is_image_name

DATA_SUFFIXES = (".parquet", ".json", ".jsonl")
SPLIT_NAMES = {"train": ("train",), "val": ("val", "validation", "dev", "valid"), "test": ("test",)}
"""The words a hub names a split's files or folders by."""
MAX_MEMBER_BYTES = 1 << 30
"""A zip member larger than this (uncompressed) is refused: no image in a published set comes near."""


class RecipeFormatError(TaskRecordError):
    """A row of a published data set that cannot be read; the message names file, row and field."""


@dataclass(frozen=True)
class ArchiveMember:
    """An image stored inside a zip archive."""

    archive: Path
    name: str

    def read(self) -> bytes:
        return _open_archive(self.archive).read(self.name)


ImageRef = bytes | Path | ArchiveMember
"""Where one image of a row is: its encoded bytes, a file, or a zip member."""


@dataclass
class RawTask:
    """One row, before its images are written into the task folder."""

    problem: str
    solution: str
    images: list[ImageRef] = field(default_factory=list)
    video: Path | list[ImageRef] | None = None
    """A video file, or a clip given as its frames in order (written as a frame folder)."""
    data_source: str | None = None
    """The row's own source (verl's per-row `data_source`); None: the import's `--source` or the format name."""
    source_id: str | None = None
    """The publisher's id of the row (Mini-o3's `doc_id`, DeepEyes' `extra_info.index`, Pixel-Reasoner's `qid`)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Further task record fields: `system`, `prompt`, `tools`, `extra_info`."""
    image_field: str = "images"
    """The publisher's column holding the images (errors name `<image_field>.<k>`)."""


def split_files(path: Path, split: str, suffixes: tuple[str, ...] = DATA_SUFFIXES) -> list[Path]:
    """The data files of `split` at `path`: the file itself, or a folder's files (see the module's policies)."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{split}: {path} is neither a file nor a folder")
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in suffixes
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise FileNotFoundError(f"{split}: {path} holds no {' or '.join(suffixes)} file")
    words = SPLIT_NAMES.get(split, (split,))

    def named_for_split(file: Path) -> bool:
        parts = [part.lower() for part in file.relative_to(path).parts]
        return any(parts[-1].startswith(word) for word in words) or any(word in parts[:-1] for word in words)

    return [f for f in files if named_for_split(f)] or files


def rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row number, row) of a parquet, JSON-list or JSONL file; rows count from 1."""
    if path.suffix.lower() == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        number = 0
        try:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=64):
                for row in batch.to_pylist():
                    number += 1
                    yield number, row
        except (OSError, pa.ArrowException) as err:
            raise RecipeFormatError(f"{path}:{number + 1}: not a readable parquet row ({err})") from None
        return
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise RecipeFormatError(f"{path}: not UTF-8 text (byte {err.start})") from None
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            listed = json.loads(text)
        except json.JSONDecodeError as err:
            raise RecipeFormatError(f"{path}: not a JSON list ({err.msg} at line {err.lineno})") from None
        yield from enumerate(listed, 1)
        return
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as err:
                raise RecipeFormatError(f"{path}:{number}: not JSON ({err.msg} at column {err.colno})") from None


def get(path: Path, number: int, row: Any, name: str, kinds: tuple[type, ...] = (str,),
        required: bool = True) -> Any:
    """The value of `name` (dotted for nested objects: `reward_model.ground_truth`) in `row`, of one of `kinds`;
    a missing or mistyped field is a RecipeFormatError naming the file, the row and the field. Not `required`:
    None when absent."""
    if not isinstance(row, dict):
        raise RecipeFormatError(f"{path}:{number}: a row must be an object, not {type(row).__name__}")
    value: Any = row
    for depth, key in enumerate(name.split(".")):
        if not isinstance(value, dict) or value.get(key) is None:
            if not required:
                return None
            where = ".".join(name.split(".")[:depth]) or "the row"
            present = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise RecipeFormatError(f"{path}:{number}: field {name!r} is missing ({where} holds {present})")
        value = value[key]
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise RecipeFormatError(f"{path}:{number}: field {name!r} is {type(value).__name__}, expected "
                                f"{' or '.join(k.__name__ for k in kinds)}")
    return value


def answer_text(path: Path, number: int, row: Any, name: str) -> str:
    """An answer field as text: a string, or a number written as the publisher's scorer compares it."""
    value = get(path, number, row, name, (str, int, float))
    text = str(value).strip()
    if not text:
        raise RecipeFormatError(f"{path}:{number}: field {name!r} is empty")
    return text


class ImageFinder:
    """Finds the images a data file names (the module's policies say where it looks)."""

    def __init__(self, data_file: Path, image_dir: Path | None = None, archive: Path | None = None,
                 parent_too: bool = False):
        self.data_file = Path(data_file)
        self.roots = ([Path(image_dir)] if image_dir is not None else []) + [self.data_file.parent]
        if parent_too:
            self.roots.append(self.data_file.parent.parent)
        self.archive = Path(archive) if archive is not None else None

    def find(self, number: int, name: str, text: Any) -> Path | ArchiveMember:
        """The file or zip member `text` names (field `name` of row `number`)."""
        where = f"{self.data_file}:{number}: field {name!r}"
        if not isinstance(text, str) or not text.strip():
            raise RecipeFormatError(f"{where}: holds no image path")
        written = text.strip().removeprefix("file://")
        if not is_image_name(written):
            raise RecipeFormatError(f"{where}: {written!r} is not an image file name")
        parts = [p for p in Path(written).parts if p not in ("/", "", ".")]
        if Path(written).is_absolute():
            if Path(written).is_file():
                return Path(written)
            tails = [parts[k:] for k in range(1, len(parts))]
        else:
            if ".." in parts:
                raise RecipeFormatError(f"{where}: {written!r} leaves the folder it is read from")
            tails = [parts[k:] for k in range(len(parts))]
        for tail in tails:
            for root in self.roots:
                candidate = root.joinpath(*tail)
                if candidate.is_file() and candidate.resolve().is_relative_to(root.resolve()):
                    return candidate
            if self.archive is not None:
                member = _member(self.archive, "/".join(tail), where)
                if member is not None:
                    return member
        places = [str(r) for r in self.roots] + ([str(self.archive)] if self.archive else [])
        raise RecipeFormatError(f"{where}: image {written!r} not found (looked under {', '.join(places)}"
                                f"{', by its trailing parts too' if len(tails) > 1 else ''})")


_ARCHIVES: dict[Path, zipfile.ZipFile] = {}


def _open_archive(archive: Path) -> zipfile.ZipFile:
    """The archive, opened and checked once per process (a published set's rows read thousands of members).

    An archive holding an entry whose name leaves it (absolute, `..`, a backslash) is refused whole: unpacked by
    `unzip`, as the publisher's script does, it would write outside the folder."""
    key = archive.resolve()
    if key not in _ARCHIVES:
        try:
            handle = zipfile.ZipFile(key)
        except (OSError, zipfile.BadZipFile) as err:
            raise RecipeFormatError(f"{archive}: not a readable zip archive ({err})") from None
        for name in handle.namelist():
            if name.startswith("/") or "\\" in name or posixpath.normpath(name).split("/")[0] == "..":
                handle.close()
                raise RecipeFormatError(f"{archive}: zip entry {name!r} escapes the archive")
        _ARCHIVES[key] = handle
    return _ARCHIVES[key]


def close_archives() -> None:
    """Close every archive opened so far (an import closes them when it ends)."""
    for handle in _ARCHIVES.values():
        handle.close()
    _ARCHIVES.clear()


def _member(archive: Path, name: str, where: str) -> ArchiveMember | None:
    """The member `name` of `archive`, None when absent."""
    try:
        handle = _open_archive(archive)
    except RecipeFormatError as err:
        raise RecipeFormatError(f"{where}: {err}") from None
    try:
        info = handle.getinfo(name)
    except KeyError:
        return None
    if info.file_size > MAX_MEMBER_BYTES:
        raise RecipeFormatError(f"{where}: zip entry {info.filename!r} of {archive} unpacks to {info.file_size:,} "
                                f"bytes, over {MAX_MEMBER_BYTES:,}")
    return ArchiveMember(archive, info.filename)


def image_value(finder: ImageFinder, number: int, name: str, value: Any) -> ImageRef:
    """One image cell: the `datasets` Image struct or raw bytes (kept as bytes), else the path it names."""
    from loupe.images import image_cell

    cell = image_cell(value)
    if isinstance(cell, bytes):
        return cell
    return finder.find(number, name, cell)
