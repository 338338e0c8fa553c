"""A model family's differences, read from the model directory's own files, in one place.

Every stage asks this module, never `config.model_type` itself: the crop grid, the chat template's LLaMA-Factory
twin, the vision markers, the kinds of cache the text layers keep, and the modules the learner wraps, freezes
and puts LoRA on.

| family (`model_type`) | crop grid (patch x merge) | LLaMA-Factory template | text layers |
|---|---|---|---|
| `qwen2_vl`, `qwen2_5_vl` | 14 x 2 = 28 | `qwen2_vl` | attention |
| `qwen3_vl`, `qwen3_vl_moe` | 16 x 2 = 32 | `qwen3_vl_nothink` (`qwen3_vl` for a thinking chat template) | attention; deepstack |
| `qwen3_5`, `qwen3_5_moe` | 16 x 2 = 32 | `qwen3_5_nothink` (`qwen3_5` for a thinking chat template) | three Gated DeltaNet in four |

Where each fact comes from:
- the grid from the image processor's settings (`preprocessor_config.json`, or transformers 5's
  `processor_config.json`: `patch_size`, `merge_size`, what the processor resizes by,
  transformers' `Qwen2VLImageProcessor`, `smart_resize(factor=patch_size * merge_size)`), else the config's
  vision section;
- LLaMA-Factory's template from the family (`llamafactory/data/template.py`: `qwen2_vl`, `qwen3_vl`,
  `qwen3_vl_nothink`, `qwen3_5`, `qwen3_5_nothink`; `llamafactory/extras/constants.py` maps the Instruct
  checkpoints to the `_nothink` ones) and whether the model's own chat template opens a `<think>` block;
- the layer kinds from `text_config.layer_types` (`linear_attention` for Qwen3.5's Gated DeltaNet layers,
  transformers' `Qwen3_5TextConfig`), every layer attention when there is none;
- module names from transformers' modeling files of each family (`model.visual`, its `merger`, Qwen3-VL's
  `deepstack_merger_list`; the Gated DeltaNet's `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`,
  `out_proj`). MoE experts are fused 3-D parameters (`mlp.experts.gate_up_proj`), not linear layers: LoRA
  takes the attention and dense projections around them.

A family not in the table runs when its files declare what Loupe needs (a processor with `patch_size` and
`merge_size`, an `image_token_id`, layer kinds the transformers engine can cache); otherwise `read_family`
stops with a `ModelFamilyError` naming the family and the missing piece.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ATTENTION = "attention"
LINEAR_ATTENTION = "linear_attention"
_LAYER_KINDS = {"full_attention": ATTENTION, "attention": ATTENTION, "sliding_attention": ATTENTION,
                "linear_attention": LINEAR_ATTENTION}
"""transformers' `layer_types` names -> the two kinds of per-dialogue state the transformers engine keeps."""

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
DENSE_MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
GATED_DELTANET_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
"""Qwen3.5's linear-attention projections (transformers' `Qwen3_5GatedDeltaNet`)."""


class ModelFamilyError(ValueError):
    """A model directory Loupe cannot run; the message names the family and what is missing."""


@dataclass(frozen=True)
class KnownFamily:
    """What a family's files do not say themselves."""

    llamafactory_template: str
    """LLaMA-Factory's template for its Instruct checkpoints."""
    thinking_template: str
    """LLaMA-Factory's template when the model's chat template opens a `<think>` block."""
    projectors: tuple[str, ...]
    """Modules between the vision tower and the language model (frozen with `freeze_multi_modal_projector`)."""
    lora_targets: tuple[str, ...]


KNOWN: dict[str, KnownFamily] = {
    "qwen2_vl": KnownFamily("qwen2_vl", "qwen2_vl", ("model.visual.merger",),
                            ATTENTION_PROJECTIONS + DENSE_MLP_PROJECTIONS),
    "qwen2_5_vl": KnownFamily("qwen2_vl", "qwen2_vl", ("model.visual.merger",),
                              ATTENTION_PROJECTIONS + DENSE_MLP_PROJECTIONS),
    "qwen3_vl": KnownFamily("qwen3_vl_nothink", "qwen3_vl", ("model.visual.merger", "model.visual.deepstack_merger_list"),
                            ATTENTION_PROJECTIONS + DENSE_MLP_PROJECTIONS),
    "qwen3_vl_moe": KnownFamily("qwen3_vl_nothink", "qwen3_vl",
                                ("model.visual.merger", "model.visual.deepstack_merger_list"),
                                ATTENTION_PROJECTIONS + DENSE_MLP_PROJECTIONS),
    "qwen3_5": KnownFamily("qwen3_5_nothink", "qwen3_5", ("model.visual.merger",),
                           ATTENTION_PROJECTIONS + DENSE_MLP_PROJECTIONS + GATED_DELTANET_PROJECTIONS),
    "qwen3_5_moe": KnownFamily("qwen3_5_nothink", "qwen3_5", ("model.visual.merger",),
                               ATTENTION_PROJECTIONS + DENSE_MLP_PROJECTIONS + GATED_DELTANET_PROJECTIONS),
}
"""The families Loupe was built and tested with (tiny models of each: `loupe model tiny --family`)."""
TINY_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5")
"""The families `loupe model tiny --family` builds offline."""


