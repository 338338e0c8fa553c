"""A published data set, read into a Loupe task folder: `loupe data import FORMAT ...`.

The readers (`loupe.data.published`, one module per publisher, each following the publisher's loader) turn
rows into `RawTask`s; this module writes the folder every stage reads::

    out/{train,val,test}.jsonl     task records (loupe.data.tasks)
    out/images/<split>/...         their images, copied out of the data set (bytes, files or zip members)

Each split is one or more files or folders (sharded parquet imports as one split). Images inside a file are
written out and files on disk are hard-linked when they can be (else copied), so the folder is self-contained
(loupe.data.tasks refuses paths outside it). Every image is checked to decode as it is written: a broken one
fails its row. Rows keep what upstream's training or reward reads: their own `data_source` (verl dispatches the
reward on it), the publisher's id (`source_id`), and DeepEyes' prompt, tool flag and `extra_info`.

The validation split is, in order: the `val` files given; or the benchmarks given (`--val-benchmark NAME PATH`,
read by loupe.data.benchmarks, so Mini-o3 and Pixel-Reasoner validate where upstream does); or `val_size` rows
held out of train (5% by default on the command line), drawn with `random.Random(seed)`. The folder is built
beside `out` and swapped in whole: a row that fails leaves nothing half-written.
"""

from __future__ import annotations

import io
import os
import random
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError
from tqdm import tqdm

from loupe.data.published import FORMATS, READERS
from loupe.data.published.rows import ArchiveMember, ImageRef, RawTask, RecipeFormatError, close_archives, split_files
from loupe.data.tasks import TaskRecord, write_tasks
from loupe.images import IMAGE_FORMATS
from loupe.io import atomic_directory

__all__ = ["FORMATS", "RecipeFormatError", "held_out_count", "import_tasks"]

_SUFFIX = {"PNG": ".png", "JPEG": ".jpg", "MPO": ".jpg", "WEBP": ".webp", "GIF": ".gif", "BMP": ".bmp", "TIFF": ".tif"}


def held_out_count(val_size: float, rows: int) -> int:
    """Rows a `val_size` holds out of `rows`: a share when below 1 (at least one row), else a count."""
    if val_size < 0:
        raise ValueError(f"val size {val_size}: give a share in [0, 1) or a row count")
    count = max(1, round(val_size * rows)) if 0 < val_size < 1 else int(val_size)
    if count >= rows:
        raise ValueError(f"val size {val_size}: {count} rows held out of {rows} leaves no training rows")
    return count


def _paths(split: str, given: Path | Sequence[Path]) -> list[Path]:
    """The data files of a split given as one path or several (files or folders); a hub name is named as such."""
    files: list[Path] = []
    for path in [given] if isinstance(given, (str, Path)) else given:
        path = Path(path)
        if not path.exists() and re.fullmatch(r"[\w.-]+/[\w.-]+(@\w+)?", str(path)):
            raise FileNotFoundError(f"{split}: {path} is not a local file or folder; it looks like a hub name, and "
                                    "Loupe reads local copies only (nothing is downloaded): download it first, e.g. "
                                    f"`huggingface-cli download --repo-type dataset {str(path).split('@')[0]} "
                                    "--local-dir DIR`, and give DIR")
        files += split_files(path, split)
    return files


def _checked(data: bytes, where: str) -> str:
    """The file suffix of encoded image `data`, after checking it decodes; a broken image names `where`."""
    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
            kind = image.format
            image.verify()
    except UnidentifiedImageError:
        raise RecipeFormatError(f"{where}: not a readable image (no image format PIL may open: "
                                f"{', '.join(IMAGE_FORMATS)})") from None
    except Exception as err:  # PIL raises many types for broken data
        raise RecipeFormatError(f"{where}: not a readable image ({type(err).__name__}: {err})") from None
    return _SUFFIX.get(kind or "", ".png")


def _write_image(image: ImageRef, folder: Path, stem: str, where: str) -> str:
    """Write one image into `folder` as `stem` plus its format's suffix; returns the file name."""
    if isinstance(image, Path):
        data = image.read_bytes()
        name = stem + _checked(data, where)
        try:
            os.link(image, folder / name)  # a large set is not stored twice when the file system allows it
        except OSError:
            shutil.copyfile(image, folder / name)
        return name
    data = image.read() if isinstance(image, ArchiveMember) else image
    name = stem + _checked(data, where)
    (folder / name).write_bytes(data)
    return name


def _write_video(video: Path | list[ImageRef], folder: Path, stem: str, where: str) -> str:
    """Write a clip into `folder`: a video file as it is, a frame folder or frame list as a folder of frames in
    order; returns its path under `folder`."""
    if isinstance(video, Path) and video.is_file():
        name = stem + video.suffix.lower()
        shutil.copyfile(video, folder / name)
        return name
    frames = sorted(p for p in video.iterdir() if p.is_file()) if isinstance(video, Path) else video
    (folder / stem).mkdir()
    for k, frame in enumerate(frames):
        _write_image(frame, folder / stem, f"{k:05d}", f"{where}: frame {k}")
    return stem


