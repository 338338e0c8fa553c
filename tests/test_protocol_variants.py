"""The dialogue protocol's other variants (Loupe, DeepEyes, single-turn, Pixel-Reasoner) and the registry,
Mini-o3's own strings, the prompts, and the converters to chat messages and ShareGPT."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from loupe.data.tasks import TaskRecord
from loupe.protocol import (
    IMAGE_PLACEHOLDER,
    MINI_O3_ERROR_PROMPT,
    MINI_O3_IMAGE_MARKUP,
    MINI_O3_OBSERVATION_TEMPLATE,
    MINI_O3_SYSTEM_PROMPT,
    MINI_O3_TOOL_ERROR_TEMPLATE,
    ORIGINAL_IMAGE,
    PROTOCOLS,
    DeepEyesProtocol,
    FormatErrorKind,
    LoupeProtocol,
    MiniO3Protocol,
    SingleTurnProtocol,
    ToolCall,
    get_protocol,
    to_chat_messages,
    to_sharegpt,
)
from loupe.tools import ImageSession, PixelBudget, ToolError, run_tool
from loupe.trajectory import Trajectory, Turn, write_trajectories
from tests.protocol_cases import (
    DEEPEYES,
    LOUPE,
    MINI,
    SINGLE,
    K,
    assert_well_typed,
    call_payload,
    grounding,
)

# --- the other variants and the registry ------------------------------------------------------------------


def test_get_protocol_returns_each_registered_variant():
    assert isinstance(get_protocol("mini_o3"), MiniO3Protocol)
    assert isinstance(get_protocol("loupe"), LoupeProtocol)
    assert isinstance(get_protocol("deepeyes"), DeepEyesProtocol)
    assert isinstance(get_protocol("single_turn"), SingleTurnProtocol)
    assert set(PROTOCOLS) >= {"mini_o3", "loupe", "deepeyes", "single_turn"}
    assert MiniO3Protocol.stop == ("</grounding>",) and DeepEyesProtocol.stop == ("</tool_call>",)
    assert SingleTurnProtocol.multi_turn is False and MiniO3Protocol.multi_turn is True


def test_get_protocol_of_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError) as info:
        get_protocol("mini_o4")
    message = str(info.value)
    assert "mini_o4" in message
    for name in ("mini_o3", "deepeyes", "single_turn"):
        assert name in message


def test_a_new_variant_plugs_in_through_the_registry(monkeypatch):
    class ZoomTagProtocol(MiniO3Protocol):
        name = "zoom_tag"
        stop = ("</zoom>",)
        call_open, call_close = "<zoom>", "</zoom>"

    monkeypatch.setitem(PROTOCOLS, ZoomTagProtocol.name, ZoomTagProtocol)
    protocol = get_protocol("zoom_tag")
    assert isinstance(protocol, ZoomTagProtocol)
    action = protocol.parse('<think>t</think><zoom>{"bbox_2d": [0.1, 0.1, 0.2, 0.2], "source": "original_image"}</zoom>')
    assert action.kind == "call" and action.call.arguments["bbox_2d"] == [0.1, 0.1, 0.2, 0.2]
    call = ToolCall("crop", {"bbox_2d": [0.3, 0.3, 0.6, 0.7], "source": ORIGINAL_IMAGE, "frame": "relative"})
    assert protocol.parse(protocol.render_call("t", call)).call == call
    assert protocol.parse(grounding(call_payload([0.1, 0.1, 0.2, 0.2]))).error.kind == K.NO_ACTION


def test_deepeyes_parses_an_absolute_pixel_box_with_its_tool_name():
    text = ('<think>tiny text</think>\n<tool_call>{"name": "image_zoom_in_tool", '
            '"arguments": {"bbox_2d": [10, 20, 3000, 4000.5]}}</tool_call>')
    action = DEEPEYES.parse(text)
    assert action.kind == "call"
    assert action.call == ToolCall("crop", {"bbox_2d": [10.0, 20.0, 3000.0, 4000.5], "source": ORIGINAL_IMAGE,
                                            "frame": "absolute"})
    assert action.think == "tiny text"


@pytest.mark.parametrize(
    "payload, kind",
    [
        ('{"name": "image_crop_tool", "arguments": {"bbox_2d": [1, 2, 3, 4]}}', K.UNKNOWN_TOOL),
        ('{"name": ["image_zoom_in_tool"], "arguments": {"bbox_2d": [1, 2, 3, 4]}}', K.UNKNOWN_TOOL),
        ('{"arguments": {"bbox_2d": [1, 2, 3, 4]}}', K.MISSING_KEY),
        ('{"name": "image_zoom_in_tool"}', K.MISSING_KEY),
        ('{"name": "image_zoom_in_tool", "arguments": [1, 2, 3, 4]}', K.WRONG_TYPE),
        ('{"name": "image_zoom_in_tool", "arguments": {}}', K.MISSING_KEY),
        ('{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [-1, 2, 3, 4]}}', K.OUT_OF_RANGE),
        ('{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [5, 2, 3, 4]}}', K.EMPTY_BOX),
        ('{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [1, 2, 3, NaN]}}', K.NOT_FINITE),
        ('{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [1, 2, 3]}}', K.WRONG_TYPE),
        ("not json", K.BAD_JSON),
    ],
)
def test_deepeyes_malformed_calls_give_typed_errors(payload, kind):
    action = DEEPEYES.parse(f"<think>t</think><tool_call>{payload}</tool_call>")
    assert_well_typed(action)
    assert action.error is not None and action.error.kind == kind, action


def test_deepeyes_unknown_tool_detail_names_both_tools():
    action = DEEPEYES.parse('<tool_call>{"name": "rotate", "arguments": {"bbox_2d": [1, 2, 3, 4]}}</tool_call>')
    assert "'rotate'" in action.error.detail and "image_zoom_in_tool" in action.error.detail


def test_deepeyes_does_not_read_the_mini_o3_grammar():
    assert DEEPEYES.parse(grounding(call_payload([0.1, 0.2, 0.3, 0.4]))).error.kind == K.NO_ACTION


@pytest.mark.parametrize(
    "text",
    [
        grounding(call_payload([0.1, 0.2, 0.3, 0.4])),
        '<think>t</think><tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [1, 2, 3, 4]}}</tool_call>',
        "<think>t</think><grounding>unclosed",
    ],
)
def test_single_turn_refuses_tool_calls(text):
    action = SINGLE.parse(text)
    assert action.kind == "error"
    assert action.error.kind == K.TOOLS_UNAVAILABLE
    assert "no tools" in action.error.detail


def test_single_turn_parses_an_answer_and_cannot_render_a_call():
    action = SINGLE.parse("<think>blue sky</think><answer>C</answer>")
    assert action.kind == "answer" and action.answer == "C" and action.think == "blue sky"
    with pytest.raises(NotImplementedError):
        SINGLE.render_call("t", ToolCall("crop", {"bbox_2d": [0, 0, 1, 1], "source": ORIGINAL_IMAGE}))


@pytest.mark.parametrize("name", sorted(set(PROTOCOLS) - {"pixel_reasoner"}))
def test_every_variant_has_a_system_prompt_naming_its_answer_tags(name):
    # Pixel-Reasoner's system turn names its tools only; its question turn asks for \boxed{} (tested below).
    prompt = get_protocol(name).system_prompt()
    answer_tag = "\\boxed{}" if name == "boxed" else "<answer>"
    assert answer_tag in prompt and "<think>" in prompt


# --- Mini-o3's own strings ----------------------------------------------------------------------------------
# Copied from github.com/Mini-o3/Mini-o3 at commit 8654dbf: verl/trainer/constants.py (TOOL_CROP_SYSTEM_PROMPT,
# TOOL_CALL_CROP_MULTI_TRUN_PROMPT, ERROR_INFO_MULTI_TURN_PROMPT) and the error line of
# AsyncvLLMEngine.process_tool_call in verl/workers/rollout/vllm_rollout/vllm_async_engine.py. Written out here a
# second time, apart from loupe/protocol.py, so an edit to the constants fails this test.

THEIR_SYSTEM_PROMPT = """You are a helpful assistant. Answer the user's question based on the image provided. Output your thinking process within the <think> and </think> tags. Whenever you find anything unclear, you can zoom in a specific region in the given image to see more clearly by outputing <grounding>{\"bbox_2d\": [x0, y0, x1, y1], \"source\": \"original_image\"}</grounding>, where (x0, y0) and (x1, y1) are the top-left and bottom-right coordinates of the region that you want to zoom in, respectively (suppose the width and height of the image are 1.0), and 'source' refers to the image that you zoom in and could be either 'original_image' or 'observation_i'. Once the final answer is confirmed, put it within <answer> and </answer>."""
THEIR_OBSERVATION = "After the above Action {action_turn}, here is the the zoom-in image (Observation {observation_turn}):\n<|vision_start|><|image_pad|><|vision_end|>.\nContinue your reasoning process inside <think> and </think>. If needed, you can continue to zoom in on the original image or any of the observations, by outputting <grounding> and </grounding> as before. If the final answer is confirmed, put your final answer inside <answer> and </answer>."
THEIR_ERROR_PROMPT = "Please analyze the error information obtained from the function tool and adjust your response. Countinue your reasoning process inside <think> and </think>."
THEIR_TOOL_ERROR = "ERROR occurs during grounding. Error Information: {error_info}.\n"


