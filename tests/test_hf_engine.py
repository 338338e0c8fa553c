"""The transformers engine on the tiny model: token-in/token-out, masks, log-probs, batching, determinism."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from loupe.config import ProtocolParams
from loupe.data.tasks import TaskRecord
from loupe.models import load_model, load_processor
from loupe.protocol import get_protocol
from loupe.rollout.hf import TransformersEngine
from loupe.rollout.loop import run_rollouts
from loupe.rollout.turn_markup import learn_turn_markup


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir), load_processor(tiny_model_dir)


def tasks(n: int) -> list[TaskRecord]:
    return [
        TaskRecord(doc_id=f"q{i}", images=["scene.png"], problem=f"What colour is square {i}?", solution="A",
                   options=["yellow", "blue", "red"])
        for i in range(n)
    ]


PROTOCOL = ProtocolParams(min_pixels=3136, max_pixels=50176, max_turns=3)


def engine(tiny, **kw) -> TransformersEngine:
    model, processor = tiny
    settings = {"stop": get_protocol("mini_o3").stop, "temperature": 1.0, "top_p": 1.0, "batch_size": 8, "seed": 0}
    return TransformersEngine(model, processor, **{**settings, **kw})


def test_turn_markup_is_learnt_from_the_chat_template(tiny):
    markup = learn_turn_markup(tiny[1])
    assert markup.close_assistant == "<|im_end|>\n"
    assert markup.user_prefix == "<|im_start|>user\n"
    assert markup.user_suffix == "<|im_end|>\n<|im_start|>assistant\n"
    assert markup.image == "<|vision_start|><|image_pad|><|vision_end|>"


def test_token_trace_marks_exactly_the_generated_tokens(tiny, scene_dir):
    eng = engine(tiny)
    trajectories = run_rollouts(tasks(3), eng, PROTOCOL, scene_dir, max_new_tokens=24)
    tokenizer = tiny[1].tokenizer
    for t in trajectories:
        trace = t.trace
        assert len(trace.input_ids) == len(trace.generated) == len(trace.logprobs)
        assert trace.generated[: t.prompt_tokens] == [0] * t.prompt_tokens
        # The generated tokens, taken turn by turn, decode to the assistant texts of the record.
        runs, current = [], []
        for token, flag in zip(trace.input_ids, trace.generated):
            if flag:
                current.append(token)
            elif current:
                runs.append(current)
                current = []
        if current:
            runs.append(current)
        assistant = [turn.text for turn in t.turns if turn.role == "assistant"]
        assert [tokenizer.decode(r, skip_special_tokens=True) for r in runs] == assistant
        assert sum(trace.generated) == t.generated_tokens
        generated_logprobs = [lp for lp, flag in zip(trace.logprobs, trace.generated) if flag]
        assert all(lp <= 0.0 for lp in generated_logprobs) and any(lp < 0.0 for lp in generated_logprobs)
        # Every image's placeholder run matches the patches the processor made for it.
        image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        assert trace.input_ids.count(image_pad) > 0


def test_logprobs_match_a_fresh_forward_pass(tiny, scene_dir):
    """The sampling log-probs recorded during generation are the model's own (what RL's ratio starts from)."""
    model, processor = tiny
    eng = engine(tiny, temperature=1.0)
    [t] = run_rollouts(tasks(1), eng, PROTOCOL, scene_dir, max_new_tokens=16)
    assert_logprobs_are_one_forward_pass(model, t.trace)


def assert_logprobs_are_one_forward_pass(model, trace) -> None:
    """The trace's recorded log-probs of generated tokens are those of one forward pass over its whole dialogue."""
    ids = torch.tensor([trace.input_ids])
    with torch.no_grad():
        logits = model(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=torch.cat(trace.extras["pixel_values"]),
            image_grid_thw=torch.cat(trace.extras["image_grid_thw"]),
            # The model's own 3D (mrope) image positions, as in training and vLLM: generation must use them too.
            mm_token_type_ids=(ids == model.config.image_token_id).long(),
        ).logits[0]
    logprobs = logits[:-1].float().log_softmax(-1).gather(1, ids[0, 1:, None]).squeeze(1)
    flags = torch.tensor(trace.generated[1:], dtype=torch.bool)
    assert torch.allclose(logprobs[flags], torch.tensor(trace.logprobs[1:])[flags], atol=1e-4)


