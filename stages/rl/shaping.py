"""Reward shaping between the reward pool's scores and the advantages: DAPO's soft overlong punishment,
Pixel-Reasoner's curiosity bonus (`curiosity_bonus`) and the per-token rewards PPO's GAE runs over.

Soft overlong punishment (DAPO, arXiv 2503.14476, eq. 13; verl `recipe/dapo/dapo_ray_trainer.py` with
`verl/workers/reward_manager/dapo.py`, `DAPORewardManager.__call__`, where `overlong_buffer_cfg.len` and
`penalty_factor` are its keys). With L_max the token budget and L_cache the buffer::

    penalty(L) = 0                                   if L <= L_max - L_cache
               = ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max
               = -1                                  if L > L_max

times the penalty factor, added to the reward. Loupe's budget is per turn (`rollout.max_new_tokens`, a turn
that exhausts it ends the trajectory with end reason `length`), so L is the trajectory's longest assistant
turn and L_max that budget; a cut trajectory (its longest turn at the budget) gets the whole factor, which is
where the linear ramp ends anyway.
"""

from __future__ import annotations

import numpy as np

from loupe.trajectory import Trajectory


def longest_turn(trajectory: Trajectory) -> int:
    """Tokens of the trajectory's longest assistant turn."""
    return max((turn.num_tokens for turn in trajectory.turns if turn.role == "assistant"), default=0)


def overlong_penalty(length: int, budget: int, buffer: int, factor: float = 1.0) -> float:
    """DAPO's soft punishment (module docstring) of a response `length` tokens long: 0 or negative."""
    if buffer <= 0 or budget <= 0:
        raise ValueError(f"overlong punishment: buffer ({buffer}) and budget ({budget}) must be positive")
    buffer = min(buffer, budget)
    expected = budget - buffer
    if length <= expected:
        return 0.0
    return -factor * min((length - expected) / buffer, 1.0)


def token_rewards(reward: float, kl: np.ndarray | None, kl_coef: float, length: int) -> np.ndarray:
    """PPO's reward per generated token: the outcome reward on the last one, and minus kl_coef x the token's KL to
    the reference on each (OpenRLHF `openrlhf/models/utils.py`, `compute_reward`: the KL penalty per token, the
    reward added at the end of the response)."""
    out = np.zeros(length, dtype=np.float64)
    if length == 0:
        return out
    if kl is not None and kl_coef:
        out -= kl_coef * np.asarray(kl, dtype=np.float64)
    out[-1] += reward
    return out


def curiosity_bonus(group_tool_calls: list[int], threshold: float, coef: float, rate_scale: float) -> list[float]:
    """Pixel-Reasoner's curiosity bonus for each trajectory of one group, from its tool-call counts.

    rate = share of the group with at least one tool call (its RaPR, counted over every sample as its code
    does); a trajectory with a call earns `coef * max(threshold - rate, 0)`, times `rate_scale / rate` when
    `rate_scale` > 0 (`stages.rl.params.CuriosityParams` cites the source). A group that never calls the tool
    earns nothing: there is no tool use to encourage in it.
    """
    if not group_tool_calls:
        return []
    rate = sum(calls > 0 for calls in group_tool_calls) / len(group_tool_calls)
    if rate == 0:
        return [0.0] * len(group_tool_calls)
    bonus = coef * max(threshold - rate, 0.0)
    if rate_scale > 0:
        bonus *= rate_scale / rate
    return [bonus if calls > 0 else 0.0 for calls in group_tool_calls]
