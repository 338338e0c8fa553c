"""LoRA for the rl stage's learner (`rl.lora`): adapters attached with peft, and the merged policy the engines and
the final model get.

- `attach_lora` wraps the policy with peft's `get_peft_model`, which injects `lora.Linear` layers into the model
  in place: the learner keeps calling the Hugging Face module it loaded, and its forward now runs base + adapter.
  Only the adapters require gradients; peft keeps them in float32 over a bf16 base (`autocast_adapter_dtype`).
- `merged_weights` yields the policy as the engines and `model/` hold it, by the base model's own names, each
  adapted weight as W + B A x alpha / r from peft's `LoraLayer.get_delta_weight`. It is computed tensor by tensor
  rather than with peft's `merge_adapter` / `unmerge_adapter`, which add the update into the frozen weight and
  subtract it again: on a bf16 base the subtraction does not give the base back exactly, so each weight sync
  would move the weights the reference (adapters off) is meant to keep.
- the reference for KL is `PeftModel.disable_adapter()` around the same module, no second model: verl does the
  same when `lora_rank` > 0 (`verl/trainer/ppo/ray_trainer.py`, `ref_in_actor`: "the reference policy will be
  actor without lora applied"; its actor worker's `compute_ref_log_prob`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from stages.rl.params import LoraParams

ADAPTER = "default"
"""peft's name for the one adapter the learner trains."""


def attach_lora(model: Any, params: LoraParams) -> Any:
    """Adapters on `model` in place (peft's LoRA); returns the `PeftModel` around it (for `disable_adapter` and
    `save_pretrained`). Every other weight is frozen."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=params.rank,
        lora_alpha=params.alpha,
        lora_dropout=params.dropout,
        target_modules=params.target_modules,
        exclude_modules=params.exclude_modules,
        bias="none",
    )
    peft_model = get_peft_model(model, config, adapter_name=ADAPTER, autocast_adapter_dtype=True)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"rl.lora: target_modules {params.target_modules!r} (less exclude_modules "
                         f"{params.exclude_modules!r}) matched no layer of the model")
    return peft_model


def _is_adapter_key(key: str) -> bool:
    return any(part.startswith("lora_") for part in key.split("."))


def merged_weights(peft_model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy by the base model's tensor names, adapters merged into their layers' weights (float32 for the
    merged ones); see the module's docstring for why not peft's in-place merge."""
    from peft.tuners.lora import LoraLayer

    base = peft_model.get_base_model()
    adapted = {name: module for name, module in base.named_modules() if isinstance(module, LoraLayer)}
    for key, tensor in base.state_dict().items():
        if _is_adapter_key(key):
            continue
        name = key.replace(".base_layer.", ".")
        owner, leaf = name.rsplit(".", 1)
        layer = adapted.get(owner)
        if layer is not None and leaf == "weight" and ADAPTER in layer.lora_A:
            tensor = tensor.float() + layer.get_delta_weight(ADAPTER).float()
        yield name, tensor


def adapter_state_keys(model: Any) -> list[str]:
    """The trained tensors' names in the learner's module (what a checkpoint keeps)."""
    return [name for name, p in model.named_parameters() if p.requires_grad]
