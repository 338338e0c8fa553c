"""The learner on the tiny model: trained-token masks, log-prob recomputation, packed vs padded, update sign,
chunked float32 log-probs and entropies, images processed in the learner's process."""

from __future__ import annotations

import pickle

import pytest
import torch
from PIL import Image
from rl_helpers import make_toy_tasks, one_torch_thread  # noqa: F401 (autouse fixture)

from loupe.config import ProtocolParams, RolloutParams
from loupe.data.tasks import read_tasks
from loupe.rollout.engine import TokenTrace
from loupe.trajectory import Trajectory
from stages.rl.batching import ImageEncoder, TrainSequence, token_logprobs, token_stats
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
    # Through a pickle, as Ray ships them: the traces arrive without the engine's pixel values, and the learner
    # computes its own from the images.
    trajectories = pickle.loads(pickle.dumps(_multi_turn_trajectories(worker, temperature)))
    assert all(not t.trace.extras for t in trajectories)
    sequences = [to_sequence(t, True, "g") for t in trajectories]
    assert all(len(s.images) == 2 for s in sequences)  # question image + one crop each
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
        logprobs, entropy = token_logprobs(
            learner.model, sequences, mode, 1.0, learner.pad_id, entropy="grad", images=learner.images
        )
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

    from stages.rl.inputs import read_inputs
    from stages.rl.trainer import _trainable, wrote_vision_marker

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

    for n in range(12):
        for parts in range(1, 6):
            chunks = split_evenly(list(range(n)), parts)
            sizes = [len(c) for c in chunks]
            assert len(chunks) == parts and max(sizes) - min(sizes) <= 1
            assert [x for c in chunks for x in c] == list(range(n))


# --- chunked float32 log-probs and entropies -------------------------------------------------------------------


def _full_vocabulary_reference(learner, sequences, mode, temperature):
    """The straightforward implementation this module replaced: every kept logit row as float32, log_softmax
    over the whole vocabulary, entropy from the log-probs."""
    from stages.rl.batching import packed_inputs, padded_inputs

    encoded = [learner.images(s) for s in sequences]
    targets = torch.cat([s.input_ids[s.positions] for s in sequences])
    if mode == "packed":
        inputs, _ = packed_inputs(learner.model, sequences, "cpu", encoded)
        logits = learner.model(**inputs, use_cache=False).logits[0]
    else:
        inputs, index = padded_inputs(learner.model, sequences, "cpu", learner.pad_id, encoded)
        logits = learner.model(**inputs, use_cache=False).logits.flatten(0, 1)[index]
    log_probs = (logits.float() / temperature).log_softmax(-1)
    return log_probs.gather(1, targets[:, None]).squeeze(1), -(log_probs.exp() * log_probs).sum(-1)


@pytest.mark.parametrize("mode", ["packed", "padded"])
def test_chunked_logprobs_and_entropy_equal_a_full_log_softmax(worker, tiny_model_dir, mode):
    sequences = [to_sequence(t, True, "g") for t in _multi_turn_trajectories(worker, 0.7)]
    total = sum(s.num_trained for s in sequences)
    learner = Learner(tiny_model_dir, _params(batching=mode), 0.7, generation_budget=16)
    results = []
    for compute in ("reference", "chunked"):
        learner.model.zero_grad(set_to_none=True)
        if compute == "reference":
            logprobs, entropy = _full_vocabulary_reference(learner, sequences, mode, 0.7)
        else:  # chunks of 4 rows: several full chunks and a short last one
            assert total % 4 and total > 8
            logprobs, entropy = token_logprobs(
                learner.model, sequences, mode, 0.7, learner.pad_id, entropy="grad", images=learner.images, chunk=4
            )
        (logprobs.sum() + 0.1 * entropy.sum()).backward()
        grads = {n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None}
        results.append((logprobs.detach(), entropy.detach(), grads))
    (ref_lp, ref_h, ref_grads), (lp, h, grads) = results
    assert lp.dtype == h.dtype == torch.float32 and lp.shape == (total,)
    assert torch.allclose(lp, ref_lp, atol=1e-5, rtol=0), (lp - ref_lp).abs().max()
    assert torch.allclose(h, ref_h, atol=1e-5, rtol=0), (h - ref_h).abs().max()
    assert grads.keys() == ref_grads.keys() and grads
    for name, grad in grads.items():
        assert torch.allclose(grad, ref_grads[name], atol=1e-6, rtol=1e-4), name


