"""The estimator family's formulas on small examples computed by hand from the papers (no rollout).

DAPO (arXiv 2503.14476) eq. 13, GSPO (arXiv 2507.18071) eqs. 5-7 and 13-14, CISPO (MiniMax-M1, arXiv 2506.13585)
eq. 4, ReMax (arXiv 2310.10505) Algorithm 1, GAE (arXiv 1506.02438) eq. 16 and PPO's clipped value loss.
Every expected number below is worked out in the comment beside it, not by calling the code under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from rl_helpers import one_torch_thread  # noqa: F401 (autouse fixture)

from loupe.trajectory import Trajectory, Turn
from stages.rl.advantages import compute_advantages, gae
from stages.rl.batching import TrainSequence
from stages.rl.critic import value_loss
from stages.rl.loss import LossConfig, loss_normaliser, policy_loss
from stages.rl.params import RLParams
from stages.rl.shaping import curiosity_bonus, longest_turn, overlong_penalty, token_rewards
from stages.rl.trainer import _trainable

# --- the recipes' defaults ---------------------------------------------------------------------------------


def test_each_estimator_brings_its_papers_defaults_and_a_set_key_wins():
    dapo = RLParams(estimator="dapo")
    assert (dapo.clip_low, dapo.clip_high, dapo.aggregation) == (0.2, 0.28, "token_mean")
    assert dapo.overlong.filter and dapo.overlong.soft_punishment and dapo.dynamic_sampling.enabled
    gspo = RLParams(estimator="gspo")
    assert (gspo.clip_low, gspo.clip_high, gspo.aggregation) == (3e-4, 4e-4, "seq_mean_token_mean")
    assert (RLParams(estimator="cispo").clip_low, RLParams(estimator="cispo").clip_high) == (1.0, 0.28)
    ppo = RLParams(estimator="ppo")
    assert (ppo.clip_low, ppo.clip_high) == (0.2, 0.2) and not ppo.dynamic_sampling.enabled and ppo.recipe.critic
    assert not RLParams(estimator="remax").dynamic_sampling.enabled and RLParams(estimator="remax").recipe.greedy_baseline
    # keys the user sets win over the recipe's
    mine = RLParams(estimator="dapo", clip_high=0.5, overlong={"filter": False}, loss_aggregation="token_sum")
    assert mine.clip_high == 0.5 and not mine.overlong.filter and mine.overlong.soft_punishment and mine.aggregation == "token_sum"
    assert RLParams(estimator="ppo", dynamic_sampling={"enabled": True}).dynamic_sampling.enabled
    # the former estimators keep their former defaults
    grpo = RLParams()
    assert (grpo.clip_low, grpo.clip_high, grpo.aggregation, grpo.overlong.filter) == (0.2, 0.3, "token_mean", False)
    assert RLParams(estimator="dr_grpo").aggregation == "token_sum"


def test_a_critic_section_without_ppo_and_an_unknown_estimator_are_errors():
    with pytest.raises(ValueError, match="only estimator ppo"):
        RLParams(estimator="grpo", critic={"lr": 1e-5})
    with pytest.raises(ValueError, match="estimator"):
        RLParams(estimator="trpo")


# --- DAPO: overlong treatment ------------------------------------------------------------------------------


def test_soft_overlong_punishment_follows_dapo_eq_13():
    # L_max 20, L_cache 5: no penalty up to 15 tokens, then (15 - L) / 5, and -1 at the budget.
    assert overlong_penalty(15, 20, 5) == 0.0
    assert overlong_penalty(17, 20, 5) == pytest.approx(-0.4)  # (15 - 17) / 5
    assert overlong_penalty(20, 20, 5) == pytest.approx(-1.0)
    assert overlong_penalty(19, 20, 5, factor=0.5) == pytest.approx(-0.4)  # 0.5 * (15 - 19) / 5
    assert overlong_penalty(40, 20, 5) == pytest.approx(-1.0)  # never more than the factor
    with pytest.raises(ValueError):
        overlong_penalty(3, 20, 0)


# --- Pixel-Reasoner: curiosity bonus -----------------------------------------------------------------------


def test_curiosity_bonus_follows_pixel_reasoners_code():
    # 8 samples, one with a tool call: RaPR 1/8; bonus 0.5 * (0.3 - 0.125) * 0.25 / 0.125 = 0.175 (the figure its
    # code pays at nsamples=8); the paper's form without the 1/RaPR factor: 0.5 * 0.175 = 0.0875.
    calls = [2, 0, 0, 0, 0, 0, 0, 0]
    assert curiosity_bonus(calls, 0.3, 0.5, 0.25) == pytest.approx([0.175] + [0.0] * 7)
    assert curiosity_bonus(calls, 0.3, 0.5, 0.0) == pytest.approx([0.0875] + [0.0] * 7)
    assert curiosity_bonus([1, 1, 1, 0], 0.3, 0.5, 0.25) == [0.0] * 4  # rate 0.75 is above H: nothing
    assert curiosity_bonus([0, 0], 0.3, 0.5, 0.25) == [0.0, 0.0]
    assert curiosity_bonus([], 0.3, 0.5, 0.25) == []


def test_trainer_adds_the_curiosity_bonus_per_group_to_valid_totals():
    from types import SimpleNamespace

    from stages.rl.trainer import Trainer

    params = RLParams(curiosity={"enabled": True}, samples_per_prompt=4)
    group_a = [_trajectory([5], "answered") for _ in range(4)]
    group_b = [_trajectory([5], "answered") for _ in range(4)]
    group_a[0].num_tool_calls = 1
    group_a[1].rewards = {"total": None, "valid": False}
    group_a[1].num_tool_calls = 1
    for t in group_b:
        t.num_tool_calls = 1
    Trainer._shape(SimpleNamespace(params=params), group_a + group_b, 4)
    # group a: rate 2/4 = 0.5 > 0.3, so no bonus; make it one in four instead
    assert [t.rewards["total"] for t in group_a] == [1.0, None, 1.0, 1.0]
    group_a[1].num_tool_calls = 0
    group_a[1].rewards = {"total": 0.0, "valid": True}
    Trainer._shape(SimpleNamespace(params=params), group_a, 4)
    assert group_a[0].rewards["total"] == pytest.approx(1.0 + 0.5 * 0.05 * 0.25 / 0.25)
    assert group_a[0].rewards["curiosity"] == pytest.approx(0.025)
    assert [t.rewards["total"] for t in group_a[1:]] == [0.0, 1.0, 1.0]
    assert all(t.rewards["total"] == 1.0 for t in group_b)  # everyone zoomed: nothing to encourage

def _trajectory(turn_tokens: list[int], end_reason: str, total: float | None = 1.0) -> Trajectory:
    t = Trajectory(traj_id="t#0", task={"doc_id": "t"}, protocol="mini_o3", system="")
    t.turns = [Turn("user", "q")] + [Turn("assistant", "x", num_tokens=n) for n in turn_tokens]
    t.end_reason = end_reason
    t.rewards = {"total": total, "valid": total is not None}
    return t


def test_the_overlong_filter_masks_a_cut_trajectory_but_keeps_it_in_its_groups_statistics():
    cut, answered = _trajectory([12, 20], "length"), _trajectory([12, 9], "answered")
    assert longest_turn(cut) == 20 and longest_turn(answered) == 12
    dapo = RLParams(estimator="dapo")
    assert _trainable(cut, dapo) == (False, True)
    assert _trainable(answered, dapo) == (True, True)
    assert _trainable(cut, RLParams(estimator="grpo")) == (True, True)  # no filter: a cut answer trains


# --- GSPO --------------------------------------------------------------------------------------------------


def _leaf(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def test_gspo_clips_the_length_normalised_sequence_ratio():
    cfg = LossConfig(clip_low=0.2, clip_high=0.1, mode="gspo", aggregation="seq_mean_token_mean")
    # Sequence 0: token log-ratios 0.1 and 0.3, mean 0.2, s = e^0.2 = 1.2214 > 1.1, A = +1: clipped, each token
    # carries -1.1. Sequence 1: one token, log-ratio -0.5, s = 0.6065 < 0.8, A = -1: -min(-0.6065, -0.8) = 0.8.
    # seq-mean-token-mean over two sequences: ((-1.1 - 1.1) / 2 + 0.8) / 2 = -0.15; both clipped, no gradient.
    logp = _leaf([-1.0, -2.0, -1.5])
    old = torch.tensor([-1.1, -2.3, -1.0], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64)
    seq = torch.tensor([0, 0, 1])
    loss, stats = policy_loss(logp, old, adv, loss_normaliser("seq_mean_token_mean", 3, 2, 0), cfg, seq_ids=seq)
    assert loss.item() == pytest.approx(-0.15)
    loss.backward()
    assert torch.allclose(logp.grad, torch.zeros(3, dtype=torch.float64))
    assert stats["clipped_sum"] == 3  # every token of both sequences
    # Inside the clip range the gradient of token t of sequence i is -A * s_i / (n_i * G): s_0 = e^0.02.
    cfg = LossConfig(clip_low=0.2, clip_high=0.3, mode="gspo", aggregation="seq_mean_token_mean")
    logp = _leaf([-1.0, -2.0])
    old = torch.tensor([-1.01, -2.03], dtype=torch.float64)  # log-ratios 0.01 and 0.03, mean 0.02
    loss, _ = policy_loss(logp, old, torch.ones(2, dtype=torch.float64), 1.0, cfg, seq_ids=torch.tensor([0, 0]))
    assert loss.item() == pytest.approx(-math.exp(0.02))
    loss.backward()
    assert torch.allclose(logp.grad, torch.full((2,), -math.exp(0.02) / 2, dtype=torch.float64))


def test_gspo_token_equals_gspo_when_a_sequences_tokens_share_their_advantage():
    logp_values, old = [-1.0, -2.0, -1.5, -0.7], torch.tensor([-1.05, -1.9, -1.6, -0.7], dtype=torch.float64)
    adv = torch.tensor([0.5, 0.5, -2.0, -2.0], dtype=torch.float64)
    seq = torch.tensor([0, 0, 1, 1])
    results = []
    for mode in ("gspo", "gspo_token"):
        cfg = LossConfig(clip_low=0.05, clip_high=0.04, mode=mode, aggregation="seq_mean_token_mean")
        logp = _leaf(logp_values)
        loss, _ = policy_loss(logp, old, adv, 2.0, cfg, seq_ids=seq)
        loss.backward()
        results.append((loss.item(), logp.grad.clone()))
    assert results[0][0] == pytest.approx(results[1][0])
    assert torch.allclose(results[0][1], results[1][1])


# --- CISPO -------------------------------------------------------------------------------------------------


def test_cispo_weights_a_reinforce_term_by_the_clipped_stopped_ratio():
    cfg = LossConfig(clip_low=1.0, clip_high=0.28, mode="cispo")
    # Token 0: r = e^0.5 = 1.6487, capped at 1.28, A = +1: loss -1.28 * logp = -1.28 * -1.0 = 1.28, d/dlogp = -1.28.
    # Token 1: r = e^-1 = 0.3679 (no lower bound), A = -1: loss -0.3679 * -1 * -2.0 = -0.7358, d/dlogp = +0.3679.
    logp = _leaf([-1.0, -2.0])
    old = torch.tensor([-1.5, -1.0], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, stats = policy_loss(logp, old, adv, 2.0, cfg)
    assert loss.item() == pytest.approx((1.28 - 2.0 * math.exp(-1.0)) / 2)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([-1.28 / 2, math.exp(-1.0) / 2], dtype=torch.float64))
    assert stats["clipped_sum"] == 1
    # With a lower bound (verl's form, eq. 5's eps_low): r = 0.3679 is raised to 0.8, d/dlogp = +0.8.
    logp = _leaf([-2.0])
    loss, _ = policy_loss(logp, old[1:], adv[1:], 1.0, LossConfig(clip_low=0.2, clip_high=0.28, mode="cispo"))
    loss.backward()
    assert float(logp.grad) == pytest.approx(0.8)
    # The same token under PPO's clip gets no gradient at all: what CISPO is for.
    logp = _leaf([-1.0])
    loss, _ = policy_loss(logp, old[:1], adv[:1], 1.0, LossConfig(clip_low=0.2, clip_high=0.28, mode="ppo"))
    loss.backward()
    assert float(logp.grad) == 0.0


# --- ReMax -------------------------------------------------------------------------------------------------


def test_remax_subtracts_the_greedy_rollouts_reward():
    # Group a: greedy 1.0 -> [1-1, 0-1, 1-1]; group b: greedy 0.0 -> [1, 0]; group c: greedy reward invalid
    # (None) -> its group's mean 0.5 -> [0.5, -0.5]. Not whitened.
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    groups = ["a", "a", "a", "b", "b", "c", "c"]
    baselines = [1.0, 1.0, 1.0, 0.0, 0.0, None, None]
    adv = compute_advantages(rewards, groups, "remax", baselines=baselines)
    assert adv.tolist() == pytest.approx([0.0, -1.0, 0.0, 1.0, 0.0, 0.5, -0.5])
    with pytest.raises(ValueError, match="greedy baseline"):
        compute_advantages(rewards, groups, "remax")


# --- PPO: GAE and the value loss ---------------------------------------------------------------------------


def test_gae_runs_backwards_over_the_generated_tokens():
    # gamma 1, lambda 0.5, rewards [0, 0, 1], values [0.5, 0.6, 0.7]:
    # delta_2 = 1 - 0.7 = 0.3; A_2 = 0.3
    # delta_1 = 0.7 - 0.6 = 0.1; A_1 = 0.1 + 0.5 * 0.3 = 0.25
    # delta_0 = 0.6 - 0.5 = 0.1; A_0 = 0.1 + 0.5 * 0.25 = 0.225; returns = A + V
    advantages, returns = gae([0.0, 0.0, 1.0], [0.5, 0.6, 0.7], gamma=1.0, lam=0.5)
    assert advantages.tolist() == pytest.approx([0.225, 0.25, 0.3])
    assert returns.tolist() == pytest.approx([0.725, 0.85, 1.0])
    # gamma 0.9, lambda 1 (Monte Carlo): A_t = 0.9^(2-t) * 1 - V_t
    advantages, returns = gae([0.0, 0.0, 1.0], [0.5, 0.6, 0.7], gamma=0.9, lam=1.0)
    assert advantages.tolist() == pytest.approx([0.81 - 0.5, 0.9 - 0.6, 1.0 - 0.7])
    assert returns.tolist() == pytest.approx([0.81, 0.9, 1.0])


def test_ppo_token_rewards_carry_the_kl_on_every_token_and_the_outcome_on_the_last():
    assert token_rewards(1.0, np.array([0.1, 0.2, 0.3]), 0.5, 3).tolist() == pytest.approx([-0.05, -0.1, 0.85])
    assert token_rewards(2.0, None, 0.0, 2).tolist() == [0.0, 2.0]


def test_the_clipped_value_loss_takes_the_worse_of_the_two_errors():
    # Token 0: v 1.0, old 0.5, R 2.0: plain (1 - 2)^2 = 1; clipped to 0.7: (0.7 - 2)^2 = 1.69 -> 1.69.
    # Token 1: v 0.0, old 0.5, R 0.0: plain 0; clipped to 0.3: 0.09 -> 0.09. Loss 0.5 * (1.69 + 0.09) / 2 = 0.445.
    values = _leaf([1.0, 0.0])
    loss, stats = value_loss(values, torch.tensor([0.5, 0.5], dtype=torch.float64),
                             torch.tensor([2.0, 0.0], dtype=torch.float64), 2.0, value_clip=0.2)
    assert loss.item() == pytest.approx(0.445)
    loss.backward()
    # Both tokens take the clipped term, whose value no longer depends on v: no gradient.
    assert torch.allclose(values.grad, torch.zeros(2, dtype=torch.float64))
    assert stats["critic_clipped_sum"] == 2
    values = _leaf([1.0, 0.0])
    loss, _ = value_loss(values, torch.tensor([0.5, 0.5], dtype=torch.float64),
                         torch.tensor([2.0, 0.0], dtype=torch.float64), 2.0, value_clip=None)
    assert loss.item() == pytest.approx(0.25)  # 0.5 * (1 + 0) / 2
    loss.backward()
    assert values.grad.tolist() == pytest.approx([-0.5, 0.0])  # (v - R) / 2


def _multi_turn_sequence() -> TrainSequence:
    # Prompt (3 tokens), turn 1 (2 generated), an observation (3 tokens), turn 2 (3 generated): 5 steps.
    generated = torch.tensor([0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1], dtype=torch.bool)
    return TrainSequence(input_ids=torch.arange(11) + 5, positions=generated.nonzero().squeeze(1), advantage=0.0,
                         old_logprobs=torch.zeros(5))


def test_ppo_advantages_step_over_generated_tokens_only_and_are_whitened():
    """GAE's steps are the 5 generated tokens of a two-turn dialogue: the step after turn 1's last token is turn
    2's first (whose state holds the observation), never an observation token."""
    from types import SimpleNamespace

    from stages.rl.trainer import Trainer

    sequence = _multi_turn_sequence()
    values = torch.tensor([0.1, 0.2, 0.4, 0.5, 0.6])
    trainer = Trainer.__new__(Trainer)
    trainer.params = RLParams(estimator="ppo", critic={"lam": 1.0, "gamma": 1.0, "whiten_advantages": False})
    trainer.learner = SimpleNamespace(values=lambda seqs: [values for _ in seqs])
    trainer._ppo_advantages([sequence], [1.0])
    # lambda = gamma = 1: A_t = R - V_t, returns = R for every step.
    assert sequence.token_advantages.tolist() == pytest.approx([0.9, 0.8, 0.6, 0.5, 0.4])
    assert sequence.returns.tolist() == pytest.approx([1.0] * 5)
    assert sequence.old_values.tolist() == pytest.approx(values.tolist())
    trainer.params = RLParams(estimator="ppo")  # whitened over the batch's tokens
    trainer._ppo_advantages([sequence], [1.0])
    assert float(sequence.token_advantages.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(sequence.token_advantages.std(unbiased=False)) == pytest.approx(1.0, abs=1e-4)


def test_the_critics_value_of_a_token_is_read_before_it_packed_or_padded(tiny_model_dir):
    """The value of trained token t comes from position t - 1, like the logit that predicts t: changing token t
    leaves its own value alone and moves the next one; packed and padded rows give the same values."""
    from loupe.models import load_model
    from stages.rl.critic import ValueModel, token_values

    critic = ValueModel(load_model(tiny_model_dir, device="cpu", dtype=torch.float32)).eval()
    ids = torch.tensor([10, 11, 12, 13, 14, 15])
    positions = torch.tensor([3, 4, 5])
    a = TrainSequence(input_ids=ids, positions=positions, advantage=0.0, old_logprobs=torch.zeros(3))
    b = TrainSequence(input_ids=torch.tensor([20, 21, 22, 23]), positions=torch.tensor([2, 3]), advantage=0.0,
                      old_logprobs=torch.zeros(2))
    with torch.no_grad():
        packed = token_values(critic, [a, b], "packed", 0, None)
        padded = token_values(critic, [a, b], "padded", 0, None)
        assert packed.shape == (5,)
        assert torch.allclose(packed, padded, atol=1e-5)
        changed = TrainSequence(input_ids=torch.tensor([10, 11, 12, 13, 99, 15]), positions=positions, advantage=0.0,
                                old_logprobs=torch.zeros(3))
        moved = token_values(critic, [changed], "padded", 0, None)
    assert torch.allclose(moved[:2], packed[:2], atol=1e-6)  # tokens 3 and 4: states before token 4 unchanged
    assert not torch.allclose(moved[2], packed[2])  # token 5's state now holds the changed token
