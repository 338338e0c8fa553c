"""Recipe prompts: Jinja templates over the question turn (`protocol.prompt_template`), a recipe's own system
prompt, and the `boxed` protocol of EasyR1's math answers."""

from __future__ import annotations

import pickle

import pytest
from pydantic import ValidationError

from loupe.config import ProtocolParams
from loupe.data.tasks import TaskRecord
from loupe.protocol import make_protocol
from loupe.rewards import RewardConfig, format_reward, score

COUNT = TaskRecord(doc_id="c1", images=["x.png"], problem="How many items are there?", solution="3")
CHOICE = TaskRecord(doc_id="c2", images=["x.png"], problem="Which is larger?", solution="B", options=["2", "5"])
TEXT = TaskRecord(doc_id="m1", problem="What is 3 * 4?", solution="12")


def test_r1v_template_renders_r1vs_question():
    protocol = make_protocol(ProtocolParams(name="single_turn", prompt_template="params/templates/r1v.jinja"))
    assert protocol.question_text(COUNT) == ("<image>\nHow many items are there?  Output the thinking process in "
                                             "<think> </think> and final answer (number) in <answer> </answer> tags.")
    assert protocol.question_text(TEXT).startswith("What is 3 * 4?  Output")


def test_template_variables_and_the_options(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ content }}\n[{{ task.doc_id }}: {{ options | length }} options]")
    protocol = make_protocol(ProtocolParams(name="single_turn", prompt_template=str(path)))
    text = protocol.question_text(CHOICE)
    assert text.startswith("<image>\nWhich is larger?\nOptions:\n(A) 2\n(B) 5") and text.endswith("[c2: 2 options]")


def test_templates_travel_with_the_params_not_the_file(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ content }} Be brief.")
    params = ProtocolParams(name="single_turn", prompt_template=str(path))
    path.unlink()  # an actor on another node has no such file
    copy = pickle.loads(pickle.dumps(params))
    assert make_protocol(copy).question_text(TEXT) == "What is 3 * 4? Be brief."


def test_bad_templates_are_named(tmp_path):
    with pytest.raises(ValidationError, match="prompt_template: cannot read"):
        ProtocolParams(prompt_template=str(tmp_path / "missing.jinja"))
    broken = tmp_path / "broken.jinja"
    broken.write_text("line one\n{{ content ")
    with pytest.raises(ValidationError, match=r"broken.jinja:2"):
        ProtocolParams(prompt_template=str(broken))
    dropping = tmp_path / "drop.jinja"
    dropping.write_text("{{ problem }}")  # loses the image placeholder
    protocol = make_protocol(ProtocolParams(prompt_template=str(dropping)))
    with pytest.raises(ValueError, match="c1.*0 <image> placeholders for 1 images"):
        protocol.question_text(COUNT)
    unknown = tmp_path / "unknown.jinja"
    unknown.write_text("{{ question }}")
    with pytest.raises(Exception, match="question"):
        make_protocol(ProtocolParams(prompt_template=str(unknown))).question_text(COUNT)


def test_system_prompt_override():
    protocol = make_protocol(ProtocolParams(name="single_turn", system_prompt="Solve the question."))
    assert protocol.system_prompt() == "Solve the question."
    assert make_protocol(ProtocolParams(name="single_turn")).system_prompt().startswith("Think about the question")


def test_boxed_protocol_reads_the_last_box():
    protocol = make_protocol(ProtocolParams(name="boxed", prompt_template="params/templates/easyr1_math.jinja"))
    assert "MUST BE put in \\boxed{}" in protocol.question_text(COUNT)
    action = protocol.parse("<think>first \\boxed{2}, no</think> so \\boxed{\\frac{1}{2}} then", 0)
    assert action.answer == "\\frac{1}{2}" and action.error is None
    assert protocol.parse("<think>x</think> the answer is 3", 0).error is not None
    assert protocol.parse("<think>x</think> \\boxed{ }", 0).error is not None
    written = protocol.render_answer("3 * 4 = 12", "12")
    assert protocol.parse(written, 0).answer == "12"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("<think>a</think> so \\boxed{12}.", 1.0), ("< think >a</ think > \\boxed{12}", 1.0),
     ("\\boxed{12}", 0.0), ("<think>a</think> 12", 0.0)],
)
def test_easyr1_format(text, expected):
    assert format_reward("answered", True, 0, "easyr1", text, "12") == expected


def test_easyr1_reward_is_0_9_accuracy_plus_0_1_format():
    cfg = RewardConfig(free_form_match="math", format_rule="easyr1", accuracy_weight=0.9, format_weight=0.1)
    right = score(TEXT, "12", "answered", 0, 0, True, cfg, final_text="<think>3*4</think> \\boxed{12}")
    assert right.total == pytest.approx(1.0)
    assert score(TEXT, "13", "answered", 0, 0, True, cfg, final_text="<think>x</think> \\boxed{13}").total == \
        pytest.approx(0.1)