@dataclass(frozen=True)
class Family:
    """A model directory's family, as its files and `KNOWN` say."""

    name: str
    """config.json's `model_type`."""
    patch_size: int
    merge_size: int
    layer_kinds: tuple[str, ...]
    """Per text layer, `attention` or `linear_attention`: what the transformers engine keeps between turns."""
    marker_ids: dict[str, int]
    """Token ids of `image_token_id`, `video_token_id`, `vision_start_token_id`, `vision_end_token_id` present."""
    llamafactory_template: str | None
    """LLaMA-Factory's template for SFT; None for a family Loupe does not know (set `sft.template`)."""
    vision_tower: str = "model.visual"
    projectors: tuple[str, ...] = ()
    lora_targets: tuple[str, ...] = ATTENTION_PROJECTIONS + DENSE_MLP_PROJECTIONS
    known: bool = True
    vocab_size: int | None = None
    """Rows of the text model's embedding (config.json's `vocab_size`): ids past the tokenizer's are never sampled."""

    @property
    def image_factor(self) -> int:
        """The crop grid: image sides the processor keeps are multiples of this (patch x merge)."""
        return self.patch_size * self.merge_size

    @property
    def hybrid(self) -> bool:
        """Whether some text layers keep a recurrent state rather than keys and values."""
        return LINEAR_ATTENTION in self.layer_kinds


def _json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise ModelFamilyError(f"{path}: not readable JSON ({err})") from None


def read_family(model_dir: str | Path) -> Family:
    """The family of the Hugging Face model directory `model_dir` (the module docstring says what is read)."""
    model_dir = Path(model_dir)
    config = _json(model_dir / "config.json")
    if config is None:
        raise FileNotFoundError(f"{model_dir}: not a Hugging Face model directory (no config.json)")
    name = str(config.get("model_type") or "unknown")
    where = f"{model_dir}: model family {name!r}"
    vision = config.get("vision_config") or {}
    text = config.get("text_config") or config
    # The hub's checkpoints keep the image processor's settings in preprocessor_config.json; transformers 5
    # saves them inside processor_config.json.
    processor = (_json(model_dir / "preprocessor_config.json")
                 or (_json(model_dir / "processor_config.json") or {}).get("image_processor") or {})
    patch = processor.get("patch_size", vision.get("patch_size"))
    merge = processor.get("merge_size", vision.get("spatial_merge_size"))
    if not (isinstance(patch, int) and isinstance(merge, int) and patch > 0 and merge > 0):
        raise ModelFamilyError(f"{where}: no image grid (patch_size and merge_size of its image processor, or "
                               "vision_config's patch_size and spatial_merge_size); Loupe crops on the model's grid")
    markers = {key: config[key] for key in ("image_token_id", "video_token_id", "vision_start_token_id",
                                            "vision_end_token_id") if isinstance(config.get(key), int)}
    if "image_token_id" not in markers:
        raise ModelFamilyError(f"{where}: config.json has no image_token_id; Loupe shows images as the model's "
                               "image tokens")
    try:
        kinds = _kinds(text)
    except ModelFamilyError as err:
        raise ModelFamilyError(f"{where}: {err}") from None
    vocab = text.get("vocab_size") if isinstance(text.get("vocab_size"), int) else None
    known = KNOWN.get(name)
    if known is None:
        return Family(name, patch, merge, kinds, markers, None, known=False, vocab_size=vocab)
    template = _chat_template(model_dir)
    thinking = "<think>" in template and "enable_thinking" in template
    return Family(name, patch, merge, kinds, markers,
                  known.thinking_template if thinking else known.llamafactory_template,
                  projectors=known.projectors, lora_targets=known.lora_targets, vocab_size=vocab)


def _kinds(text: dict[str, Any]) -> tuple[str, ...]:
    types = text.get("layer_types") or ["full_attention"] * int(text.get("num_hidden_layers") or 0)
    unknown = sorted({t for t in types if t not in _LAYER_KINDS})
    if unknown:
        raise ModelFamilyError(f"text layers of kind {', '.join(unknown)} keep a state the transformers engine has "
                               f"no place for (it keeps {', '.join(sorted(_LAYER_KINDS))})")
    return tuple(_LAYER_KINDS[t] for t in types)