def test_mini_o3_constants_are_mini_o3s_strings():
    assert MINI_O3_SYSTEM_PROMPT == THEIR_SYSTEM_PROMPT
    assert MINI_O3_OBSERVATION_TEMPLATE == THEIR_OBSERVATION
    assert MINI_O3_ERROR_PROMPT == THEIR_ERROR_PROMPT
    assert MINI_O3_TOOL_ERROR_TEMPLATE == THEIR_TOOL_ERROR
    assert MINI_O3_IMAGE_MARKUP == "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.mark.parametrize("index", [1, 2, 5, 12])
def test_mini_o3_protocol_speaks_with_the_constants_and_numbers_turns_as_mini_o3(index):
    assert MINI.system_prompt() == MINI_O3_SYSTEM_PROMPT
    # Mini-o3 fills the template with action_turn=current_iteration, observation_turn=current_iteration + 1,
    # counting assistant turns from 0: crop 1 answers Action 0. Loupe's turn holds <image> where the chat
    # template writes the vision markup.
    expected = THEIR_OBSERVATION.format(action_turn=index - 1, observation_turn=index)
    text = MINI.observation_text(index)
    assert text.replace(IMAGE_PLACEHOLDER, MINI_O3_IMAGE_MARKUP) == expected
    assert text.count(IMAGE_PLACEHOLDER) == 1 and MINI_O3_IMAGE_MARKUP not in text
    assert MINI.error_text("bad box") == THEIR_TOOL_ERROR.format(error_info="bad box") + THEIR_ERROR_PROMPT