def test_same_seed_same_trajectories(tiny, scene_dir):
    first = run_rollouts(tasks(4), engine(tiny, seed=7), PROTOCOL, scene_dir, max_new_tokens=24)
    second = run_rollouts(tasks(4), engine(tiny, seed=7), PROTOCOL, scene_dir, max_new_tokens=24)
    assert [t.trace.input_ids for t in first] == [t.trace.input_ids for t in second]
    third = run_rollouts(tasks(4), engine(tiny, seed=8), PROTOCOL, scene_dir, max_new_tokens=24)
    assert [t.trace.input_ids for t in first] != [t.trace.input_ids for t in third]


def test_batched_greedy_equals_one_at_a_time(tiny, scene_dir):
    """Left padding and concatenated images must not change what each row generates."""
    batched = run_rollouts(tasks(4), engine(tiny, temperature=0.0, batch_size=4), PROTOCOL, scene_dir, max_new_tokens=16)
    single = run_rollouts(tasks(4), engine(tiny, temperature=0.0, batch_size=1), PROTOCOL, scene_dir, max_new_tokens=16)
    assert [t.trace.input_ids for t in batched] == [t.trace.input_ids for t in single]


def test_observation_turn_appends_tokens_and_pixels(tiny, scene_dir):
    eng = engine(tiny)
    model, processor = tiny
    image = Image.new("RGB", (112, 112), (255, 0, 0))
    state = eng.begin("sys", "<image>\nQ?", [image])
    before = eng.context_length(state)
    eng.add_user_turn(state, "Observation 1: <image>.", [image])
    added = state.trace.input_ids[before:]
    text = processor.tokenizer.decode(added)
    assert text.startswith("<|im_end|>\n<|im_start|>user\nObservation 1: <|vision_start|>")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert len(state.pixel_values) == 2 and sum(state.trace.generated) == 0


def test_greedy_turns_are_the_round_synchronous_loops(tiny, scene_dir):
    """The per-trajectory loop refills batches of three from trajectories at different turns; the round-by-round
    loop it replaced (kept in benchmarks/rollout_throughput.py as the baseline) batches by rounds. The
    benchmark's scripted engine generates every turn for real but scripts what it says (zoom k times, then
    answer), so the untrained model searches for several turns. Greedy, both loops give every trajectory the
    same tokens, turns and end."""
    from benchmarks.rollout_throughput import ScriptedTurns, round_synchronous_rollouts

    model, processor = tiny
    protocol = ProtocolParams(min_pixels=3136, max_pixels=50176, max_turns=6, max_images=8)

    def scripted():
        return ScriptedTurns(model, processor, get_protocol("mini_o3").stop, temperature=0.0, batch_size=3,
                             max_turns=6, seed=0)

    per_trajectory = run_rollouts(tasks(4), scripted(), protocol, scene_dir, samples_per_task=2, max_new_tokens=8)
    by_rounds = round_synchronous_rollouts(tasks(4), scripted(), protocol, scene_dir, samples_per_task=2,
                                           max_new_tokens=8)
    turns = [t.num_turns for t in per_trajectory]
    assert turns == [t.num_turns for t in by_rounds] and len(set(turns)) > 1 and max(turns) >= 3
    for mine, theirs in zip(per_trajectory, by_rounds):
        assert mine.trace.input_ids == theirs.trace.input_ids and mine.trace.generated == theirs.trace.generated
        assert [turn.text for turn in mine.turns] == [turn.text for turn in theirs.turns]
        assert mine.end_reason == theirs.end_reason == "answered"


