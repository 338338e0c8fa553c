"""The token-level policy loss: clipped surrogate with asymmetric clip, KL to a reference, entropy bonus.

For every trained token (flat tensors over a micro-batch's trained tokens)::

    ratio   = exp(logp - old_logp)
    pg      = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
    loss_t  = pg + kl_coef * KL_t - entropy_coef * H_t

and the micro-batch's loss is `sum_t loss_t / normaliser`. The normaliser is fixed for a whole mini-batch so
that micro-batches accumulate to exactly the mini-batch's loss: its trained-token count for `token_mean`
(Mini-o3, DAPO: every token weighs the same, whatever its sequence's length), or sequences x generation budget
for `token_sum` (Dr. GRPO: a constant, so long answers are not down-weighted). `loss_normaliser` computes it.

Statistics come back as sums (clipped tokens, ratio, KL, entropy, ...) so callers can add them over
micro-batches and ranks and divide once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossConfig:
    """The loss's knobs (a subset of RLParams, so this module needs no params file)."""

    clip_low: float = 0.2
    clip_high: float = 0.3
    kl_coef: float = 0.0
    """Weight of the KL term in the loss (0 when KL is off or applied to rewards instead)."""
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from tokens sampled by the policy (Schulman's k1/k2/k3)."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        # exp(-x) + x - 1 >= 0; clamped as verl does so one wild token cannot blow up the loss.
        neg = (-log_ratio).clamp(-10.0, 10.0)
        return neg.exp() - neg - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; use k1, k2 or k3")


def loss_normaliser(aggregation: str, trained_tokens: int, sequences: int, generation_budget: int) -> float:
    """What a mini-batch's summed token losses are divided by (see the module docstring)."""
    if aggregation == "token_mean":
        return float(max(trained_tokens, 1))
    if aggregation == "token_sum":
        return float(max(sequences * generation_budget, 1))
    raise ValueError(f"unknown loss aggregation {aggregation!r}; use token_mean or token_sum")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    normaliser: float,
    cfg: LossConfig,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The micro-batch's loss (to call `.backward()` on) and summed statistics over its tokens.

    `entropy` enters the loss only when `cfg.entropy_coef` is set, and must then carry its graph; without an
    entropy term it may come detached (computed under no_grad for the statistics, `batching.token_logprobs`'s
    "detached"), so logging it costs no activation memory. A detached or missing entropy with a positive
    coefficient would silently drop the bonus's gradient, so it is an error.
    """
    if cfg.entropy_coef and logprobs.requires_grad and (entropy is None or not entropy.requires_grad):
        raise ValueError("entropy_coef > 0: the entropy bonus needs entropies with their graph (token_logprobs entropy='grad')")
    log_ratio = logprobs - old_logprobs
    ratio = log_ratio.clamp(max=20.0).exp()  # a stale old log-prob must not overflow to inf
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * advantages
    pg = -torch.minimum(unclipped, clipped)
    per_token = pg
    kl = None
    if ref_logprobs is not None:
        kl = kl_estimate(logprobs, ref_logprobs, cfg.kl_estimator)
        if cfg.kl_coef:
            per_token = per_token + cfg.kl_coef * kl
    if entropy is not None and cfg.entropy_coef:
        per_token = per_token - cfg.entropy_coef * entropy
    loss = per_token.sum() / normaliser

    with torch.no_grad():
        was_clipped = clipped < unclipped  # the clip bound the objective: no gradient from this token
        stats = {
            "tokens": float(logprobs.numel()),
            "pg_loss_sum": float(pg.sum()),
            "clipped_sum": float(was_clipped.sum()),
            "clipped_high_sum": float((was_clipped & (advantages > 0)).sum()),
            "clipped_low_sum": float((was_clipped & (advantages < 0)).sum()),
            "ratio_sum": float(ratio.sum()),
            "ratio_max": float(ratio.max()) if ratio.numel() else 0.0,
            # k3 between the sampling policy and the current one: how far the update has moved.
            "policy_kl_sum": float(kl_estimate(logprobs, old_logprobs, "k3").sum()),
        }
        if kl is not None:
            stats["kl_sum"] = float(kl.sum())
        if entropy is not None:
            stats["entropy_sum"] = float(entropy.sum())
    return loss, stats
