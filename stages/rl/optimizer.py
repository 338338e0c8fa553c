"""The learner's AdamW around its steps: the learning-rate schedule (resumed past the steps taken), the count of
steps taken, and moving the optimiser's state between the GPU and the host (a colocated vLLM takes the memory
back during rollouts)."""

from __future__ import annotations

import math

import torch

from stages.rl.params import RLParams


def lr_scheduler(optimizer: torch.optim.Optimizer, params: RLParams, taken: int = 0) -> torch.optim.lr_scheduler.LRScheduler:
    """The learning-rate schedule of `params` (`lr_schedule`, `warmup_ratio`, `min_lr_ratio`) over the run's
    optimiser steps, through transformers' `get_scheduler` (`constant_with_warmup`, `linear`,
    `cosine_with_min_lr`: OpenRLHF builds its schedule with the same function), advanced past the `taken`
    steps of a resumed run."""
    import warnings

    from transformers import get_scheduler

    total = params.steps * params.ppo_epochs * params.mini_batches
    warmup = math.ceil(params.warmup_ratio * total)
    name = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine_with_min_lr"}[params.lr_schedule]
    extra = {"min_lr_rate": params.min_lr_ratio} if params.lr_schedule == "cosine" else None
    for group in optimizer.param_groups:  # a rebuilt schedule starts from the configured rate, not the decayed one
        group["lr"] = group.get("initial_lr", group["lr"])
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total,
                              scheduler_specific_kwargs=extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()": replaying steps already taken
        for _ in range(taken):
            scheduler.step()
    return scheduler


def optimizer_steps_taken(optimizer: torch.optim.Optimizer) -> int:
    """How many steps AdamW has taken, from its per-parameter `step` counters (0 before the first)."""
    steps = [float(state["step"]) for state in optimizer.state.values() if "step" in state]
    return int(max(steps)) if steps else 0


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> int:
    """Move every tensor of the optimiser's state (AdamW's two moments and step) to `device`; returns the bytes
    moved (0 when all were there already)."""
    moved = 0
    device = torch.device(device)
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != device:
                state[key] = value.to(device, non_blocking=False)
                moved += value.numel() * value.element_size()
    return moved
