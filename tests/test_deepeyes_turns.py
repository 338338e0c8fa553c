"""DeepEyes' turns as its code reads them (Visual-Agent/DeepEyes@6c5e796): no stop string, the last call read, an
answer beside a call winning (`protocol.turn_reading: deepeyes`), and rows without a tool answered in one turn
(`TaskRecord.tools`, its `env_name` rule), in the rollout loop, the oracle teacher and the engines' stop strings."""

from __future__ import annotations

from pathlib import Path

from PIL import Image
from test_rollout_loop import ScriptedEngine

from loupe.config import ProtocolParams, RolloutParams
from loupe.data.tasks import TaskRecord
from loupe.protocol import make_protocol
from loupe.rollout import make_engine
from loupe.rollout.loop import run_rollouts
from pipelines.workspace import read_recipe

REPO = Path(__file__).resolve().parent.parent
PRESET = read_recipe(REPO, REPO / "params" / "deepeyes.yaml")


def _params(**protocol) -> ProtocolParams:
    return ProtocolParams.model_validate({**PRESET["protocol"], "max_turns": 3, **protocol})


def _call(box: list[int]) -> str:
    return '<tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": %s}}</tool_call>' % box


def _rollout(tmp_path: Path, turns: list[str], tools: bool = True, **protocol):
    Image.new("RGB", (1000, 800), (90, 120, 150)).save(tmp_path / "scene.png")
    task = TaskRecord(doc_id="t", images=["scene.png"], problem="What colour?", solution="red", tools=tools)
    [trajectory] = run_rollouts([task], ScriptedEngine([turns]), _params(**protocol), tmp_path, max_turns=3)
    return trajectory


def test_the_preset_reads_turns_as_deepeyes_and_generates_without_a_stop_string(tiny_model_dir):
    """parallel_env.py:121-126 and ppo_trainer.yaml:128 (`custom_stop: []`): generation runs to EOS."""
    assert PRESET["protocol"]["turn_reading"] == "deepeyes"
    assert make_protocol(_params()).stop_strings() == ()
    assert make_protocol(_params(turn_reading="first_call")).stop_strings() == ("</tool_call>",)
    engine = make_engine(RolloutParams(device="cpu"), _params(), model_path=str(tiny_model_dir))
    assert engine.stop == ()


def test_the_last_call_of_a_turn_is_the_one_run(tmp_path):
    """visual_toolbox_v2.py:43-44: `re.findall(r'<tool_call>(.*?)</tool_call>', ..., re.DOTALL)[-1]`."""
    turn = "<think>first here, no, there</think>" + _call([0, 0, 100, 100]) + " then " + _call([400, 200, 700, 600])
    done = _rollout(tmp_path, [turn, "<think>red</think><answer>red</answer>"])
    assert done.end_reason == "answered"
    [crop] = [t.crop for t in done.turns if t.crop is not None]
    assert crop["box_px"] == [400, 200, 700, 600]
    first = _rollout(tmp_path, [turn, "<answer>red</answer>"], turn_reading="first_call")
    assert [t.crop["box_px"] for t in first.turns if t.crop is not None] == [[0, 0, 100, 100]]


def test_an_answer_beside_a_call_ends_the_episode_and_the_call_is_not_run(tmp_path):
    """visual_toolbox_v2.py:60-62: `answer = extract_answer(...)`, and `if answer:` the episode is done."""
    turn = "<think>it is red</think>" + _call([400, 200, 700, 600]) + "<answer>red</answer>"
    done = _rollout(tmp_path, [turn])
    assert (done.end_reason, done.answer, done.num_tool_calls) == ("answered", "red", 0)
    assert not any(t.crop for t in done.turns)
    empty = _rollout(tmp_path, ["<answer></answer>" + _call([400, 200, 700, 600]), "<answer>red</answer>"])
    assert empty.num_tool_calls == 1  # an empty answer is not an answer upstream either: the call runs
    loupe = _rollout(tmp_path, [turn, "<answer>red</answer>"], turn_reading="first_call")
    assert loupe.num_tool_calls == 1  # Loupe's own reading stops at the call: the answer after it is not read


def test_a_question_without_the_tool_is_answered_in_its_first_turn(tmp_path):
    """parallel_env.py:320-322,480-495: a row with an empty `env_name` gets no tool; its episode is one response."""
    answered = _rollout(tmp_path, ["<think>red</think><answer>red</answer>"], tools=False)
    assert (answered.end_reason, answered.num_turns) == ("answered", 1)
    called = _rollout(tmp_path, ["<think>zoom</think>" + _call([400, 200, 700, 600]), "<answer>red</answer>"],
                      tools=False)
    assert (called.end_reason, called.num_turns, called.num_tool_calls) == ("format_error", 1, 0)
    assert not any(t.crop for t in called.turns) and called.turns[-1].error.startswith("no_tools")
    with_tool = _rollout(tmp_path, ["<think>zoom</think>" + _call([400, 200, 700, 600]), "<answer>red</answer>"])
    assert (with_tool.end_reason, with_tool.num_tool_calls) == ("answered", 1)
    assert TaskRecord.model_validate({"doc_id": "d", "problem": "q", "solution": "a", "tools": False}).tools is False


def test_the_oracle_teacher_answers_a_question_without_the_tool_directly(tmp_path):
    from stages.synth.oracle import OracleEngine
    from stages.synth.params import OracleParams

    Image.new("RGB", (1000, 800), (90, 120, 150)).save(tmp_path / "scene.png")
    params = ProtocolParams(name="mini_o3", max_turns=4)
    tasks = [TaskRecord(doc_id=f"t{i}", images=["scene.png"], problem=f"What colour is thing {i}?", solution="red",
                        bbox=[0.4, 0.25, 0.7, 0.75], tools=i == 0) for i in range(2)]
    teacher = OracleEngine(OracleParams(), make_protocol(params), seed=0, max_turns=4)
    teacher.prepare(tasks, samples_per_task=4, image_root=tmp_path)
    trajectories = run_rollouts(tasks, teacher, params, tmp_path, samples_per_task=4, max_turns=4)
    with_tool = [t for t in trajectories if t.task["doc_id"] == "t0"]
    without = [t for t in trajectories if t.task["doc_id"] == "t1"]
    assert any(t.num_tool_calls for t in with_tool)
    assert all((t.num_turns, t.num_tool_calls, t.end_reason) == (1, 0, "answered") for t in without)
