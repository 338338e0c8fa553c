"""The dataset writer and the shard store: LLaMA-Factory's reading of the folder, dedup, atomicity, resume."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
from test_synth_support import synth_tasks_dir, train_tasks  # noqa: F401  (fixture)

from loupe.config import ProtocolParams
from loupe.protocol import get_protocol
from loupe.rollout import run_rollouts
from loupe.trajectory import write_trajectories
from stages.synth import dataset as dataset_module
from stages.synth.dataset import DATASET_NAME, ShardStore, write_llamafactory_dataset
from stages.synth.oracle import OracleEngine
from stages.synth.params import OracleParams


@pytest.fixture(scope="module")
def saved(synth_tasks_dir, tmp_path_factory):  # noqa: F811
    """Oracle trajectories of three tasks x 2 samples, written to disk and read back (as the stage does)."""
    tasks = train_tasks(synth_tasks_dir)[:3]
    engine = OracleEngine(OracleParams(), get_protocol("mini_o3"), seed=0, max_turns=6)
    engine.prepare(tasks, 2)
    trajectories = run_rollouts(tasks, engine, ProtocolParams(), synth_tasks_dir, samples_per_task=2)
    store = ShardStore(tmp_path_factory.mktemp("shards"), {"test": 1})
    store.write(0, trajectories, {"index": 0})
    return store.read(0)[0]


def test_records_are_what_llamafactory_reads(saved, tmp_path):
    """Checked with LLaMA-Factory's own dataset parser, sharegpt converter and qwen2_vl image-count check."""
    from llamafactory.data.converter import get_dataset_converter
    from llamafactory.data.mm_plugin import get_mm_plugin
    from llamafactory.data.parser import get_dataset_list
    from llamafactory.hparams import DataArguments

    folder = tmp_path / "dataset"
    summary = write_llamafactory_dataset(saved, folder)
    assert summary.records == len(saved) == 6 and summary.duplicates == 0
    [attr] = get_dataset_list([DATASET_NAME], str(folder))
    assert (attr.formatting, attr.messages, attr.images, attr.load_from) == ("sharegpt", "conversations", "images", "file")
    converter = get_dataset_converter(attr.formatting, attr, DataArguments(dataset_dir=str(folder), dataset=DATASET_NAME))
    plugin = get_mm_plugin("qwen2_vl", image_token="<|image_pad|>")
    records = json.loads((folder / f"{DATASET_NAME}.json").read_text())
    for record, trajectory in zip(records, saved):
        assert all(not Path(p).is_absolute() and (folder / p).is_file() for p in record["images"])
        out = converter(record)
        assert out["_prompt"] and out["_response"][0]["role"] == "assistant"  # not skipped as abnormal
        assert out["_system"] == trajectory.system
        assert len(out["_prompt"]) == 2 * trajectory.num_turns - 1  # every turn, observations as user turns
        plugin._validate_messages(out["_prompt"] + out["_response"], out["_images"], [], [])
        for dataset_path, source in zip(record["images"], trajectory.images):  # the very bytes of each image
            assert (folder / dataset_path).read_bytes() == trajectory.image_path(trajectory.images.index(source)).read_bytes()
    index = [json.loads(line) for line in (folder / "index.jsonl").read_text().splitlines()]
    assert [row["traj_id"] for row in index] == [t.traj_id for t in saved]


def test_each_image_is_stored_once_and_identical_trajectories_once(saved, tmp_path):
    twin = copy.deepcopy(saved[0])  # same dialogue, same pixels in other files: a duplicate
    twin.traj_id = "twin"
    write_trajectories([twin], tmp_path / "elsewhere" / "t.jsonl")
    folder = tmp_path / "dataset"
    summary = write_llamafactory_dataset([*saved, twin], folder)
    assert summary.records == len(saved) and summary.duplicates == 1
    records = json.loads((folder / f"{DATASET_NAME}.json").read_text())
    originals = {r["images"][0] for r in records}
    assert len(originals) == 3  # one file per task image, shared by its samples
    files = list((folder / "images").iterdir())
    assert len(files) == summary.images == len({p for r in records for p in r["images"]})
    source = saved[0].image_path(0)
    placed = folder / records[0]["images"][0]
    assert os.path.samefile(source, placed) or placed.read_bytes() == source.read_bytes()


def test_a_failed_write_leaves_the_previous_dataset_whole(saved, tmp_path, monkeypatch):
    folder = tmp_path / "dataset"
    write_llamafactory_dataset(saved[:2], folder)
    before = (folder / f"{DATASET_NAME}.json").read_text()
    calls = {"n": 0}
    real = dataset_module._link_or_copy

    def dies_midway(source, target):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # a kill in the middle of copying images
        real(source, target)

    monkeypatch.setattr(dataset_module, "_link_or_copy", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        write_llamafactory_dataset(saved, folder)
    assert (folder / f"{DATASET_NAME}.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dataset"]  # no half-built folder left beside it


def test_shards_resume_and_are_discarded_when_their_inputs_change(saved, tmp_path):
    store = ShardStore(tmp_path / "shards", {"tasks": "abc"})
    store.write(0, saved[:2], {"index": 0})
    assert store.is_done(0) and not store.is_done(1) and store.done() == [0]
    (tmp_path / "shards" / ".shard-00001.partial-x").mkdir()  # what a killed write leaves
    again = ShardStore(tmp_path / "shards", {"tasks": "abc"})
    assert again.done() == [0] and again.discarded == 0
    again.write(1, saved[2:], {"index": 1})
    assert not (tmp_path / "shards" / ".shard-00001.partial-x").exists()
    trajectories, manifest = again.read(0)
    assert [t.traj_id for t in trajectories] == [t.traj_id for t in saved[:2]] and manifest == {"index": 0}
    assert trajectories[0].load_image(1).size == saved[0].load_image(1).size  # crops travel with the shard
    changed = ShardStore(tmp_path / "shards", {"tasks": "xyz"})
    assert changed.done() == [] and changed.discarded == 2


def test_an_original_a_plain_decoder_would_show_rotated_is_stored_upright(saved, tmp_path):
    """LLaMA-Factory opens images with a plain convert("RGB"): it must get the upright pixels the crops came from."""
    import numpy as np
    from PIL import Image

    from loupe.images import open_image

    trajectory = copy.deepcopy(saved[0])
    upright = open_image(trajectory.image_path(0))
    stored = upright.rotate(90, expand=True)  # EXIF orientation 6: turn 270 degrees clockwise to show it upright
    exif = Image.Exif()
    exif[0x0112] = 6
    rotated_file = tmp_path / "photo.png"
    stored.save(rotated_file, exif=exif)
    assert np.array_equal(np.asarray(open_image(rotated_file)), np.asarray(upright))
    trajectory.images[0] = str(rotated_file)
    folder = tmp_path / "dataset"
    write_llamafactory_dataset([trajectory], folder)
    [record] = json.loads((folder / f"{DATASET_NAME}.json").read_text())
    assert record["images"][0].endswith(".upright.png")
    with Image.open(folder / record["images"][0]) as image:  # as LLaMA-Factory's plugin reads it
        assert np.array_equal(np.asarray(image.convert("RGB")), np.asarray(upright))
    assert not record["images"][1].endswith(".upright.png")  # plain crops are linked as they are
