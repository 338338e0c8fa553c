"""Models: the embedded tiny models, and loading any Hugging Face VLM directory the same way.

`build_tiny_model(dir, seed, family=...)` writes a tiny model (see `loupe.models.tiny`);
`load_model_and_processor(dir)` loads it, or a real Qwen2.5-VL-7B, Qwen3-VL-8B or Qwen3.5-9B, or a stage's
output, through `AutoProcessor` and `AutoModelForImageTextToText`, so every stage loads models one way; the
model's family (its crop grid, templates, cache kinds, module names) is read from its files by
`loupe.models.family.read_family`, which stops a model Loupe cannot run with a message naming what is missing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loupe.models.tiny import build_tiny_model

__all__ = ["build_tiny_model", "load_model", "load_model_and_processor", "load_processor", "resolve_device"]


def _check_model_dir(path: str | Path) -> Path:
    """`path`, once its files say Loupe can run the model (`read_family`: a clear error otherwise, never a
    traceback from inside transformers)."""
    from loupe.models.family import read_family

    path = Path(path)
    read_family(path)
    return path


def resolve_device(device: str = "auto") -> str:
    """`auto` is cuda when a GPU is visible, else cpu; anything else is passed through."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_processor(path: str | Path) -> Any:
    """The model directory's processor (tokenizer, image processor, chat template)."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(_check_model_dir(path))


def load_model(path: str | Path, device: str = "auto", dtype: Any = "auto") -> Any:
    """The VLM at `path`, in eval mode on `device`, with the KV cache on for generation.

    `dtype` is a torch dtype or its name; `auto` is float32 on CPU and bfloat16 on GPU. The KV cache is
    switched on because LLaMA-Factory saves fine-tuned models with `use_cache: false`, which would make every
    generated token recompute the whole sequence.
    """
    import torch
    from transformers import AutoModelForImageTextToText

    device = resolve_device(device)
    if dtype == "auto" or dtype is None:
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    elif isinstance(dtype, str):
        named = getattr(torch, dtype, None)
        if not isinstance(named, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}; use a torch dtype name such as 'bfloat16' or 'float32'")
        dtype = named
    model = AutoModelForImageTextToText.from_pretrained(_check_model_dir(path), dtype=dtype)
    model = model.to(device).eval()
    model.generation_config.use_cache = True
    return model


def load_model_and_processor(path: str | Path, device: str = "auto", dtype: Any = "auto") -> tuple[Any, Any]:
    """(model, processor) for the Hugging Face VLM directory at `path`."""
    return load_model(path, device, dtype), load_processor(path)
