"""The `data` section: which procedural task family the data stage draws, and each family's knobs.

- `zoom` (loupe.data.zoom_tasks, the default): a colour patch legible only in a crop, at a place the question
  names and the overview shows; the tiny model learns it in minutes (docs/learning.md).
- `synthetic` (loupe.data.synthetic): cluttered visual search over five question kinds, a harder setting.
- `operations` (loupe.data.operation_tasks): signs to read, shapes to segment and measure, squares to track in
  short videos: questions a crop cannot answer, for Pixelis' visual operations.
- `arithmetic`, `counting`, `geometry` (loupe.data.recipe_tasks): the seeds' recipes' kinds of task (text-only
  math, CLEVR-like counting, GeoQA-like geometry) for the CPU twins of their presets.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from loupe.data.recipe_tasks import (
    ArithmeticConfig,
    CountingConfig,
    GeometryConfig,
    generate_arithmetic_tasks,
    generate_counting_tasks,
    generate_geometry_tasks,
)
from loupe.data.operation_tasks import OperationTaskConfig, generate_operation_tasks
from loupe.data.splits import SPLITS, SplitConfig, check_replaceable
from loupe.data.tasks import TaskRecord, read_tasks, write_tasks
from loupe.io import atomic_directory
from loupe.data.synthetic import SyntheticConfig, generate_tasks
from loupe.data.zoom_tasks import ZoomTaskConfig, generate_zoom_tasks


Family = Literal["zoom", "synthetic", "operations", "arithmetic", "counting", "geometry"]


class DataParams(BaseModel):
    """The `data` section of params.yaml."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    family: Literal["zoom", "synthetic", "operations", "arithmetic", "counting", "geometry", "mixed"] = "zoom"
    """Task family the data stage writes: zoom (the embedded default), synthetic (harder), operations (Pixelis'
    visual operations), one of the recipes' kinds: arithmetic (text-only), counting, geometry; or mixed: the families `mixed` lists, together."""
    mixed: list[Family] = ["arithmetic", "geometry"]
    """The families a `mixed` task set holds, each with its own knobs (a cold start that covers a two-stage
    recipe's kinds of task); records interleaved, each family's images under images/<family>/."""
    zoom: ZoomTaskConfig = Field(default_factory=ZoomTaskConfig)
    """Knobs of the zoom family (read when `family` is zoom)."""
    synthetic: SyntheticConfig = Field(default_factory=SyntheticConfig)
    """Knobs of the synthetic family (read when `family` is synthetic)."""
    operations: OperationTaskConfig = Field(default_factory=OperationTaskConfig)
    """Knobs of the operations family (signs, shapes, moving squares)."""
    arithmetic: ArithmeticConfig = Field(default_factory=ArithmeticConfig)
    """Knobs of the arithmetic family (text-only questions)."""
    counting: CountingConfig = Field(default_factory=CountingConfig)
    """Knobs of the counting family."""
    geometry: GeometryConfig = Field(default_factory=GeometryConfig)
    """Knobs of the geometry family."""

    extra_families: list[Family] = []
    """More task sets the data stage writes, each in `<out>/tasks_<family>` (a two-stage recipe trains its
    stages on different data: LMM-R1's text-only FRE, then geometry)."""

    @property
    def config(self) -> SplitConfig:
        """The chosen family's config (a mixed set's first family's)."""
        return getattr(self, self.mixed[0] if self.family == "mixed" else self.family)


_GENERATORS = {"zoom": generate_zoom_tasks, "synthetic": generate_tasks, "operations": generate_operation_tasks, "arithmetic": generate_arithmetic_tasks,
               "counting": generate_counting_tasks, "geometry": generate_geometry_tasks}


def generate_family(out_dir: Path, params: DataParams, progress: bool = False, workers: int = 1) -> dict[str, Path]:
    """Write the chosen family's splits into `out_dir`; returns {split: jsonl path}."""
    if params.family == "mixed":
        return generate_mixed(out_dir, params, progress, workers)
    return _GENERATORS[params.family](out_dir, params.config, progress, workers)


def generate_mixed(out_dir: Path, params: DataParams, progress: bool = False, workers: int = 1) -> dict[str, Path]:
    """The families of `params.mixed` in one task folder: each drawn with its own knobs into a scratch folder,
    its image paths moved under images/<family>/, the records of every split interleaved family by family."""
    check_replaceable(out_dir)
    with tempfile.TemporaryDirectory(dir=out_dir.parent if out_dir.parent.exists() else None) as scratch, \
            atomic_directory(out_dir) as tmp:
        parts = {}
        for family in dict.fromkeys(params.mixed):
            parts[family] = _GENERATORS[family](Path(scratch) / family, getattr(params, family), progress, workers)
            (tmp / "images").mkdir(exist_ok=True)
            shutil.move(str(Path(scratch) / family / "images"), str(tmp / "images" / family))
        for split in SPLITS:
            streams = [[_moved(r, family) for r in read_tasks(paths[split])] for family, paths in parts.items()]
            interleaved = [r for group in itertools.zip_longest(*streams) for r in group if r is not None]
            write_tasks(interleaved, tmp / f"{split}.jsonl")
    return {split: out_dir / f"{split}.jsonl" for split in SPLITS}


def _moved(record: TaskRecord, family: str) -> TaskRecord:
    """`record` with its image and video paths under images/<family>/."""
    def moved(path: str) -> str:
        return f"images/{family}/{path.removeprefix('images/')}"

    update: dict = {"images": [moved(i) for i in record.images]}
    if record.video is not None:
        update["video"] = moved(record.video)
    return record.model_copy(update=update)


def generate_families(out_dir: Path, params: DataParams, progress: bool = False, workers: int = 1) -> dict[str, Path]:
    """The chosen family into `out_dir/tasks` and each extra family into `out_dir/tasks_<family>`;
    returns {folder name: folder}."""
    folders = {"tasks": out_dir / "tasks"}
    generate_family(folders["tasks"], params, progress, workers)
    for family in params.extra_families:
        folder = folders[f"tasks_{family}"] = out_dir / f"tasks_{family}"
        _GENERATORS[family](folder, getattr(params, family), progress, workers)
    return folders
