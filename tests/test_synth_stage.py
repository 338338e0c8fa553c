"""The synth stage end to end with the oracle: outputs, resume after a kill, bad input, and LLaMA-Factory training."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_synth_support import synth_tasks_dir, write_params  # noqa: F401  (fixture)

import stages.synth.__main__ as synth_main
from stages.synth.__main__ import main
from stages.synth.dataset import DATASET_NAME

SMALL = {"samples_per_task": 4, "shard_tasks": 2, "viewer_trajectories": 8}


@pytest.fixture(scope="module")
def finished(synth_tasks_dir, tmp_path_factory):  # noqa: F811
    """One complete run of the stage on six tasks x 4 samples; returns (out dir, stdout)."""
    root = tmp_path_factory.mktemp("synth_stage")
    params = write_params(root / "params.yaml", SMALL)
    out = root / "out"
    capture = subprocess.run(
        [sys.executable, "-m", "stages.synth", "--params", str(params), "--tasks", str(synth_tasks_dir),
         "--out", str(out), "--no-progress"],
        capture_output=True, text=True, check=False, env={**os.environ, "LOUPE_TRACKING": "off"},
    )
    assert capture.returncode == 0, capture.stderr
    return out, capture.stdout


def test_the_stage_writes_dataset_metrics_plots_and_viewer(finished):
    out, stdout = finished
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["teacher"] == "oracle" and metrics["tasks"] == 6 and metrics["trajectories"] == 24
    assert metrics["accepted"] == 24 and metrics["acceptance_rate"] == 1.0 and metrics["rejections"] == {}
    assert metrics["records"] == 24 - metrics["duplicates"]
    assert sum(metrics["turns_histogram"].values()) == metrics["accepted"]
    assert metrics["end_reasons"]["answered"] == 24 and sum(metrics["patterns"].values()) == 24
    assert "accepted 24 (100.0%)" in stdout and "turns (kept):" in stdout and "end reasons:" in stdout
    records = json.loads((out / "dataset" / f"{DATASET_NAME}.json").read_text())
    assert len(records) == metrics["records"]
    info = json.loads((out / "dataset" / "dataset_info.json").read_text())
    assert info[DATASET_NAME]["file_name"] == f"{DATASET_NAME}.json"
    assert info[DATASET_NAME]["columns"] == {"messages": "conversations", "images": "images"}
    assert info[DATASET_NAME]["tags"]["user_tag"] == "human" and info[DATASET_NAME]["tags"]["system_tag"] == "system"
    turns = json.loads((out / "plots" / "turns.json").read_text())
    assert sum(row["kept"] for row in turns) == 24
    assert (out / "plots" / "turns.png").stat().st_size > 1000 and (out / "plots" / "rejections.json").is_file()
    viewer = (out / "viewer.html").read_text()
    assert viewer.count('<details class="traj"') == 8 and "synth-train-000000#0" in viewer
    assert sorted(p.name for p in (out / "shards").iterdir()) == [
        "fingerprint.json", "shard-00000", "shard-00001", "shard-00002"]


def test_a_killed_run_resumes_after_its_finished_shards(finished, synth_tasks_dir, tmp_path, monkeypatch):  # noqa: F811
    params = write_params(tmp_path / "params.yaml", SMALL)
    out = tmp_path / "out"
    real = synth_main.run_rollouts
    calls: list[list[str]] = []

    def killed_on_the_second_shard(tasks, *args, **kwargs):
        calls.append([t.doc_id for t in tasks])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(tasks, *args, **kwargs)

    monkeypatch.setattr(synth_main, "run_rollouts", killed_on_the_second_shard)
    with pytest.raises(KeyboardInterrupt):
        main(["--params", str(params), "--tasks", str(synth_tasks_dir), "--out", str(out), "--no-progress"])
    assert not (out / "dataset").exists() and not (out / "metrics.json").exists()
    assert sorted(p.name for p in (out / "shards").iterdir() if not p.name.startswith(".")) == [
        "fingerprint.json", "shard-00000"]

    calls.clear()
    monkeypatch.setattr(synth_main, "run_rollouts", lambda tasks, *a, **k: calls.append([t.doc_id for t in tasks])
                        or real(tasks, *a, **k))
    assert main(["--params", str(params), "--tasks", str(synth_tasks_dir), "--out", str(out), "--no-progress"]) == 0
    assert calls == [["synth-train-000002", "synth-train-000003"], ["synth-train-000004", "synth-train-000005"]]
    clean_out, _ = finished
    assert (out / "dataset" / f"{DATASET_NAME}.json").read_text() == \
        (clean_out / "dataset" / f"{DATASET_NAME}.json").read_text()  # the same dataset as an uninterrupted run

    calls.clear()  # a rerun with everything finished generates nothing
    assert main(["--params", str(params), "--tasks", str(synth_tasks_dir), "--out", str(out), "--no-progress"]) == 0
    assert calls == []

    monkeypatch.setattr(synth_main, "_code_digest", lambda: "changed code")  # shards of other code are not reused
    assert main(["--params", str(params), "--tasks", str(synth_tasks_dir), "--out", str(out), "--no-progress"]) == 0
    assert len(calls) == 3


def test_bad_input_exits_2_naming_the_file_and_field(synth_tasks_dir, tmp_path, capsys):  # noqa: F811
    out = str(tmp_path / "out")
    typo = write_params(tmp_path / "typo.yaml", {"samples_per_taks": 2})
    assert main(["--params", str(typo), "--tasks", str(synth_tasks_dir), "--out", out]) == 2
    assert "synth.samples_per_taks" in capsys.readouterr().err

    params = write_params(tmp_path / "params.yaml", SMALL)
    assert main(["--params", str(params), "--tasks", str(tmp_path / "nowhere"), "--out", out]) == 2
    assert "nowhere: task folder or file not found" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["--params", str(params), "--tasks", str(tmp_path / "empty"), "--out", out]) == 2
    assert "empty/train.jsonl: task file not found" in capsys.readouterr().err

    record = json.loads((synth_tasks_dir / "train.jsonl").read_text().splitlines()[0])
    del record["bbox"]
    (tmp_path / "train.jsonl").write_text(json.dumps(record) + "\n")
    shutil.copytree(synth_tasks_dir / "images", tmp_path / "images")  # a symlink out of the task folder is refused
    assert main(["--params", str(params), "--tasks", str(tmp_path), "--out", out, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"task {record['doc_id']}: field 'bbox' is missing" in err and len(err.splitlines()) == 1

    record["images"] = ["images/train/missing.png"]
    record["bbox"] = [0.1, 0.1, 0.2, 0.2]
    (tmp_path / "train.jsonl").write_text(json.dumps(record) + "\n")
    assert main(["--params", str(params), "--tasks", str(tmp_path), "--out", out, "--no-progress"]) == 2
    assert "train.jsonl:1: field 'images.0'" in capsys.readouterr().err

    no_import_path = write_params(tmp_path / "imp.yaml", {"teacher": "import"})
    assert main(["--params", str(no_import_path), "--out", out]) == 2
    assert "import.path" in capsys.readouterr().err


@pytest.mark.slow
def test_llamafactory_trains_two_steps_on_the_dataset(finished, tiny_model_dir, tmp_path):
    """`llamafactory-cli train` accepts the dataset: full SFT of the tiny model on CPU for two steps."""
    out, _ = finished
    config = {
        "model_name_or_path": str(tiny_model_dir),
        "stage": "sft",
        "do_train": True,
        "finetuning_type": "full",
        "dataset": DATASET_NAME,
        "dataset_dir": str(out / "dataset"),
        "template": "qwen2_vl",
        "cutoff_len": 4096,
        "image_max_pixels": 50176,
        "image_min_pixels": 3136,
        "max_samples": 8,
        "max_steps": 2,
        "per_device_train_batch_size": 2,
        "learning_rate": 1.0e-4,
        "output_dir": str(tmp_path / "sft"),
        "overwrite_output_dir": True,
        "bf16": False,
        "report_to": "none",
        "logging_steps": 1,
        "save_strategy": "no",
        "preprocessing_num_workers": 1,
    }
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(config))
    cli = Path(sys.executable).with_name("llamafactory-cli")
    env = {**os.environ, "DISABLE_VERSION_CHECK": "1", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([str(cli), "train", str(tmp_path / "train.yaml")], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=600, check=False)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-3000:]
    assert "Num examples = 8" in log and "Skipping this abnormal example" not in log
    assert "'loss'" in log and (tmp_path / "sft" / "model.safetensors").is_file()


def test_every_crop_in_the_dataset_is_the_originals_pixels_at_the_composed_box(finished):
    """Replayed as Mini-o3 reads the dataset: each call's relative box, composed through the observations it names,
    is a box on the original. The region Loupe recorded must lie within 1 px of it, and the crop shown next must
    be the original's full-resolution pixels there, resized (not pixels of a downscaled observation)."""
    import re

    import numpy as np
    from PIL import Image

    out, _ = finished
    folder = out / "dataset"
    records = json.loads((folder / f"{DATASET_NAME}.json").read_text())
    index = [json.loads(line) for line in (folder / "index.jsonl").read_text().splitlines()]
    recorded = {}  # traj_id -> the region_px of each observation, from the shards' trajectories
    for file in sorted((out / "shards").glob("shard-*/trajectories.jsonl")):
        for line in file.read_text().splitlines():
            trajectory = json.loads(line)
            recorded[trajectory["traj_id"]] = [t["crop"]["region_px"] for t in trajectory["turns"] if t.get("crop")]
    checked = {"original_image": 0, "observation": 0}
    for record, row in zip(records, index):
        original = Image.open(folder / record["images"][0]).convert("RGB")
        width, height = original.size
        relative = {"original_image": (0.0, 0.0, 1.0, 1.0)}  # each image's box on the original, as fractions
        calls = [json.loads(re.search(r"<grounding>(.*?)</grounding>", turn["value"], re.S).group(1))
                 for turn in record["conversations"] if turn["from"] == "gpt" and "<grounding>" in turn["value"]]
        assert len(calls) == len(recorded[row["traj_id"]]) == len(record["images"]) - 1
        for shown, (call, region_px) in enumerate(zip(calls, recorded[row["traj_id"]]), start=1):
            sx0, sy0, sx1, sy1 = relative[call["source"]]
            x0, y0, x1, y1 = call["bbox_2d"]
            box = (sx0 + x0 * (sx1 - sx0), sy0 + y0 * (sy1 - sy0), sx0 + x1 * (sx1 - sx0), sy0 + y1 * (sy1 - sy0))
            relative[f"observation_{shown}"] = box
            composed = (box[0] * width, box[1] * height, box[2] * width, box[3] * height)
            assert all(abs(a - b) < 1.0 for a, b in zip(region_px, composed)), (row["traj_id"], region_px, composed)
            crop = Image.open(folder / record["images"][shown]).convert("RGB")
            expected = original.crop(tuple(region_px)).resize(crop.size, Image.Resampling.BICUBIC)
            difference = np.abs(np.asarray(crop, dtype=np.int16) - np.asarray(expected, dtype=np.int16))
            assert difference.max() <= 1, (record["images"][shown], call)
            checked["original_image" if call["source"] == "original_image" else "observation"] += 1
    assert checked["observation"] >= 3 and checked["original_image"] >= 6, checked
