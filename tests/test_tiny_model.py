"""The embedded tiny Qwen2.5-VL: reproducible build, reload through Auto classes, generation, tokenizer.

Uses the session fixture `tiny_model_dir` (seed 0) from conftest; the few extra builds here take a second or
two each on a CPU.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from loupe.models import build_tiny_model, load_model_and_processor
from loupe.models.tiny_tokenizer import SPECIAL_TOKENS, training_corpus
from loupe.protocol import PROTOCOLS, FormatError, FormatErrorKind, ToolCall, get_protocol

SAMPLE_CALL = '<grounding>{"bbox_2d": [0.123, 0.5, 0.75, 0.9], "source": "observation_3"}</grounding>'
EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "processor_config.json",
}


def _file_hashes(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model_and_processor(tiny_model_dir)


def _prompt(processor, question: str = "What colour is the circle?", system: str | None = None) -> str:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


# --- the build -----------------------------------------------------------------------------------------------


def test_directory_holds_a_complete_model(tiny_model_dir):
    assert EXPECTED_FILES <= {p.name for p in tiny_model_dir.iterdir()}
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert config["text_config"]["use_cache"] is True
    assert json.loads((tiny_model_dir / "generation_config.json").read_text())["use_cache"] is True
    assert (tiny_model_dir / "model.safetensors").stat().st_mode & 0o044 == 0o044  # readable by others


def test_same_seed_gives_byte_identical_files(tiny_model_dir, tmp_path):
    again = build_tiny_model(tmp_path / "again", seed=0)
    assert _file_hashes(again) == _file_hashes(tiny_model_dir)


def test_different_seed_gives_different_weights(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    other = build_tiny_model(tmp_path / "other", seed=1)
    ours, theirs = load_file(tiny_model_dir / "model.safetensors"), load_file(other / "model.safetensors")
    assert ours.keys() == theirs.keys()
    matrices = [name for name, tensor in ours.items() if tensor.ndim >= 2]
    assert len(matrices) > 20
    # Norms start at 1 and biases at 0 whatever the seed; every randomly initialised matrix must differ.
    assert all(not torch.equal(ours[name], theirs[name]) for name in matrices)


def test_pixel_budget_reaches_the_processor(tmp_path):
    from transformers import AutoProcessor

    directory = build_tiny_model(tmp_path / "budget", seed=0, min_pixels=28 * 28 * 16, max_pixels=28 * 28 * 16)
    processor = AutoProcessor.from_pretrained(directory)
    grid = processor.image_processor(images=[Image.new("RGB", (1000, 1000))], return_tensors="pt")["image_grid_thw"]
    assert int(grid.prod()) // 4 == 16


# --- reload and run -----------------------------------------------------------------------------------------


def test_reloads_with_auto_classes_and_ids_agree(loaded):
    model, processor = loaded
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert type(processor).__name__ == "Qwen2_5_VLProcessor"
    tokenizer = processor.tokenizer
    config = model.config
    assert config.text_config.vocab_size == len(tokenizer)
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer)
    assert config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert config.video_token_id == tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert config.vision_start_token_id == tokenizer.convert_tokens_to_ids("<|vision_start|>")
    assert config.vision_end_token_id == tokenizer.convert_tokens_to_ids("<|vision_end|>")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert config.text_config.eos_token_id == tokenizer.eos_token_id
    assert config.text_config.pad_token_id == tokenizer.pad_token_id
    assert 100_000 < sum(p.numel() for p in model.parameters()) < 500_000
    assert model.generation_config.use_cache is True


def test_special_tokens_follow_the_learned_vocabulary_in_qwen_order(loaded):
    tokenizer = loaded[1].tokenizer
    ids = [tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS]
    assert ids == list(range(len(tokenizer) - len(SPECIAL_TOKENS), len(tokenizer)))
    for token in SPECIAL_TOKENS:  # each one id, and it survives decoding
        encoded = tokenizer(token, add_special_tokens=False)["input_ids"]
        assert len(encoded) == 1 and tokenizer.decode(encoded) == token


@pytest.mark.parametrize("size", [(10, 10), (300, 200), (1000, 60), (2000, 1500)])
def test_image_token_count_matches_the_grid(loaded, size):
    model, processor = loaded
    inputs = processor(images=[Image.new("RGB", size, (200, 30, 30))], text=[_prompt(processor)], return_tensors="pt")
    merged_patches = int(inputs["image_grid_thw"].prod()) // 4
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == merged_patches
    assert 4 <= merged_patches <= 64  # the default pixel budget: 4 to 64 merged patches
    with torch.no_grad():  # raises "image features and image tokens do not match" on a mismatch
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], len(processor.tokenizer))


def test_generates_new_tokens_from_an_image_and_a_question(loaded):
    model, processor = loaded
    inputs = processor(
        images=[Image.new("RGB", (320, 240), (20, 90, 200))], text=[_prompt(processor)], return_tensors="pt"
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False, use_cache=True)
    new_tokens = output[0, inputs["input_ids"].shape[1] :]
    assert new_tokens.shape == (8,)
    assert int(new_tokens.max()) < len(processor.tokenizer)


def test_generates_a_left_padded_batch_of_different_prompts(loaded):
    model, processor = loaded
    texts = [
        _prompt(processor, "Which shape is left of the red star?"),
        _prompt(processor, "Colour?", system="Be brief."),
    ]
    images = [Image.new("RGB", (500, 300), (0, 200, 0)), Image.new("RGB", (64, 640), (90, 0, 90))]
    # Batched generation pads on the left; the tokenizer's own default is right (for training).
    inputs = processor(images=images, text=texts, return_tensors="pt", padding=True, padding_side="left")
    assert int(inputs["attention_mask"][:, 0].sum()) < 2 and bool(inputs["attention_mask"][:, -1].all())
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=True, use_cache=True)
    assert output.shape == (2, inputs["input_ids"].shape[1] + 6)


# --- chat template ------------------------------------------------------------------------------------------


def test_chat_template_renders_qwen_layout(loaded):
    processor = loaded[1]
    vision = "<|vision_start|><|image_pad|><|vision_end|>"
    assert _prompt(processor, "Q?") == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n{vision}Q?<|im_end|>\n<|im_start|>assistant\n"
    )
    conversation = [
        {"role": "system", "content": [{"type": "text", "text": "Zoom."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Q?"}]},
        {"role": "assistant", "content": "<think>t</think>\n" + SAMPLE_CALL},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Obs 1: "}, {"type": "image"}, {"type": "text", "text": "."}],
        },
    ]
    expected = (
        "<|im_start|>system\nZoom.<|im_end|>\n"
        f"<|im_start|>user\n{vision}Q?<|im_end|>\n"
        f"<|im_start|>assistant\n<think>t</think>\n{SAMPLE_CALL}<|im_end|>\n"
        f"<|im_start|>user\nObs 1: {vision}.<|im_end|>\n"
    )
    assert processor.apply_chat_template(conversation, tokenize=False) == expected
    assert processor.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True) == (
        expected + "<|im_start|>assistant\n"
    )
    # vLLM and other text-only consumers render through the tokenizer's copy of the template.
    assert processor.tokenizer.apply_chat_template(conversation, tokenize=False) == expected


def test_chat_template_tokenizes_images_through_the_processor(loaded):
    processor = loaded[1]
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "image": Image.new("RGB", (200, 200))}, {"type": "text", "text": "Q?"}],
        }
    ]
    inputs = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    image_tokens = int((inputs["input_ids"] == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum())
    assert image_tokens == int(inputs["image_grid_thw"].prod()) // 4 > 0


# --- tokenizer ----------------------------------------------------------------------------------------------


def _protocol_strings() -> list[str]:
    texts = []
    for name in sorted(PROTOCOLS):
        protocol = get_protocol(name)
        texts.append(protocol.system_prompt())
        if protocol.multi_turn:
            texts += [protocol.observation_text(i) for i in (1, 2, 17)]
            call = ToolCall(
                "crop", {"bbox_2d": [0.1234, 0.5, 0.75, 0.999], "source": "observation_2", "frame": "relative"}
            )
            texts.append(protocol.render_call("The red circle is above the blue square.", call))
        texts.append(protocol.error_text(FormatError(FormatErrorKind.BAD_JSON, "the grounding call is not valid JSON")))
        texts.append(protocol.render_answer("It is (B).", "B"))
    # " ." and " 's" would be rewritten by clean_up_tokenization_spaces; non-ASCII text is encoded byte by byte.
    return texts + [SAMPLE_CALL, "</grounding>", "(B) blue\n(C) hexagon", "It is red . The cat 's", "Ü é 漢字 🙂"]


@pytest.mark.parametrize("text", _protocol_strings())
def test_protocol_text_round_trips_exactly(loaded, text):
    tokenizer = loaded[1].tokenizer
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.unk_token_id not in ids  # byte-level: nothing is unknown


def test_protocol_text_tokenises_compactly(loaded):
    tokenizer = loaded[1].tokenizer
    # Measured with seed 0: the sample call is 40 tokens (digits are single tokens, as in Qwen's split), the
    # mini_o3 system prompt 181 tokens for 679 characters. The bounds leave margin for corpus changes.
    assert len(tokenizer(SAMPLE_CALL, add_special_tokens=False)["input_ids"]) <= 46
    prompt = get_protocol("mini_o3").system_prompt()
    assert len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) <= len(prompt) // 3
    for word in ("grounding", " circle", " hexagon", " observation", " blue", "source"):
        assert len(tokenizer(word, add_special_tokens=False)["input_ids"]) == 1, word


def test_stop_strings_end_on_the_closing_tag(loaded):
    # `</grounding>` spans several tokens, merged differently by context ('"}</' + 'grounding' + '>'), so the
    # rollout stops on text; transformers' stop-string criterion must find it through this vocabulary.
    from transformers.generation.stopping_criteria import StopStringCriteria

    tokenizer = loaded[1].tokenizer
    criterion = StopStringCriteria(tokenizer, ["</grounding>"])

    def stops(text: str) -> bool:
        return bool(criterion(torch.tensor([tokenizer(text)["input_ids"]]), None)[0])

    assert stops("<think>x</think>\n" + SAMPLE_CALL)
    assert stops("a</grounding>")
    assert not stops("I think </grounding")
    assert not stops("</grounding> and more")


def test_corpus_covers_its_protocols_and_is_deterministic():
    """The corpus is built from a fixed list of protocols (CORPUS_PROTOCOLS), so registering a new one changes
    neither the embedded model nor its measured learning curve."""
    from loupe.models.tiny_tokenizer import CORPUS_PROTOCOLS

    corpus = training_corpus(0)
    assert set(CORPUS_PROTOCOLS) < set(PROTOCOLS)
    for name in CORPUS_PROTOCOLS:
        assert get_protocol(name).system_prompt() in corpus
    assert training_corpus(0) == corpus
    assert training_corpus(1) != corpus


# --- loading helper -----------------------------------------------------------------------------------------


def test_load_helper_turns_the_cache_on_and_casts(tiny_model_dir, tmp_path):
    # LLaMA-Factory saves fine-tuned models with use_cache false; loading must switch it back on.
    saved = shutil.copytree(tiny_model_dir, tmp_path / "sft_output")
    generation = json.loads((saved / "generation_config.json").read_text())
    (saved / "generation_config.json").write_text(json.dumps({**generation, "use_cache": False}))
    model, _ = load_model_and_processor(saved, dtype="bfloat16")
    assert model.generation_config.use_cache is True
    assert next(model.parameters()).dtype == torch.bfloat16
    assert not model.training
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model_and_processor(saved, dtype="float99")
