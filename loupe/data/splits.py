"""What every procedural task family shares: split sizes and seed, and writing the splits as a task folder.

A family (loupe.data.synthetic, loupe.data.zoom_tasks) subclasses `SplitConfig` for its knobs and hands
`write_splits` a function that draws task `index` of a split, saves its canvas and returns its record. The
folder layout is the one the synth, rl and eval stages read::

    out_dir/{train,val,test}.jsonl      task records (loupe.data.tasks)
    out_dir/images/<split>/<index>.png  their canvases
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field
from tqdm import tqdm

from loupe.data.tasks import TaskRecord, write_tasks
from loupe.io import atomic_directory

SPLITS = ("train", "val", "test")


class SplitConfig(BaseModel):
    """The seed and split sizes of a task family's config."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    seed: int = Field(0, ge=0)
    """Root seed; task i of a split draws from its own stream seeded by (seed, split, i)."""
    train: int = Field(32, ge=0)
    """Number of training tasks."""
    val: int = Field(8, ge=0)
    """Number of validation tasks."""
    test: int = Field(8, ge=0)
    """Number of test tasks (held out: the eval stage's `synthetic` benchmark reads test.jsonl)."""

    def split_size(self, split: str) -> int:
        """Number of tasks of `split`."""
        return {"train": self.train, "val": self.val, "test": self.test}[split]


MakeAndSave = Callable[[SplitConfig, str, int, Path], TaskRecord]
"""(config, split, index, folder) -> the record of task `index`, its canvas saved under `folder`."""


def check_replaceable(out_dir: Path) -> None:
    """Refuse to replace a folder that does not look like an earlier output of a task generator."""
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"{out_dir}: output path exists and is not a folder")
    if out_dir.is_dir():
        ours = {f"{s}.jsonl" for s in SPLITS} | {"images"}
        entries = {p.name for p in out_dir.iterdir()}
        if entries and not entries & ours:
            raise FileExistsError(f"{out_dir}: folder holds files that are not task files ({sorted(entries)[:5]}); "
                                  "refusing to replace it, pick an empty or new folder")


def write_splits(out_dir: Path, cfg: SplitConfig, make_and_save: MakeAndSave, label: str, progress: bool = False,
                 workers: int = 1) -> dict[str, Path]:
    """Draw every split's tasks into `out_dir`; return {split: jsonl path}.

    The whole folder is built beside `out_dir` and swapped in at the end, so a killed run leaves the previous
    output (or nothing) rather than a mix; `out_dir` is owned by the generator and replaced whole. `workers` > 1
    draws tasks in that many spawned processes (the calling script needs the usual `if __name__ ==
    "__main__":` guard, and `make_and_save` must be importable); the files are byte-identical for any `workers`.
    """
    out_dir = Path(out_dir)
    check_replaceable(out_dir)
    with atomic_directory(out_dir) as tmp:
        # Spawned, not forked: forking a process that already runs threads (tqdm's monitor, a caller's MLflow
        # client) can deadlock the child.
        spawn = multiprocessing.get_context("spawn")
        pool = ProcessPoolExecutor(workers, mp_context=spawn) if workers > 1 else None
        try:
            for split in SPLITS:
                count = cfg.split_size(split)
                (tmp / "images" / split).mkdir(parents=True)
                args = ([cfg] * count, [split] * count, range(count), [tmp] * count)
                results = pool.map(make_and_save, *args, chunksize=4) if pool else map(make_and_save, *args)
                records = list(tqdm(results, total=count, desc=f"{label} {split}", unit="task", disable=not progress))
                write_tasks(records, tmp / f"{split}.jsonl")
        finally:
            if pool is not None:
                pool.shutdown(cancel_futures=True)
    return {split: out_dir / f"{split}.jsonl" for split in SPLITS}
