"""LLaMA-Factory YAML configs generated from params.yaml: one for training, one for merging LoRA adapters.

The YAML is the whole interface to LLaMA-Factory: the stage writes it beside the model and runs
`llamafactory-cli train <yaml>` on it, so anyone can repeat a run by hand with the same command. Paths in it
are absolute, so it runs from any folder.

What goes in:
- the base model, the dataset (name, folder), the model family's template (`qwen2_vl`, `qwen3_vl_nothink`,
  `qwen3_5_nothink`, ...: loupe.models.family, or `sft.template`), the protocol's pixel budget as
  `image_min_pixels`/`image_max_pixels` (the same budget the rollout loop shows the model);
- full or LoRA fine-tuning, frozen vision tower and projector, cutoff, optimiser and schedule, batch,
  accumulation, seed, logging and checkpoint cadence;
- on GPU: bf16, flash-attention and a DeepSpeed ZeRO config (copied beside the YAML); on CPU: float32.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import yaml

from loupe.config import ParamsError, ProtocolParams
from loupe.io import atomic_write_text
from stages.sft.params import SftParams

DEEPSPEED_DIR = Path(__file__).parent / "deepspeed"
SHIPPED_DEEPSPEED = {"z2": DEEPSPEED_DIR / "ds_z2.json", "z3": DEEPSPEED_DIR / "ds_z3.json"}

FINGERPRINT_EXEMPT = (
    "report_to",
    "run_name",
    "logging_steps",
    "save_steps",
    "save_total_limit",
    "preprocessing_num_workers",
    "dataloader_num_workers",
    "overwrite_cache",
)
"""Keys that do not change what is trained: a rerun with tracking switched on or off, or checkpointing more
often, still resumes the run it finds."""


def resolve_deepspeed(choice: str | None) -> Path | None:
    """The DeepSpeed JSON named by `gpu.deepspeed` (z2, z3 or a path), or None."""
    if choice is None or choice.lower() in ("none", ""):
        return None
    path = SHIPPED_DEEPSPEED.get(choice.lower(), Path(choice))
    if not path.is_file():
        raise ParamsError(f"params.yaml: sft.gpu.deepspeed: {choice!r} is neither z2, z3 nor a DeepSpeed JSON file")
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise ParamsError(f"params.yaml: sft.gpu.deepspeed: {path} is not valid JSON ({err})") from None
    return path


def cpu_processes(params: SftParams, on_gpu: bool) -> int:
    """How many data-parallel processes train on the CPU: `sft.cpu_processes`, or 1 on a GPU (where the GPUs
    decide). The step's batch is shared out, so it must divide by them."""
    if on_gpu or params.cpu_processes == 1:
        return 1
    if params.per_device_train_batch_size % params.cpu_processes:
        raise ParamsError(
            f"params.yaml: sft.per_device_train_batch_size ({params.per_device_train_batch_size}) does not divide by "
            f"sft.cpu_processes ({params.cpu_processes}): each process takes an equal share of the step's batch"
        )
    return params.cpu_processes


def launch_environment(processes: int) -> dict[str, str]:
    """The variables data-parallel CPU processes train with: one torch thread each (torchrun's own default,
    said here so that it does not warn about it)."""
    return {} if processes == 1 else {"OMP_NUM_THREADS": "1"}


