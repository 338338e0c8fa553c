"""Advantage estimators: pure functions from a batch's scalar rewards and groups to one advantage per sequence.

A group is the n trajectories sampled for one prompt. `in_stats` marks the trajectories whose rewards count
in the group's statistics (Mini-o3's over-turn masking can leave over-turn trajectories out); every
trajectory still receives an advantage, and the loss mask decides which ones are trained.

- `grpo`: (r - group mean) / (group std + eps), std with Bessel's correction (as verl and EasyR1 compute it).
- `dr_grpo`: r - group mean (Dr. GRPO: no std normalisation, which over-weights easy and hard prompts).
- `rloo`: r - mean of the *other* members of the group (leave-one-out baseline, unbiased).
- `reinforce_pp`: (r - batch mean) / (batch std + eps) (REINFORCE++ with outcome rewards: a global baseline
  and whitening instead of a per-group one).
- `reinforce_baseline`: r - group mean, then whitened over the batch's trained tokens (OpenRLHF's
  `--advantage_estimator reinforce_baseline`, the one LMM-R1's scripts pass: `openrlhf/trainer/ppo_utils/
  experience_maker.py` subtracts each prompt's mean reward, and the trainer then normalises the advantages over
  every action token of the batch with the biased variance, `(a - mean) * rsqrt(max(var, 1e-8))`). Every token
  of a sequence carries its sequence's advantage, so the batch statistics weigh a sequence by its token count
  (`token_counts`); without counts, every sequence weighs the same. On rewards [1,1,1,0 | 1,0,0,0] of equal
  length this gives [.58,.58,.58,-1.73 | 1.73,-.58,-.58,-.58].
- `remax`: r - b, where b is the reward of one greedy rollout of the same prompt (ReMax, arXiv 2310.10505,
  Algorithm 1; verl `verl/trainer/ppo/core_algos.py`, `compute_remax_outcome_advantage`, with the baseline from
  `RayPPOTrainer.fit`'s greedy `gen_baseline_batch`). Not whitened, as there. A prompt whose greedy reward is
  missing (an invalid judge score) falls back to its group's mean.

`gae` computes PPO's per-token advantages and returns over one trajectory's generated tokens from a critic's
values (GAE, arXiv 1506.02438, eq. 16).

A group with fewer than two counted members (or, for reinforce_pp, a batch) has no baseline: its advantages
are 0. Written with numpy, not torch, because these run on the driver over a few hundred floats.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence

import numpy as np

ESTIMATORS = ("grpo", "rloo", "reinforce_pp", "reinforce_baseline", "dr_grpo", "remax")
"""Sequence-level advantage kinds (estimators.Recipe.advantage; `gae` is per token, below)."""


def compute_advantages(
    rewards: Sequence[float],
    groups: Sequence[Hashable],
    estimator: str = "grpo",
    in_stats: Sequence[bool] | None = None,
    eps: float = 1e-6,
    baselines: Sequence[float | None] | None = None,
    token_counts: Sequence[int] | None = None,
) -> np.ndarray:
    """One advantage per sequence, in input order. `baselines` (remax): each sequence's greedy reward.
    `token_counts` (reinforce_baseline): each sequence's trained tokens, its weight in the batch whitening."""
    r = np.asarray(rewards, dtype=np.float64)
    if len(groups) != len(r):
        raise ValueError(f"{len(r)} rewards but {len(groups)} group ids")
    counted = np.ones(len(r), dtype=bool) if in_stats is None else np.asarray(in_stats, dtype=bool)
    if len(counted) != len(r):
        raise ValueError(f"{len(r)} rewards but {len(counted)} in_stats flags")
    if not np.isfinite(r[counted]).all():
        raise ValueError("rewards counted in the statistics must be finite")
    out = np.zeros(len(r), dtype=np.float64)

    if estimator == "reinforce_pp":
        if counted.sum() >= 2:
            mean, std = r[counted].mean(), r[counted].std(ddof=1)
            out = (r - mean) / (std + eps)
        return np.where(np.isfinite(out), out, 0.0)
    if estimator == "reinforce_baseline":
        return _group_mean_then_batch_whitened(r, groups, counted, token_counts)
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; known: {', '.join(ESTIMATORS)}")
    if estimator == "remax" and (baselines is None or len(baselines) != len(r)):
        raise ValueError("remax needs one greedy baseline per sequence")

    all_members: dict[Hashable, list[int]] = defaultdict(list)
    for i, group in enumerate(groups):
        all_members[group].append(i)
    for group, members in all_members.items():
        stats = [i for i in members if counted[i]]
        if len(stats) < 2:
            continue
        values = r[stats]
        mean = values.mean()
        for i in members:
            if estimator == "grpo":
                out[i] = (r[i] - mean) / (values.std(ddof=1) + eps)
            elif estimator == "dr_grpo":
                out[i] = r[i] - mean
            elif estimator == "remax":
                baseline = baselines[i]  # type: ignore[index]
                out[i] = r[i] - (baseline if baseline is not None and np.isfinite(baseline) else mean)
            else:  # rloo: the baseline of a counted member leaves that member out
                baseline = (values.sum() - r[i]) / (len(stats) - 1) if counted[i] else mean
                out[i] = r[i] - baseline
    return np.where(np.isfinite(out), out, 0.0)


