"""Where synthesised trajectories go: resumable shards, then the LLaMA-Factory dataset folder built from them.

Shards (`<out>/shards/shard-NNNNN/`): each holds every trajectory of a slice of the tasks, kept and rejected
alike (`trajectories.jsonl`, crops under `images/`), plus `manifest.json`. A shard is written under a temporary
name and renamed into place when complete, so a killed run leaves only finished shards, and a rerun skips them.
`fingerprint.json` records what the shards were made from (params, task file, teacher, code digest); when it
changes, the old shards are discarded rather than mixed with new ones.

The dataset (`<out>/dataset/`), rebuilt from the shards on every run in a temporary folder swapped in whole:

    loupe_synth.json    sharegpt records: {"conversations": [{"from": "system"|"human"|"gpt", "value": ...}],
                        "images": ["images/<sha256 prefix>.png", ...]}  (paths relative to the dataset folder)
    dataset_info.json   declares `loupe_synth` for LLaMA-Factory (`dataset_dir` = this folder)
    index.jsonl         one line per record: trajectory id, task id, teacher, pattern (for tracing a record back)
    images/             each distinct image file once, named by content, hard-linked where the filesystem
                        allows (copied otherwise); an original that a plain decoder would show otherwise than
                        `loupe.images.open_image` (EXIF rotation, transparency, 16-bit) is stored as
                        `<prefix>.upright.png`, the pixels the model was shown and the crops were cut from

Identical trajectories (same dialogue text and same image contents) become one record.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loupe.images import decodes_plainly, open_image
from loupe.io import atomic_directory, atomic_write_json, file_digest
from loupe.png import encode_png
from loupe.protocol import to_sharegpt
from loupe.trajectory import Trajectory, read_trajectories, write_trajectories

DATASET_NAME = "loupe_synth"
DATASET_FILE = f"{DATASET_NAME}.json"
SHARD_FORMAT = 1
"""Bumped when what a shard holds changes, so old shards are not reused."""


def dataset_info(name: str = DATASET_NAME, file_name: str = DATASET_FILE) -> dict[str, Any]:
    """LLaMA-Factory's declaration of a sharegpt dataset with images (Mini-o3's cold-start layout)."""
    return {
        name: {
            "file_name": file_name,
            "formatting": "sharegpt",
            "columns": {"messages": "conversations", "images": "images"},
            "tags": {
                "role_tag": "from",
                "content_tag": "value",
                "user_tag": "human",
                "assistant_tag": "gpt",
                "system_tag": "system",
            },
        }
    }


class ShardStore:
    """Finished shards under `root`, valid for one fingerprint."""

    def __init__(self, root: str | Path, fingerprint: dict[str, Any]):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        fingerprint = {"shard_format": SHARD_FORMAT, **fingerprint}
        path = self.root / "fingerprint.json"
        previous = None
        if path.is_file():
            try:
                previous = json.loads(path.read_text(encoding="utf-8"))
            except ValueError:
                previous = None
        self.discarded = 0
        if previous != json.loads(json.dumps(fingerprint)):
            for stale in self.root.glob("shard-*"):
                shutil.rmtree(stale, ignore_errors=True)
                self.discarded += 1
            atomic_write_json(path, fingerprint)

    def path(self, index: int) -> Path:
        return self.root / f"shard-{index:05d}"

    def is_done(self, index: int) -> bool:
        return (self.path(index) / "manifest.json").is_file()

    def write(self, index: int, trajectories: list[Trajectory], manifest: dict[str, Any],
              files: dict[str, bytes] | None = None) -> None:
        """Write one shard whole: extra `files` (relative path -> bytes), the trajectories and their crops."""
        with atomic_directory(self.path(index)) as tmp:
            for relative, data in (files or {}).items():
                target = tmp / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
            write_trajectories(trajectories, tmp / "trajectories.jsonl")
            atomic_write_json(tmp / "manifest.json", manifest)
        for trajectory in trajectories:  # written relative to the temporary folder, which is now this one
            trajectory.base_dir = self.path(index)

    def manifest(self, index: int) -> dict[str, Any]:
        """A finished shard's manifest (its counts), without reading its trajectories."""
        return json.loads((self.path(index) / "manifest.json").read_text(encoding="utf-8"))

    def read(self, index: int) -> tuple[list[Trajectory], dict[str, Any]]:
        return read_trajectories(self.path(index) / "trajectories.jsonl"), self.manifest(index)

    def done(self) -> list[int]:
        return sorted(int(p.name.split("-")[1]) for p in self.root.glob("shard-*") if (p / "manifest.json").is_file())


@dataclass(frozen=True)
class DatasetSummary:
    records: int
    duplicates: int
    images: int
    """Distinct image files in the dataset folder."""
    image_bytes: int


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another filesystem, or links not allowed: a copy is as good, only larger
        shutil.copyfile(source, target)


def write_llamafactory_dataset(trajectories: Iterable[Trajectory], folder: str | Path,
                               name: str = DATASET_NAME) -> DatasetSummary:
    """Write the kept `trajectories` as a LLaMA-Factory dataset folder, atomically (see the module docstring)."""
    folder = Path(folder)
    file_name = f"{name}.json"
    with atomic_directory(folder) as tmp:
        (tmp / "images").mkdir()
        placed: dict[Path, tuple[str, str]] = {}  # source file -> (path in the dataset, content digest)
        seen: set[str] = set()
        records: list[dict[str, Any]] = []
        index_lines: list[str] = []
        duplicates = image_bytes = 0
        for trajectory in trajectories:
            record = to_sharegpt(trajectory)
            paths, digests = [], []
            for source in record["images"]:
                source_path = Path(source).resolve()
                if source_path not in placed:
                    if not source_path.is_file():
                        raise FileNotFoundError(f"trajectory {trajectory.traj_id}: image {source_path} not found")
                    digest = file_digest(source_path)
                    plain = decodes_plainly(source_path)
                    suffix = source_path.suffix.lower() or ".png"
                    relative = f"images/{digest[:24]}{suffix if plain else '.upright.png'}"
                    if not (tmp / relative).exists():
                        if plain:
                            _link_or_copy(source_path, tmp / relative)
                        else:
                            # LLaMA-Factory decodes with a plain convert("RGB"): no EXIF rotation, alpha on black,
                            # 16-bit clipped. It gets the pixels the crops were cut from instead.
                            (tmp / relative).write_bytes(encode_png(open_image(source_path)))
                        image_bytes += (tmp / relative).stat().st_size
                    placed[source_path] = (relative, digest)
                relative, digest = placed[source_path]
                paths.append(relative)
                digests.append(digest)
            key = hashlib.sha256(json.dumps([record["conversations"], digests]).encode("utf-8")).hexdigest()
            if key in seen:
                duplicates += 1
                continue
            seen.add(key)
            records.append({"conversations": record["conversations"], "images": paths})
            index_lines.append(json.dumps({
                "record": len(records) - 1,
                "traj_id": trajectory.traj_id,
                "doc_id": trajectory.task.get("doc_id"),
                "teacher": trajectory.meta.get("teacher"),
                "pattern": trajectory.meta.get("pattern"),
            }))
        (tmp / file_name).write_text(json.dumps(records, ensure_ascii=False, indent=1), encoding="utf-8")
        (tmp / "dataset_info.json").write_text(json.dumps(dataset_info(name, file_name), indent=2), encoding="utf-8")
        (tmp / "index.jsonl").write_text("".join(line + "\n" for line in index_lines), encoding="utf-8")
        distinct = len({relative for relative, _ in placed.values()})
    return DatasetSummary(len(records), duplicates, distinct, image_bytes)
