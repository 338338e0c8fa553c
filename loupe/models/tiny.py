"""The embedded tiny models: complete Hugging Face model directories of each family, built offline in seconds.

Tests, CI and a laptop run the whole pipeline (synth -> sft -> rl -> eval) on these models, so each is the real
architecture, loaded through the same Auto classes as a real checkpoint of its family, only tiny (random weights):

- `qwen2_5_vl` (the default, about 0.29 M parameters at 64 x 2): `Qwen2_5_VLForConditionalGeneration` from a
  small `Qwen2_5_VLConfig` (text: hidden 64, 2 layers, 2 heads of 32, 1 KV head; vision: depth 2, hidden 32,
  patch 14, merge 2);
- `qwen3_vl`, `qwen3_vl_moe`: `Qwen3VLForConditionalGeneration` / `Qwen3VLMoeForConditionalGeneration` (patch
  16, merge 2, deepstack from vision block 0; the MoE with 4 experts, 2 a token, in every layer);
- `qwen3_5`: `Qwen3_5ForConditionalGeneration`, its text layers Gated DeltaNet linear attention with a full
  attention layer every second one at 2 layers (every fourth at 4 and more, as the real checkpoints);

each with vocabulary and token ids of `loupe.models.tiny_tokenizer` (a BPE trained on protocol text) and its
family's processor (`Qwen2_5_VLProcessor`, or `Qwen3VLProcessor` with Qwen3's 0.5 image mean and std) at a small
pixel budget. Heads are 32 wide at every size: vLLM's CPU attention takes head sizes 32, 64, 80, ... only
(`HEAD_DIM` below), and the real engine runs these models in the tests.

Nothing is downloaded, and the same seed gives byte-identical files, so a DVC stage that builds the model
is reproducible. Build one with::

    from loupe.models.tiny import build_tiny_model
    build_tiny_model("models/tiny", seed=0)                       # or family="qwen3_vl", ...
    loupe model tiny --family qwen3_5 --out models/tiny-qwen3_5   # the same from the command line
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from loupe.models.tiny_tokenizer import (
    IM_END,
    IMAGE_PAD,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    chat_template,
    train_tokenizer,
)

PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 14, 2, 2
"""Qwen2.5-VL's vision grid; the Qwen3 families' patch is 16 (`patch_size`)."""
FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5")
LINEAR_HEAD_DIM = 64
"""Width of a Qwen3.5 linear-attention (Gated DeltaNet) head: the smallest vLLM's CPU kernel of those layers takes."""
HEAD_DIM = 32
"""Width of a text attention head. vLLM's CPU attention backend supports 32, 64, 80, 96, 112, 128, ... (its
`CPUAttentionBackend.get_supported_head_sizes`), so 32 is the smallest the real engine generates with."""


def patch_size(family: str) -> int:
    """The family's vision patch (14 for Qwen2.5-VL, 16 for Qwen3-VL and Qwen3.5); the merge is 2 in all."""
    return PATCH_SIZE if family == "qwen2_5_vl" else 16


def _mrope_section(rotary_dim: int, family: str) -> list[int]:
    """How a head's rotary frequencies (rotary_dim / 2) split over (time, height, width), in the proportions of
    the family's own: Qwen2.5-VL's [16, 24, 24] for 128, Qwen3-VL's [24, 20, 20] for 128, Qwen3.5's [11, 11, 10]
    for its 64 rotary dimensions (a quarter of each 256-wide head)."""
    half = rotary_dim // 2
    time = half // 4 if family == "qwen2_5_vl" else (half * 3) // 8 if family.startswith("qwen3_vl") else (half + 2) // 3
    height = (half - time + 1) // 2
    return [time, height, half - time - height]


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"tiny model: unknown family {family!r}; built offline: {', '.join(FAMILIES)}")