def test_chunked_logprobs_keep_no_float32_vocabulary_rows_for_the_backward():
    """What autograd saves for the backward: the straightforward form keeps float32 (tokens x vocabulary) tensors
    (the log-softmax output, its exponential); the chunked form recomputes each chunk in the backward instead, and
    its gradient is the same."""
    torch.manual_seed(0)
    rows, vocab = 40, 3001
    logits = torch.randn(rows, vocab, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,))

    def saved_vocab_rows(compute):
        saved: list[tuple] = []

        def pack(t):
            if t.dim() == 2 and t.shape[-1] == vocab and t.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr():
                saved.append((tuple(t.shape), t.dtype))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logprobs, entropy = compute()
        logits.grad = None
        (logprobs.sum() + 0.1 * entropy.sum()).backward()
        return saved, logits.grad.clone()

    def straightforward():
        log_probs = logits.float().log_softmax(-1)
        return log_probs.gather(1, targets[:, None]).squeeze(1), -(log_probs.exp() * log_probs).sum(-1)

    kept, expected = saved_vocab_rows(straightforward)
    assert (rows, vocab) in [shape for shape, _ in kept]
    kept, found = saved_vocab_rows(lambda: token_stats(logits, targets, entropy="grad", chunk=16))
    assert kept == []
    assert torch.allclose(found.float(), expected.float(), atol=1e-3)


def test_entropy_is_computed_only_as_far_as_it_is_needed(tiny_model_dir, worker, toy_dir, monkeypatch):
    import stages.rl.learner as learner_module
    from stages.rl.loss import LossConfig, policy_loss

    sequences = [to_sequence(t, True, "g") for t in _multi_turn_trajectories(worker, 1.0)][:2]
    for s in sequences:
        s.advantage = 1.0
    learner = Learner(tiny_model_dir, _params(), 1.0, generation_budget=16)
    off = token_logprobs(learner.model, sequences, "padded", 1.0, learner.pad_id, images=learner.images)
    detached = token_logprobs(learner.model, sequences, "padded", 1.0, learner.pad_id, entropy="detached", images=learner.images)
    graph = token_logprobs(learner.model, sequences, "padded", 1.0, learner.pad_id, entropy="grad", images=learner.images)
    assert off[1] is None
    assert off[0].requires_grad and not detached[1].requires_grad and graph[1].requires_grad
    assert torch.allclose(detached[1], graph[1].detach()) and float(detached[1].min()) > 0

    # The update asks for a graph only when the loss has an entropy bonus, and logs the entropy either way.
    modes: list[str] = []
    real = learner_module.token_logprobs
    monkeypatch.setattr(learner_module, "token_logprobs", lambda *a, **k: modes.append(k.get("entropy", "off")) or real(*a, **k))
    assert learner.update(sequences)["entropy"] == pytest.approx(float(graph[1].detach().mean()), rel=1e-4)
    bonus = Learner(tiny_model_dir, _params(entropy_coef=0.01), 1.0, generation_budget=16)
    assert bonus.update(sequences)["entropy"] > 0
    assert modes == ["detached", "grad"]

    # A positive coefficient with an entropy that carries no graph would silently drop the bonus's gradient.
    with pytest.raises(ValueError, match="entropy bonus needs"):
        policy_loss(graph[0], graph[0].detach(), torch.ones_like(graph[0]), 1.0, LossConfig(entropy_coef=0.1), entropy=detached[1])


# --- images: uint8 across processes, pixel values in the learner's ----------------------------------------------


def test_a_pickled_token_trace_leaves_its_extras_behind():
    image = Image.new("RGB", (56, 56), "red")
    trace = TokenTrace(images=[image])
    trace.append([1, 2, 3], generated=False)
    trace.append([4], generated=True, logprobs=[-0.5])
    trace.extras["pixel_values"] = [torch.zeros(16, 1176)]
    restored = pickle.loads(pickle.dumps(trace))
    assert restored.extras == {}
    assert restored.input_ids == trace.input_ids and restored.generated == trace.generated and restored.logprobs == trace.logprobs
    assert restored.images[0].tobytes() == image.tobytes()
    assert len(trace.extras["pixel_values"]) == 1  # the original keeps its own
    assert len(pickle.dumps(trace)) < 16 * 1176 * 4  # the float32 pixels alone would be 75 KB