def test_loupe_protocol_keeps_loupes_wording_with_the_same_grammar():
    assert LOUPE.system_prompt() != MINI.system_prompt() and "observation_N" in LOUPE.system_prompt()
    assert LOUPE.observation_text(3) != MINI.observation_text(3)
    assert "Observation 3" in LOUPE.observation_text(3) and LOUPE.observation_text(3).count(IMAGE_PLACEHOLDER) == 1
    assert LOUPE.error_text("bad box").startswith("Your last turn could not be carried out: bad box.")
    assert LOUPE.stop == MINI.stop
    call = ToolCall("crop", {"bbox_2d": [0.25, 0.5, 0.75, 1.0], "source": "observation_2", "frame": "relative"})
    assert LOUPE.render_call("t", call) == MINI.render_call("t", call)
    assert LOUPE.parse(MINI.render_call("t", call), num_observations=2).call == call


# --- prompts ------------------------------------------------------------------------------------------------


def test_question_text_renders_one_image_per_task_image_and_lettered_options():
    task = TaskRecord(doc_id="t1", images=["a.png", "b.png"], problem=" What colour is the car? ", solution="B",
                      options=["red", "blue", "green"])
    text = MINI.question_text(task)
    assert text.count(IMAGE_PLACEHOLDER) == 2
    lines = text.splitlines()
    assert lines[0] == IMAGE_PLACEHOLDER * 2
    assert "What colour is the car?" in lines
    assert lines.index("(A) red") < lines.index("(B) blue") < lines.index("(C) green")
    assert "(D)" not in text


