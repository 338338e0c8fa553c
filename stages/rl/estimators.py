"""What each value of `rl.estimator` means: its advantage, its policy loss and the defaults it brings.

An estimator is a recipe, named as its users know it, built from three independent parts that the other
modules implement once each:

- the **advantage** (stages/rl/advantages.py: group-relative, leave-one-out, batch-whitened, a greedy
  baseline, or GAE over a critic's values in stages/rl/critic.py);
- the **policy loss** (stages/rl/loss.py: the clipped token ratio of PPO, GSPO's sequence ratio, CISPO's
  clipped stop-gradient weights);
- **defaults** for the keys left unset in params.yaml (clip range, loss aggregation, DAPO's overlong
  treatment). A key the user sets always wins.

| estimator | advantage | policy loss | clip low / high | aggregation | source |
|---|---|---|---|---|---|
| grpo | group (mean, std) | ppo | 0.2 / 0.3 | token_mean | DeepSeekMath (arXiv 2402.03300) |
| dr_grpo | group mean only | ppo | 0.2 / 0.3 | token_sum | Dr. GRPO (arXiv 2503.20783) |
| rloo | leave-one-out mean | ppo | 0.2 / 0.3 | token_mean | Ahmadian et al. (arXiv 2402.14740) |
| reinforce_pp | batch-whitened | ppo | 0.2 / 0.3 | token_mean | REINFORCE++ (arXiv 2501.03262) |
| reinforce_baseline | group mean, then batch-whitened over tokens | ppo | 0.2 / 0.2 | token_mean | OpenRLHF's `reinforce_baseline` (LMM-R1's scripts); dynamic sampling off |
| dapo | group (mean, std) | ppo | 0.2 / 0.28 | token_mean | DAPO (arXiv 2503.14476), with overlong filter and soft punishment |
| gspo | group (mean, std) | gspo | 3e-4 / 4e-4 | seq_mean_token_mean | GSPO (arXiv 2507.18071) |
| cispo | group (mean, std) | cispo | 1.0 (no lower bound) / 0.28 | token_mean | MiniMax-M1 (arXiv 2506.13585) |
| remax | reward - greedy rollout's reward | ppo | 0.2 / 0.3 | token_mean | ReMax (arXiv 2310.10505); dynamic sampling off |
| ppo | GAE over a critic (per token, whitened) | ppo | 0.2 / 0.2 | token_mean | PPO (arXiv 1707.06347), GAE (arXiv 1506.02438); dynamic sampling off |

docs/rl.md ("Estimators") has the same table with each recipe's keys and the upstream code it follows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

AdvantageKind = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_baseline", "remax", "gae"]
PolicyLossKind = Literal["ppo", "gspo", "cispo"]
Aggregation = Literal["token_mean", "token_sum", "seq_mean_token_mean"]


@dataclass(frozen=True)
class Recipe:
    """One estimator's parts and defaults."""

    advantage: AdvantageKind
    """How a sequence's (or, for gae, a token's) advantage is computed from rewards."""
    policy_loss: PolicyLossKind
    """Which surrogate the learner minimises (stages/rl/loss.py)."""
    clip_low: float
    """Default lower clip: ratios below 1 - clip_low are clipped (1.0: no lower bound)."""
    clip_high: float
    """Default upper clip: ratios above 1 + clip_high are clipped."""
    aggregation: Aggregation = "token_mean"
    """Default loss aggregation (loss.loss_normaliser)."""
    overlong: bool = False
    """DAPO's overlong treatment on by default: truncated trajectories masked, soft length punishment."""
    critic: bool = False
    """Trains a value model beside the policy (stages/rl/critic.py)."""
    greedy_baseline: bool = False
    """Rolls out one greedy trajectory a prompt whose reward is the baseline."""
    dynamic_sampling: bool = True
    """DAPO's zero-spread group filter on by default. Off for remax and ppo: a group whose samples all earn the
    same reward still has non-zero advantages against a greedy baseline or a critic's values."""


RECIPES: dict[str, Recipe] = {
    "grpo": Recipe("grpo", "ppo", 0.2, 0.3),
    "dr_grpo": Recipe("dr_grpo", "ppo", 0.2, 0.3, aggregation="token_sum"),
    "rloo": Recipe("rloo", "ppo", 0.2, 0.3),
    "reinforce_pp": Recipe("reinforce_pp", "ppo", 0.2, 0.3),
    # OpenRLHF's defaults (`openrlhf/cli/train_ppo_ray.py`): --eps_clip 0.2, symmetric.
    # No zero-spread filter there either: OpenRLHF trains every sample (its dynamic filtering is opt-in).
    "reinforce_baseline": Recipe("reinforce_baseline", "ppo", 0.2, 0.2, dynamic_sampling=False),
    # DAPO's paper (section 3.1): eps_low 0.2, eps_high 0.28; token-level loss; overlong filtering and shaping.
    "dapo": Recipe("grpo", "ppo", 0.2, 0.28, overlong=True),
    # GSPO's paper (section 5.1): clip range (3e-4, 4e-4) on the length-normalised sequence ratio.
    "gspo": Recipe("grpo", "gspo", 3e-4, 4e-4, aggregation="seq_mean_token_mean"),
    # MiniMax-M1 (section 3.1): the IS weight is clipped above only (no lower bound: clip_low 1.0).
    "cispo": Recipe("grpo", "cispo", 1.0, 0.28),
    "remax": Recipe("remax", "ppo", 0.2, 0.3, greedy_baseline=True, dynamic_sampling=False),
    # PPO's paper and OpenRLHF's defaults: a symmetric clip of 0.2.
    "ppo": Recipe("gae", "ppo", 0.2, 0.2, critic=True, dynamic_sampling=False),
}

ESTIMATOR_NAMES = tuple(RECIPES)


def recipe(name: str) -> Recipe:
    """The recipe of estimator `name`, or a ValueError listing the known ones."""
    if name not in RECIPES:
        raise ValueError(f"unknown estimator {name!r}; known: {', '.join(RECIPES)}")
    return RECIPES[name]
