"""The learner on the tiny model: trained-token masks, log-prob recomputation, packed vs padded, update sign."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from rl_helpers import make_toy_tasks, one_torch_thread  # noqa: F401 (autouse fixture)

from loupe.config import ProtocolParams, RolloutParams
from loupe.data.tasks import read_tasks
from loupe.rollout.engine import TokenTrace
from loupe.trajectory import Trajectory
from stages.rl.batching import token_logprobs
from stages.rl.learner import Learner
from stages.rl.params import RLParams
from stages.rl.trainer import to_sequence
from stages.rl.workers import RolloutWorker


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    return make_toy_tasks(tmp_path_factory.mktemp("toy"))


def _params(**overrides) -> RLParams:
    return RLParams(**{"micro_batch_size": 3, "lr": 0.01, "ray": {"enabled": False}, **overrides})


def _multi_turn_trajectories(worker: RolloutWorker, temperature: float) -> list[Trajectory]:
    """Two-turn dialogues with a crop observation, driven through the engine exactly as the loop drives it."""
    engine = worker.engine
    engine.temperature = temperature
    out = []
    for k, colour in enumerate(["red", "blue", "green"]):
        image = Image.new("RGB", (112, 84), colour)
        state = engine.begin("sys", "<image>\nWhat colour?", [image])
        engine.generate([state], 5 + k)
        engine.add_user_turn(state, "Observation 1: <image>. Continue.", [Image.new("RGB", (56, 56), "white")])
        engine.generate([state], 4)
        t = Trajectory(traj_id=f"t{k}", task={}, protocol="mini_o3", system="sys")
        t.trace = engine.trace(state)
        out.append(t)
    return out


@pytest.fixture(scope="module")
def worker(tiny_model_dir, toy_dir):
    protocol = ProtocolParams(name="mini_o3")
    return RolloutWorker(str(tiny_model_dir), RolloutParams(device="cpu"), protocol, str(toy_dir), seed=0)


def test_only_generated_tokens_are_trained_and_masked_trajectories_train_none():
    trace = TokenTrace()
    trace.append([5, 6, 7], generated=False)
    trace.append([8, 9], generated=True, logprobs=[-0.5, -0.25])
    trace.append([10, 11, 12], generated=False)  # an observation turn
    trace.append([13], generated=True, logprobs=[-1.0])
    t = Trajectory(traj_id="x", task={}, protocol="mini_o3", system="")
    t.trace = trace
    seq = to_sequence(t, trained=True, group="g")
    assert seq.positions.tolist() == [3, 4, 8]
    assert seq.old_logprobs.tolist() == [-0.5, -0.25, -1.0]
    assert seq.input_ids[seq.positions].tolist() == [8, 9, 13]
    assert to_sequence(t, trained=False, group="g").num_trained == 0


@pytest.mark.parametrize("batching", ["packed", "padded"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_recomputed_logprobs_equal_the_samplers(worker, tiny_model_dir, batching, temperature):
    """The learner scores exactly the sampled tokens, at their positions, with the sampler's images, 3D
    positions and temperature: on the same weights its log-probs equal the rollout's."""
    trajectories = _multi_turn_trajectories(worker, temperature)
    sequences = [to_sequence(t, True, "g") for t in trajectories]
    assert all(s.image_grid_thw.shape[0] == 2 for s in sequences)  # question image + one crop each
    learner = Learner(tiny_model_dir, _params(batching=batching), temperature, generation_budget=16)
    recomputed = learner.logprobs(sequences)
    for seq, new in zip(sequences, recomputed):
        assert new.shape == seq.old_logprobs.shape
        assert torch.allclose(new, seq.old_logprobs, atol=1e-4), (new, seq.old_logprobs)


def test_packed_and_padded_agree_on_logprobs_and_gradients(worker, tiny_model_dir):
    sequences = [to_sequence(t, True, "g") for t in _multi_turn_trajectories(worker, 1.0)]
    results = {}
    for mode in ("packed", "padded"):
        learner = Learner(tiny_model_dir, _params(batching=mode), 1.0, generation_budget=16)
        logprobs, entropy = token_logprobs(learner.model, sequences, mode, 1.0, learner.pad_id, with_entropy=True)
        (logprobs.sum() + 0.1 * entropy.sum()).backward()
        grads = {n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None}
        results[mode] = (logprobs.detach(), grads)
    assert torch.allclose(results["packed"][0], results["padded"][0], atol=1e-5)
    assert results["packed"][1].keys() == results["padded"][1].keys()
    for name, grad in results["packed"][1].items():
        assert torch.allclose(grad, results["padded"][1][name], atol=1e-5, rtol=1e-4), name


