"""Images scaled once, before training, exactly as LLaMA-Factory would scale them at every step.

LLaMA-Factory opens every image of a batch from its file and scales it into `image_max_pixels` each time it
is used: once while tokenising the dataset and once per epoch in the collator. Synthetic canvases and
benchmark photographs are megapixels, so on a CPU most of a training step goes to decoding and resizing them
(measured on the tiny pipeline: 40% of a step, and most of the tokenising pass).

`presize_dataset` writes a copy of the dataset folder whose too-large images are already scaled, by the very
call LLaMA-Factory makes (`image.resize((int(w * f), int(h * f)))` with PIL's default filter) and saved
losslessly as PNG (one process per core). LLaMA-Factory then finds them within its budget and leaves them as
they are, so the pixels the model sees are identical (tests/test_sft_images.py compares them through LLaMA-Factory's own plugin);
only the time changes. Images within the budget, and modes PNG cannot hold, are referenced where they are.
The copy is rebuilt only when the dataset or the budget changes.
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from PIL import Image
from tqdm import tqdm

from loupe.io import atomic_directory, atomic_write_json
from loupe.png import encode_png, read_own_png
from stages.sft.checks import DatasetSpec

MANIFEST = "loupe_presize.json"
PNG_MODES = ("RGB", "RGBA", "L", "LA", "P", "I", "I;16", "1")
POOL_FROM_IMAGES = 64
"""Images to scale from which the work is spread over processes (fewer are scaled in the stage's own)."""


def scaled_size(width: int, height: int, image_max_pixels: int, image_min_pixels: int) -> tuple[int, int] | None:
    """The size LLaMA-Factory scales an over-budget image to, or None when the image should stay as it is.

    None too when the scaled image would fall under image_min_pixels: LLaMA-Factory would scale it up again,
    and a second scaling of our copy would not reproduce its single one.
    """
    if width * height <= image_max_pixels:
        return None
    factor = math.sqrt(image_max_pixels / (width * height))
    size = int(width * factor), int(height * factor)
    return size if size[0] * size[1] >= image_min_pixels and min(size) > 0 else None


def _digest(spec: DatasetSpec, sizes: dict[Path, tuple[int, int]], image_max_pixels: int, image_min_pixels: int) -> str:
    hasher = hashlib.sha256(f"{image_max_pixels}:{image_min_pixels}\n".encode())
    for path in (spec.file, spec.folder / "dataset_info.json"):
        hasher.update(path.read_bytes())
    for path, (w, h) in sorted(sizes.items()):
        hasher.update(f"{path}:{w}x{h}:{path.stat().st_size}\n".encode())
    return hasher.hexdigest()


def presize_dataset(
    spec: DatasetSpec,
    records: list[dict[str, Any]],
    sizes: dict[Path, tuple[int, int]],
    image_max_pixels: int,
    image_min_pixels: int,
    out_dir: Path,
    progress: bool = True,
) -> tuple[Path, int]:
    """Write (or reuse) the pre-scaled copy of the dataset at `out_dir`; returns (folder, images scaled)."""
    out_dir = Path(out_dir)
    digest = _digest(spec, sizes, image_max_pixels, image_min_pixels)
    manifest = out_dir / MANIFEST
    if manifest.is_file():
        previous = json.loads(manifest.read_text(encoding="utf-8"))
        if previous.get("digest") == digest:
            return out_dir, int(previous.get("scaled", 0))

    with atomic_directory(out_dir) as tmp:
        (tmp / "images").mkdir()
        replaced: dict[Path, str] = {}
        scaled_sizes = [(p, scaled_size(w, h, image_max_pixels, image_min_pixels)) for p, (w, h) in sorted(sizes.items())]
        over_budget = [(p, size) for p, size in scaled_sizes if size is not None]
        todo = [(p, size, tmp / f"images/{index:07d}.png") for index, (p, size) in enumerate(over_budget)]
        # Decoding, scaling and encoding are independent per image and hold the GIL in places: one process per
        # core, spawned (a fork of this process, which runs tqdm's and MLflow's threads, can deadlock). A spawned
        # process takes about 2 s to start, which a few dozen canvases do not repay.
        workers = min(len(os.sched_getaffinity(0)), 8) if len(todo) >= POOL_FROM_IMAGES else 1
        with ExitStack() as stack:
            pool = stack.enter_context(ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
                                       ) if workers > 1 else None
            done = pool.map(_scale_one, todo, chunksize=max(1, len(todo) // (8 * workers))) if pool else map(_scale_one, todo)
            for (path, _, target), scaled in tqdm(zip(todo, done), total=len(todo), desc="sft: scaling images",
                                                 unit="img", disable=not progress):
                if scaled:
                    replaced[path] = str(target.relative_to(tmp))
        column = spec.images
        rewritten = []
        for record in records:
            record = dict(record)
            if column and record.get(column):
                images = record[column] if isinstance(record[column], list) else [record[column]]
                record[column] = [_reference(spec.folder, p, replaced) for p in images]
            rewritten.append(record)
        (tmp / spec.file.name).write_text(json.dumps(rewritten, ensure_ascii=False), encoding="utf-8")
        info = json.loads((spec.folder / "dataset_info.json").read_text(encoding="utf-8"))
        info[spec.name] = {**info[spec.name], "file_name": spec.file.name}
        atomic_write_json(tmp / "dataset_info.json", {spec.name: info[spec.name]})
        atomic_write_json(tmp / MANIFEST, {"digest": digest, "scaled": len(replaced), "source": str(spec.folder)})
    return out_dir, len(replaced)


def _scale_one(job: tuple[Path, tuple[int, int], Path]) -> bool:
    """Scale one image into `target` as LLaMA-Factory would; False for a mode PNG cannot hold (left as it is)."""
    path, size, target = job
    own = read_own_png(path)  # the pipeline's canvases: loupe.png's fast decoder, the same pixels as Pillow's
    with own if own is not None else Image.open(path) as image:
        if image.mode not in PNG_MODES:
            return False
        scaled = image.resize(size)  # LLaMA-Factory's call, default filter: the same pixels
    if scaled.mode == "RGB":
        target.write_bytes(encode_png(scaled))
    else:
        scaled.save(target, format="PNG", compress_level=1)
    return True


def _reference(folder: Path, image: str, replaced: dict[Path, str]) -> str:
    """The scaled copy's relative path, or the original as an absolute path (LLaMA-Factory takes both)."""
    original = Path(image) if Path(image).is_absolute() else folder / image
    return replaced.get(original) or os.path.abspath(original)
