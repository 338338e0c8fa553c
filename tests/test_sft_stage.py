"""`python -m stages.sft` on the tiny model: trains, exports a model that loads and generates, reports to MLflow,
refuses bad input before training, passes LLaMA-Factory's own errors on, resumes a killed run, merges LoRA."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from PIL import Image
from test_sft_checks import build_dataset

from stages.sft.__main__ import main as sft_main
from stages.sft.runner import complete_checkpoints

REPO = Path(__file__).parents[1]


def write_params(root: Path, name: str = "params.yaml", **sft) -> Path:
    params = {
        "seed": 3,
        "protocol": {"min_pixels": 3136, "max_pixels": 50176},
        "sft": {"learning_rate": 3e-3, "per_device_train_batch_size": 2, "logging_steps": 1, "save_steps": 4,
                "warmup_ratio": 0.0, "lr_scheduler_type": "constant", **sft},
    }
    path = root / name
    path.write_text(yaml.safe_dump(params))
    return path


def run_stage(params: Path, model: Path, dataset: Path, out: Path) -> int:
    return sft_main(["--params", str(params), "--model", str(model), "--dataset", str(dataset), "--out", str(out)])


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return build_dataset(tmp_path_factory.mktemp("sft-data") / "dataset", samples=8)


def generate_with_image(model_dir: Path) -> str:
    """Load through the Auto classes (as eval and rl do) and generate from an image question."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    messages = [{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (112, 84), "red")},
                                             {"type": "text", "text": "What colour is the small square?"}]}]
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                           return_dict=True, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert model.generation_config.use_cache and model.config.text_config.use_cache
    return processor.decode(output[0, inputs["input_ids"].shape[1]:])


def test_stage_trains_exports_and_reports_to_mlflow(tmp_path, tiny_model_dir, dataset, monkeypatch, capsys):
    monkeypatch.setenv("LOUPE_TRACKING", "on")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    out = tmp_path / "sft"
    assert run_stage(write_params(tmp_path, max_steps=8), tiny_model_dir, dataset, out) == 0
    printed = capsys.readouterr().out
    assert "sft: 8 samples" in printed and "sft: 8 steps (full, cpu)" in printed
    # LLaMA-Factory's own records go to its log file, not the console.
    assert "[INFO|" not in printed and "[INFO|" in (out / "llamafactory" / "train.log").read_text()

    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 8 and metrics["samples"] == 8 and metrics["resumed_from_step"] == 0
    assert metrics["final_loss"] < metrics["first_loss"]  # 8 steps at 3e-3 on 8 samples: clearly learning
    assert metrics["samples_per_second"] > 0 and metrics["wall_time_s"] > 0
    curve = json.loads((out / "plots" / "loss.json").read_text())
    assert [row["step"] for row in curve] == list(range(1, 9)) and curve[0]["loss"] == metrics["first_loss"]
    assert (out / "plots" / "loss.png").read_bytes().startswith(b"\x89PNG")

    config = yaml.safe_load((out / "llamafactory" / "train.yaml").read_text())
    assert config["report_to"] == "mlflow" and config["output_dir"] == str((out / "train").resolve())
    assert "llamafactory-cli train" in (out / "llamafactory" / "train.yaml").read_text().splitlines()[1]
    assert "Training completed" in (out / "llamafactory" / "train.log").read_text()
    assert not list((out / "train").glob("checkpoint-*"))  # removed after export (keep_checkpoints false)

    assert isinstance(generate_with_image(out / "model"), str)
    base = json.loads((tiny_model_dir / "config.json").read_text())
    assert json.loads((out / "model" / "config.json").read_text())["architectures"] == base["architectures"]
    assert oct((out / "model" / "model.safetensors").stat().st_mode & 0o777) == "0o644"

    import mlflow

    [run] = mlflow.search_runs(experiment_names=["loupe"], output_format="list")
    client = mlflow.MlflowClient()
    # LLaMA-Factory's own reporting, from the subprocess, into the stage's run: the loss at every step.
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == list(range(1, 9))
    assert client.get_metric_history(run.info.run_id, "learning_rate")
    assert run.data.metrics["final_loss"] == pytest.approx(metrics["final_loss"])
    assert run.data.params["sft.learning_rate"] == "0.003" and run.data.tags["loupe.stage"] == "sft"
    artefacts = {a.path for a in client.list_artifacts(run.info.run_id, "llamafactory")}
    assert "llamafactory/train.yaml" in artefacts


def test_bad_input_fails_before_training_with_exit_2(tmp_path, tiny_model_dir, dataset, capsys):
    params = write_params(tmp_path, max_steps=2)
    assert run_stage(params, tmp_path / "no-model", dataset, tmp_path / "a") == 2
    assert "no-model: base model not found" in capsys.readouterr().err
    assert run_stage(write_params(tmp_path, "tight.yaml", cutoff_len=64), tiny_model_dir, dataset, tmp_path / "b") == 2
    err = capsys.readouterr().err
    assert "loupe_synth.json: sample" in err and "sft.cutoff_len is 64" in err
    assert run_stage(write_params(tmp_path, "typo.yaml", lerning_rate=1), tiny_model_dir, dataset, tmp_path / "c") == 2
    assert "sft.lerning_rate" in capsys.readouterr().err
    assert not any((tmp_path / name).exists() for name in ("a", "b", "c"))  # nothing started