def test_question_text_of_a_free_form_question_has_no_options():
    task = TaskRecord(doc_id="t2", images=["a.png"], problem="What does the sign say?", solution="STOP")
    text = DEEPEYES.question_text(task)
    assert text.count(IMAGE_PLACEHOLDER) == 1
    assert "(A)" not in text and "Options" not in text
    assert text.endswith("What does the sign say?")


def test_a_problem_already_holding_its_placeholder_gets_no_second_one():
    # Mini-o3's records (VisualProbe val.json, its demo format) start their problem with "<image>\n", and
    # Mini-o3 sends the problem as the user turn as it is.
    task = TaskRecord(doc_id="vp-1", images=["a.jpg"], problem="<image>\nWhat is written on the red sign?",
                      solution="EXIT")
    assert MINI.question_text(task) == "<image>\nWhat is written on the red sign?"
    assert DEEPEYES.question_text(task).count(IMAGE_PLACEHOLDER) == 1


def test_a_problem_with_one_placeholder_per_image_keeps_them_where_they_are_and_gets_options():
    task = TaskRecord(doc_id="t3", images=["a.png", "b.png"], problem="Compare <image> with <image>.", solution="A",
                      options=["same", "different"])
    text = MINI.question_text(task)
    assert text.count(IMAGE_PLACEHOLDER) == 2
    assert text.splitlines()[:2] == ["Compare <image> with <image>.", "Options:"]
    assert "(A) same" in text and "(B) different" in text


@pytest.mark.parametrize(
    "problem, images", [("<image>\nWhich?", ["a.png", "b.png"]), ("<image><image> Which?", ["a.png"])]
)
def test_a_problem_whose_placeholders_do_not_match_its_images_is_a_named_error(problem, images):
    # Built without validation: the task reader may refuse such a record first; question_text must too.
    task = TaskRecord.model_construct(doc_id="bad-7", images=images, problem=problem, solution="x", options=None)
    with pytest.raises(ValueError) as info:
        MINI.question_text(task)
    message = str(info.value)
    assert "bad-7" in message and "'problem'" in message
    assert f"holds {problem.count(IMAGE_PLACEHOLDER)}" in message and f"has {len(images)} images" in message


@pytest.mark.parametrize("index", [1, 2, 7])
def test_observation_text_holds_exactly_one_image(index):
    text = MINI.observation_text(index)
    assert text.count(IMAGE_PLACEHOLDER) == 1
    assert f"Observation {index}" in text and f"Action {index - 1}" in text
    assert DEEPEYES.observation_text(index).count(IMAGE_PLACEHOLDER) == 1


# --- converters on a hand-built trajectory ----------------------------------------------------------------


@pytest.fixture
def finished_trajectory(tmp_path) -> Trajectory:
    """Question on one file image, a zoom whose crop is still in memory, then an answer."""
    original = tmp_path / "task.png"
    Image.new("RGB", (64, 48), (0, 0, 255)).save(original)
    task = TaskRecord(doc_id="doc-1", images=[str(original)], problem="What colour?", solution="A",
                      options=["blue", "red"])
    trajectory = Trajectory(traj_id="doc-1#0", task=task.model_dump(), protocol="mini_o3", system=MINI.system_prompt())
    first = trajectory.add_image(original)
    trajectory.turns.append(Turn("user", MINI.question_text(task), images=[first]))
    call = ToolCall("crop", {"bbox_2d": [0.0, 0.0, 0.5, 0.5], "source": ORIGINAL_IMAGE, "frame": "relative"})
    trajectory.turns.append(Turn("assistant", MINI.render_call("zoom", call), action="call",
                                 call={"tool": call.tool, "arguments": call.arguments}))
    crop_index = trajectory.add_image(Image.new("RGB", (56, 56), (0, 0, 255)))
    trajectory.turns.append(Turn("user", MINI.observation_text(1), images=[crop_index]))
    trajectory.turns.append(Turn("assistant", MINI.render_answer("it is blue", "A"), action="answer"))
    trajectory.end_reason, trajectory.answer = "answered", "A"
    return trajectory


