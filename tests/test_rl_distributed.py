"""The sharded learner: FSDP2 ranks as Ray actors must update the policy exactly as one process does.

On CPU the ranks talk over gloo (slow-marked: two more processes load torch and the model); the gpu-marked
twin runs the same group over NCCL on every visible GPU.
"""

from __future__ import annotations

import pytest
import torch
from rl_helpers import make_toy_tasks, one_torch_thread  # noqa: F401 (autouse fixture)

from loupe.config import ProtocolParams, RolloutParams
from loupe.data.tasks import read_tasks
from stages.rl.learner import Learner
from stages.rl.params import RLParams
from stages.rl.trainer import to_sequence
from stages.rl.workers import LearnerGroup, RolloutWorker, start_ray


def _batch(tiny_model_dir, tmp_path):
    toy = make_toy_tasks(tmp_path / "toy")
    worker = RolloutWorker(str(tiny_model_dir), RolloutParams(device="cpu"), ProtocolParams(name="single_turn"), str(toy))
    trajectories, _ = worker.rollout(read_tasks(toy / "train.jsonl")[:5], samples=1, seed=1, max_turns=1, max_new_tokens=5)
    sequences = [to_sequence(t, True, "g") for t in trajectories]
    for k, s in enumerate(sequences):
        s.advantage = [1.0, -0.5, 0.25, -1.0, 0.75][k]
    return sequences


def _compare_group_with_single(tiny_model_dir, tmp_path, world: int, gpus: float):
    # 5 sequences, one per micro-batch, over 2 ranks: one rank runs a zero-weight filler micro-batch. Float32
    # on every device (the GPU ranks' `auto` would be bf16): the bf16 policy has its own test below.
    params = RLParams(lr=1e-2, micro_batch_size=1, mini_batches=1, ray={"enabled": True}, mixed_precision="off")
    sequences = _batch(tiny_model_dir, tmp_path)
    single = Learner(tiny_model_dir, params, 1.0, generation_budget=5, device="cpu")
    single_logprobs = single.logprobs(sequences)
    single_stats = single.update(sequences)
    expected = single.state_dict()

    started = start_ray(params.ray)
    try:
        group = LearnerGroup(str(tiny_model_dir), params, 1.0, 5, world=world, gpus=gpus)
        # Images travel by reference: one object-store entry per distinct image object, shared by every
        # sequence (and every pass of the step) that holds it.
        import ray

        twice = group._by_reference(sequences + sequences)
        refs = [ref for s in twice for ref in s.images]
        assert refs and all(isinstance(ref, ray.ObjectRef) for ref in refs)
        assert len({ref.hex() for ref in refs}) == len({id(image) for s in sequences for image in s.images})
        assert [r.hex() for s in twice[: len(sequences)] for r in s.images] == [r.hex() for s in twice[len(sequences):] for r in s.images]
        assert all(not isinstance(image, ray.ObjectRef) for s in sequences for image in s.images)  # originals intact
        for a, b in zip(group.logprobs(sequences), single_logprobs):
            assert torch.allclose(a, b, atol=1e-4)
        stats = group.update(sequences)
        assert stats["update_tokens"] == single_stats["update_tokens"]
        assert stats["grad_norm"] == pytest.approx(single_stats["grad_norm"], rel=1e-3)
        found = group.state_dict()
        assert found.keys() == expected.keys()
        for name in expected:
            assert torch.allclose(found[name].float().cpu(), expected[name].float(), atol=1e-5 if not gpus else 2e-2), name
        # Each rank writes its own shard; a single process reads them back in place (resharded by DCP).
        group.save_checkpoint(tmp_path / "checkpoint")
        group.save_model(tmp_path / "saved", tiny_model_dir)
        assert (tmp_path / "saved" / "config.json").is_file()
        # One sequence over two ranks: rank 1 trains nothing (a zero-weight filler); its statistics must still
        # line up with rank 0's in the all-reduce, not hang or mix values.
        lone = group.update(sequences[:1])
        assert lone["update_tokens"] == sequences[0].num_trained
        assert lone["optimizer_steps"] == 1
        group.close()
    finally:
        if started:
            import ray

            ray.shutdown()
    restored = Learner(tiny_model_dir, params, 1.0, generation_budget=5, device="cpu")
    restored.load_checkpoint(tmp_path / "checkpoint")
    for name, tensor in restored.state_dict().items():
        assert torch.allclose(tensor.float(), expected[name].float(), atol=1e-5 if not gpus else 2e-2), name
    moments = [restored.optimizer.state[p]["exp_avg_sq"] for p in restored.model.parameters()]
    reference = [single.optimizer.state[p]["exp_avg_sq"] for p in single.model.parameters()]
    assert all(torch.allclose(a.float().cpu(), b.float(), rtol=1e-3, atol=1e-12) for a, b in zip(moments, reference))


@pytest.mark.slow  # two extra processes load torch, transformers and the model: ~30-60 s on 2 cores
def test_two_gloo_ranks_update_like_one_process(tiny_model_dir, tmp_path):
    _compare_group_with_single(tiny_model_dir, tmp_path, world=2, gpus=0)


