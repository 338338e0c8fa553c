"""The tiny model's perception pretraining (loupe.models.tiny_perception) and the data section's families."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

from loupe.data.families import DataParams, generate_family
from loupe.data.synthetic_draw import PALETTE
from loupe.data.tasks import read_tasks
from loupe.models.tiny_perception import COLOURS, perception_picture, pretrain_perception


def test_pictures_are_deterministic_and_show_their_colour():
    first = [perception_picture(np.random.default_rng([3, 1])) for _ in range(1)]
    again = [perception_picture(np.random.default_rng([3, 1])) for _ in range(1)]
    assert np.array_equal(np.asarray(first[0][0]), np.asarray(again[0][0])) and first[0][1] == again[0][1]
    rng = np.random.default_rng(5)
    for _ in range(20):
        image, colour = perception_picture(rng)
        assert image.width % 28 == 0 and image.height % 28 == 0 and 56 <= min(image.size) <= 112
        pixels = {tuple(p) for p in np.asarray(image).reshape(-1, 3)}
        assert PALETTE[colour] in pixels and colour in COLOURS


def test_pretraining_changes_the_weights_in_place_and_reports_held_out_accuracy(tiny_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    before = {k: v.copy() for k, v in load_file(str(model / "model.safetensors")).items()}
    report = pretrain_perception(model, steps=3, held_out=8)
    after = load_file(str(model / "model.safetensors"))
    assert set(after) == set(before) and any(not np.array_equal(before[k], after[k]) for k in before)
    assert report.steps == 3 and 0.0 <= report.held_out_accuracy <= 1.0 and report.first_loss > 0


def test_pretraining_moves_only_the_words_its_texts_hold(tiny_model_dir, tmp_path):
    """Tied embeddings let the answer's language-model loss push every unused word the same way; the pretraining
    keeps them where they were, so "left" and "right" stay apart for SFT (docs/learning.md)."""
    from transformers import AutoTokenizer

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    key = next(k for k in load_file(str(model / "model.safetensors")) if k.endswith("embed_tokens.weight"))
    before = load_file(str(model / "model.safetensors"))[key]
    pretrain_perception(model, steps=5, held_out=4)
    after = load_file(str(model / "model.safetensors"))[key]
    word = lambda text: tokenizer.encode(text, add_special_tokens=False)[0]  # noqa: E731
    for unused in (" left", " right", " middle", " centre", "<grounding>"):
        assert np.array_equal(before[word(unused)], after[word(unused)]), unused
    for used in (" red", " colour", " square"):
        assert not np.array_equal(before[word(used)], after[word(used)]), used


def test_the_data_section_picks_a_family(tmp_path):
    zoom = DataParams.model_validate({"zoom": {"train": 2, "val": 1, "test": 1}})
    assert zoom.family == "zoom" and zoom.config is zoom.zoom
    generate_family(tmp_path / "zoom", zoom)
    assert read_tasks(tmp_path / "zoom" / "train.jsonl")[0].data_source == "zoom"
    synthetic = DataParams.model_validate({"family": "synthetic", "synthetic": {"train": 2, "val": 0, "test": 0,
                                                                              "canvas_side": [1024, 1024]}})
    generate_family(tmp_path / "synthetic", synthetic)
    assert read_tasks(tmp_path / "synthetic" / "train.jsonl")[0].data_source != "zoom"
    with pytest.raises(ValueError, match="family"):
        DataParams.model_validate({"family": "other"})
