"""LoRA RL (`rl.lora`, stages/rl/lora.py) on the tiny model: the update touches the adapters only, the reference is
the base with its adapters off, engines and `model/` get the merged policy, checkpoints hold the adapters and
resume exactly, and the toy reward rises from chance.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rl_helpers import crash_at_step_3, make_toy_tasks, one_torch_thread, write_params  # noqa: F401 (autouse fixture)
from safetensors.torch import load_file

from loupe.rollout.weight_sync import module_digest
from stages.rl import __main__ as rl_main
from stages.rl.batching import TrainSequence
from stages.rl.learner import Learner
from stages.rl.params import RLParams
from stages.rl.trainer import Trainer

LORA = {"rank": 8, "alpha": 16}


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    return make_toy_tasks(tmp_path_factory.mktemp("toy"))


@pytest.fixture(scope="module")
def sharper_base(tiny_model_dir, tmp_path_factory):
    """The tiny model with its (tied) embeddings x 8: a base whose head can be steered from its hidden state.

    The random tiny model's logits are near uniform (entropy 7.6, ln 2048) and RMSNorm bounds its last hidden
    state, so adapters on its linear layers cannot move a logit by more than the head's small norm allows: 30
    steps at lr 0.05 left the toy reward at chance (measured), while full fine-tuning learns it through the head
    itself. A trained model's head is not that small. x 8 keeps the start at chance (reward 0.0-0.03 in the first
    three steps) and lets LoRA lift it (0.85 over the last five, measured)."""
    import shutil

    from transformers import AutoModelForImageTextToText

    out = tmp_path_factory.mktemp("sharper") / "model"
    model = AutoModelForImageTextToText.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(8.0)
    model.save_pretrained(out)
    for found in Path(tiny_model_dir).iterdir():
        if found.is_file() and not (out / found.name).exists():
            shutil.copy(found, out / found.name)
    return out


def _train(params: Path, model: Path, tasks: Path, out: Path) -> dict:
    return rl_main.train(params, model, tasks, out, progress=False)


def _rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    [file] = list(Path(model_dir).glob("*.safetensors"))
    return load_file(str(file))


def _sequence(length: int = 12) -> TrainSequence:
    ids = torch.randint(10, 100, (length,))
    positions = torch.arange(length // 2, length)
    return TrainSequence(input_ids=ids, positions=positions, advantage=1.0, old_logprobs=torch.full((len(positions),), -2.0),
                         images=[], traj_id="t", group="g")


def test_only_the_adapters_train_and_the_reference_is_the_base_with_them_off(tiny_model_dir):
    torch.manual_seed(0)
    params = RLParams(lr=0.05, kl={"coef": 0.1}, lora=LORA)
    learner = Learner(tiny_model_dir, params, 1.0, generation_budget=8, device="cpu")
    assert learner.reference is None  # no second copy of the model
    assert learner.trainable and all("lora_" in n for n, p in learner.model.named_parameters() if p.requires_grad)
    assert not any("visual" in n for n, p in learner.model.named_parameters() if p.requires_grad)  # vision frozen
    full = Learner(tiny_model_dir, RLParams(kl={"coef": 0.1}), 1.0, generation_budget=8, device="cpu")
    base_before = {n: t.clone() for n, t in learner.policy_weights()}
    assert module_digest(full.model) == module_digest(_as_module(full, base_before))  # B = 0: merged == base

    sequences = [_sequence(), _sequence()]
    for s in sequences:
        s.ref_logprobs = learner.logprobs([s], reference=True)[0]
    learner.update(sequences)
    after = dict(learner.policy_weights())
    frozen = {n: p for n, p in learner.model.named_parameters() if not p.requires_grad}
    assert all(torch.equal(p, full.model.state_dict()[n.replace(".base_layer.", ".")]) for n, p in frozen.items())
    assert any(not torch.equal(after[n], base_before[n]) for n in after)  # the merged policy moved
    # The reference is still the starting policy: the same log-probs as a full learner's frozen copy.
    for s in sequences:
        assert torch.allclose(learner.logprobs([s], reference=True)[0], full.logprobs([s], reference=True)[0], atol=1e-6)
        assert not torch.allclose(learner.logprobs([s])[0], full.logprobs([s])[0], atol=1e-4)


def _as_module(learner: Learner, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    import copy

    module = copy.deepcopy(learner.model)
    module.load_state_dict(state)
    return module


def test_the_merged_policy_is_what_peft_merges(tiny_model_dir):
    learner = Learner(tiny_model_dir, RLParams(lora=LORA), 1.0, generation_budget=8, device="cpu")
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    merged = dict(learner.policy_weights())
    import copy

    reference = copy.deepcopy(learner.lora).merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.allclose(merged[name], tensor, atol=1e-6), name


def test_lora_learns_the_toy_task_and_its_model_reloads_merged(sharper_base, toy_dir, tmp_path):
    from transformers import AutoModelForImageTextToText

    keys = {"steps": 30, "prompts_per_step": 4, "samples_per_prompt": 8, "checkpoint_every": 100, "lr": 0.05,
            "lora": LORA}
    _train(write_params(tmp_path / "params.yaml", keys), sharper_base, toy_dir, tmp_path / "out")
    rewards = [row["reward/mean"] for row in _rows(tmp_path / "out")]
    assert max(rewards[:3]) <= 0.2, rewards  # chance: about one random 4-token response in ten holds a "B"
    assert sum(rewards[-5:]) / 5 >= 0.7, rewards
    model_dir = tmp_path / "out" / "model"
    start, learnt = _weights(sharper_base), _weights(model_dir)
    assert learnt.keys() == start.keys()  # merged: the base model's names, no adapter tensors
    assert any(not torch.equal(start[k], learnt[k]) for k in start)
    visual = [k for k in start if "visual." in k]  # "visual.*" on disk, "model.visual.*" in memory
    assert visual and all(torch.equal(start[k], learnt[k]) for k in visual)
    assert (model_dir / "adapter" / "adapter_config.json").is_file()
    reloaded = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32)
    assert all(torch.equal(reloaded.state_dict()[k], learnt[k]) for k in learnt if k in reloaded.state_dict())


def test_a_crashed_lora_run_resumes_to_the_same_weights_and_its_checkpoints_hold_the_adapters(tiny_model_dir, toy_dir, tmp_path, monkeypatch):
    params = write_params(tmp_path / "params.yaml", {"steps": 4, "checkpoint_every": 2, "lr": 0.05, "lora": LORA,
                                                     "dynamic_sampling": {"enabled": True, "max_tries": 2}})
    _train(params, tiny_model_dir, toy_dir, tmp_path / "straight")
    real_step = crash_at_step_3(params, tiny_model_dir, toy_dir, tmp_path / "resumed", monkeypatch)
    checkpoint = tmp_path / "resumed" / "checkpoints" / "step_000002"
    stored = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())
    base = sum(f.stat().st_size for f in Path(tiny_model_dir).glob("*.safetensors"))
    assert stored < base / 2, (stored, base)  # adapters and their moments, not the frozen base
    monkeypatch.setattr(Trainer, "train_step", real_step)
    _train(params, tiny_model_dir, toy_dir, tmp_path / "resumed")

    straight, resumed = _weights(tmp_path / "straight" / "model"), _weights(tmp_path / "resumed" / "model")
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert [r["reward/mean"] for r in _rows(tmp_path / "straight")] == [r["reward/mean"] for r in _rows(tmp_path / "resumed")]
    assert [r["update/grad_norm"] for r in _rows(tmp_path / "straight")] == [r["update/grad_norm"] for r in _rows(tmp_path / "resumed")]


def test_lora_refuses_a_sharded_learner():
    with pytest.raises(ValueError, match="single-process learner"):
        RLParams(lora=LORA, ray={"enabled": True, "gpus_per_node": 2})


def test_colocated_lora_generates_with_the_adapted_module_and_trains_like_a_separate_engine(tiny_model_dir, toy_dir, tmp_path):
    """Colocated with LoRA: the engine generates with the learner's module, adapters injected, and sees each update
    exactly as a separate engine does after its merged sync, so both runs end on the same weights."""
    keys = {"steps": 3, "lr": 0.05, "lora": LORA}
    _train(write_params(tmp_path / "local.yaml", keys), tiny_model_dir, toy_dir, tmp_path / "local")
    _train(write_params(tmp_path / "colocated.yaml", {**keys, "ray": {"enabled": False, "colocate": True}}),
           tiny_model_dir, toy_dir, tmp_path / "colocated")
    local, colocated = _weights(tmp_path / "local" / "model"), _weights(tmp_path / "colocated" / "model")
    assert local.keys() == colocated.keys()
    assert all(torch.allclose(local[k], colocated[k], atol=1e-6) for k in local)
    assert [r["reward/mean"] for r in _rows(tmp_path / "local")] == [r["reward/mean"] for r in _rows(tmp_path / "colocated")]