@pytest.mark.gpu
def test_fsdp_ranks_on_gpus_update_like_one_process(tiny_model_dir, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _compare_group_with_single(tiny_model_dir, tmp_path, world=max(1, torch.cuda.device_count()), gpus=1)


def _compare_bf16_worlds(tiny_model_dir, tmp_path, world: int, gpus: float):
    params = RLParams(lr=1e-2, micro_batch_size=1, mini_batches=1, ray={"enabled": True}, mixed_precision="bf16")
    sequences = _batch(tiny_model_dir, tmp_path)
    autocast = Learner(tiny_model_dir, params, 1.0, generation_budget=5, device="cuda" if gpus else "cpu")
    assert autocast.precision is not None and autocast.autocast is autocast.precision
    autocast_logprobs = autocast.logprobs(sequences)
    autocast_stats = autocast.update(sequences)
    del autocast

    started = start_ray(params.ray)
    try:
        runs = {}
        for ranks in (1, world):
            group = LearnerGroup(str(tiny_model_dir), params, 1.0, 5, world=ranks, gpus=gpus)
            before = group.logprobs(sequences)
            stats = group.update(sequences)
            runs[ranks] = (before, stats, group.logprobs(sequences), group.state_dict())
            group.close()
    finally:
        if started:
            import ray

            ray.shutdown()
    (one_before, one_stats, one_after, one_state), (many_before, many_stats, many_after, many_state) = runs[1], runs[world]
    assert {t.dtype for t in many_state.values()} == {torch.float32}  # master weights stay float32 on the ranks
    assert many_stats["update_tokens"] == one_stats["update_tokens"] == autocast_stats["update_tokens"]
    for a, b in zip(many_before, one_before):
        assert torch.allclose(a, b, atol=1e-5)
    assert many_stats["grad_norm"] == pytest.approx(one_stats["grad_norm"], rel=1e-4)
    for name in one_state:
        assert torch.allclose(many_state[name], one_state[name], atol=1e-6), name
    for a, b in zip(many_after, one_after):
        assert torch.allclose(a, b, atol=1e-5)
    # Against the single-process autocast path: bf16 accuracy.
    for a, b in zip(many_before, autocast_logprobs):
        assert torch.allclose(a, b, atol=1e-2)
    assert many_stats["grad_norm"] == pytest.approx(autocast_stats["grad_norm"], rel=1e-3)


@pytest.mark.slow  # Ray and three rank processes: ~35 s on 2 cores
def test_two_gloo_ranks_under_the_bf16_policy_update_like_one(tiny_model_dir, tmp_path):
    """FSDP2 with the learner's bf16 MixedPrecisionPolicy (bf16 all-gathers, float32 gradient reduction) over
    gloo on CPU: gloo carries the bf16 collectives, and two ranks update exactly like one rank under the same
    policy (float32 reduction; measured 1.2e-7 on weights after an update, log-probs identical before it). The
    single-process autocast path agrees to bf16 accuracy only (it keeps norms and softmaxes in float32 where
    FSDP runs them on bf16 weights): measured 2e-3 on log-probs, 1e-4 relative on the gradient norm."""
    _compare_bf16_worlds(tiny_model_dir, tmp_path, world=2, gpus=0)


@pytest.mark.gpu
def test_fsdp_ranks_on_gpus_under_the_bf16_policy_update_like_one(tiny_model_dir, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    _compare_bf16_worlds(tiny_model_dir, tmp_path, world=torch.cuda.device_count(), gpus=1)


def _with_ppo_targets(sequences):
    """PPO's per-token fields on the toy batch: advantages, the rollout's values and GAE's returns, made up but
    fixed, so one process and a group of ranks train on exactly the same targets."""
    for k, s in enumerate(sequences):
        n = s.num_trained
        s.token_advantages = torch.linspace(-1.0, 1.0, n) * (1 + k % 2)
        s.old_values = torch.full((n,), 0.1 * k)
        s.returns = torch.linspace(0.0, 1.0, n)
    return sequences


@pytest.mark.slow  # Ray and two rank processes with a policy and a critic each: ~40 s on 2 cores
def test_two_gloo_ranks_train_ppos_critic_like_one_process(tiny_model_dir, tmp_path):
    """The critic is sharded like the policy: two FSDP2 ranks compute the same values, step the critic to the
    same weights and write a checkpoint that one process reads back into the same critic."""
    params = RLParams(estimator="ppo", lr=1e-2, micro_batch_size=1, ray={"enabled": True}, mixed_precision="off",
                      critic={"lr": 1e-2})
    sequences = _with_ppo_targets(_batch(tiny_model_dir, tmp_path))
    single = Learner(tiny_model_dir, params, 1.0, generation_budget=5, device="cpu")
    single_values = single.values(sequences)
    single_stats = single.update(sequences)
    expected = {k: v.detach().clone() for k, v in single.critic.model.state_dict().items()}

    started = start_ray(params.ray)
    try:
        group = LearnerGroup(str(tiny_model_dir), params, 1.0, 5, world=2, gpus=0)
        for a, b in zip(group.values(sequences), single_values):
            assert torch.allclose(a, b, atol=1e-5)
        stats = group.update(sequences)
        assert stats["critic_loss"] == pytest.approx(single_stats["critic_loss"], rel=1e-4)
        assert stats["critic_grad_norm"] == pytest.approx(single_stats["critic_grad_norm"], rel=1e-3)
        assert stats["grad_norm"] == pytest.approx(single_stats["grad_norm"], rel=1e-3)
        group.save_checkpoint(tmp_path / "checkpoint" / "learner")
        group.close()
    finally:
        if started:
            import ray

            ray.shutdown()
    restored = Learner(tiny_model_dir, params, 1.0, generation_budget=5, device="cpu")
    restored.load_checkpoint(tmp_path / "checkpoint" / "learner")
    for name, tensor in restored.critic.model.state_dict().items():
        assert torch.allclose(tensor, expected[name], atol=1e-5), name