def test_an_update_raises_rewarded_tokens_and_lowers_punished_ones(worker, tiny_model_dir, toy_dir):
    tasks = read_tasks(toy_dir / "train.jsonl")[:2]
    trajectories, _ = worker.rollout(tasks, samples=2, seed=3, max_turns=1, max_new_tokens=6)
    sequences = [to_sequence(t, True, "g") for t in trajectories]
    for k, s in enumerate(sequences):
        s.advantage = 1.0 if k % 2 == 0 else -1.0
    learner = Learner(tiny_model_dir, _params(lr=1e-3), 1.0, generation_budget=6)
    before = learner.logprobs(sequences)
    stats = learner.update(sequences)
    after = learner.logprobs(sequences)
    assert stats["optimizer_steps"] == 1 and stats["grad_norm"] > 0 and stats["update_tokens"] == sum(s.num_trained for s in sequences)
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # on-policy: the first pass has ratio 1
    for k, (b, a) in enumerate(zip(before, after)):
        change = float((a - b).sum())
        assert change > 0 if k % 2 == 0 else change < 0


def test_mini_batches_and_epochs_give_several_optimiser_steps(worker, tiny_model_dir, toy_dir):
    tasks = read_tasks(toy_dir / "train.jsonl")[:2]
    trajectories, _ = worker.rollout(tasks, samples=2, seed=4, max_turns=1, max_new_tokens=4)
    sequences = [to_sequence(t, True, "g") for t in trajectories]
    for s in sequences:
        s.advantage = 1.0
    learner = Learner(tiny_model_dir, _params(lr=1e-2, mini_batches=2, ppo_epochs=2, micro_batch_size=1), 1.0, 4)
    stats = learner.update(sequences)
    assert stats["optimizer_steps"] == 4
    # after the first optimiser step the policy has moved: later mini-batches see ratios away from 1
    assert stats["policy_kl"] > 0


def test_vision_markers_are_never_sampled_and_never_trained(tiny_model_dir, toy_dir):
    """A model that strongly prefers <|image_pad|> must still not write it (its next turn could not run), and a
    trajectory from an engine that did write one is not trained (the learner could not replay it)."""
    from rl_helpers import write_params

    from stages.rl.trainer import _trainable, read_inputs, wrote_vision_marker

    worker = RolloutWorker(str(tiny_model_dir), RolloutParams(device="cpu"), ProtocolParams(name="single_turn"), str(toy_dir))
    model = worker.engine.model
    image_pad = model.config.image_token_id
    with torch.no_grad():  # tied embeddings: a long image_pad row dominates every logit
        model.get_input_embeddings().weight[image_pad] *= 400.0
    tasks = read_tasks(toy_dir / "train.jsonl")[:2]
    trajectories, _ = worker.rollout(tasks, samples=4, seed=0, max_turns=1, max_new_tokens=8)
    generated = [i for t in trajectories for i, g in zip(t.trace.input_ids, t.trace.generated) if g]
    assert generated and image_pad not in generated

    inputs = read_inputs(write_params(toy_dir / "params.yaml", {}), tiny_model_dir, toy_dir)
    assert image_pad in inputs.vision_markers
    t = trajectories[0]
    t.rewards = {"total": 1.0, "valid": True}
    assert _trainable(t, inputs.params, inputs.vision_markers) == (True, True)
    position = t.trace.generated.index(1)
    t.trace.input_ids[position] = image_pad
    assert wrote_vision_marker(t, inputs.vision_markers)
    assert _trainable(t, inputs.params, inputs.vision_markers) == (False, True)


def test_split_evenly_keeps_order_and_balances_the_parts():
    from stages.rl.batching import split_evenly

    for n in range(0, 12):
        for parts in range(1, 6):
            chunks = split_evenly(list(range(n)), parts)
            sizes = [len(c) for c in chunks]
            assert len(chunks) == parts and max(sizes) - min(sizes) <= 1
            assert [x for c in chunks for x in c] == list(range(n))
