"""Rejection: each check turns away exactly the trajectories it should, and names why."""

from __future__ import annotations

import copy

import pytest
from test_synth_support import synth_tasks_dir, train_tasks  # noqa: F401  (fixture)

from loupe.config import ProtocolParams
from loupe.protocol import get_protocol
from loupe.rewards import RewardConfig, score_trajectory
from loupe.rollout import run_rollouts
from stages.synth.oracle import OracleEngine
from stages.synth.params import OracleParams
from stages.synth.rejection import RejectionRules, protocol_violation, rejection_reason

PROTOCOL = ProtocolParams()
MINI_O3 = get_protocol("mini_o3")
RULES = RejectionRules.from_params(PROTOCOL, max_turns=6, keep_format_errors=False, require_think=True,
                                   min_tool_calls=1)


@pytest.fixture(scope="module")
def clean(synth_tasks_dir):  # noqa: F811
    """A scored oracle trajectory with three or more turns, which every check keeps."""
    tasks = train_tasks(synth_tasks_dir)[:2]
    engine = OracleEngine(OracleParams(turns={4: 1}), MINI_O3, seed=0, max_turns=6)
    engine.prepare(tasks, 2)
    trajectories = run_rollouts(tasks, engine, PROTOCOL, synth_tasks_dir, samples_per_task=2)
    for trajectory in trajectories:
        score_trajectory(trajectory, RewardConfig())
    return trajectories


def variant(trajectory, **changes):
    out = copy.deepcopy(trajectory)
    for key, value in changes.items():
        setattr(out, key, value)
    return out


def test_a_clean_oracle_trajectory_is_kept(clean):
    assert all(rejection_reason(t, MINI_O3, RULES) is None for t in clean)
    assert all(protocol_violation(t, MINI_O3, True) is None for t in clean)


def test_each_check_names_its_reason(clean):
    t = clean[0]
    assert rejection_reason(variant(t, end_reason="over_turn"), MINI_O3, RULES) == "not_answered:over_turn"
    assert rejection_reason(variant(t, end_reason="length"), MINI_O3, RULES) == "not_answered:length"
    wrong = variant(t, rewards={**t.rewards, "accuracy": 0.0})
    assert rejection_reason(wrong, MINI_O3, RULES) == "wrong_answer"
    judge_failed = variant(t, rewards={**t.rewards, "accuracy": None, "valid": False})
    assert rejection_reason(judge_failed, MINI_O3, RULES) == "invalid_reward"
    assert rejection_reason(variant(t, num_format_errors=1), MINI_O3, RULES) == "format_errors"
    assert rejection_reason(variant(t, num_tool_calls=0), MINI_O3, RULES) == "too_few_tool_calls"
    assert rejection_reason(t, MINI_O3, RejectionRules(**{**RULES.__dict__, "max_turns": 3})) == "turn_limit"
    assert rejection_reason(t, MINI_O3, RejectionRules(**{**RULES.__dict__, "max_images": 2})) == "image_limit"
    assert rejection_reason(t, MINI_O3, RejectionRules(**{**RULES.__dict__, "max_pixels": 1000})) == "pixel_budget"
    assert rejection_reason(variant(t, meta={"reject": "bad_image"}), MINI_O3, RULES) == "bad_image"


def test_protocol_check_rereads_every_turn(clean):
    t = clean[0]
    no_think = copy.deepcopy(t)
    no_think.turns[1].text = no_think.turns[1].text.split("</think>")[1].strip()
    assert "think" in protocol_violation(no_think, MINI_O3, True)
    assert protocol_violation(no_think, MINI_O3, False) is None  # only when reasoning is required
    assert rejection_reason(no_think, MINI_O3, RULES) == "protocol"
    early_answer = copy.deepcopy(t)
    early_answer.turns[1].text = "<think>sure</think>\n<answer>A</answer>"
    assert "does not call the tool" in protocol_violation(early_answer, MINI_O3, True)
    missing_image = copy.deepcopy(t)
    missing_image.turns[2].images = []
    assert "placeholders" in protocol_violation(missing_image, MINI_O3, True)
    bad_source = copy.deepcopy(t)
    bad_source.turns[1].text = bad_source.turns[1].text.replace('"original_image"', '"observation_4"')
    assert "unknown_source" in protocol_violation(bad_source, MINI_O3, True)


def test_recovered_format_errors_are_kept_only_when_asked(clean):
    t = copy.deepcopy(clean[0])
    t.num_format_errors = 1
    lenient = RejectionRules(**{**RULES.__dict__, "keep_format_errors": True})
    assert rejection_reason(t, MINI_O3, RULES) == "format_errors"
    assert rejection_reason(t, MINI_O3, lenient) is None