def train_config(
    params: SftParams,
    protocol: ProtocolParams,
    seed: int,
    model_path: Path,
    dataset_dir: Path,
    output_dir: Path,
    on_gpu: bool,
    template: str,
    deepspeed: Path | None = None,
    report_to: str = "none",
    hide_gpu: bool = False,
) -> dict[str, Any]:
    """The `llamafactory-cli train` arguments for this run, in LLaMA-Factory's key names and a readable order.

    `template` is LLaMA-Factory's chat template of the model's family (`loupe.models.family.llamafactory_template`);
    `hide_gpu` (sft.device: cpu) trains on the CPU even where a GPU is visible.
    """
    processes = cpu_processes(params, on_gpu)
    config: dict[str, Any] = {
        # model
        "model_name_or_path": str(Path(model_path).resolve()),
        "image_min_pixels": protocol.min_pixels,
        "image_max_pixels": protocol.max_pixels,
        "trust_remote_code": False,
        # method
        "stage": "sft",
        "do_train": True,
        "finetuning_type": params.finetuning_type,
        "freeze_vision_tower": params.freeze_vision_tower,
        "freeze_multi_modal_projector": params.freeze_multi_modal_projector,
    }
    if params.finetuning_type == "lora":
        config["lora_rank"] = params.lora.rank
        if params.lora.alpha is not None:
            config["lora_alpha"] = params.lora.alpha
        config["lora_dropout"] = params.lora.dropout
        config["lora_target"] = params.lora.target
    config.update(
        {
            # data
            "dataset": params.dataset,
            "dataset_dir": str(Path(dataset_dir).resolve()),
            "template": template,
            "cutoff_len": params.cutoff_len,
            # A changed dataset file must be tokenised again, never served from the datasets cache.
            "overwrite_cache": True,
            "preprocessing_num_workers": params.preprocessing_num_workers,
            "dataloader_num_workers": params.dataloader_num_workers,
            # output: checkpoints every save_steps, and a rerun resumes from the last (overwrite_output_dir false)
            "output_dir": str(Path(output_dir).resolve()),
            "logging_steps": params.logging_steps,
            "save_steps": params.save_steps,
            "save_total_limit": params.save_total_limit,
            "save_only_model": False,  # optimiser and scheduler state too, so a resume continues exactly
            "overwrite_output_dir": False,
            "plot_loss": False,  # the stage draws the loss curve itself, as DVC plot data and a PNG
            "report_to": report_to,
            # train
            "per_device_train_batch_size": params.per_device_train_batch_size // processes,
            "gradient_accumulation_steps": params.gradient_accumulation_steps,
            "learning_rate": params.learning_rate,
            "num_train_epochs": params.num_train_epochs,
            "max_steps": params.max_steps if params.max_steps is not None else -1,
            "lr_scheduler_type": params.lr_scheduler_type,
            "warmup_ratio": params.warmup_ratio,
            "weight_decay": params.weight_decay,
            "max_grad_norm": params.max_grad_norm,
            "seed": seed,
            "bf16": bool(on_gpu and params.gpu.bf16),
        }
    )
    checkpointing = params.gradient_checkpointing == "on" or (params.gradient_checkpointing == "auto" and on_gpu)
    config["disable_gradient_checkpointing"] = not checkpointing
    if config["preprocessing_num_workers"] is None:
        del config["preprocessing_num_workers"]
    if hide_gpu:
        config["use_cpu"] = True
    if processes > 1:
        config["ddp_backend"] = "gloo"  # torch's CPU collectives
    if on_gpu:
        config["flash_attn"] = params.gpu.flash_attn
        if deepspeed is not None:
            config["deepspeed"] = str(Path(deepspeed).resolve())
    clash = sorted(set(params.extra) & set(config))
    if clash:
        raise ParamsError(f"params.yaml: sft.extra: {', '.join(clash)} set by the stage itself; use the sft section's own keys")
    config.update(params.extra)
    return config


def export_config(base_model: Path, adapter_dir: Path, export_dir: Path, template: str,
                  trust_remote_code: bool = False) -> dict[str, Any]:
    """The `llamafactory-cli export` arguments that merge the trained LoRA adapters into the base weights."""
    return {
        "model_name_or_path": str(Path(base_model).resolve()),
        "adapter_name_or_path": str(Path(adapter_dir).resolve()),
        "template": template,
        "finetuning_type": "lora",
        "trust_remote_code": trust_remote_code,
        "export_dir": str(Path(export_dir).resolve()),
        "export_size": 5,
        "export_device": "cpu",
        "export_legacy_format": False,
    }


def fingerprint_view(config: dict[str, Any]) -> dict[str, Any]:
    """The part of a train config that decides what is trained (for the resume check)."""
    return {k: v for k, v in config.items() if k not in FINGERPRINT_EXEMPT}


def copy_deepspeed(deepspeed: Path | None, folder: Path) -> Path | None:
    """Copy the DeepSpeed JSON beside the YAML, so the saved config keeps working if the repo's copy changes."""
    if deepspeed is None:
        return None
    target = Path(folder) / "deepspeed.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    if Path(deepspeed).resolve() != target.resolve():
        shutil.copyfile(deepspeed, target)
    return target


def write_yaml(path: Path, config: dict[str, Any], command: str) -> Path:
    """Write `config` as YAML with a header saying how to run it by hand."""
    header = (
        "# Generated by `python -m stages.sft` from params.yaml; edit params.yaml, not this file.\n"
        f"# Run by hand: {command}\n"
    )
    atomic_write_text(Path(path), header + yaml.safe_dump(config, sort_keys=False, allow_unicode=True))
    return Path(path)