def test_cached_turns_log_probs_match_one_forward_pass_over_a_long_search(tiny, scene_dir):
    """Each turn prefills only its new tokens on top of the dialogue's kept keys and values, with positions given
    explicitly (3D for images): over a scripted search of several crops, the log-probs recorded turn by turn are
    those of one forward pass over the whole dialogue, images and all."""
    from benchmarks.rollout_throughput import ScriptedTurns

    model, processor = tiny
    protocol = ProtocolParams(min_pixels=3136, max_pixels=50176, max_turns=6, max_images=8)
    engine = ScriptedTurns(model, processor, get_protocol("mini_o3").stop, temperature=1.0, batch_size=3,
                           max_turns=6, seed=0)
    trajectories = run_rollouts(tasks(4), engine, protocol, scene_dir, samples_per_task=2, max_new_tokens=12)
    longest = max(trajectories, key=lambda t: len(t.trace.extras["pixel_values"]))
    assert len(longest.trace.extras["pixel_values"]) >= 3 and len({t.num_turns for t in trajectories}) > 1
    assert_logprobs_are_one_forward_pass(model, longest.trace)


def test_a_row_leaves_when_its_turn_ends_and_a_queued_turn_takes_its_place(tiny):
    """Continuous batching at token granularity: with two slots and three turns, the third turn starts as soon
    as the shorter of the first two ends, while the longer one is still decoding."""
    image = Image.new("RGB", (112, 112), (0, 128, 255))

    class Budgets(TransformersEngine):
        def turn_budget(self, state, max_new_tokens):
            return state.trace.extras["budget"]

    eng = Budgets(*tiny, stop=(), temperature=1.0, batch_size=2, seed=0)
    eng.end_ids = []  # every turn runs to its budget
    states = []
    for budget in (3, 12, 4):
        state = eng.begin("sys", "<image>\nQ?", [image])
        state.trace.extras["budget"] = budget
        states.append(state)
    tickets = [eng.submit(state, 16) for state in states]
    first = eng.poll()
    assert [ticket for ticket, _ in first] == [tickets[0]] and first[0][1].num_tokens == 3
    second = eng.poll()  # the third turn joins while the second is mid-turn, and ends first
    assert [ticket for ticket, _ in second] == [tickets[2]] and second[0][1].num_tokens == 4
    assert [row.ticket for row in eng._running.rows] == [tickets[1]] and len(eng._running.rows[0].new_ids) < 12
    third = eng.poll()
    assert [ticket for ticket, _ in third] == [tickets[1]] and third[0][1].num_tokens == 12
    assert eng._running is None


def test_later_turns_sample_at_their_own_temperature_and_record_its_log_probs():
    import torch

    from loupe.rollout.kv_batch import sample

    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    per_row = torch.tensor([[1.0], [0.5], [0.0], [2.0]])
    tokens, logprobs = sample(logits, per_row, 1.0, [], torch.Generator().manual_seed(1))
    assert tokens[2] == logits[2].argmax()  # a greedy row among sampled ones
    for row in range(4):
        scale = per_row[row, 0] if per_row[row, 0] > 0 else 1.0
        expected = (logits[row] / scale).log_softmax(-1)[tokens[row]]
        assert logprobs[row] == pytest.approx(float(expected), abs=1e-5)
    # One temperature for every row is the scalar path exactly.
    same = sample(logits, torch.full((4, 1), 0.7), 1.0, [], torch.Generator().manual_seed(3))
    scalar = sample(logits, 0.7, 1.0, [], torch.Generator().manual_seed(3))
    assert torch.equal(same[0], scalar[0]) and torch.allclose(same[1], scalar[1])


def test_an_engine_picks_the_later_turn_temperature_after_the_first_turn():
    from loupe.rollout.engine import Engine

    class Plain(Engine):
        begin = generate = add_user_turn = context_length = None

    engine = Plain.__new__(Plain)
    engine.temperature = 1.0
    assert engine.temperature_for(True) == engine.temperature_for(False) == 1.0
    engine.later_temperature = 0.9
    assert (engine.temperature_for(True), engine.temperature_for(False)) == (1.0, 0.9)
