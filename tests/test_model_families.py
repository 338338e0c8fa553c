"""Each model family through the pieces that differ by family (loupe.models.family), on a tiny model of each built
offline: Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE and Qwen3.5 (hybrid linear attention)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from PIL import Image

from loupe.config import ProtocolParams
from loupe.data.tasks import TaskRecord
from loupe.models import load_model, load_processor
from loupe.models.family import ModelFamilyError, llamafactory_template, read_family
from loupe.models.tiny import FAMILIES
from loupe.protocol import get_protocol
from loupe.rollout.loop import run_rollouts
from tests.test_hf_engine import assert_logprobs_are_one_forward_pass

GRID = {"qwen2_5_vl": 28, "qwen3_vl": 32, "qwen3_vl_moe": 32, "qwen3_5": 32}
TEMPLATE = {"qwen2_5_vl": "qwen2_vl", "qwen3_vl": "qwen3_vl_nothink", "qwen3_vl_moe": "qwen3_vl_nothink",
            "qwen3_5": "qwen3_5_nothink"}


def tasks(n: int) -> list[TaskRecord]:
    return [TaskRecord(doc_id=f"q{i}", images=["scene.png"], problem=f"What colour is square {i}?", solution="A",
                       options=["yellow", "blue", "red"]) for i in range(n)]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_is_read_from_its_own_files(family, family_model_dirs):
    found = read_family(family_model_dirs[family])
    assert found.name == family and found.image_factor == GRID[family]
    assert llamafactory_template(found) == TEMPLATE[family]
    assert found.hybrid == (family == "qwen3_5")
    if found.hybrid:
        assert found.layer_kinds == ("linear_attention", "attention")  # three in four at the real depth
    config = json.loads((family_model_dirs[family] / "config.json").read_text())
    assert found.marker_ids["image_token_id"] == config["image_token_id"] and len(found.marker_ids) == 4


def test_a_thinking_chat_template_picks_the_family_s_thinking_template(family_model_dirs, tmp_path):
    model = shutil.copytree(family_model_dirs["qwen3_vl"], tmp_path / "thinking")
    template = (model / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").write_text(
        template + "{%- if enable_thinking is defined and enable_thinking -%}{{- '<think>\\n' -}}{%- endif -%}")
    assert llamafactory_template(read_family(model)) == "qwen3_vl"
    assert llamafactory_template(read_family(model), "qwen3_vl_nothink") == "qwen3_vl_nothink"  # sft.template


def test_a_model_loupe_cannot_run_stops_at_load_naming_the_family_and_the_piece(family_model_dirs, tmp_path):
    model = shutil.copytree(family_model_dirs["qwen2_5_vl"], tmp_path / "odd")
    config = json.loads((model / "config.json").read_text())
    json.dump({**config, "model_type": "llava_next", "vision_config": {}}, (model / "config.json").open("w"))
    (model / "processor_config.json").write_text("{}")
    with pytest.raises(ModelFamilyError, match=r"model family 'llava_next': no image grid \(patch_size and merge_size"):
        load_model(model)
    config["text_config"]["layer_types"] = ["mamba", "full_attention"]
    json.dump(config, (model / "config.json").open("w"))
    shutil.copyfile(family_model_dirs["qwen2_5_vl"] / "processor_config.json", model / "processor_config.json")
    with pytest.raises(ModelFamilyError, match="model family 'qwen2_5_vl': text layers of kind mamba"):
        load_processor(model)
    config["text_config"]["layer_types"] = None
    json.dump({**config, "model_type": "llava_next"}, (model / "config.json").open("w"))
    unknown = read_family(model)  # runs on what it declares; SFT alone needs what it does not
    assert unknown.image_factor == 28 and not unknown.known
    with pytest.raises(ModelFamilyError, match="'llava_next': Loupe does not know its LLaMA-Factory template; set sft.template"):
        llamafactory_template(unknown)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_engine_s_log_probs_are_one_forward_pass_per_family(family, family_model_dirs, scene_dir):
    """Over scripted searches of several crops, three turns decoding together and rows joining and leaving the
    running batch, each dialogue kept between turns (keys and values, and Qwen3.5's convolution and recurrent
    states), the recorded log-probs are those of one fresh forward over each whole dialogue."""
    from benchmarks.rollout_throughput import ScriptedTurns

    model, processor = load_model(family_model_dirs[family]), load_processor(family_model_dirs[family])
    protocol = ProtocolParams(min_pixels=4096, max_pixels=65536, max_turns=6, max_images=8)
    engine = ScriptedTurns(model, processor, get_protocol("mini_o3").stop, temperature=1.0, batch_size=3,
                           max_turns=6, seed=0)
    trajectories = run_rollouts(tasks(4), engine, protocol, scene_dir, samples_per_task=2, max_new_tokens=12)
    assert max(len(t.trace.extras["pixel_values"]) for t in trajectories) >= 3
    assert len({t.num_turns for t in trajectories}) > 1
    for trajectory in trajectories:
        assert_logprobs_are_one_forward_pass(model, trajectory.trace)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_image_and_crop_sits_on_the_family_s_grid_and_the_processor_keeps_it(family, family_model_dirs,
                                                                                  scene_dir):
    """The loop shows images on the model's own grid (its processor's patch x merge, read by the engine), so
    the processor resizes nothing: its pixels of a crop are those of the crop taken as it is."""
    from benchmarks.rollout_throughput import ScriptedTurns

    model, processor = load_model(family_model_dirs[family]), load_processor(family_model_dirs[family])
    # Within every tiny processor's own bounds (4 to 64 grid cells): outside them the processor would resize.
    protocol = ProtocolParams(min_pixels=4096, max_pixels=50176, max_turns=4, max_images=8)
    engine = ScriptedTurns(model, processor, get_protocol("mini_o3").stop, temperature=1.0, batch_size=2,
                           max_turns=4, seed=1)
    assert engine.image_factor == GRID[family]
    trajectories = run_rollouts(tasks(3), engine, protocol, scene_dir, samples_per_task=2, max_new_tokens=8)
    crops = [image for t in trajectories for image in t.trace.images[1:]]
    assert crops and all(isinstance(image, Image.Image) for image in crops), "the script zooms"
    patch = processor.image_processor.patch_size
    for image in crops:
        assert image.width % GRID[family] == 0 and image.height % GRID[family] == 0, image.size
        shown = processor.image_processor(images=[image], return_tensors="pt")
        as_is = processor.image_processor(images=[image], return_tensors="pt", do_resize=False)
        assert shown["image_grid_thw"].tolist() == [[1, image.height // patch, image.width // patch]]
        assert torch.equal(shown["pixel_values"], as_is["pixel_values"])


def test_a_grid_the_params_give_that_the_model_contradicts_stops_the_run(family_model_dirs, scene_dir):
    from benchmarks.rollout_throughput import ScriptedTurns

    directory = family_model_dirs["qwen3_vl"]
    engine = ScriptedTurns(load_model(directory), load_processor(directory), (), temperature=1.0, batch_size=1,
                           max_turns=2, seed=0)
    with pytest.raises(ValueError, match="protocol.image_factor is 28, but the model's processor resizes images on "
                                         "a 32-px grid"):
        run_rollouts(tasks(1), engine, ProtocolParams(image_factor=28), scene_dir, max_new_tokens=4)


def test_lora_on_qwen3_5_adapts_its_linear_attention_projections(family_model_dirs):
    from stages.rl.lora import attach_lora
    from stages.rl.params import LoraParams

    model = load_model(family_model_dirs["qwen3_5"])
    peft_model = attach_lora(model, LoraParams(rank=4))
    adapted = {name.split(".")[-1] for name, module in peft_model.named_modules() if hasattr(module, "lora_A")}
    assert {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"} <= adapted
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= adapted
    assert not [name for name, module in peft_model.named_modules() if hasattr(module, "lora_A") and ".visual." in name]