def test_a_llamafactory_failure_exits_1_with_its_own_error(tmp_path, tiny_model_dir, dataset, capsys):
    params = write_params(tmp_path, max_steps=2, extra={"not_a_llamafactory_key": 1})
    assert run_stage(params, tiny_model_dir, dataset, tmp_path / "sft") == 1
    err = capsys.readouterr().err
    assert "llamafactory-cli train failed (exit code 1)" in err
    assert "not_a_llamafactory_key" in err and "Traceback" in err and "train.log" in err
    assert not (tmp_path / "sft" / "model").exists() and not (tmp_path / "sft" / "metrics.json").exists()


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.is_file() else []


@pytest.mark.slow
def test_a_killed_run_resumes_from_its_last_checkpoint(tmp_path, tiny_model_dir, dataset):
    """SIGKILL the trainer after its first checkpoint; the rerun continues from the last one to the end."""
    out = tmp_path / "sft"
    params = write_params(tmp_path, max_steps=40, save_steps=10)
    command = [sys.executable, "-m", "stages.sft", "--params", str(params), "--model", str(tiny_model_dir),
               "--dataset", str(dataset), "--out", str(out)]
    env = {**os.environ, "LOUPE_TRACKING": "off"}
    stage = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not complete_checkpoints(out / "train"):
        assert stage.poll() is None, stage.stderr.read().decode()
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    [trainer] = _children(stage.pid)
    os.kill(trainer, signal.SIGKILL)
    assert stage.wait(timeout=60) == 1
    assert "killed by signal 9" in stage.stderr.read().decode()
    last_step = complete_checkpoints(out / "train")[-1][0]
    assert 10 <= last_step < 40 and not (out / "model").exists()

    rerun = subprocess.run(command, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert f"resuming from checkpoint-{last_step}" in rerun.stdout
    assert f"Resuming training from {(out / 'train').resolve()}/checkpoint-{last_step}" in rerun.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 40 and metrics["resumed_from_step"] == last_step
    steps = [row["step"] for row in json.loads((out / "plots" / "loss.json").read_text())]
    assert steps == list(range(1, 41))  # every step once: the restored history, then the new steps

    again = subprocess.run(command, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "training already finished" in again.stdout


@pytest.mark.slow
def test_two_cpu_processes_train_the_same_steps_over_gloo(tmp_path, tiny_model_dir, dataset, capsys):
    """sft.cpu_processes: 2 runs LLaMA-Factory under torchrun on the CPU; the step's batch of 2 is shared out,
    so 8 samples still make 4 steps, and the model it exports loads and generates."""
    out = tmp_path / "sft"
    params = write_params(tmp_path, num_train_epochs=1, cpu_processes=2, dataloader_num_workers=0)
    assert run_stage(params, tiny_model_dir, dataset, out) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 4 and metrics["cpu_processes"] == 2 and metrics["final_loss"] > 0
    by_hand = (out / "llamafactory" / "train.yaml").read_text().splitlines()[1]
    assert "OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node=2 " in by_hand and by_hand.endswith("train.yaml")
    log = (out / "llamafactory" / "train.log").read_text()
    assert "world size: 2" in log and "distributed training: True" in log
    assert "sft: 4 steps (full, cpu)" in capsys.readouterr().out
    assert isinstance(generate_with_image(out / "model"), str)


@pytest.mark.slow
def test_lora_adapters_are_merged_into_a_plain_model(tmp_path, tiny_model_dir, dataset):
    out = tmp_path / "sft"
    params = write_params(tmp_path, max_steps=6, finetuning_type="lora",
                          lora={"rank": 4, "alpha": 8, "target": "all"}, learning_rate=1e-2)
    assert run_stage(params, tiny_model_dir, dataset, out) == 0
    model_dir = out / "model"
    assert not (model_dir / "adapter_config.json").exists() and (model_dir / "config.json").is_file()
    export = yaml.safe_load((out / "llamafactory" / "export.yaml").read_text())
    assert export["adapter_name_or_path"] == str((out / "train").resolve())
    assert export["export_dir"] == str(model_dir.resolve())  # the by-hand command writes where the stage did

    from safetensors.torch import load_file

    base, merged = load_file(tiny_model_dir / "model.safetensors"), load_file(next(model_dir.glob("*.safetensors")))
    assert base.keys() == merged.keys()
    changed = [k for k in base if not base[k].equal(merged[k])]
    assert any(".self_attn." in k for k in changed)  # the language model's layers got the merged adapters
    assert not any("visual" in k for k in changed)  # the vision tower stays frozen
    assert isinstance(generate_with_image(model_dir), str)
