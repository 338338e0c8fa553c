"""Pixelis' conservative update (`rl.ttrl.conservative`, stages/rl/conservative.py): each rule worked by hand
from ClayKa/Pixelis @ 991bb06 (`core/engine/update_worker.py`, `core/engine/inference_engine.py`), then the
rules together in the rl stage."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rl_helpers import make_toy_tasks, one_torch_thread, votes_by_first_letter, write_params  # noqa: F401 (fixtures)
from stages.rl.conservative import AdaptiveKL, WeightEMA, confidence_lr, k3_forward_kl
from stages.rl.params import ConservativeParams, RLParams


def test_k3_estimates_kl_old_to_new_from_the_old_policys_samples():
    # Two tokens, each policy a coin: old P(heads) 0.5, new 0.8. KL(old || new) = 0.5 ln(0.5/0.8) + 0.5 ln(0.5/0.2).
    exact = 0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.5 / 0.2)
    old = torch.log(torch.tensor([0.5, 0.5]))
    new = torch.log(torch.tensor([0.8, 0.2]))  # heads drawn once, tails once: the old policy's expectation
    assert float(k3_forward_kl(new, old).mean()) == pytest.approx(exact, rel=1e-6)
    assert float(k3_forward_kl(old, old).abs().max()) == 0.0


@pytest.mark.parametrize("confidence, lr", [(0.75, 2.5e-5), (0.0, 1e-4), (1.0, 1e-6), (0.995, 1e-6), (0.7, 3e-5)])
def test_the_rate_is_max_lr_times_one_minus_confidence_within_its_bounds(confidence, lr):
    assert confidence_lr(confidence, max_lr=1e-4, min_lr=1e-6) == pytest.approx(lr)


def test_beta_waits_for_ten_kls_then_moves_by_1_2_toward_the_target():
    kl = AdaptiveKL(ConservativeParams(enabled=True))  # beta 0.01, target 0.05 +- 0.01
    for _ in range(9):
        kl.record(0.2)
    assert kl.beta == 0.01  # `_adjust_beta` returns below 10 in the window
    kl.record(0.2)
    assert kl.beta == pytest.approx(0.012)
    kl.record(0.2)
    assert kl.beta == pytest.approx(0.0144)
    inside = AdaptiveKL(ConservativeParams(enabled=True))
    for _ in range(20):
        inside.record(0.055)  # within the tolerance: no move
    assert inside.beta == 0.01
    low = AdaptiveKL(ConservativeParams(enabled=True, initial_beta=2e-4))
    for _ in range(15):
        low.record(0.0)
    assert low.beta == pytest.approx(1e-4)  # 2e-4 / 1.2^6 is 6.7e-5: floored at min_beta
    high = AdaptiveKL(ConservativeParams(enabled=True, initial_beta=0.9))
    for _ in range(12):
        high.record(1.0)
    assert high.beta == 1.0  # capped at max_beta


def test_the_window_is_the_last_hundred_kls():
    kl = AdaptiveKL(ConservativeParams(enabled=True))
    for _ in range(100):
        kl.record(1.0)
    beta = kl.beta
    for _ in range(100):  # the high ones leave the window one by one; the mean crosses below 0.04 at the 61st
        kl.record(0.0)
    assert len(kl.history) == 100 and set(kl.history) == {0.0} and kl.beta < beta
    restored = AdaptiveKL(ConservativeParams(enabled=True))
    restored.load(kl.state())
    assert restored.beta == kl.beta and list(restored.history) == list(kl.history)


def test_an_update_past_twice_the_target_is_skipped():
    kl = AdaptiveKL(ConservativeParams(enabled=True))
    assert not kl.skips(0.1) and kl.skips(0.1001)


def test_the_ema_moves_a_tenth_of_the_way_at_decay_0_9_and_swaps_in_without_losing_the_weights():
    weight = torch.nn.Parameter(torch.zeros(2))
    ema = WeightEMA([weight], decay=0.9)
    with torch.no_grad():
        weight.fill_(1.0)
    ema.update()
    assert ema.shadow[0].tolist() == pytest.approx([0.1, 0.1])
    ema.update()
    assert ema.shadow[0].tolist() == pytest.approx([0.19, 0.19])  # 0.9 x 0.1 + 0.1 x 1
    with ema.swapped_in():
        assert weight.tolist() == pytest.approx([0.19, 0.19])
    assert weight.tolist() == [1.0, 1.0]


def test_bounds_out_of_order_are_refused():
    with pytest.raises(ValueError, match="min_lr"):
        ConservativeParams(min_lr=1e-3, max_lr=1e-4)
    with pytest.raises(ValueError, match="min_beta"):
        ConservativeParams(min_beta=2.0)


def test_the_stage_applies_all_four_rules(tiny_model_dir, tmp_path, monkeypatch, votes_by_first_letter):
    """Test-time RL with the conservative update on the toy: each step's rate is the vote's (gate 0, so
    every group votes), a huge KL skips the mini-batches after the first, the saved model is the EMA (not the
    trained weights) and a checkpoint carries beta and the EMA. The untrained tiny model writes no `<answer>`,
    so a sample's vote is the first option letter in its text (as in tests/test_ttrl.py)."""
    from safetensors.torch import load_file

    from stages.rl.inputs import read_inputs
    from stages.rl.trainer import Trainer

    toy = make_toy_tasks(tmp_path / "toy")
    params = write_params(tmp_path / "params.yaml", {
        "steps": 2, "mini_batches": 2, "checkpoint_every": 1,
        "ttrl": {"enabled": True, "confidence_gate": 0.0,
                 "conservative": {"enabled": True, "target_kl": 1e-9, "ema_decay": 0.5, "max_lr": 0.05}},
    })
    inputs = read_inputs(params, tiny_model_dir, toy)
    kept = {}
    stop = Trainer._stop
    monkeypatch.setattr(Trainer, "_stop", lambda self: (kept.setdefault("learner", self.learner), stop(self)))
    Trainer(inputs, tmp_path / "out", progress=False, use_ray=False).run_loop()
    learner = kept["learner"]
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    for row in train:
        assert row["update/lr"] == pytest.approx(min(max(0.05 * (1 - row["ttrl/kept_confidence"]), 1e-6), 0.05))
        # The first mini-batch starts at the sampler's policy (KL about 0, below any target only up to its float
        # error), so at a target of 1e-9 at most it passes; the second follows a step at rate ~0.03 and is refused.
        assert row["update/conservative_skipped"] >= 1
        assert row["update/optimizer_steps"] + row["update/conservative_skipped"] == 2
        assert "ttrl/pseudo_label_accuracy" in row and 0.0 <= row["ttrl/pseudo_label_accuracy"] <= 1.0
        assert row["ttrl/buffer_hits"] >= 0.0
    saved = load_file(str(tmp_path / "out" / "model" / "model.safetensors"))
    trained = dict(learner.model.named_parameters())
    ema = dict(zip([n for n, p in learner.model.named_parameters() if p.requires_grad], learner.ema.shadow))
    moved = [n for n in ema if not torch.equal(ema[n], trained[n].detach())]
    if sum(r["update/optimizer_steps"] for r in train):
        assert moved, "an applied step at decay 0.5 leaves the EMA apart from the trained weights"
    for name in ema:
        if name in saved:
            assert torch.equal(saved[name], ema[name]), name
    checkpoint = tmp_path / "out" / "checkpoints" / "step_000002"
    assert (checkpoint / ".metadata").is_file() or any(checkpoint.rglob(".metadata"))
    resumed = Trainer(read_inputs(params, tiny_model_dir, toy), tmp_path / "out", progress=False, use_ray=False)
    resumed._start()  # loads the newest checkpoint, step 2
    try:
        assert resumed.learner.adaptive_kl.beta == learner.adaptive_kl.beta
        assert all(torch.equal(a, b) for a, b in zip(resumed.learner.ema.shadow, learner.ema.shadow))
    finally:
        stop(resumed)


def test_a_colocated_transformers_engine_is_refused_with_the_ema(tiny_model_dir, tmp_path):
    from stages.rl.inputs import read_inputs
    from stages.rl.trainer import Trainer

    toy = make_toy_tasks(tmp_path / "toy")
    params = write_params(tmp_path / "params.yaml", {
        "ray": {"enabled": False, "colocate": True},
        "ttrl": {"enabled": True, "conservative": {"enabled": True}},
    })
    with pytest.raises(ValueError, match="colocate"):
        Trainer(read_inputs(params, tiny_model_dir, toy), tmp_path / "out", progress=False, use_ray=False).run_loop()


def test_conservative_params_live_under_rl_ttrl():
    params = RLParams.model_validate({"ttrl": {"enabled": True, "conservative": {"enabled": True, "ema_decay": 0.9}}})
    assert params.ttrl.conservative.ema_decay == 0.9 and params.ttrl.conservative.target_kl == 0.05
