"""The tiny model as a committed artefact (loupe.models.tiny_artifact): a manifest of its files' hashes, refused
when a file changed, copied by the data stage only when it was built with the settings the model section asks for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from loupe.config import ModelParams
from loupe.models.tiny_artifact import MANIFEST, ArtifactError, build_artifact, build_settings, read_manifest, sha256
from pipelines.data_stage import build_tiny

REPO = Path(__file__).resolve().parent.parent
SMALL = build_settings(seed=3, text_hidden=64, text_layers=1, perception_steps=2)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("artefact") / "tiny"
    build_artifact(out, SMALL, command="test")
    return out


def test_the_manifest_lists_every_file_with_its_hash_and_how_it_was_built(artifact):
    manifest = read_manifest(artifact)
    assert manifest["build"] == SMALL and manifest["perception"]["steps"] == 2
    assert set(manifest["files"]) == {p.name for p in artifact.iterdir()} - {MANIFEST}
    assert manifest["files"]["model.safetensors"] == sha256(artifact / "model.safetensors")
    assert manifest["built_with"]["cpu_capability"] and manifest["built_with"]["command"] == "test"


def test_a_changed_or_missing_file_is_refused_by_name(artifact, tmp_path):
    import shutil

    copy = tmp_path / "tiny"
    shutil.copytree(artifact, copy)
    weights = bytearray((copy / "model.safetensors").read_bytes())
    weights[-1] ^= 1  # one bit of one weight
    (copy / "model.safetensors").write_bytes(bytes(weights))
    with pytest.raises(ArtifactError, match=r"model.safetensors: its SHA-256 differs"):
        read_manifest(copy)
    (copy / "config.json").unlink()
    with pytest.raises(ArtifactError, match=r"config.json: listed in .* but missing"):
        read_manifest(copy)
    with pytest.raises(ArtifactError, match="no loupe-tiny.json; build the artefact with `loupe model tiny"):
        read_manifest(tmp_path)


def _model(artifact: Path, steps: int) -> ModelParams:
    return ModelParams(tiny_seed=3, tiny_text_hidden=64, tiny_text_layers=1, tiny_perception_steps=steps,
                       tiny_artifact=str(artifact))


def test_the_data_stage_copies_a_matching_artefact_and_builds_otherwise(artifact, tmp_path, capsys):
    copied = tmp_path / "copied"
    _, report = build_tiny(copied, _model(artifact, 2))
    assert report["from_artifact"] == 1 and "checked by hash" in capsys.readouterr().out
    for name, digest in read_manifest(artifact)["files"].items():
        assert sha256(copied / name) == digest
    built = tmp_path / "built"
    _, report = build_tiny(built, _model(artifact, 0))  # another step count: not the artefact's model
    assert "from_artifact" not in report and "building it here" in capsys.readouterr().out
    assert sha256(built / "model.safetensors") != sha256(artifact / "model.safetensors")


def test_the_committed_artefact_is_intact_and_is_the_one_params_yaml_asks_for():
    model = yaml.safe_load((REPO / "params.yaml").read_text())["model"]
    manifest = read_manifest(REPO / model["tiny_artifact"])
    assert manifest["build"] == build_settings(model["tiny_seed"], model["tiny_text_hidden"],
                                               model["tiny_text_layers"], model["tiny_perception_steps"])
    assert manifest["perception"]["held_out_accuracy"] >= 0.8  # it sees colours: docs/learning.md
    assert json.loads((REPO / model["tiny_artifact"] / "config.json").read_text())["model_type"] == "qwen2_5_vl"


def test_a_run_on_another_model_builds_no_tiny_model(tmp_path, capsys):
    count, report = build_tiny(tmp_path / "tiny", ModelParams(build_tiny=False, path="/models/Qwen3-VL-8B-Instruct"))
    assert (count, report) == (0, {})
    assert [p.name for p in (tmp_path / "tiny").iterdir()] == ["NOT_BUILT.txt"]
    assert "/models/Qwen3-VL-8B-Instruct" in (tmp_path / "tiny" / "NOT_BUILT.txt").read_text()
    assert "not built (model.build_tiny: false" in capsys.readouterr().out
