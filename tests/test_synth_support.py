"""Shared helpers of the synth stage's tests (no tests here): a small synthetic task set and params files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from loupe.data.synthetic import SyntheticConfig, generate_tasks
from loupe.data.tasks import TaskRecord, read_tasks


@pytest.fixture(scope="session")
def synth_tasks_dir(tmp_path_factory) -> Path:
    """Six small synthetic train tasks (choice and free-form mixed), written once per session."""
    folder = tmp_path_factory.mktemp("synth_tasks") / "tasks"
    generate_tasks(folder, SyntheticConfig(seed=3, train=6, val=0, test=0, canvas_side=(1024, 1280)))
    return folder


def train_tasks(folder: Path) -> list[TaskRecord]:
    return read_tasks(folder / "train.jsonl")


def write_params(path: Path, synth: dict[str, Any] | None = None, **sections: Any) -> Path:
    """A params.yaml with a synth section and any other sections given (defaults for the rest)."""
    data: dict[str, Any] = {"seed": 0, **sections}
    if synth is not None:
        data["synth"] = synth
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path
