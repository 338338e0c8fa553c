"""PPO's critic: a value model on the policy's architecture, its values over trained tokens and its update.

The value model is the policy's body (the same Hugging Face class, vision tower included, loaded from
`rl.critic.path` or the policy's own folder) with its language-model head removed and a scalar head on the
last hidden state, as OpenRLHF's `openrlhf/models/model.py` (`_get_critic_model`: `value_head`, a
`nn.Linear(hidden, 1)`) and verl's critic (`AutoModelForTokenClassification` with one label) build theirs.
The value of trained token t is read at position t - 1, the state from which the policy generated t: the
same alignment as the policy's log-probs (stages/rl/batching.py: the logit at t - 1 predicts t).

Its loss is the clipped value loss of PPO implementations (OpenRLHF `openrlhf/models/loss.py`, `ValueLoss`;
verl `core_algos.py`, `compute_value_loss`)::

    v_clipped = v_old + clip(v - v_old, -value_clip, value_clip)
    loss_t    = 0.5 * max((v - R_t)^2, (v_clipped - R_t)^2)

averaged over the mini-batch's trained tokens (R_t: GAE's return, advantages.gae). It has its own AdamW and
gradient clipping, runs on the learner's ranks (sharded with FSDP2 exactly like the policy when the learner
is), and is checkpointed beside the policy with torch.distributed.checkpoint (`<checkpoint>/critic/`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from stages.rl.batching import ImageEncoder, TrainSequence, padded_inputs, packed_inputs
from stages.rl.params import CriticParams
from stages.rl.precision import autocast_context


class ValueModel(torch.nn.Module):
    """The policy's body and a scalar value head; `forward` takes `batching`'s model inputs and returns the values
    at the `logits_to_keep` positions, (rows, kept)."""

    def __init__(self, body: Any):
        super().__init__()
        hidden = body.config.get_text_config().hidden_size
        # No language-model head: a value model never computes logits (for a 7B model that head alone is 0.5 B
        # parameters). A tied head shares the embedding's tensor, which stays with the embedding.
        body.lm_head = torch.nn.Identity()
        self.body = body
        self.value_head = torch.nn.Linear(hidden, 1)
        # OpenRLHF's critic starts its head at std 1 / (hidden + 1); a small start keeps the first values near 0,
        # so the first advantages are about the rewards themselves. Drawn from its own generator: the same head
        # whatever the process's random state, so a resumed run and a fresh one build the same critic.
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            self.value_head.weight.normal_(0.0, 1.0 / (hidden + 1), generator=generator)
            self.value_head.bias.zero_()

    def forward(self, logits_to_keep: torch.Tensor, **inputs: Any) -> torch.Tensor:
        hidden = self.body.model(**inputs, use_cache=False).last_hidden_state  # (rows, length, hidden)
        kept = hidden.index_select(1, logits_to_keep)
        return self.value_head(kept.to(self.value_head.weight.dtype)).squeeze(-1)


def token_values(
    model: ValueModel,
    sequences: list[TrainSequence],
    mode: str,
    pad_id: int,
    images: ImageEncoder | None,
    precision: Any = None,
) -> torch.Tensor:
    """The critic's value before every trained token of `sequences`, flat in sequence then position order,
    float32 (the inputs are built by the same functions as the policy's log-probs)."""
    sequences = [s for s in sequences if s.num_trained]
    device = next(model.parameters()).device
    if not sequences:
        return torch.zeros(0, device=device)
    encoded = [images(s) if images is not None else ([], None) for s in sequences]
    if mode == "packed":
        inputs, index = packed_inputs(model.body, sequences, device, encoded)
    else:
        inputs, index = padded_inputs(model.body, sequences, device, pad_id, encoded)
    with autocast_context(precision, device):
        values = model(**inputs).float().flatten()
    return values if index is None else values.index_select(0, index.to(device))


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, normaliser: float, value_clip: float | None
) -> tuple[torch.Tensor, dict[str, float]]:
    """The micro-batch's value loss (module docstring) divided by the mini-batch's `normaliser`, and summed
    statistics."""
    unclipped = (values - returns).square()
    if value_clip is not None:
        moved = old_values + (values - old_values).clamp(-value_clip, value_clip)
        clipped = (moved - returns).square()
        per_token = torch.maximum(unclipped, clipped)
        clip_count = float((clipped > unclipped).sum())
    else:
        per_token, clip_count = unclipped, 0.0
    loss = 0.5 * per_token.sum() / normaliser
    with torch.no_grad():
        stats = {
            "critic_tokens": float(values.numel()),
            "critic_loss_sum": float(0.5 * per_token.sum()),
            "critic_clipped_sum": clip_count,
            "critic_value_sum": float(values.sum()),
            "critic_error_sum": float((returns - values).square().sum()),
            "critic_return_sum": float(returns.sum()),
            "critic_return_sq_sum": float(returns.square().sum()),
        }
    return loss, stats


