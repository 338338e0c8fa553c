"""The rollout loop's logic, driven by a scripted engine: end reasons, limits, error observations, crops."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from loupe.config import ProtocolParams
from loupe.data.tasks import TaskRecord
from loupe.rollout.engine import Engine, Generation
from loupe.rollout.loop import run_rollouts
from loupe.trajectory import read_trajectories, write_trajectories


class ScriptedEngine(Engine):
    """Replays fixed assistant turns per dialogue, in order; records what the loop sends back."""

    name = "scripted"

    def __init__(self, scripts: list[list[str]], finish: str | None = None, batch_size: int = 64):
        self.scripts = scripts
        self.started = 0
        self.calls = 0
        self.batches: list[list[tuple[int, int]]] = []
        """Each generate call's (dialogue number, turn number) pairs."""
        self.finish = finish
        self.batch_size = batch_size

    def begin(self, system, question, images):
        state = {"script": list(self.scripts[self.started % len(self.scripts)]), "tokens": 100, "user_turns": [],
                 "number": self.started, "turn": 0}
        state["question_images"] = [img.size for img in images]
        self.started += 1
        return state

    def generate(self, states, max_new_tokens):
        self.calls += 1
        self.batches.append([(state["number"], state["turn"]) for state in states])
        out = []
        for state in states:
            state["turn"] += 1
            text = state["script"].pop(0) if state["script"] else "nothing useful"
            state["tokens"] += 10
            finish = self.finish or ("stop" if text.endswith("</grounding>") else "eos")
            out.append(Generation(text=text, finish=finish, num_tokens=10))
        return out

    def add_user_turn(self, state, text, images):
        state["user_turns"].append((text, [img.size for img in images]))
        state["tokens"] += 50 + 64 * len(images)

    def context_length(self, state):
        return state["tokens"]


def call(box, source="original_image"):
    return f'<think>look</think>\n<grounding>{json.dumps({"bbox_2d": box, "source": source})}</grounding>'


ANSWER_B = "<think>found it</think>\n<answer>B</answer>"


@pytest.fixture()
def task_dir(tmp_path: Path) -> Path:
    image = Image.new("RGB", (1600, 1200), (200, 200, 200))
    image.paste((255, 0, 0), (800, 600, 900, 700))
    image.save(tmp_path / "big.png")
    return tmp_path


def make_task(doc_id="t1") -> TaskRecord:
    return TaskRecord(
        doc_id=doc_id, images=["big.png"], problem="What colour is the square?", solution="B",
        options=["blue", "red"], bbox=[0.5, 0.5, 0.5625, 0.5833],
    )


def params(**kw) -> ProtocolParams:
    return ProtocolParams(**{"min_pixels": 3136, "max_pixels": 50176, **kw})


def test_answer_after_two_crops_records_turns_images_and_boxes(task_dir):
    engine = ScriptedEngine([[call([0.4, 0.4, 0.7, 0.7]), call([0.2, 0.2, 0.8, 0.8], "observation_1"), ANSWER_B]])
    [t] = run_rollouts([make_task()], engine, params(), task_dir)
    assert t.end_reason == "answered" and t.answer == "B"
    assert [turn.role for turn in t.turns] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    assert t.num_turns == 3 and t.num_tool_calls == 2 and len(t.images) == 3
    first, second = t.turns[2].crop, t.turns[4].crop
    assert first["source"] == "original_image" and first["box_px"] == [640, 480, 1120, 840]
    assert second["source"] == "observation_1" and second["source_image"] == 1
    w, h = first["size"]
    assert w % 28 == 0 and h % 28 == 0 and 3136 <= w * h <= 50176
    assert t.prompt_tokens == 100 and t.generated_tokens == 30


def test_turn_limit_with_a_pending_call_ends_over_turn(task_dir):
    engine = ScriptedEngine([[call([0.1, 0.1, 0.5, 0.5])] * 10])
    [t] = run_rollouts([make_task()], engine, params(max_turns=3), task_dir)
    assert t.end_reason == "over_turn" and t.num_turns == 3 and t.num_tool_calls == 3
    assert len(t.images) == 3  # the third call was not executed
    assert t.turns[-1].role == "assistant"


def test_eval_turn_limit_overrides_protocol_limit(task_dir):
    engine = ScriptedEngine([[call([0.1, 0.1, 0.5, 0.5])] * 4 + [ANSWER_B]])
    [t] = run_rollouts([make_task()], engine, params(max_turns=2), task_dir, max_turns=8)
    assert t.end_reason == "answered" and t.num_turns == 5


def test_image_limit_ends_over_turn(task_dir):
    engine = ScriptedEngine([[call([0.1, 0.1, 0.5, 0.5])] * 10])
    [t] = run_rollouts([make_task()], engine, params(max_turns=10, max_images=3), task_dir)
    assert t.end_reason == "over_turn" and len(t.images) == 3


