"""The learner's numeric precision: float32 master weights and optimiser state, bfloat16 compute.

The policy is always loaded and kept in float32, and AdamW's moments follow the parameters' dtype, so every
optimiser step adds a small update to a float32 weight (bf16 has 8 mantissa bits: at lr 1e-6 most updates to
a bf16 weight would round away). Only the forward and backward arithmetic runs in bfloat16, one of two ways,
both decided by the same policy object (`fsdp_mixed_precision`):

- sharded (FSDP2, `sharding.shard_model`): the policy is given to every `fully_shard`; FSDP casts each shard to
  `param_dtype` before its all-gather, so the gathered weights, the activations and the gradients are bf16,
  and reduces the gradients in `reduce_dtype` float32 into the float32 sharded gradients (torch's FSDP2 docs,
  `torch.distributed.fsdp.MixedPrecisionPolicy`; verl's `verl/workers/fsdp_workers.py`,
  `ActorRolloutRefWorker._build_model_optimizer`, loads the actor in float32 and uses the same bf16/fp32 pair).
- one process: `autocast_context` wraps the forward in `torch.autocast(device_type, dtype=param_dtype)`, which
  casts inputs of matmul-like ops to bf16 and keeps reductions, norms and softmaxes in float32; gradients land
  on the float32 parameters in float32.

The two paths round differently (autocast leaves some ops in float32 that FSDP runs on bf16 weights), so they
agree to bf16 accuracy, not bit for bit (`tests/test_rl_precision.py` states the tolerance). Log-probabilities
are computed from the logits in float32 either way (`batching.token_logprobs`).

`auto` is bf16 on CUDA and off on CPU: CPUs without bf16 units emulate it (slower than float32), and the CPU
tests compare runs exactly.
"""

from __future__ import annotations

import contextlib
from typing import Any, Literal

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

MixedPrecision = Literal["auto", "bf16", "off"]
"""`rl.mixed_precision`: bf16 compute over float32 weights, off (float32 throughout), or auto (bf16 on CUDA)."""


def fsdp_mixed_precision(mode: MixedPrecision, device: Any) -> MixedPrecisionPolicy | None:
    """The learner's precision policy for `device`: bf16 parameters and activations, float32 gradient
    reduction; None when the learner computes in float32 (mode `off`, or `auto` on a CPU).

    The one place the choice is made: the sharded learner hands the object to `fully_shard`, the single
    process passes it to `autocast_context`.
    """
    if mode not in ("auto", "bf16", "off"):
        raise ValueError(f"unknown mixed_precision {mode!r}; use auto, bf16 or off")
    if mode == "off" or (mode == "auto" and torch.device(device).type != "cuda"):
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def autocast_context(policy: MixedPrecisionPolicy | None, device: Any) -> contextlib.AbstractContextManager:
    """`torch.autocast` to the policy's compute dtype on `device` (the unsharded learner's forward), or a no-op
    context when there is no policy. Never used around a sharded model: FSDP casts the weights itself."""
    if policy is None or policy.param_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=policy.param_dtype)