def _group_mean_then_batch_whitened(r: np.ndarray, groups: Sequence[Hashable], counted: np.ndarray,
                                    token_counts: Sequence[int] | None) -> np.ndarray:
    """`reinforce_baseline` (module docstring): each group's counted mean subtracted, then whitened over the
    batch's counted sequences, each weighted by its token count; 1e-8 floors the variance as OpenRLHF does."""
    centred = np.zeros(len(r), dtype=np.float64)
    members: dict[Hashable, list[int]] = defaultdict(list)
    for i, group in enumerate(groups):
        members[group].append(i)
    for indices in members.values():
        stats = [i for i in indices if counted[i]]
        if stats:
            mean = r[stats].mean()
            for i in indices:
                centred[i] = r[i] - mean
    weights = np.ones(len(r)) if token_counts is None else np.asarray(token_counts, dtype=np.float64)
    if len(weights) != len(r):
        raise ValueError(f"{len(r)} rewards but {len(weights)} token counts")
    weights = np.where(counted, weights, 0.0)
    if weights.sum() <= 0:
        return np.zeros(len(r))
    mean = (weights * centred).sum() / weights.sum()
    variance = (weights * (centred - mean) ** 2).sum() / weights.sum()
    out = (centred - mean) / np.sqrt(max(variance, 1e-8))
    return np.where(np.isfinite(out), out, 0.0)


def groups_with_signal(
    rewards: Sequence[float], groups: Sequence[Hashable], in_stats: Sequence[bool] | None = None, tol: float = 1e-9
) -> set[Hashable]:
    """Groups whose counted rewards differ (DAPO's dynamic-sampling filter); the rest carry no gradient."""
    r = np.asarray(rewards, dtype=np.float64)
    counted = [True] * len(r) if in_stats is None else list(in_stats)
    values: dict[Hashable, list[float]] = defaultdict(list)
    for reward, group, keep in zip(r, groups, counted):
        if keep:
            values[group].append(float(reward))
    return {g for g, v in values.items() if len(v) >= 2 and max(v) - min(v) > tol}


def gae(rewards: Sequence[float], values: Sequence[float], gamma: float = 1.0, lam: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """(advantages, returns) over one trajectory's T generated tokens, in order.

    Token t is one step of the policy: `values[t]` is the critic's value of the state before it (the dialogue up
    to t, observations included), `rewards[t]` what it earned (the outcome reward on the last token, and a
    per-token KL penalty where there is one). Observation tokens are not steps: the step after a turn's last
    token is the next turn's first generated token, whose state holds the observation. With
    delta_t = r_t + gamma * V_{t+1} - V_t (V_T = 0, the trajectory has ended)::

        A_t = delta_t + gamma * lam * A_{t+1},    returns_t = A_t + V_t

    (GAE, arXiv 1506.02438, eq. 16; OpenRLHF `openrlhf/trainer/ppo_utils/experience_maker.py`,
    `get_advantages_and_returns`, and verl `compute_gae_advantage_return` run the same recursion backwards.)
    """
    r = np.asarray(rewards, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    if r.shape != v.shape:
        raise ValueError(f"gae: {len(r)} rewards but {len(v)} values")
    advantages = np.zeros_like(r)
    running = 0.0
    for t in range(len(r) - 1, -1, -1):
        following = v[t + 1] if t + 1 < len(r) else 0.0
        running = r[t] + gamma * following - v[t] + gamma * lam * running
        advantages[t] = running
    return advantages, advantages + v