def test_context_limit_ends_over_turn(task_dir):
    engine = ScriptedEngine([[call([0.1, 0.1, 0.5, 0.5])] * 10])
    [t] = run_rollouts([make_task()], engine, params(max_turns=10, max_context_tokens=500), task_dir, max_new_tokens=64)
    assert t.end_reason == "over_turn"
    assert t.turns[-1].role == "user"  # the observation that overflowed is recorded, then the dialogue stops


def test_malformed_call_gets_an_error_observation_then_retries_run_out(task_dir):
    bad = '<think>x</think><grounding>{"bbox_2d": [0.5, 0.5, 0.2, 0.9], "source": "original_image"}</grounding>'
    engine = ScriptedEngine([[bad, bad, ANSWER_B]])
    [t] = run_rollouts([make_task()], engine, params(format_error_retries=1), task_dir)
    assert t.end_reason == "format_error" and t.num_format_errors == 2
    assert t.turns[1].action == "error" and t.turns[1].error.startswith("empty_box")
    error_turn = t.turns[2]
    assert error_turn.role == "user" and not error_turn.images and "x0 < x1" in error_turn.text


def test_error_then_recovery_answers(task_dir):
    engine = ScriptedEngine([["I think it is red", ANSWER_B]])
    [t] = run_rollouts([make_task()], engine, params(format_error_retries=2), task_dir)
    assert t.end_reason == "answered" and t.num_format_errors == 1 and t.turns[1].error.startswith("no_action")


def test_tool_error_comes_back_as_error_observation(task_dir):
    # A 1600 x 1 px sliver is well-formed JSON but more elongated than 200:1: the tool refuses it.
    sliver = call([0.0, 0.5, 1.0, 0.5001])
    engine = ScriptedEngine([[sliver, ANSWER_B]])
    [t] = run_rollouts([make_task()], engine, params(format_error_retries=1), task_dir)
    assert t.end_reason == "answered" and t.num_tool_calls == 1 and t.num_format_errors == 1
    assert t.turns[2].role == "user" and t.turns[2].error.startswith("degenerate_box") and not t.turns[2].images


def test_length_finish_ends_as_length(task_dir):
    engine = ScriptedEngine([["<think>very long"]], finish="length")
    [t] = run_rollouts([make_task()], engine, params(), task_dir)
    assert t.end_reason == "length" and t.turns[-1].error.startswith("length")


def test_question_image_is_shown_inside_the_pixel_budget(task_dir):
    engine = ScriptedEngine([[ANSWER_B]])
    states = []
    original_begin = engine.begin
    engine.begin = lambda *a: states.append(original_begin(*a)) or states[-1]
    run_rollouts([make_task()], engine, params(), task_dir)
    [(w, h)] = states[0]["question_images"]
    assert w % 28 == 0 and h % 28 == 0 and w * h <= 50176 and abs(w / h - 1600 / 1200) < 0.2  # sides round to multiples of 28


def test_samples_and_order_and_batching(task_dir):
    engine = ScriptedEngine([[ANSWER_B], [call([0.1, 0.1, 0.6, 0.6]), ANSWER_B]])
    tasks = [make_task("a"), make_task("b")]
    trajectories = run_rollouts(tasks, engine, params(), task_dir, samples_per_task=2)
    assert [t.traj_id for t in trajectories] == ["a#0", "a#1", "b#0", "b#1"]
    assert engine.calls == 2  # all four first turns in one batch, then the two second turns
    assert [t.num_turns for t in trajectories] == [1, 2, 1, 2]


def test_a_batch_is_refilled_with_whichever_trajectories_wait_whatever_their_turn(task_dir):
    """Batches of two, first in first out: the trajectory back from its crop shares the next batch with one
    still at its first turn, instead of the round waiting for every first turn to finish."""
    engine = ScriptedEngine([[call([0.1, 0.1, 0.6, 0.6]), call([0.2, 0.2, 0.7, 0.7]), ANSWER_B], [ANSWER_B],
                             [ANSWER_B]], batch_size=2)
    trajectories = run_rollouts([make_task("a"), make_task("b"), make_task("c")], engine, params(), task_dir)
    assert engine.batches == [[(0, 0), (1, 0)], [(2, 0), (0, 1)], [(0, 2)]]
    assert [t.num_turns for t in trajectories] == [3, 1, 1] and all(t.end_reason == "answered" for t in trajectories)


def test_single_turn_protocol_allows_one_turn(task_dir):
    engine = ScriptedEngine([[call([0.1, 0.1, 0.6, 0.6]), ANSWER_B]])
    [t] = run_rollouts([make_task()], engine, params(name="single_turn", format_error_retries=3), task_dir)
    assert t.end_reason == "format_error" and t.num_turns == 1


