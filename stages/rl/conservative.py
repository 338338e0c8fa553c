"""Pixelis' conservative online update (`rl.ttrl.conservative`): the guardrails its update worker puts around
each test-time update.

Upstream: ClayKa/Pixelis @ 991bb06.
- `core/engine/update_worker.py`:
  - `KLConfig`: initial beta 0.01, target KL 0.05, tolerance 0.01, factors 1.2 up and down, beta in
    [1e-4, 1.0].
  - `_process_update`: loss = RL loss + beta x KL(pre-update policy || current). An update whose KL exceeds
    twice the target is skipped. Otherwise: backward, gradient clip, optimiser step, EMA update, KL history,
    beta adjusted.
  - `_update_kl_tracking` and `_adjust_beta`: a window of the last 100 KLs. Once it holds 10, beta grows 1.2x
    when their mean is above target + tolerance, and shrinks 1.2x below target - tolerance.
  - `_update_ema_model`: after each update, ema = decay x ema + (1 - decay) x weights, with decay 0.999. The
    EMA is what the inference engine loads (`_save_ema_snapshot`).
- `core/engine/inference_engine.py`, `_calculate_adaptive_lr`: lr = clip(max_lr x (1 - confidence), min_lr,
  max_lr), with max_lr 1e-4 and min_lr 1e-6, where confidence is the vote's.

Where Loupe differs, and why (docs/recipes.md, Pixelis' table):
- **The KL is estimated on the sampled tokens.** Upstream takes the full-vocabulary KL from stored logits.
  Loupe uses k3, exp(new - old) - 1 - (new - old), whose mean over tokens sampled from the old policy is an
  unbiased estimate of KL(old || new). It is averaged over the mini-batch's trained tokens, and the rollout
  keeps no logits.
- **One update is one mini-batch.** Upstream updates once per question. The rate comes from the mean
  confidence of the step's groups that passed the gate.
- **The EMA is what the rollouts and the saved model use.** So the smoothed weights both answer the questions
  and are evaluated, as upstream's engine serves the snapshot.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


def k3_forward_kl(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Per token, exp(new - old) - 1 - (new - old), from log-probs of tokens sampled from the old policy. Its
    expectation is KL(old || new), the direction of upstream's `_calculate_kl_penalty`. It is never negative, and
    it is 0 where the policies agree."""
    log_ratio = new - old
    return torch.exp(log_ratio) - 1.0 - log_ratio


def confidence_lr(confidence: float, max_lr: float, min_lr: float) -> float:
    """`_calculate_adaptive_lr`: a surer vote moves the weights less."""
    return float(np.clip(max_lr * (1.0 - confidence), min_lr, max_lr))


class AdaptiveKL:
    """The KL coefficient beta, and the skip rule (`KLConfig`, `_update_kl_tracking`, `_adjust_beta`)."""

    def __init__(self, params) -> None:
        self.params = params
        self.beta = params.initial_beta
        self.history: deque[float] = deque(maxlen=params.window)

    def skips(self, kl: float) -> bool:
        """Whether an update at this KL is refused (upstream: above twice the target; nothing is recorded)."""
        return kl > self.params.skip_factor * self.params.target_kl

    def record(self, kl: float) -> None:
        """After an applied update: the KL joins the window; with `min_history` in it, beta moves by its mean."""
        p = self.params
        self.history.append(kl)
        if len(self.history) < p.min_history:
            return
        mean_kl = float(np.mean(self.history))
        if mean_kl > p.target_kl + p.tolerance:
            self.beta = min(self.beta * p.increase_factor, p.max_beta)
        elif mean_kl < p.target_kl - p.tolerance:
            self.beta = max(self.beta / p.decrease_factor, p.min_beta)

    def state(self) -> dict[str, torch.Tensor]:
        """As tensors, so it travels in the learner's torch.distributed.checkpoint beside the weights."""
        window = torch.full((self.params.window,), float("nan"), dtype=torch.float64)
        window[: len(self.history)] = torch.tensor(list(self.history), dtype=torch.float64)
        return {"beta": torch.tensor([self.beta], dtype=torch.float64), "history": window}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        self.beta = float(state["beta"][0])
        self.history = deque((float(v) for v in state["history"] if not torch.isnan(v)), maxlen=self.params.window)


class WeightEMA:
    """An exponential moving average of the trained tensors (`_update_ema_model`). It is kept in float32 on
    the weights' own device."""

    def __init__(self, parameters: list[torch.nn.Parameter], decay: float) -> None:
        self.parameters = parameters
        self.decay = decay
        self.shadow = [p.detach().clone() for p in parameters]

    @torch.no_grad()
    def update(self) -> None:
        for average, p in zip(self.shadow, self.parameters):
            average.mul_(self.decay).add_(p.detach(), alpha=1.0 - self.decay)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The averages in the parameters' place while the block runs. The engines and the saved model get the
        EMA; the trained weights come back afterwards, untouched."""
        with torch.no_grad():
            trained = [p.detach().clone() for p in self.parameters]
            for p, average in zip(self.parameters, self.shadow):
                p.copy_(average)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, kept in zip(self.parameters, trained):
                    p.copy_(kept)

    def state(self) -> dict[str, torch.Tensor]:
        return {str(i): t for i, t in enumerate(self.shadow)}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for i, average in enumerate(self.shadow):
                average.copy_(state[str(i)])
