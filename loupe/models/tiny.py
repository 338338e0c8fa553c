"""The embedded tiny Qwen2.5-VL: a complete Hugging Face model directory, built offline in seconds.

Tests, CI and a laptop run the whole pipeline (synth -> sft -> rl -> eval) on this model, so it is the real
architecture, loaded through the same Auto classes as a real Qwen2.5-VL-7B checkpoint, only tiny (about
0.29 M parameters, random weights):

- `Qwen2_5_VLForConditionalGeneration` from a small `Qwen2_5_VLConfig` (text: hidden 64, 2 layers, 2 heads of
  32, 1 KV head; vision: depth 2, hidden 32, patch 14, merge 2) whose vocabulary and token ids are the
  tokenizer's. Heads are 32 wide at every size: vLLM's CPU attention takes head sizes 32, 64, 80, ... only
  (`HEAD_DIM` below), and the real engine runs this model in the tests;
- the tokenizer and chat template of `loupe.models.tiny_tokenizer` (a BPE trained on protocol text);
- `Qwen2_5_VLProcessor` around `Qwen2VLImageProcessor` and `Qwen2VLVideoProcessor` at a small pixel budget.

Nothing is downloaded, and the same seed gives byte-identical files, so a DVC stage that builds the model
is reproducible. Build one with::

    from loupe.models.tiny import build_tiny_model
    build_tiny_model("models/tiny", seed=0)
"""

from __future__ import annotations

import os
from pathlib import Path

from loupe.models.tiny_tokenizer import (
    CHAT_TEMPLATE,
    IM_END,
    IMAGE_PAD,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    train_tokenizer,
)

PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 14, 2, 2
HEAD_DIM = 32
"""Width of a text attention head. vLLM's CPU attention backend supports 32, 64, 80, 96, 112, 128, ... (its
`CPUAttentionBackend.get_supported_head_sizes`), so 32 is the smallest the real engine generates with."""


def _mrope_section(head_dim: int) -> list[int]:
    """Qwen2.5-VL's split of a head's rotary frequencies (head_dim / 2) over (time, height, width), in the
    proportions of its own [16, 24, 24] for head_dim 128."""
    half = head_dim // 2
    time = half // 4
    height = (half - time) // 2
    return [time, height, half - time - height]


def tiny_config(tokenizer, text_hidden: int = 64, text_layers: int = 2):
    """A `Qwen2_5_VLConfig` whose vocabulary and token ids are `tokenizer`'s: about 0.29 M parameters at the
    default size (tests), 0.95 M at `text_hidden=128, text_layers=4` (the pipeline's default, params.yaml)."""
    from transformers import Qwen2_5_VLConfig

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    if text_hidden % HEAD_DIM:
        raise ValueError(f"tiny model: text_hidden {text_hidden} must be a multiple of the head size {HEAD_DIM}")
    heads = text_hidden // HEAD_DIM
    # Grouped-query attention as in Qwen2.5-VL (two query heads a KV head), down to one KV head.
    kv_heads = max(1, heads // 2)
    return Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),  # every id the tokenizer can produce, special tokens included
            "hidden_size": text_hidden,
            "intermediate_size": 2 * text_hidden,
            "num_hidden_layers": text_layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "max_position_embeddings": 32768,
            "max_window_layers": text_layers,  # no sliding window anyway; keeps the config consistent
            # mrope splits each head's rotary frequencies over (time, height, width): must sum to head_dim/2.
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                "mrope_section": _mrope_section(text_hidden // heads)},
            "bos_token_id": ids[PAD_TOKEN],
            "eos_token_id": ids[IM_END],
            "pad_token_id": ids[PAD_TOKEN],
            "use_cache": True,
            "tie_word_embeddings": True,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": PATCH_SIZE,
            "spatial_merge_size": MERGE_SIZE,
            "temporal_patch_size": TEMPORAL_PATCH_SIZE,
            "out_hidden_size": text_hidden,
            "window_size": 112,  # 4x4 merged patches a window
            "fullatt_block_indexes": [1],  # block 0 windowed, block 1 full: both attention paths run
        },
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        bos_token_id=ids[PAD_TOKEN],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[PAD_TOKEN],
        use_cache=True,
        tie_word_embeddings=True,  # halves the parameters; Qwen2.5-VL-3B ties its embeddings too
    )


def tiny_processor(tokenizer, min_pixels: int, max_pixels: int):
    """`Qwen2_5_VLProcessor` with the Qwen2-VL image and video processors at the given pixel budget."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    vision = {"patch_size": PATCH_SIZE, "merge_size": MERGE_SIZE, "temporal_patch_size": TEMPORAL_PATCH_SIZE}
    # transformers 5.x reads the budget from `size`; a fresh dict each time, because the classes would
    # otherwise write min/max_pixels into their shared class-level default.
    image_processor = Qwen2VLImageProcessor(size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, **vision)
    video_processor = Qwen2VLVideoProcessor(size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, **vision)
    return Qwen2_5_VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_model(
    out_dir: str | Path, seed: int = 0, min_pixels: int = 28 * 28 * 4, max_pixels: int = 28 * 28 * 64,
    text_hidden: int = 64, text_layers: int = 2,
) -> Path:
    """Write a complete tiny Qwen2.5-VL model directory to `out_dir` and return its path.

    `seed` fixes the tokenizer corpus and the random weights: the same seed gives byte-identical files.
    `min_pixels`/`max_pixels` are the processor's pixel budget (default 4 to 64 merged patches an image);
    `text_hidden`/`text_layers` size the language model (see `tiny_config`).
    """
    import torch
    from transformers import GenerationConfig, Qwen2_5_VLForConditionalGeneration

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(seed)
    config = tiny_config(tokenizer, text_hidden, text_layers)
    with torch.random.fork_rng(devices=[]):  # seed the weights without disturbing the caller's generator
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=config.text_config.bos_token_id,
        # <|im_end|> ends a turn; like Qwen's own generation config, <|endoftext|> ends generation too.
        eos_token_id=[config.text_config.eos_token_id, config.text_config.pad_token_id],
        pad_token_id=config.text_config.pad_token_id,
        use_cache=True,
    )
    model.save_pretrained(out_dir)
    tiny_processor(tokenizer, min_pixels, max_pixels).save_pretrained(out_dir)
    for weights in out_dir.glob("*.safetensors"):
        # transformers 5.6 writes the weights through a private temporary file (mode 0600); a container
        # running as another user, or a DVC cache shared between users, must be able to read them.
        os.chmod(weights, 0o644)
    return out_dir
