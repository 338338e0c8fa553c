"""The `data` section: which procedural task family the data stage draws, and each family's knobs.

- `zoom` (loupe.data.zoom_tasks, the default): a colour patch legible only in a crop, at a place the question
  names and the overview shows; the tiny model learns it in minutes (docs/learning.md).
- `synthetic` (loupe.data.synthetic): cluttered visual search over five question kinds, a harder setting.
- `arithmetic`, `counting`, `geometry` (loupe.data.recipe_tasks): the seeds' recipes' kinds of task (text-only
  math, CLEVR-like counting, GeoQA-like geometry) for the CPU twins of their presets.
"""

from __future__ import annotations

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
from loupe.data.splits import SplitConfig
from loupe.data.synthetic import SyntheticConfig, generate_tasks
from loupe.data.zoom_tasks import ZoomTaskConfig, generate_zoom_tasks


class DataParams(BaseModel):
    """The `data` section of params.yaml."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    family: Literal["zoom", "synthetic", "arithmetic", "counting", "geometry"] = "zoom"
    """Task family the data stage writes: zoom (the embedded default), synthetic (harder), or one of the
    recipes' kinds: arithmetic (text-only), counting, geometry."""
    zoom: ZoomTaskConfig = Field(default_factory=ZoomTaskConfig)
    """Knobs of the zoom family (read when `family` is zoom)."""
    synthetic: SyntheticConfig = Field(default_factory=SyntheticConfig)
    """Knobs of the synthetic family (read when `family` is synthetic)."""
    arithmetic: ArithmeticConfig = Field(default_factory=ArithmeticConfig)
    """Knobs of the arithmetic family (text-only questions)."""
    counting: CountingConfig = Field(default_factory=CountingConfig)
    """Knobs of the counting family."""
    geometry: GeometryConfig = Field(default_factory=GeometryConfig)
    """Knobs of the geometry family."""

    extra_families: list[Literal["zoom", "synthetic", "arithmetic", "counting", "geometry"]] = []
    """More task sets the data stage writes, each in `<out>/tasks_<family>` (a two-stage recipe trains its
    stages on different data: LMM-R1's text-only FRE, then geometry)."""

    @property
    def config(self) -> SplitConfig:
        """The chosen family's config."""
        return getattr(self, self.family)


_GENERATORS = {"zoom": generate_zoom_tasks, "synthetic": generate_tasks, "arithmetic": generate_arithmetic_tasks,
               "counting": generate_counting_tasks, "geometry": generate_geometry_tasks}


def generate_family(out_dir: Path, params: DataParams, progress: bool = False, workers: int = 1) -> dict[str, Path]:
    """Write the chosen family's splits into `out_dir`; returns {split: jsonl path}."""
    return _GENERATORS[params.family](out_dir, params.config, progress, workers)


def generate_families(out_dir: Path, params: DataParams, progress: bool = False, workers: int = 1) -> dict[str, Path]:
    """The chosen family into `out_dir/tasks` and each extra family into `out_dir/tasks_<family>`;
    returns {folder name: folder}."""
    folders = {"tasks": out_dir / "tasks"}
    generate_family(folders["tasks"], params, progress, workers)
    for family in params.extra_families:
        folder = folders[f"tasks_{family}"] = out_dir / f"tasks_{family}"
        _GENERATORS[family](folder, getattr(params, family), progress, workers)
    return folders
