"""The policy loss: PPO's clipped surrogate, GSPO's sequence ratio or CISPO's clipped IS weights, plus a KL to a
reference and an entropy bonus.

For every trained token t of sequence i (flat tensors over a micro-batch's trained tokens; A is the token's
advantage, the same for all tokens of a sequence except under GAE), `policy_loss` computes by `mode`:

- `ppo` (PPO, arXiv 1707.06347, eq. 7; verl `verl/trainer/ppo/core_algos.py`, `compute_policy_loss_vanilla`)::

      r_t  = exp(logp_t - old_t)
      pg_t = -min(r_t * A, clip(r_t, 1 - clip_low, 1 + clip_high) * A)

- `gspo` (GSPO, arXiv 2507.18071, eqs. 5-7): the sequence ratio is the geometric mean of its token ratios,
  s_i = exp(mean_t(logp_t - old_t)), clipped as a whole: every token of sequence i carries
  pg_t = -min(s_i * A, clip(s_i, 1 - clip_low, 1 + clip_high) * A), and with `seq_mean_token_mean` aggregation
  the sequence's tokens sum to one sequence term.
- `gspo_token` (GSPO-token, eqs. 13-14; what verl's `compute_policy_loss_gspo` computes): the token ratio
  s_i,t = sg[s_i] * exp(logp_t - sg[logp_t]) has the value s_i and the gradient s_i * grad logp_t; it is
  clipped per token like PPO's.
- `cispo` (MiniMax-M1, arXiv 2506.13585, eqs. 4-5; verl `compute_policy_loss_cispo`): the ratio, clipped
  and stopped from the gradient, weights a REINFORCE term, so no token loses its gradient to a clip::

      pg_t = -sg[clip(r_t, 1 - clip_low, 1 + clip_high)] * A * logp_t

  (MiniMax-M1 sets no lower bound: cispo's default clip_low is 1.0, a bound of 0.)

Then `loss_t = pg_t + kl_coef * KL_t - entropy_coef * H_t`, and the micro-batch's loss is
`sum_t w_t * loss_t / normaliser`. The normaliser is fixed for a whole mini-batch so that micro-batches
accumulate to exactly the mini-batch's loss (`loss_normaliser`): its trained-token count for `token_mean`
(Mini-o3, DAPO: every token weighs the same, whatever its sequence's length; w_t = 1), sequences x generation
budget for `token_sum` (Dr. GRPO: a constant, so long answers are not down-weighted; w_t = 1), or its sequence
count for `seq_mean_token_mean` (GSPO; w_t = 1 / the length of t's sequence). `micro_token_mean` is verl's
`token-mean` as it runs per micro-batch (DeepEyes: 4 sequences a GPU): each micro-batch's own token mean,
averaged over the mini-batch's micro-batches (dp_actor.py:302-306,381), so a token of a short micro-batch weighs
more; its divisor is set per micro-batch by the learner.

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
    mode: str = "ppo"
    """ppo, gspo, gspo_token or cispo (module docstring)."""
    aggregation: str = "token_mean"
    """token_mean, token_sum or seq_mean_token_mean (`loss_normaliser`)."""
    dual_clip: float | None = None
    """Dual-clip bound c > 1: a negative-advantage token's loss is at most -A x c (ppo and gspo modes)."""


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
    """What a mini-batch's summed token losses are divided by (see the module docstring); `micro_token_mean`'s
    divisor is each micro-batch's own (the learner's), this its value for a whole mini-batch in one micro-batch."""
    if aggregation in ("token_mean", "micro_token_mean"):
        return float(max(trained_tokens, 1))
    if aggregation == "token_sum":
        return float(max(sequences * generation_budget, 1))
    if aggregation == "seq_mean_token_mean":
        return float(max(sequences, 1))
    raise ValueError(f"unknown loss aggregation {aggregation!r}; use token_mean, token_sum, seq_mean_token_mean or "
                     "micro_token_mean")


