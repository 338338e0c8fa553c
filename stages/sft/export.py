"""The stage's model directory: the trained weights as a plain Hugging Face model that loads and generates.

- Full fine-tuning: the files LLaMA-Factory saved at the top of its output folder (weights, config,
  tokenizer, processor, chat template), without its training records. Weights are hard-linked when the file
  system allows (a 7B model is 15 GB; the training folder keeps its copy so a rerun can re-export).
- LoRA: `llamafactory-cli export` merges the adapters into the base weights (its YAML is saved beside the
  training YAML).
- Either way `use_cache` is switched back on: LLaMA-Factory saves `use_cache: false` (needed while training
  with gradient checkpointing), which would make every generated token recompute the whole sequence.
- Weight files are made world-readable: transformers writes them with mode 0600, which a container running as
  another user, or a DVC cache shared between users, cannot read.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from loupe.io import atomic_directory, atomic_write_json, make_readable
from loupe.models.family import write_published_layout
from stages.sft import llamafactory_config, runner

TRAINING_RECORDS = {
    "trainer_log.jsonl",
    "trainer_state.json",
    "train_results.json",
    "all_results.json",
    "eval_results.json",
    "training_args.bin",
    "training_loss.png",
    "README.md",
    "loupe_fingerprint.json",
}
"""Files of LLaMA-Factory's output folder that describe the training, not the model."""
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def copy_model_files(train_dir: Path, target: Path) -> None:
    """The model's files from LLaMA-Factory's output folder into `target` (weights hard-linked if possible)."""
    target.mkdir(parents=True, exist_ok=True)
    for path in sorted(Path(train_dir).iterdir()):
        if path.is_dir() or path.name.startswith(".") or path.name in TRAINING_RECORDS:
            continue
        destination = target / path.name
        if path.suffix in WEIGHT_SUFFIXES:
            try:
                os.link(path, destination)
                continue
            except OSError:
                pass  # another file system, or links not allowed: copy
        shutil.copy2(path, destination)


def restore_use_cache(model_dir: Path) -> None:
    """Switch the KV cache back on in config.json (and its text config) and generation_config.json."""
    config_path = Path(model_dir) / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["use_cache"] = True
    if isinstance(config.get("text_config"), dict):
        config["text_config"]["use_cache"] = True
    atomic_write_json(config_path, config)
    generation_path = Path(model_dir) / "generation_config.json"
    if generation_path.is_file():
        generation = json.loads(generation_path.read_text(encoding="utf-8"))
        generation["use_cache"] = True
        atomic_write_json(generation_path, generation)


def check_model_dir(model_dir: Path) -> None:
    """The exported folder holds a config and weights, and no unmerged adapter."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file() or not any(p.suffix in WEIGHT_SUFFIXES for p in model_dir.iterdir()):
        raise RuntimeError(f"{model_dir}: the exported model has no config.json or no weights")
    if (model_dir / "adapter_config.json").is_file():
        raise RuntimeError(f"{model_dir}: holds LoRA adapters, not merged weights")


def build_model_dir(finetuning_type: str, base_model: Path, train_dir: Path, model_dir: Path, lf_dir: Path,
                    env: dict[str, str], template: str) -> None:
    """Write the stage's model directory in one atomic swap: copied (full) or merged (LoRA), then fixed up."""
    with atomic_directory(model_dir) as tmp:
        if finetuning_type == "lora":
            export_yaml = lf_dir / "export.yaml"
            # The saved YAML names the final folder, so the by-hand command writes where the stage did; the
            # stage itself exports into the temporary folder that is swapped into place afterwards.
            llamafactory_config.write_yaml(
                export_yaml,
                llamafactory_config.export_config(base_model, train_dir, Path(model_dir).resolve(), template),
                f"llamafactory-cli export {export_yaml.resolve()}",
            )
            command = runner.llamafactory_command("export", export_yaml, {"export_dir": tmp.resolve()})
            runner.launch(command, env, lf_dir / "export.log")
        else:
            copy_model_files(train_dir, tmp)
        write_published_layout(tmp)  # transformers writes Qwen3-VL-MoE's experts transposed; vLLM reads the published
        restore_use_cache(tmp)
        make_readable(tmp)
        check_model_dir(tmp)