def test_trajectories_round_trip_with_crops(task_dir, tmp_path):
    engine = ScriptedEngine([[call([0.4, 0.4, 0.7, 0.7]), ANSWER_B]])
    [t] = run_rollouts([make_task()], engine, params(), task_dir)
    out = write_trajectories([t], tmp_path / "out" / "traj.jsonl")
    [back] = read_trajectories(out)
    assert back.end_reason == "answered" and back.turns[2].crop == t.turns[2].crop
    crop = back.load_image(1)
    assert crop.size == tuple(t.turns[2].crop["size"])
    # The crop shows the red square: the box [640, 480, 1120, 840] holds it at its centre.
    assert crop.getpixel((crop.width // 2, crop.height // 2)) == (255, 0, 0)


def test_a_recipes_turn_templates_extra_arguments_and_minimum_crop_are_what_the_model_sees(task_dir):
    """DeepEyes' shape on the mini_o3 grammar: the crop comes back inside the recipe's tool-response template,
    an error in its error template, a `label` argument is accepted (and ignored), and a crop whose shorter side
    is under the minimum is refused with an error turn; errors are answered until the turn limit."""
    labelled = ('<think>look</think>\n<grounding>{"bbox_2d": [0.5, 0.5, 0.6, 0.6], "source": "original_image", '
                '"label": "the red square"}</grounding>')
    small = call([0.5, 0.5, 0.51, 0.51])  # 16 x 12 px of the 1600 x 1200 original
    engine = ScriptedEngine([[labelled, small, "no tags at all", ANSWER_B]])
    protocol = params(observation_template="<tool_response>{image}\nThink first. ({index})</tool_response>",
                      error_template="Error: {error}", tool_extra_arguments=["label"], min_crop_side=31,
                      format_error_retries=6)
    [t] = run_rollouts([make_task()], engine, protocol, task_dir)
    assert t.end_reason == "answered" and t.num_tool_calls == 2 and t.num_format_errors == 2
    observation, refused, no_action = t.turns[2], t.turns[4], t.turns[6]
    assert observation.text == "<tool_response><image>\nThink first. (1)</tool_response>" and observation.images
    assert refused.text.startswith("Error: the box is 16x12 px of the original; both sides must be at least 31 px")
    assert no_action.text.startswith("Error: ") and not no_action.images


def test_turn_templates_are_checked_when_the_params_load():
    with pytest.raises(ValueError, match=r"observation_template: must hold \{image\} exactly once"):
        params(observation_template="<tool_response></tool_response>")
    with pytest.raises(ValueError, match="error_template"):
        params(error_template="Error: {reason}")
    assert params(error_template="{{literal}} {error}").error_template  # doubled braces are text


def test_top_k_samples_among_the_k_likeliest_tokens_and_keeps_the_untruncated_log_prob():
    import torch

    from loupe.rollout.kv_batch import sample

    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]]).repeat(400, 1)
    generator = torch.Generator().manual_seed(0)
    tokens, logprobs = sample(logits, 1.0, 1.0, [], generator, top_k=2)
    assert set(tokens.tolist()) == {0, 1}  # both kept tokens drawn, no other
    full = logits[0].log_softmax(-1)
    assert torch.allclose(logprobs, full[tokens])
    unlimited, _ = sample(logits, 1.0, 1.0, [], torch.Generator().manual_seed(0))
    assert set(unlimited.tolist()) > {0, 1}


def test_a_turn_without_a_call_can_end_the_dialogue_while_broken_calls_get_error_turns(task_dir):
    """`turn_without_call: ends` (DeepEyes, Mini-o3, Pixel-Reasoner): prose ends the trajectory at once, to be
    scored as it stands; a broken call still gets its error turn and the dialogue goes on."""
    bad = '<think>x</think><grounding>{"bbox_2d": [0.5, 0.5, 0.2, 0.9], "source": "original_image"}</grounding>'
    engine = ScriptedEngine([[bad, "It is red, I think.", ANSWER_B]])
    [t] = run_rollouts([make_task()], engine, params(format_error_retries=6, turn_without_call="ends"), task_dir)
    assert t.end_reason == "format_error" and t.num_format_errors == 2
    assert [turn.role for turn in t.turns] == ["user", "assistant", "user", "assistant"]
    assert t.turns[-1].text == "It is red, I think." and t.turns[-1].error.startswith("no_action")
    [default] = run_rollouts([make_task()], ScriptedEngine([[bad, "It is red, I think.", ANSWER_B]]),
                             params(format_error_retries=6), task_dir)
    assert default.end_reason == "answered"  # the default answers the prose with an error turn too
