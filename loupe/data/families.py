"""The `data` section: which procedural task family the data stage draws, and each family's knobs.

- `zoom` (loupe.data.zoom_tasks, the default): a colour patch legible only in a crop, at a place the question
  names and the overview shows; the tiny model learns it in minutes (docs/learning.md).
- `synthetic` (loupe.data.synthetic): cluttered visual search over five question kinds, a harder setting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from loupe.data.splits import SplitConfig
from loupe.data.synthetic import SyntheticConfig, generate_tasks
from loupe.data.zoom_tasks import ZoomTaskConfig, generate_zoom_tasks


class DataParams(BaseModel):
    """The `data` section of params.yaml."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    family: Literal["zoom", "synthetic"] = "zoom"
    """Task family the data stage writes: zoom (the embedded default) or synthetic (harder)."""
    zoom: ZoomTaskConfig = Field(default_factory=ZoomTaskConfig)
    """Knobs of the zoom family (read when `family` is zoom)."""
    synthetic: SyntheticConfig = Field(default_factory=SyntheticConfig)
    """Knobs of the synthetic family (read when `family` is synthetic)."""

    @property
    def config(self) -> SplitConfig:
        """The chosen family's config."""
        return self.zoom if self.family == "zoom" else self.synthetic


def generate_family(out_dir: Path, params: DataParams, progress: bool = False, workers: int = 1) -> dict[str, Path]:
    """Write the chosen family's splits into `out_dir`; returns {split: jsonl path}."""
    if params.family == "zoom":
        return generate_zoom_tasks(out_dir, params.zoom, progress, workers)
    return generate_tasks(out_dir, params.synthetic, progress, workers)