def tiny_config(tokenizer: Any, text_hidden: int = 64, text_layers: int = 2, family: str = "qwen2_5_vl") -> Any:
    """The family's config whose vocabulary and token ids are `tokenizer`'s: about 0.29 M parameters at the
    default size (tests) for Qwen2.5-VL, 0.95 M at `text_hidden=128, text_layers=4` (the pipeline's default,
    params.yaml)."""
    from transformers import AutoConfig

    _check_family(family)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    if text_hidden % HEAD_DIM:
        raise ValueError(f"tiny model: text_hidden {text_hidden} must be a multiple of the head size {HEAD_DIM}")
    heads = text_hidden // HEAD_DIM
    # Grouped-query attention as in the real models (two query heads a KV head), down to one KV head.
    kv_heads = max(1, heads // 2)
    text: dict[str, Any] = {
        "vocab_size": len(tokenizer),  # every id the tokenizer can produce, special tokens included
        "hidden_size": text_hidden,
        "intermediate_size": 2 * text_hidden,
        "num_hidden_layers": text_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 32768,
        "bos_token_id": ids[PAD_TOKEN],
        "eos_token_id": ids[IM_END],
        "pad_token_id": ids[PAD_TOKEN],
        "use_cache": True,
        "tie_word_embeddings": True,
    }
    vision: dict[str, Any] = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                              "patch_size": patch_size(family), "spatial_merge_size": MERGE_SIZE,
                              "temporal_patch_size": TEMPORAL_PATCH_SIZE, "out_hidden_size": text_hidden}
    if family == "qwen2_5_vl":
        text["max_window_layers"] = text_layers  # no sliding window anyway; keeps the config consistent
        # mrope splits each head's rotary frequencies over (time, height, width): must sum to head_dim/2.
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0,
                                   "mrope_section": _mrope_section(HEAD_DIM, family)}
        vision.update(window_size=112,  # 4x4 merged patches a window
                      fullatt_block_indexes=[1])  # block 0 windowed, block 1 full: both attention paths run
    elif family.startswith("qwen3_vl"):
        text["head_dim"] = HEAD_DIM
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_interleaved": True,
                                   "mrope_section": _mrope_section(HEAD_DIM, family)}
        # Learned 2D position embeddings on a 16 x 16 grid, interpolated to each image's grid; block 0's output
        # joins the language model after its first layer (deepstack), as Qwen3-VL's blocks 8, 16 and 24 do.
        vision.update(num_position_embeddings=256, deepstack_visual_indexes=[0])
        if family == "qwen3_vl_moe":
            # Experts 1.5 x as wide as the model, in 32s: neither expert matrix is square (transformers reads a square
            # one as stored while vLLM transposes it, loupe.models.family.write_published_layout), a matrix laid out
            # the wrong way round fails to load rather than loading transposed, and no padding is needed by vLLM's
            # CPU kernel, which pads to 32s (its reload of padded experts fails; Qwen3-VL-30B-A3B's are 768 wide).
            # norm_topk_prob: the routing weights renormalised over the chosen experts, as Qwen3-VL-30B-A3B's
            # config.json says (vLLM's qwen3_vl_moe.py reads the key; transformers' config has no default for it).
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=-(-3 * text_hidden // 64) * 32,
                        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    else:  # qwen3_5: Gated DeltaNet layers, a full-attention layer every fourth (every second when shallower)
        # Linear-attention heads 64 wide: vLLM's CPU Gated DeltaNet kernel takes 64 and 128 ("Unexpected head dim
        # size, 32"); the real models' are 128.
        text.update(head_dim=HEAD_DIM, linear_conv_kernel_dim=4, linear_key_head_dim=LINEAR_HEAD_DIM,
                    linear_value_head_dim=LINEAR_HEAD_DIM, linear_num_key_heads=kv_heads,
                    linear_num_value_heads=heads, full_attention_interval=4 if text_layers >= 4 else 2)
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                   "mrope_interleaved": True, "mrope_section": _mrope_section(HEAD_DIM // 4, family)}
        vision["num_position_embeddings"] = 256
    return AutoConfig.for_model(
        family, text_config=text, vision_config=vision,
        image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END],
        bos_token_id=ids[PAD_TOKEN], eos_token_id=ids[IM_END], pad_token_id=ids[PAD_TOKEN], use_cache=True,
        tie_word_embeddings=True,  # halves the parameters; Qwen2.5-VL-3B ties its embeddings too
    )


def tiny_processor(tokenizer: Any, min_pixels: int, max_pixels: int, family: str = "qwen2_5_vl") -> Any:
    """The family's processor around Qwen2-VL's image processor (which every family uses, with its own patch)
    and its video processor, at the given pixel budget."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    _check_family(family)
    vision = {"patch_size": patch_size(family), "merge_size": MERGE_SIZE, "temporal_patch_size": TEMPORAL_PATCH_SIZE}
    # transformers 5.x reads the budget from `size`; a fresh dict each time, because the classes would
    # otherwise write min/max_pixels into their shared class-level default.
    if family == "qwen2_5_vl":
        image_processor = Qwen2VLImageProcessor(size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, **vision)
        video_processor = Qwen2VLVideoProcessor(size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, **vision)
        return Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                   video_processor=video_processor, chat_template=chat_template(True))
    from transformers import Qwen3VLProcessor, Qwen3VLVideoProcessor

    half = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}  # Qwen3-VL's and Qwen3.5's processors
    image_processor = Qwen2VLImageProcessor(size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
                                            **vision, **half)
    video_processor = Qwen3VLVideoProcessor(size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
                                            **vision, **half)
    # Qwen3-VL's and Qwen3.5's own templates add no default system prompt (Qwen2.5-VL's does).
    return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
                            chat_template=chat_template(False))


def build_tiny_model(
    out_dir: str | Path, seed: int = 0, min_pixels: int | None = None, max_pixels: int | None = None,
    text_hidden: int = 64, text_layers: int = 2, family: str = "qwen2_5_vl",
) -> Path:
    """Write a complete tiny model directory of `family` to `out_dir` and return its path.

    `seed` fixes the tokenizer corpus and the random weights: the same seed gives byte-identical files.
    `min_pixels`/`max_pixels` are the processor's pixel budget (default 4 to 64 merged patches an image, on the
    family's grid); `text_hidden`/`text_layers` size the language model (see `tiny_config`).
    """
    import torch
    from transformers import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING, GenerationConfig

    factor = patch_size(family) * MERGE_SIZE
    min_pixels = factor * factor * 4 if min_pixels is None else min_pixels
    max_pixels = factor * factor * 64 if max_pixels is None else max_pixels
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(seed)
    config = tiny_config(tokenizer, text_hidden, text_layers, family)
    with torch.random.fork_rng(devices=[]):  # seed the weights without disturbing the caller's generator
        torch.manual_seed(seed)
        model = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)](config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=config.text_config.bos_token_id,
        # <|im_end|> ends a turn; like Qwen's own generation config, <|endoftext|> ends generation too.
        eos_token_id=[config.text_config.eos_token_id, config.text_config.pad_token_id],
        pad_token_id=config.text_config.pad_token_id,
        use_cache=True,
    )
    model.save_pretrained(out_dir)
    from loupe.models.family import write_published_layout

    write_published_layout(out_dir)  # Qwen3-VL-MoE's experts as its checkpoints store them (vLLM reads those)
    tiny_processor(tokenizer, min_pixels, max_pixels, family).save_pretrained(out_dir)
    for weights in out_dir.glob("*.safetensors"):
        # transformers 5.6 writes the weights through a private temporary file (mode 0600); a container
        # running as another user, or a DVC cache shared between users, must be able to read them.
        os.chmod(weights, 0o644)
    return out_dir