def layer_kinds(config: Any) -> tuple[str, ...]:
    """Per text layer of a loaded model's config, `attention` or `linear_attention`."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return _kinds({"layer_types": getattr(text, "layer_types", None),
                   "num_hidden_layers": getattr(text, "num_hidden_layers", 0)})


def _chat_template(model_dir: Path) -> str:
    """The model's chat template text (a `chat_template.jinja`, or the tokenizer's or processor's JSON)."""
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    for name in ("chat_template.json", "tokenizer_config.json", "processor_config.json"):
        data = _json(model_dir / name) or {}
        if isinstance(data.get("chat_template"), str):
            return data["chat_template"]
    return ""


def llamafactory_template(family: Family, chosen: str | None = None) -> str:
    """LLaMA-Factory's template for SFT on this family: `chosen` (`sft.template`) when given, else the family's."""
    if chosen:
        return chosen
    if family.llamafactory_template is None:
        raise ModelFamilyError(f"model family {family.name!r}: Loupe does not know its LLaMA-Factory template; set "
                               f"sft.template (known families: {', '.join(KNOWN)})")
    return family.llamafactory_template


def processor_grid(processor: Any) -> int | None:
    """patch x merge of a loaded processor's image processor, or None when it has none (a text model)."""
    images = getattr(processor, "image_processor", None)
    patch, merge = getattr(images, "patch_size", None), getattr(images, "merge_size", None)
    return patch * merge if isinstance(patch, int) and isinstance(merge, int) else None


def processor_pixels(processor: Any) -> tuple[int, int] | None:
    """(min, max) image area a loaded processor's image processor resizes into (its `size`'s `shortest_edge` and
    `longest_edge`, which Qwen's processors read as pixel counts, or its `min_pixels`, `max_pixels`), or None."""
    images = getattr(processor, "image_processor", None)
    size = getattr(images, "size", None)
    size = size if isinstance(size, dict) else dict(size) if hasattr(size, "keys") else {}
    low = size.get("shortest_edge", getattr(images, "min_pixels", None))
    high = size.get("longest_edge", getattr(images, "max_pixels", None))
    return (low, high) if isinstance(low, int) and isinstance(high, int) and 0 < low <= high else None


EXPERTS_TRANSPOSED_ON_DISK = ("qwen3_vl_moe",)
"""Families whose published checkpoints store the fused experts transposed from the module's layout:
Qwen3-VL-MoE's hold `mlp.experts.gate_up_proj` as (experts, hidden, 2 x intermediate) and `down_proj` as
(experts, intermediate, hidden); transformers transposes both when it loads them (its conversion mapping for
`qwen3_vl_moe`) but, at 5.6, writes the module's layout back when it saves (its reverse conversion compares with
the module's own shape), and vLLM's loader (`qwen3_vl_moe.py`, `is_fused_checkpoint_transposed`) transposes
whatever it reads. Qwen3.5-MoE's checkpoints are in the module's layout already."""
_EXPERT_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def published_layout(model_type: str, name: str, tensor: Any) -> Any:
    """`tensor` (named `name`, in the module's layout) as the family's published checkpoints store it: what
    vLLM's loader expects, from a file or a weight sync."""
    if model_type in EXPERTS_TRANSPOSED_ON_DISK and name.endswith(_EXPERT_TENSORS):
        return tensor.transpose(-1, -2).contiguous()
    return tensor


def write_published_layout(model_dir: str | Path) -> int:
    """Rewrite a model directory transformers saved into its family's published layout (only Qwen3-VL-MoE's experts
    differ), atomically file by file; returns the tensors rewritten. A tensor already in the published layout is
    left alone; when the two layouts have the same shape (a square expert matrix) the file is taken to be
    transformers 5.6's, which writes the module's. Such a checkpoint cannot be read right by both sides: at 5.6
    transformers transposes a file's experts only when their shape differs from the module's, vLLM always does.
    The published Qwen3-VL-MoE checkpoints' experts are not square (30B-A3B: hidden 2,048, experts 768 wide)."""
    model_dir = Path(model_dir)
    config = _json(model_dir / "config.json") or {}
    if config.get("model_type") not in EXPERTS_TRANSPOSED_ON_DISK:
        return 0
    from safetensors import safe_open
    from safetensors.torch import load_file, save

    from loupe.io import atomic_write_bytes

    text = config.get("text_config") or config
    hidden, intermediate = text.get("hidden_size"), text.get("moe_intermediate_size")
    rewritten = 0
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors = load_file(file)
        changed = False
        for name, tensor in tensors.items():
            if not name.endswith(_EXPERT_TENSORS):
                continue
            module_shape = (2 * intermediate, hidden) if name.endswith("gate_up_proj") else (hidden, intermediate)
            if tuple(tensor.shape[1:]) == module_shape:
                tensors[name] = published_layout(config["model_type"], name, tensor)
                changed, rewritten = True, rewritten + 1
        if changed:
            with safe_open(str(file), "pt") as handle:
                metadata = handle.metadata()
            atomic_write_bytes(file, save(tensors, metadata=metadata))
    return rewritten