class Critic:
    """The value model, its optimiser and its checkpoints, owned by a Learner (one per learner rank)."""

    def __init__(self, model_path: str | Path, params: CriticParams, max_grad_norm: float, device: Any,
                 distributed: bool, precision: Any, gradient_checkpointing: bool = False, attn_implementation: str | None = None):
        from loupe.models import load_model

        self.params = params
        self.max_grad_norm = max_grad_norm
        self.distributed = distributed
        self.device = device
        body = load_model(params.path or model_path, device="cpu", dtype=torch.float32)
        body.config.use_cache = False
        if attn_implementation:
            body.set_attn_implementation(attn_implementation)
        if gradient_checkpointing:
            body.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model = ValueModel(body)
        if distributed:
            from stages.rl.sharding import shard_model

            shard_model(body, mp_policy=precision, root=self.model)
        else:
            self.model.to(device)
        self.autocast = None if distributed else precision
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=params.lr)

    @torch.no_grad()
    def values(self, micro: list[TrainSequence], mode: str, pad_id: int, images: ImageEncoder) -> torch.Tensor:
        return token_values(self.model, micro, mode, pad_id, images, self.autocast)

    def backward(self, micro: list[TrainSequence], normaliser: float, mode: str, pad_id: int, images: ImageEncoder,
                 world: int = 1, scale: float = 1.0) -> dict[str, float]:
        """Accumulate one micro-batch's value-loss gradient (scaled like the policy's: see Learner._backward)."""
        values = token_values(self.model, micro, mode, pad_id, images, self.autocast)
        device = values.device
        old = torch.cat([s.old_values for s in micro]).to(device)  # type: ignore[misc]
        returns = torch.cat([s.returns for s in micro]).to(device)  # type: ignore[misc]
        loss, stats = value_loss(values, old, returns, normaliser, self.params.value_clip)
        (loss * (scale * world)).backward()
        return stats if scale else {}

    def step(self) -> float:
        """Clip the accumulated gradient and step AdamW (skipped on a non-finite norm); returns the norm."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if math.isfinite(norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def set_state(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def summarise_critic(totals: dict[str, float], grad_norms: list[float]) -> dict[str, float]:
    """The critic's row of update statistics from summed ones: loss, clip fraction, mean value, explained
    variance of the returns (1 - E[(R - V)^2] / Var[R]) and gradient norm."""
    tokens = max(totals.get("critic_tokens", 0.0), 1.0)
    mean_return = totals.get("critic_return_sum", 0.0) / tokens
    variance = totals.get("critic_return_sq_sum", 0.0) / tokens - mean_return**2
    error = totals.get("critic_error_sum", 0.0) / tokens
    return {
        "critic_loss": totals.get("critic_loss_sum", 0.0) / tokens,
        "critic_clip_frac": totals.get("critic_clipped_sum", 0.0) / tokens,
        "critic_value_mean": totals.get("critic_value_sum", 0.0) / tokens,
        "critic_explained_variance": 1.0 - error / variance if variance > 1e-12 else 0.0,
        "critic_grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
    }