def _per_sequence_mean(values: torch.Tensor, seq_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Each token's sequence mean of `values` (same shape as `values`)."""
    sums = torch.zeros(len(lengths), dtype=values.dtype, device=values.device).index_add(0, seq_ids, values)
    return (sums / lengths.to(values.dtype))[seq_ids]


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    normaliser: float,
    cfg: LossConfig,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    seq_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The micro-batch's loss (to call `.backward()` on) and summed statistics over its tokens.

    `seq_ids` gives each token's sequence (0..S-1 within the micro-batch, tokens of a sequence contiguous); the
    gspo modes and `seq_mean_token_mean` need it, the others ignore it.

    `entropy` enters the loss only when `cfg.entropy_coef` is set, and must then carry its graph; without an
    entropy term it may come detached (computed under no_grad for the statistics, `batching.token_logprobs`'s
    "detached"), so logging it costs no activation memory. A detached or missing entropy with a positive
    coefficient would silently drop the bonus's gradient, so it is an error.
    """
    if cfg.entropy_coef and logprobs.requires_grad and (entropy is None or not entropy.requires_grad):
        raise ValueError("entropy_coef > 0: the entropy bonus needs entropies with their graph (token_logprobs entropy='grad')")
    needs_sequences = cfg.mode.startswith("gspo") or cfg.aggregation == "seq_mean_token_mean"
    if needs_sequences and seq_ids is None:
        raise ValueError(f"policy loss {cfg.mode!r} with {cfg.aggregation!r} aggregation needs each token's sequence (seq_ids)")
    lengths = torch.bincount(seq_ids) if needs_sequences else None
    log_ratio = logprobs - old_logprobs
    if cfg.mode == "gspo":
        log_ratio = _per_sequence_mean(log_ratio, seq_ids, lengths)
    elif cfg.mode == "gspo_token":
        sequence = _per_sequence_mean(log_ratio.detach(), seq_ids, lengths)
        log_ratio = logprobs - logprobs.detach() + sequence
    elif cfg.mode not in ("ppo", "cispo"):
        raise ValueError(f"unknown policy loss {cfg.mode!r}; use ppo, gspo, gspo_token or cispo")
    ratio = log_ratio.clamp(max=20.0).exp()  # a stale old log-prob must not overflow to inf
    if cfg.mode == "cispo":
        weight = ratio.detach().clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
        pg = -weight * advantages * logprobs
        unclipped, clipped = ratio * advantages, weight * advantages  # for the statistics only
    else:
        unclipped = ratio * advantages
        clipped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * advantages
        pg = -torch.minimum(unclipped, clipped)
    dual_clipped = None
    if cfg.dual_clip is not None and cfg.mode != "cispo":
        # verl's `compute_policy_loss`: min(pg, -A * c) where A < 0 (no gradient through a capped token).
        cap = -advantages * cfg.dual_clip
        dual_clipped = (advantages < 0) & (pg > cap)
        pg = torch.where(dual_clipped, cap, pg)
    per_token = pg
    kl = None
    if ref_logprobs is not None:
        kl = kl_estimate(logprobs, ref_logprobs, cfg.kl_estimator)
        if cfg.kl_coef:
            per_token = per_token + cfg.kl_coef * kl
    if entropy is not None and cfg.entropy_coef:
        per_token = per_token - cfg.entropy_coef * entropy
    if cfg.aggregation == "seq_mean_token_mean":
        per_token = per_token / lengths.to(per_token.dtype)[seq_ids]
    loss = per_token.sum() / normaliser

    with torch.no_grad():
        # The clip bound the objective: no gradient from this token (cispo: its weight was capped, but the token
        # keeps its gradient).
        was_clipped = (clipped < unclipped) if cfg.mode != "cispo" else (weight != ratio)
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
        if dual_clipped is not None:
            stats["dual_clipped_sum"] = float(dual_clipped.sum())
        if kl is not None:
            stats["kl_sum"] = float(kl.sum())
        if entropy is not None:
            stats["entropy_sum"] = float(entropy.sum())
    return loss, stats