def test_the_learner_computes_the_engines_pixel_values_once_per_image(worker, tiny_model_dir, toy_dir):
    # In-process trajectories still hold the engine's pixel values: the learner's own must equal them.
    trajectories = _multi_turn_trajectories(worker, 1.0)
    learner = Learner(tiny_model_dir, _params(), 1.0, generation_budget=16)
    for t in trajectories:
        pixels, grids = learner.images(to_sequence(t, True, "g"))
        assert torch.equal(torch.cat(pixels), torch.cat(t.trace.extras["pixel_values"]))
        assert torch.equal(grids, torch.cat(t.trace.extras["image_grid_thw"]))

    # A group of K samples shares its question image object, through a pickle too: processed once per batch.
    tasks = read_tasks(toy_dir / "train.jsonl")[:1]
    group, _ = worker.rollout(tasks, samples=4, seed=5, max_turns=1, max_new_tokens=4)
    shipped = pickle.loads(pickle.dumps([to_sequence(t, True, "g") for t in group]))
    assert all(s.images[0] is shipped[0].images[0] for s in shipped)
    encoder = ImageEncoder(learner.images.image_processor, learner.images.image_token_id)
    learner.images = encoder
    learner.logprobs(shipped)
    learner.update([s for s in shipped if s.num_trained])
    assert encoder.processed == 1


def test_a_trace_whose_image_pads_do_not_match_the_learners_processor_is_refused(worker, tiny_model_dir):
    t = _multi_turn_trajectories(worker, 1.0)[0]
    learner = Learner(tiny_model_dir, _params(), 1.0, generation_budget=16)
    seq = to_sequence(t, True, "g")
    learner.logprobs([seq])  # as rolled out: fine
    bigger = TrainSequence(seq.input_ids, seq.positions, 0.0, seq.old_logprobs, [Image.new("RGB", (224, 224)), seq.images[1]], traj_id="t0")
    with pytest.raises(ValueError, match=r"trajectory t0: the rollout's token ids hold 2 image\(s\) of \[12, 4\] image-pad tokens.*\[64, 4\]"):
        learner.logprobs([bigger])
    missing = TrainSequence(seq.input_ids, seq.positions, 0.0, seq.old_logprobs, seq.images[:1], traj_id="t0")
    with pytest.raises(ValueError, match="same processor settings"):
        learner.logprobs([missing])


def test_the_learning_rate_follows_a_cosine_with_warmup_and_a_floor_and_resumes_where_it_was():
    """OpenRLHF's schedule (cosine_with_min_lr, min 0.1 x lr, warm-up 3% of steps) over steps x ppo_epochs x
    mini_batches optimiser steps, and a schedule rebuilt for a resumed run at the optimiser's step count."""
    from stages.rl.optimizer import lr_scheduler

    params = _params(lr=1e-3, steps=25, mini_batches=4, lr_schedule="cosine", warmup_ratio=0.03, min_lr_ratio=0.1)
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([weight], lr=params.lr)
    scheduler = lr_scheduler(optimizer, params)
    rates = []
    for _ in range(100):  # 25 steps x 4 mini-batches
        rates.append(scheduler.get_last_lr()[0])
        weight.grad = torch.ones(2)
        optimizer.step()
        scheduler.step()
    assert rates[0] == 0.0 and rates[1] == pytest.approx(1e-3 / 3) and rates[3] == pytest.approx(1e-3)  # 3 warm-up steps
    assert rates[3:] == sorted(rates[3:], reverse=True)
    assert rates[-1] == pytest.approx(1e-4, rel=0.01)  # the floor: 0.1 x lr
    mid = rates[3 + 97 // 2]
    assert mid == pytest.approx(1e-4 + 0.5 * 9e-4, rel=0.02)  # halfway down the cosine
    resumed = lr_scheduler(optimizer, params, taken=40)
    assert resumed.get_last_lr()[0] == pytest.approx(rates[40])
    constant = lr_scheduler(torch.optim.AdamW([weight], lr=1e-3), _params(lr=1e-3))
    assert constant.get_last_lr()[0] == 1e-3  # the default: constant, no warm-up


def test_optimiser_steps_can_be_given_in_the_upstreams_units():
    """OpenRLHF counts samples per update (train_batch_size), verl and EasyR1 prompts (ppo_mini_batch_size)."""
    assert _params(prompts_per_step=256, samples_per_prompt=16, samples_per_update=256).mini_batches == 16
    assert _params(prompts_per_step=512, samples_per_prompt=5, prompts_per_update=128).mini_batches == 4
    with pytest.raises(ValueError, match="does not divide"):
        _params(prompts_per_step=10, samples_per_prompt=4, samples_per_update=16)
    with pytest.raises(ValueError, match="one way"):
        _params(prompts_per_step=8, samples_per_update=8, mini_batches=2)
