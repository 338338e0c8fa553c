"""The `sft` section of params.yaml: what LLaMA-Factory is asked to do, in our words.

Every field maps to one or a few keys of the generated LLaMA-Factory YAML (stages/sft/llamafactory_config.py);
the image pixel budget is not here because it comes from the shared `protocol` section, so the model is
trained on images of exactly the size the rollout loop shows it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from loupe.config import Section


class LoraParams(Section):
    """LoRA adapter settings (used when finetuning_type is lora; merged into the weights afterwards)."""

    rank: int = Field(8, ge=1)
    """Rank of the adapter matrices (LLaMA-Factory `lora_rank`)."""
    alpha: int | None = Field(None, ge=1)
    """Scale numerator (`lora_alpha`); None is LLaMA-Factory's default, twice the rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input (`lora_dropout`)."""
    target: str = "all"
    """Modules that get adapters (`lora_target`): `all` (every linear layer of the language model) or a
    comma-separated list of module names such as `q_proj,v_proj`."""


class GpuParams(Section):
    """Settings applied only when the run has a GPU (ignored on CPU, where training runs in float32)."""

    bf16: bool = True
    """Mixed precision in bfloat16."""
    flash_attn: Literal["fa2", "sdpa", "auto", "disabled"] = "fa2"
    """Attention kernel (LLaMA-Factory `flash_attn`); fa2 needs the flash-attn package in the image."""
    deepspeed: str | None = "z3"
    """DeepSpeed ZeRO config: `z2` or `z3` (shipped in stages/sft/deepspeed/), a path to a JSON config, or
    None for plain single-process training. ZeRO-3 is what a 7B full fine-tune on 8 GPUs needs."""


class SftParams(Section):
    """Supervised fine-tuning of the base model on the synth stage's dataset, through LLaMA-Factory."""

    dataset: str = "loupe_synth"
    """Dataset name declared in the dataset folder's dataset_info.json."""
    template: str | None = None
    """LLaMA-Factory's chat template; None: the model family's (loupe.models.family: `qwen2_vl` for Qwen2-VL and
    Qwen2.5-VL, `qwen3_vl_nothink` for Qwen3-VL, `qwen3_5_nothink` for Qwen3.5, their thinking templates when the
    model's own chat template opens a `<think>` block). Give it for a family Loupe does not know."""
    finetuning_type: Literal["full", "lora"] = "full"
    """Full fine-tuning, or LoRA adapters merged into the weights after training."""
    lora: LoraParams = LoraParams()
    """LoRA settings (finetuning_type lora only)."""
    freeze_vision_tower: bool = True
    """Keep the vision encoder's weights fixed (Mini-o3 does)."""
    freeze_multi_modal_projector: bool = True
    """Keep the vision-to-language projector fixed (Mini-o3 does)."""
    cutoff_len: int = Field(4096, ge=16)
    """Tokens one training sample may hold, images included. A longer sample is refused before training,
    with the fix named: LLaMA-Factory would cut it and fail on 'image features and image tokens do not match'."""
    learning_rate: float = Field(1e-5, gt=0)
    """Peak learning rate."""
    lr_scheduler_type: str = "cosine"
    """Learning-rate schedule after warm-up (transformers names: cosine, linear, constant, ...)."""
    warmup_ratio: float = Field(0.03, ge=0, lt=1)
    """Share of the steps spent warming the learning rate up from zero."""
    num_train_epochs: float = Field(1.0, gt=0)
    """Passes over the dataset; ignored when max_steps is set."""
    max_steps: int | None = Field(None, ge=1)
    """Optimiser steps to run, overriding num_train_epochs; None to train by epochs."""
    per_device_train_batch_size: int = Field(1, ge=1)
    """Samples per device per forward pass."""
    gradient_accumulation_steps: int = Field(1, ge=1)
    """Forward passes per optimiser step (effective batch = this x batch size x devices)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clipping norm."""
    logging_steps: int = Field(10, ge=1)
    """Steps between loss records (console, MLflow, the loss curve)."""
    save_steps: int = Field(100, ge=1)
    """Steps between checkpoints; a killed run resumes from the last one."""
    save_total_limit: int | None = Field(2, ge=1)
    """Checkpoints kept on disk (older ones are deleted); None keeps all."""
    keep_checkpoints: bool = False
    """Keep the checkpoints after a successful run (they hold optimiser state: about 8x the model's size)."""
    presize_images: bool = True
    """Scale images larger than the pixel budget once, before training, by LLaMA-Factory's own rule (same
    pixels), instead of at every step; the scaled copy of the dataset goes to <out>/dataset."""
    gradient_checkpointing: Literal["auto", "on", "off"] = "auto"
    """Recompute activations in the backward pass to save memory: auto = on GPU only (a tiny model on a CPU has
    memory to spare and would pay a third more time for it; LLaMA-Factory's own default is on everywhere)."""
    preprocessing_num_workers: int | None = Field(None, ge=1)
    """Processes tokenising the dataset; None tokenises in the training process (on the default, 2 processes
    took 23 s where the training process alone took 8: each worker starts and loads the processor)."""
    dataloader_num_workers: int = Field(1, ge=0)
    """Processes loading and preprocessing images during training, beside the training loop; 0 collates each
    batch on the training thread. The batches are the same (same order, same pixels, bit-identical losses);
    one worker made the default's steps 10% faster on 2 cores (docs/speed.md, "What was removed")."""
    cpu_processes: int = Field(1, ge=1)
    """Data-parallel training processes on a CPU (torchrun with gloo, one torch thread each; ignored on GPU). The
    optimiser step's batch is unchanged: each process takes an equal share of `per_device_train_batch_size`,
    which must divide by it, and the gradients are averaged. That average weighs each process's token mean
    alike, where one process takes the mean over all the batch's tokens: LLaMA-Factory turns off transformers'
    token count across processes for multimodal models (llamafactory/train/sft/trainer.py,
    CustomSeq2SeqTrainer.__init__ sets model_accepts_loss_kwargs false), so a process holding short trajectories
    weighs their tokens more. On the default, 2 processes ran SFT's steps in 411 s instead of 453 on 2 cores and SFT reached 0.767
    instead of 0.917, glancing more (docs/speed.md, "Two processes, not two threads")."""
    device: Literal["auto", "cpu", "gpu"] = "auto"
    """Where training runs: auto picks the GPU when torch sees one. Decides whether `gpu` settings apply."""
    gpu: GpuParams = GpuParams()
    """bf16, flash-attention and DeepSpeed, applied on GPU only."""
    extra: dict[str, Any] = Field(default_factory=dict)
    """Further LLaMA-Factory keys passed through verbatim (an escape hatch; a key we set ourselves is an error)."""
