"""The token-level policy loss: gradient sign, asymmetric clipping, aggregation, KL and entropy terms."""

from __future__ import annotations

import math

import pytest
import torch

from stages.rl.loss import LossConfig, kl_estimate, loss_normaliser, policy_loss


def _grad(logprobs, old, adv, cfg=None, normaliser=None, **kw):
    cfg = cfg or LossConfig()
    logprobs = torch.tensor(logprobs, requires_grad=True)
    loss, stats = policy_loss(logprobs, torch.tensor(old), torch.tensor(adv), normaliser or len(adv), cfg, **kw)
    loss.backward()
    return loss, logprobs.grad, stats


def test_on_policy_gradient_raises_good_tokens_and_lowers_bad_ones():
    loss, grad, stats = _grad([-1.0, -2.0], [-1.0, -2.0], [1.0, -1.0])
    # minimising the loss moves log-probs against the gradient: up for A > 0, down for A < 0
    assert grad.tolist() == pytest.approx([-0.5, 0.5])
    assert float(loss.detach()) == pytest.approx(0.0)
    assert stats["clipped_sum"] == 0 and stats["ratio_sum"] == pytest.approx(2.0)


def test_clip_is_asymmetric_and_stops_the_gradient():
    cfg = LossConfig(clip_low=0.2, clip_high=0.3)
    up = math.log(1.25)  # inside 1 + 0.3, outside 1 + 0.2
    _, grad, stats = _grad([up], [0.0], [1.0], cfg)
    assert grad.item() != 0 and stats["clipped_sum"] == 0
    _, grad, stats = _grad([up], [0.0], [1.0], LossConfig(clip_low=0.2, clip_high=0.2))
    assert grad.item() == 0 and stats["clipped_high_sum"] == 1
    # low side: a bad token already made much less likely stops being pushed down
    _, grad, stats = _grad([math.log(0.7)], [0.0], [-1.0], cfg)
    assert grad.item() == 0 and stats["clipped_low_sum"] == 1
    # the pessimistic bound: a bad token made *more* likely is never clipped
    _, grad, stats = _grad([math.log(1.5)], [0.0], [-1.0], cfg)
    assert grad.item() > 0 and stats["clipped_sum"] == 0


def test_micro_batches_accumulate_to_the_whole_batch_loss():
    torch.manual_seed(0)
    new, old, adv = torch.randn(10) * 0.1 - 1, torch.randn(10) * 0.1 - 1, torch.randn(10)
    whole, _ = policy_loss(new, old, adv, 10.0, LossConfig())
    parts = sum(policy_loss(new[s], old[s], adv[s], 10.0, LossConfig())[0] for s in (slice(0, 3), slice(3, 10)))
    assert float(parts) == pytest.approx(float(whole), rel=1e-6)


def test_normalisers():
    assert loss_normaliser("token_mean", trained_tokens=37, sequences=4, generation_budget=100) == 37
    assert loss_normaliser("token_sum", trained_tokens=37, sequences=4, generation_budget=100) == 400
    with pytest.raises(ValueError):
        loss_normaliser("seq_mean", 1, 1, 1)


def test_kl_estimators():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    assert kl_estimate(logp, logp, "k3").abs().max() == 0
    ref = torch.tensor([-1.5, -1.0, -0.5])
    k1, k2, k3 = (kl_estimate(logp, ref, k) for k in ("k1", "k2", "k3"))
    assert k1.tolist() == pytest.approx([0.5, -1.0, 0.0])
    assert k2.tolist() == pytest.approx([0.125, 0.5, 0.0])
    assert (k3 >= 0).all() and k3[1] == pytest.approx(math.exp(1.0) - 1.0 - 1.0)
    with pytest.raises(ValueError):
        kl_estimate(logp, ref, "k4")


def test_kl_and_entropy_terms_enter_the_loss_with_their_signs():
    logp, old, adv = torch.tensor([-1.0]), torch.tensor([-1.0]), torch.tensor([0.0])
    ref, entropy = torch.tensor([-2.0]), torch.tensor([3.0])
    base, _ = policy_loss(logp, old, adv, 1.0, LossConfig())
    with_kl, stats = policy_loss(logp, old, adv, 1.0, LossConfig(kl_coef=0.5), ref_logprobs=ref)
    assert float(with_kl - base) == pytest.approx(0.5 * float(kl_estimate(logp, ref)))
    assert stats["kl_sum"] == pytest.approx(float(kl_estimate(logp, ref)))
    with_entropy, _ = policy_loss(logp, old, adv, 1.0, LossConfig(entropy_coef=0.1), entropy=entropy)
    assert float(with_entropy - base) == pytest.approx(-0.3)


def test_dual_clip_caps_a_negative_advantage_tokens_loss_at_c_times_its_advantage():
    """verl's dual clip (clip_ratio_c 3): with A = -1 and a ratio of 5, PPO's loss is 5; capped, it is 3 and the
    token sends no gradient. Positive advantages and small ratios are untouched."""
    old = torch.zeros(4)
    logprobs = torch.log(torch.tensor([5.0, 5.0, 1.1, 0.5])).requires_grad_()
    advantages = torch.tensor([-1.0, 1.0, -1.0, -1.0])
    plain, plain_stats = policy_loss(logprobs, old, advantages, 1.0, LossConfig(clip_low=0.2, clip_high=0.2))
    capped, stats = policy_loss(logprobs, old, advantages, 1.0, LossConfig(clip_low=0.2, clip_high=0.2, dual_clip=3.0))
    # per token, plain: -min(r A, clip(r) A) = [5, -1.2, 1.1, 0.8]; dual-clipped: [3, -1.2, 1.1, 0.8]
    assert float(plain.detach()) == pytest.approx(5 - 1.2 + 1.1 + 0.8)
    assert float(capped.detach()) == pytest.approx(3 - 1.2 + 1.1 + 0.8)
    assert stats["dual_clipped_sum"] == 1.0 and "dual_clipped_sum" not in plain_stats
    capped.backward()
    assert logprobs.grad[0] == 0.0 and logprobs.grad[2] != 0.0
