"""Shared fixtures: the embedded tiny model and a small synthetic task set, each built once per test session, and
the tool tests' images."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from PIL import Image

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tests opt in to MLflow (with a store under their tmp_path); everything else runs with the stand-in logger.
os.environ.setdefault("LOUPE_TRACKING", "off")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A freshly built tiny Qwen2.5-VL directory (seed 0)."""
    from loupe.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def scene_dir(tmp_path_factory) -> Path:
    """A folder holding `scene.png`: a 1400x1000 blue canvas with a small yellow square at (700, 500)."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("scene")
    image = Image.new("RGB", (1400, 1000), (30, 90, 160))
    image.paste((250, 220, 0), (700, 500, 760, 560))
    image.save(folder / "scene.png")
    return folder


@pytest.fixture(scope="session")
def family_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """A freshly built tiny model of each family (seed 0, text 64 x 2): Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE and
    Qwen3.5 (a Gated DeltaNet layer, then a full-attention one)."""
    from loupe.models.tiny import FAMILIES, build_tiny_model

    root = tmp_path_factory.mktemp("families")
    return {family: build_tiny_model(root / family, seed=0, family=family) for family in FAMILIES}


@pytest.fixture
def noise() -> Image.Image:
    """1120x896 RGB noise: any crop of it shows whether the right pixels came back."""
    from tests.tool_cases import noise_image

    return noise_image(1120, 896)


@pytest.fixture
def square_image() -> Image.Image:
    """White 1000x800 with a red square at x 200..300, y 100..200 and a blue one at x 600..700, y 500..600."""
    from tests.tool_cases import BLUE, RED, WHITE

    image = Image.new("RGB", (1000, 800), WHITE)
    image.paste(RED, (200, 100, 300, 200))
    image.paste(BLUE, (600, 500, 700, 600))
    return image