def test_to_chat_messages_maps_roles_and_splits_text_around_images(finished_trajectory):
    messages = to_chat_messages(finished_trajectory)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[0]["content"] == [{"type": "text", "text": finished_trajectory.system}]
    question = messages[1]["content"]
    assert question[0] == {"type": "image", "image": finished_trajectory.images[0]}
    assert question[1]["type"] == "text" and question[1]["text"].startswith("\nWhat colour?")
    observation = messages[3]["content"]
    assert [part["type"] for part in observation] == ["text", "image", "text"]
    assert observation[1]["image"] is finished_trajectory.pending[1]
    before, after = MINI.observation_text(1).split(IMAGE_PLACEHOLDER)
    assert observation[0]["text"] == before and observation[2]["text"] == after
    images = [part for m in messages for part in m["content"] if part["type"] == "image"]
    assert len(images) == len(finished_trajectory.images) == 2
    texts = "".join(part.get("text", "") for m in messages for part in m["content"])
    assert IMAGE_PLACEHOLDER not in texts


def test_to_chat_messages_refuses_a_turn_whose_placeholders_do_not_match_its_images(finished_trajectory):
    finished_trajectory.turns[2].images = []
    with pytest.raises(ValueError, match="placeholder"):
        to_chat_messages(finished_trajectory)


def test_to_sharegpt_refuses_unsaved_crops_until_they_are_written(finished_trajectory, tmp_path):
    with pytest.raises(ValueError, match="unsaved crop"):
        to_sharegpt(finished_trajectory)
    write_trajectories([finished_trajectory], tmp_path / "out" / "traj.jsonl")
    record = to_sharegpt(finished_trajectory)
    assert [c["from"] for c in record["conversations"]] == ["system", "human", "gpt", "human", "gpt"]
    assert record["conversations"][0]["value"] == finished_trajectory.system
    assert [c["value"] for c in record["conversations"][1:]] == [t.text for t in finished_trajectory.turns]
    placeholders = sum(c["value"].count(IMAGE_PLACEHOLDER) for c in record["conversations"])
    assert placeholders == len(record["images"]) == 2
    crop_file = tmp_path / "out" / finished_trajectory.images[1]
    assert record["images"] == [str(tmp_path / "task.png"), str(crop_file)]
    assert crop_file.is_file()


@pytest.mark.parametrize("cut", [0, 3])
def test_to_sharegpt_refuses_a_trajectory_not_ending_on_an_assistant_turn(finished_trajectory, cut):
    finished_trajectory.turns = finished_trajectory.turns[:cut]
    finished_trajectory.pending.clear()
    with pytest.raises(ValueError, match="assistant turn"):
        to_sharegpt(finished_trajectory)


# --- Pixel-Reasoner's own dialogue ----------------------------------------------------------------------------

PR = get_protocol("pixel_reasoner")


def _pr_call(arguments, name="crop_image_normalized", tail=""):
    return "Let me look. <tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>" + tail


