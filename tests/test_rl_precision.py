"""The learner's precision: float32 master weights and AdamW state under bf16 compute, one policy object for the
sharded and the single-process paths, and non-reentrant gradient checkpointing.

The two-rank FSDP2 comparison under the bf16 policy lives in test_rl_distributed.py (slow: Ray and two ranks).
"""

from __future__ import annotations

import pytest
import torch
from rl_helpers import make_toy_tasks, one_torch_thread  # noqa: F401 (autouse fixture)
from torch.distributed.fsdp import MixedPrecisionPolicy

from loupe.config import ProtocolParams, RolloutParams
from loupe.data.tasks import read_tasks
from stages.rl.learner import Learner
from stages.rl.params import RLParams
from stages.rl.precision import autocast_context, fsdp_mixed_precision
from stages.rl.trainer import to_sequence
from stages.rl.workers import RolloutWorker


@pytest.fixture(scope="module")
def sequences(tiny_model_dir, tmp_path_factory):
    toy = make_toy_tasks(tmp_path_factory.mktemp("toy"))
    worker = RolloutWorker(str(tiny_model_dir), RolloutParams(device="cpu"), ProtocolParams(name="single_turn"), str(toy))
    trajectories, _ = worker.rollout(read_tasks(toy / "train.jsonl")[:3], samples=1, seed=1, max_turns=1, max_new_tokens=6)
    out = [to_sequence(t, True, "g") for t in trajectories]
    for k, s in enumerate(out):
        s.advantage = [1.0, -0.5, 0.75][k]
    return out


def _params(**overrides) -> RLParams:
    return RLParams(**{"micro_batch_size": 2, "lr": 1e-2, "ray": {"enabled": False}, **overrides})


def test_one_policy_decides_both_paths():
    assert fsdp_mixed_precision("auto", "cpu") is None and fsdp_mixed_precision("off", "cuda") is None
    for mode, device in (("auto", "cuda"), ("auto", "cuda:1"), ("bf16", "cpu"), ("bf16", torch.device("cuda"))):
        policy = fsdp_mixed_precision(mode, device)
        assert isinstance(policy, MixedPrecisionPolicy)
        assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    with pytest.raises(ValueError, match="mixed_precision"):
        fsdp_mixed_precision("fp16", "cpu")  # type: ignore[arg-type]
    linear = torch.nn.Linear(4, 4)
    with autocast_context(fsdp_mixed_precision("bf16", "cpu"), "cpu"):
        assert linear(torch.ones(2, 4)).dtype == torch.bfloat16
    with autocast_context(None, "cpu"):
        assert linear(torch.ones(2, 4)).dtype == torch.float32
    with pytest.raises(ValueError):
        RLParams(mixed_precision="fp16")


def test_bf16_computes_in_bf16_over_float32_weights_and_adam_state(tiny_model_dir, sequences):
    learner = Learner(tiny_model_dir, _params(mixed_precision="bf16", lr=1e-6), 1.0, generation_budget=6, device="cpu")
    assert learner.autocast is learner.precision is not None
    assert {p.dtype for p in learner.model.parameters()} == {torch.float32}
    seen: dict[str, torch.dtype] = {}
    layer = learner.model.model.language_model.layers[0]
    hooks = [  # (a hook that returns something replaces the output: update() returns None)
        layer.mlp.register_forward_hook(lambda m, i, o: seen.update(mlp=o.dtype)),
        learner.model.lm_head.register_forward_hook(lambda m, i, o: seen.update(logits=o.dtype)),
        learner.model.model.visual.blocks[0].register_forward_hook(lambda m, i, o: seen.update(vision=o.dtype)),
    ]
    bf16 = learner.logprobs(sequences)
    assert seen == {"mlp": torch.bfloat16, "logits": torch.bfloat16, "vision": torch.bfloat16}
    for hook in hooks:
        hook.remove()
    assert all(lp.dtype == torch.float32 for lp in bf16)  # log-softmax in float32 from bf16 logits

    fp32 = Learner(tiny_model_dir, _params(mixed_precision="off"), 1.0, generation_budget=6, device="cpu").logprobs(sequences)
    gap = max(float((a - b).abs().max()) for a, b in zip(bf16, fp32))
    assert 0 < gap < 0.05, gap  # bf16 rounding shows, and stays small

    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    stats = learner.update(sequences)
    assert stats["optimizer_steps"] == 1 and stats["grad_norm"] > 0
    for p in learner.model.parameters():
        assert p.dtype == torch.float32 and (p.grad is None or p.grad.dtype == torch.float32)
        state = learner.optimizer.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    # Why float32 masters: AdamW's first step moves each weight by about lr (1e-6), which the float32 weights
    # keep and bf16 weights (8 mantissa bits) would mostly round away.
    weights = learner.model.model.language_model.layers[0].mlp.up_proj.weight
    old = before["model.language_model.layers.0.mlp.up_proj.weight"]
    assert float((weights != old).float().mean()) > 0.9
    assert float((weights.bfloat16() == old.bfloat16()).float().mean()) > 0.9


def test_auto_is_float32_on_cpu(tiny_model_dir, sequences):
    learner = Learner(tiny_model_dir, _params(), 1.0, generation_budget=6, device="cpu")
    assert learner.precision is None
    seen = []
    learner.model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    learner.logprobs(sequences)
    assert seen and set(seen) == {torch.float32}


def test_gradient_checkpointing_is_the_non_reentrant_kind(tiny_model_dir, sequences):
    import torch.utils.checkpoint

    from stages.rl.batching import token_logprobs

    grads = {}
    for on in (False, True):
        learner = Learner(tiny_model_dir, _params(gradient_checkpointing=on), 1.0, generation_budget=6, device="cpu")
        checkpointed = [m for m in learner.model.modules() if getattr(m, "gradient_checkpointing", False)]
        if on:
            # transformers 5 keeps, on every module that checkpoints, a functools.partial of torch's checkpoint
            # with the kwargs given to gradient_checkpointing_enable.
            layers = len(learner.model.model.language_model.layers) + len(learner.model.model.visual.blocks)
            assert len([m for m in checkpointed if m._gradient_checkpointing_func is not None]) >= layers
            for module in checkpointed:
                assert module._gradient_checkpointing_func.func is torch.utils.checkpoint.checkpoint
                assert module._gradient_checkpointing_func.keywords == {"use_reentrant": False}
        else:
            assert not checkpointed
        logprobs, _ = token_logprobs(learner.model, sequences, "padded", 1.0, learner.pad_id, images=learner.images)
        logprobs.sum().backward()
        grads[on] = {n: p.grad for n, p in learner.model.named_parameters() if p.grad is not None}
    assert grads[True].keys() == grads[False].keys()
    for name, grad in grads[True].items():
        assert torch.allclose(grad, grads[False][name], atol=1e-6, rtol=1e-5), name
