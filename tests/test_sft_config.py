"""The sft section and the LLaMA-Factory YAML generated from it: every key one LLaMA-Factory accepts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from loupe.config import ParamsError, ProtocolParams, load_section, parse_section
from stages.sft import llamafactory_config as lf
from stages.sft.params import SftParams

PROTOCOL = ProtocolParams(min_pixels=3136, max_pixels=200704)


def build(params: SftParams, on_gpu: bool = False, tmp: Path = Path("/tmp/x"), deepspeed: Path | None = None) -> dict:
    return lf.train_config(params, PROTOCOL, seed=7, model_path=tmp / "base", dataset_dir=tmp / "data",
                           output_dir=tmp / "train", on_gpu=on_gpu, template="qwen2_vl", deepspeed=deepspeed,
                           report_to="none")


def llamafactory_train_fields() -> set[str]:
    from llamafactory.hparams.parser import _TRAIN_ARGS

    return {f.name for cls in _TRAIN_ARGS for f in dataclasses.fields(cls)}


def test_full_cpu_config_carries_our_parameters():
    params = SftParams(learning_rate=2e-4, max_steps=300, cutoff_len=2048, per_device_train_batch_size=4,
                       gradient_accumulation_steps=2, lr_scheduler_type="linear", warmup_ratio=0.1, save_steps=50)
    config = build(params)
    assert config["template"] == "qwen2_vl" and config["stage"] == "sft" and config["finetuning_type"] == "full"
    assert (config["image_min_pixels"], config["image_max_pixels"]) == (3136, 200704)  # the protocol's budget
    assert config["freeze_vision_tower"] and config["freeze_multi_modal_projector"]
    assert (config["learning_rate"], config["max_steps"], config["cutoff_len"]) == (2e-4, 300, 2048)
    assert (config["per_device_train_batch_size"], config["gradient_accumulation_steps"]) == (4, 2)
    assert (config["seed"], config["save_steps"], config["warmup_ratio"]) == (7, 50, 0.1)
    assert config["bf16"] is False and "deepspeed" not in config and "flash_attn" not in config
    assert config["overwrite_output_dir"] is False and config["save_only_model"] is False  # resumable
    assert not any(key.startswith("lora_") for key in config)
    assert Path(config["output_dir"]).is_absolute() and Path(config["dataset_dir"]).is_absolute()


def test_device_cpu_hides_a_visible_gpu():
    config = lf.train_config(SftParams(device="cpu"), PROTOCOL, 0, Path("/m"), Path("/d"), Path("/o"),
                             on_gpu=False, template="qwen2_vl", hide_gpu=True)
    assert config["use_cpu"] is True and config["bf16"] is False
    assert "use_cpu" not in build(SftParams())


def test_cpu_processes_share_the_step_batch_and_train_over_gloo():
    config = build(SftParams(per_device_train_batch_size=4, cpu_processes=2))
    assert config["per_device_train_batch_size"] == 2 and config["ddp_backend"] == "gloo"
    assert lf.launch_environment(2) == {"OMP_NUM_THREADS": "1"}
    assert lf.launch_environment(1) == {} and "ddp_backend" not in build(SftParams(per_device_train_batch_size=4))
    # On a GPU the GPUs decide; the CPU setting is ignored.
    assert lf.cpu_processes(SftParams(per_device_train_batch_size=4, cpu_processes=2), on_gpu=True) == 1
    assert build(SftParams(per_device_train_batch_size=4, cpu_processes=2), on_gpu=True)["per_device_train_batch_size"] == 4
    with pytest.raises(ParamsError, match=r"sft.per_device_train_batch_size \(3\) does not divide by sft.cpu_processes \(2\)"):
        build(SftParams(per_device_train_batch_size=3, cpu_processes=2))


def test_epochs_unless_steps_are_given():
    assert build(SftParams(num_train_epochs=3))["max_steps"] == -1
    assert build(SftParams(num_train_epochs=3))["num_train_epochs"] == 3


def test_lora_and_gpu_settings(tmp_path):
    params = SftParams(finetuning_type="lora", lora={"rank": 16, "alpha": 32, "target": "q_proj,v_proj"},
                       freeze_vision_tower=False, gpu={"deepspeed": "z2", "flash_attn": "fa2"})
    deepspeed = lf.copy_deepspeed(lf.resolve_deepspeed(params.gpu.deepspeed), tmp_path)
    config = build(params, on_gpu=True, deepspeed=deepspeed)
    assert (config["lora_rank"], config["lora_alpha"], config["lora_target"]) == (16, 32, "q_proj,v_proj")
    assert config["freeze_vision_tower"] is False
    assert config["bf16"] is True and config["flash_attn"] == "fa2"
    assert config["deepspeed"] == str(tmp_path / "deepspeed.json")
    assert json.loads((tmp_path / "deepspeed.json").read_text())["zero_optimization"]["stage"] == 2
    assert set(config) <= llamafactory_train_fields()  # every key is one LLaMA-Factory knows


@pytest.mark.parametrize("name, stage", [("z2", 2), ("z3", 3)])
def test_shipped_deepspeed_configs_defer_to_the_trainer(name, stage):
    config = json.loads(lf.resolve_deepspeed(name).read_text())
    assert config["zero_optimization"]["stage"] == stage
    # "auto" lets the HF trainer fill batch sizes and precision from the LLaMA-Factory YAML: one source.
    assert config["train_micro_batch_size_per_gpu"] == "auto" and config["bf16"]["enabled"] == "auto"


def test_llamafactory_parses_the_generated_cpu_config(tmp_path):
    from llamafactory.hparams.parser import _parse_train_args

    config = build(SftParams(max_steps=5), tmp=tmp_path)
    model_args, data_args, training_args, finetuning_args, _ = _parse_train_args(config)
    assert data_args.template == "qwen2_vl" and data_args.cutoff_len == 4096
    assert model_args.image_max_pixels == 200704 and finetuning_args.freeze_vision_tower
    assert training_args.max_steps == 5 and training_args.seed == 7


def test_written_yaml_says_how_to_rerun_it(tmp_path):
    config = build(SftParams(), tmp=tmp_path)
    path = lf.write_yaml(tmp_path / "train.yaml", config, "llamafactory-cli train /abs/train.yaml")
    text = path.read_text()
    assert text.startswith("# Generated by `python -m stages.sft`") and "llamafactory-cli train /abs/train.yaml" in text
    assert yaml.safe_load(text) == config


def test_extra_keys_pass_through_but_never_override_ours():
    assert build(SftParams(extra={"gradient_checkpointing": True}))["gradient_checkpointing"] is True
    with pytest.raises(ParamsError, match="sft.extra: learning_rate"):
        build(SftParams(extra={"learning_rate": 1.0}))


def test_resume_fingerprint_ignores_tracking_and_checkpoint_cadence():
    a, b = build(SftParams()), build(SftParams())
    b["report_to"], b["save_steps"], b["logging_steps"] = "mlflow", 7, 3
    assert lf.fingerprint_view(a) == lf.fingerprint_view(b)
    assert lf.fingerprint_view(a) != lf.fingerprint_view(build(SftParams(learning_rate=1.0)))


def test_params_errors_name_their_key(tmp_path):
    with pytest.raises(ParamsError, match=r"sft.finetuning_type: Input should be 'full' or 'lora'"):
        parse_section(SftParams, {"finetuning_type": "qlora"}, "sft")
    with pytest.raises(ParamsError, match=r"sft.lerning_rate: Extra inputs are not permitted"):
        parse_section(SftParams, {"lerning_rate": 1e-5}, "sft")
    with pytest.raises(ParamsError, match="neither z2, z3 nor a DeepSpeed JSON"):
        lf.resolve_deepspeed("z4")


def test_repository_params_yaml_has_a_valid_sft_section():
    params = load_section(SftParams, "sft", Path(__file__).parents[1] / "params.yaml")
    assert params.dataset == "loupe_synth"


def test_the_gpu_preset_generates_a_zero3_bf16_config(tmp_path):
    preset = Path(__file__).parents[1] / "params" / "mini-o3.yaml"
    params = load_section(SftParams, "sft", preset)
    protocol = load_section(ProtocolParams, "protocol", preset)
    deepspeed = lf.copy_deepspeed(lf.resolve_deepspeed(params.gpu.deepspeed), tmp_path)
    config = lf.train_config(params, protocol, 0, tmp_path / "qwen", tmp_path / "data", tmp_path / "train",
                             on_gpu=params.device == "gpu", template="qwen2_vl", deepspeed=deepspeed)
    assert config["bf16"] is True and config["flash_attn"] == "fa2"
    assert json.loads(Path(config["deepspeed"]).read_text())["zero_optimization"]["stage"] == 3
    assert config["image_max_pixels"] == protocol.max_pixels and config["learning_rate"] == params.learning_rate
    assert set(config) <= llamafactory_train_fields()