def test_pixel_reasoner_system_turn_is_the_nous_tool_block_over_its_two_tools():
    prompt = PR.system_prompt()
    assert prompt.startswith("You are a helpful assistant.\n\n# Tools\n\nYou may call one or more functions")
    tools = prompt.split("<tools>\n")[1].split("\n</tools>")[0].split("\n")
    assert [json.loads(t)["function"]["name"] for t in tools] == ["crop_image_normalized", "select_frames"]
    assert json.loads(tools[0])["function"]["parameters"]["required"] == ["bbox_2d", "target_image"]
    assert prompt.endswith('<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def test_pixel_reasoner_reads_a_call_only_from_a_turn_that_ends_with_it():
    action = PR.parse(_pr_call({"bbox_2d": [0.1, 0.2, 0.5, 0.6], "target_image": 2}), num_observations=1)
    assert action.call == ToolCall("crop", {"bbox_2d": [0.1, 0.2, 0.5, 0.6], "source": "observation_1",
                                            "frame": "relative"})
    assert action.think == "Let me look."
    # A newline after </tool_call> makes the turn final (upstream checks endswith, unstripped): graded as text.
    final = PR.parse(_pr_call({"bbox_2d": [0.1, 0.2, 0.5, 0.6], "target_image": 1}, tail="\n"))
    assert final.call is None and final.answer is not None
    # The last <tool_call> is read.
    two = PR.parse("<tool_call>{}</tool_call> then " + _pr_call({"bbox_2d": [1, 2, 30, 40], "target_image": 1}))
    assert two.call.arguments["frame"] == "absolute" and two.call.arguments["bbox_2d"] == [1, 2, 30, 40]


@pytest.mark.parametrize(("text", "answer"), [("so \\boxed{B}.", "B"), ("the answer is 3", "the answer is 3"),
                                              ("\\boxed{\\frac{1}{2}} or \\boxed{ 7 }", "7")])
def test_pixel_reasoner_answers_with_the_last_box_or_the_text(text, answer):
    assert PR.parse(text).answer == answer


@pytest.mark.parametrize(("arguments", "name", "kind"), [
    ({"bbox_2d": [0.1, 0.1, 0.5, 0.5]}, "crop_image_normalized", FormatErrorKind.MISSING_KEY),
    ({"bbox_2d": [0.1, 0.1, 0.5, 0.5], "target_image": 0}, "crop_image_normalized", FormatErrorKind.UNKNOWN_SOURCE),
    ({"bbox_2d": [0.1, 0.1, 0.5, 0.5], "target_image": 1.5}, "crop_image_normalized", FormatErrorKind.WRONG_TYPE),
    ({"bbox_2d": [0.1, 0.1, 0.5], "target_image": 1}, "crop_image_normalized", FormatErrorKind.WRONG_TYPE),
    ({"bbox_2d": [0.1, 0.1, 0.5, 0.5], "target_image": 1}, "zoom", FormatErrorKind.UNKNOWN_TOOL),
])
def test_pixel_reasoner_refuses_malformed_calls(arguments, name, kind):
    action = PR.parse(_pr_call(arguments, name))
    assert action.error is not None and action.error.kind == kind


def test_pixel_reasoner_passes_a_missing_image_and_select_frames_to_the_tools_which_fail_them():

    session = ImageSession(original=Image.new("RGB", (200, 100)))
    far = PR.parse(_pr_call({"bbox_2d": [0.1, 0.1, 0.5, 0.5], "target_image": 4}), num_observations=1).call
    frames = PR.parse(_pr_call({"target_frames": [1, 2]}, "select_frames")).call
    for call in (far, frames):
        assert isinstance(run_tool(call, session, PixelBudget(3136, 50176)), ToolError)


def test_pixel_reasoner_turns_are_upstreams():
    assert PR.observation_turn(1, (504, 392)) == "\nHere is the cropped image (Image Size: 504x392):" + IMAGE_PLACEHOLDER
    assert PR.error_turn("bad box") == "\nExecution error:\nbad box\n"


def test_pixel_reasoner_renders_calls_it_reads_back():
    call = ToolCall("crop", {"bbox_2d": [0.25, 0.5, 1.0, 1.0], "source": "observation_2", "frame": "relative"})
    back = PR.parse(PR.render_call("zoom", call), num_observations=2).call
    assert back.arguments["source"] == "observation_2" and back.arguments["frame"] == "relative"
    assert back.arguments["bbox_2d"] == [0.25, 0.5, 0.999, 0.999]
    assert PR.parse(PR.render_answer("so", "B")).answer == "B"


def test_out_of_range_boxes_are_refused_or_clamped_as_the_protocol_says():
    from loupe.config import ProtocolParams
    from loupe.protocol import make_protocol

    turn = '<think>x</think>\n<tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [-40, 300, 1180, 640]}}</tool_call>'
    refusing = make_protocol(ProtocolParams(name="deepeyes"))
    clamping = make_protocol(ProtocolParams(name="deepeyes", out_of_range_boxes="clamp"))
    assert refusing.parse(turn).error.kind == FormatErrorKind.OUT_OF_RANGE
    assert clamping.parse(turn).call.arguments["bbox_2d"] == [0.0, 300.0, 1180.0, 640.0]
    relative = make_protocol(ProtocolParams(name="mini_o3", out_of_range_boxes="clamp"))
    call = relative.parse('<grounding>{"bbox_2d": [-0.3, 0.2, 1.4, 0.6], "source": "original_image"}</grounding>').call
    assert call.arguments["bbox_2d"] == [0.0, 0.2, 1.0, 0.6]
    outside = relative.parse('<grounding>{"bbox_2d": [1.2, 0.2, 1.4, 0.6], "source": "original_image"}</grounding>')
    assert outside.error.kind == FormatErrorKind.EMPTY_BOX  # clamped to nothing