def _record(raw: RawTask, split: str, index: int, folder: Path, source: str, where: str) -> TaskRecord:
    images = []
    for k, image in enumerate(raw.images):
        name = _write_image(image, folder, f"{index:06d}_{k}", f"{where}: field '{raw.image_field}.{k}'")
        images.append(f"images/{split}/{name}")
    video = None
    if raw.video is not None:
        clip = _write_video(raw.video, folder, f"{index:06d}_clip", f"{where}: field '{raw.image_field}'")
        video = f"images/{split}/{clip}"
    fields: dict[str, Any] = {"doc_id": f"{split}-{index:06d}", "images": images, "problem": raw.problem,
                              "solution": raw.solution, "data_source": source, "video": video,
                              "source_id": raw.source_id, **raw.extra}
    try:
        return TaskRecord(**{k: v for k, v in fields.items() if v is not None})
    except ValueError as err:
        raise RecipeFormatError(f"{where}: {err}") from None


def _benchmark_records(benchmarks: Sequence[tuple[str, Path]], tmp: Path) -> list[TaskRecord]:
    """Every benchmark's questions as val records, their images copied under `images/val/<benchmark>/`."""
    from loupe.data.benchmarks import load_benchmark

    records: list[TaskRecord] = []
    for name, path in benchmarks:
        benchmark = load_benchmark(name, path, tmp / ".benchmark-cache")
        folder = tmp / "images" / "val" / benchmark.name
        folder.mkdir(parents=True, exist_ok=True)
        for n, task in enumerate(benchmark.tasks):
            images = []
            for k, source in enumerate(benchmark.image_paths(task)):
                written = _write_image(Path(source), folder, f"{n:06d}_{k}", f"{path}: {task.doc_id}")
                images.append(f"images/val/{benchmark.name}/{written}")
            records.append(task.model_copy(update={"images": images}))
    shutil.rmtree(tmp / ".benchmark-cache", ignore_errors=True)
    return records


def import_tasks(format: str, sources: dict[str, Path | Sequence[Path]], out_dir: Path, data_source: str | None = None,
                 limit: int | None = None, val_size: float = 0.0, seed: int = 0, image_dir: Path | None = None,
                 options: dict[str, Any] | None = None, val_benchmarks: Sequence[tuple[str, Path]] = (),
                 progress: bool = False) -> dict[str, Path]:
    """Read each split's published files with `format`'s reader into the task folder `out_dir`; returns
    {split: jsonl path} (the module docstring has the layout and the policies).

    `data_source` replaces every row's own; `image_dir` is where the rows' image paths are rooted (Mini-o3's
    BASE_IMAGE_DIR, EasyR1's `data.image_dir`); `options` go to the reader (EasyR1's keys and `videos`)."""
    if format not in READERS:
        raise ValueError(f"unknown data format {format!r}; known: {', '.join(FORMATS)}")
    reader, options = READERS[format], options or {}
    files = {split: _paths(split, given) for split, given in sources.items()}
    written: dict[str, Path] = {}
    try:
        with atomic_directory(Path(out_dir)) as tmp:
            for split, paths in files.items():
                folder = tmp / "images" / split
                folder.mkdir(parents=True)
                records: list[TaskRecord] = []
                bar = tqdm(desc=f"import {format} {split}", unit="row", disable=not progress)
                for path in paths:
                    for number, raw in enumerate(reader(path, image_dir, **options), 1):
                        if limit is not None and len(records) >= limit:
                            break
                        source = data_source or raw.data_source or format
                        records.append(_record(raw, split, len(records), folder, source, f"{path}:{number}"))
                        bar.update()
                bar.close()
                if split == "train" and "val" not in sources and not val_benchmarks and val_size:
                    held = set(random.Random(seed).sample(range(len(records)), held_out_count(val_size, len(records))))
                    write_tasks([r for i, r in enumerate(records) if i in held], tmp / "val.jsonl")
                    written["val"] = Path(out_dir) / "val.jsonl"
                    records = [r for i, r in enumerate(records) if i not in held]
                if split == "val":
                    records += _benchmark_records(val_benchmarks, tmp)
                write_tasks(records, tmp / f"{split}.jsonl")
                written[split] = Path(out_dir) / f"{split}.jsonl"
            if val_benchmarks and "val" not in files:
                write_tasks(_benchmark_records(val_benchmarks, tmp), tmp / "val.jsonl")
                written["val"] = Path(out_dir) / "val.jsonl"
    finally:
        close_archives()
    return written
