"""The oracle teacher: plans hold the target where they should, the loop carries them out, answers are right."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_synth_support import synth_tasks_dir, train_tasks  # noqa: F401  (fixture)

from loupe.config import ProtocolParams
from loupe.protocol import get_protocol
from loupe.rewards import RewardConfig, score_trajectory
from loupe.rollout import run_rollouts
from stages.synth.oracle import OracleEngine, OracleError, draw_plan
from stages.synth.params import OracleParams

PROTOCOL = ProtocolParams()


def contains(outer, inner, slack=1e-9) -> bool:
    return (outer[0] <= inner[0] + slack and outer[1] <= inner[1] + slack
            and outer[2] >= inner[2] - slack and outer[3] >= inner[3] - slack)


def overlaps(a, b) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


@st.composite
def targets(draw):
    w = draw(st.floats(0.005, 0.3))
    h = draw(st.floats(0.005, 0.3))
    x0 = draw(st.floats(0.0, 1.0 - w))
    y0 = draw(st.floats(0.0, 1.0 - h))
    return (x0, y0, x0 + w, y0 + h)


@settings(max_examples=300, deadline=None)
@given(target=targets(), seed=st.integers(0, 10_000), max_turns=st.integers(2, 8))
def test_every_plan_ends_on_a_look_that_holds_the_target(target, seed, max_turns):
    plan = draw_plan(target, OracleParams(), max_turns, random.Random(seed))
    assert plan.pattern in ("direct", "wide_then_close", "wrong_then_right", "observation_zoom")
    assert 1 <= len(plan.looks) <= max_turns - 1
    assert plan.looks[-1].role == "close" and contains(plan.looks[-1].region, target)
    for i, look in enumerate(plan.looks):
        assert all(0.0 <= v <= 1.0 for v in look.box) and look.box[0] < look.box[2] and look.box[1] < look.box[3]
        if look.role == "wrong":
            assert not overlaps(look.region, target) and look.source == 0
        else:
            assert contains(look.region, target)
        if look.source:  # a zoom into an earlier observation: the one just made, and inside it
            assert look.source == i and contains(plan.looks[i - 1].region, look.region, slack=1e-6)
    if plan.pattern == "observation_zoom":
        assert all(look.source == i for i, look in enumerate(plan.looks) if i > 0)
    if plan.pattern == "wrong_then_right":
        assert plan.looks[0].role == "wrong"


def test_pattern_mix_and_turn_counts_follow_the_params():
    params = OracleParams(patterns={"direct": 0, "wide_then_close": 0, "wrong_then_right": 1, "observation_zoom": 0},
                          turns={2: 5, 4: 1})
    plans = [draw_plan((0.45, 0.45, 0.5, 0.5), params, 6, random.Random(s)) for s in range(50)]
    assert {p.pattern for p in plans} == {"wrong_then_right"}
    assert {len(p.looks) + 1 for p in plans} == {4}  # 2 turns is not a wrong-then-right search
    mixed = OracleParams()
    counts = Counter(len(draw_plan((0.3, 0.6, 0.32, 0.62), mixed, 6, random.Random(s)).looks) + 1 for s in range(400))
    assert set(counts) == {2, 3, 4, 5, 6} and counts[4] > counts[6]
    capped = Counter(len(draw_plan((0.3, 0.6, 0.32, 0.62), mixed, 3, random.Random(s)).looks) + 1 for s in range(100))
    assert set(capped) == {2, 3}


def _oracle_run(tasks, folder, samples, max_new_tokens=96, seed=0, params=None):
    engine = OracleEngine(params or OracleParams(), get_protocol("mini_o3"), seed=seed, max_turns=6)
    engine.prepare(tasks, samples)
    return engine, run_rollouts(tasks, engine, PROTOCOL, folder, samples_per_task=samples,
                                max_new_tokens=max_new_tokens)


@pytest.fixture()
def tasks(synth_tasks_dir):  # noqa: F811
    return train_tasks(synth_tasks_dir)


def test_oracle_through_the_loop_answers_right_with_real_crops_of_the_target(tasks, synth_tasks_dir):  # noqa: F811
    assert {t.is_choice for t in tasks} == {True, False}  # letters and free-form words both covered
    engine, trajectories = _oracle_run(tasks, synth_tasks_dir, samples=6)
    assert len(trajectories) == 36
    for trajectory in trajectories:
        parts = score_trajectory(trajectory, RewardConfig())
        assert trajectory.end_reason == "answered" and parts.accuracy == 1.0, trajectory.traj_id
        assert trajectory.num_format_errors == 0 and trajectory.num_tool_calls == trajectory.num_turns - 1
        task = trajectory.task
        expected = task["solution"]
        assert trajectory.answer == expected  # a letter for choice questions, the word itself otherwise
        # The last crop, mapped back through its chain of sources onto the original, holds the target.
        regions, sizes = {}, {}
        for turn in trajectory.turns:
            if turn.crop is None:
                continue
            x0, y0, x1, y1 = turn.crop["box_px"]
            if turn.crop["source"] == "original_image":
                region = (x0, y0, x1, y1)
            else:  # pixels of an observation image: scale them back to the region it shows
                (sx0, sy0, sx1, sy1), (w, h) = regions[turn.crop["source"]], sizes[turn.crop["source"]]
                kx, ky = (sx1 - sx0) / w, (sy1 - sy0) / h
                region = (sx0 + x0 * kx, sy0 + y0 * ky, sx0 + x1 * kx, sy0 + y1 * ky)
            name = f"observation_{turn.crop['observation']}"
            regions[name], sizes[name] = region, turn.crop["size"]
        last = regions[f"observation_{len(regions)}"]
        width, height = trajectory.load_image(0).size
        bx0, by0, bx1, by1 = task["bbox"]
        assert contains(last, (bx0 * width, by0 * height, bx1 * width, by1 * height), slack=2.0), trajectory.traj_id
    assert set(engine.patterns.values()) >= {"wide_then_close", "wrong_then_right", "observation_zoom"}


def test_reasoning_is_varied_deterministic_and_within_the_token_budget(tasks, synth_tasks_dir):  # noqa: F811
    _, first = _oracle_run(tasks, synth_tasks_dir, samples=6)
    _, again = _oracle_run(tasks, synth_tasks_dir, samples=6)
    texts = [turn.text for t in first for turn in t.turns if turn.role == "assistant"]
    assert texts == [turn.text for t in again for turn in t.turns if turn.role == "assistant"]
    thinks = [text.split("</think>")[0] for text in texts]
    assert len(set(thinks)) > 0.8 * len(thinks)  # hardly any sentence repeats word for word
    openers = Counter(t.turns[1].text.split(".")[0] for t in first)
    assert len(openers) >= 5
    _, other_seed = _oracle_run(tasks, synth_tasks_dir, samples=6, seed=1)
    assert [t.turns[1].text for t in other_seed] != [t.turns[1].text for t in first]
    _, tight = _oracle_run(tasks, synth_tasks_dir, samples=3, max_new_tokens=75)  # shorter wordings are chosen to fit
    assert all(turn.num_tokens <= 75 for t in tight for turn in t.turns if turn.role == "assistant")
    assert all(t.end_reason == "answered" for t in tight)
    _, impossible = _oracle_run(tasks, synth_tasks_dir, samples=1, max_new_tokens=10)  # no wording fits: cut, as a model is
    assert {t.end_reason for t in impossible} == {"length"}


def test_glances_answer_at_once_and_are_right_about_as_often_as_chance(tasks, synth_tasks_dir):  # noqa: F811
    params = OracleParams(patterns={"glance": 1.0})
    engine, trajectories = _oracle_run(tasks, synth_tasks_dir, samples=40, params=params)
    assert set(engine.patterns.values()) == {"glance"}
    free_answers = {t.solution for t in tasks if not t.is_choice}
    right = []
    for trajectory in trajectories:
        assert trajectory.end_reason == "answered" and trajectory.num_turns == 1 and trajectory.num_tool_calls == 0
        task = next(t for t in tasks if t.doc_id == trajectory.task["doc_id"])
        # a guess among what answers look like: option letters, or the free-form answers of the prepared tasks
        allowed = set("ABCDEFGHIJ"[: len(task.options)]) if task.is_choice else free_answers
        assert trajectory.answer in allowed
        right.append(score_trajectory(trajectory, RewardConfig()).accuracy)
    guessing = sum(1 / len(t.options) if t.is_choice else 1 / len(free_answers) for t in tasks) / len(tasks)
    assert abs(sum(right) / len(right) - guessing) < 0.12  # right by luck, not by knowing


def test_plain_wording_keeps_one_sentence_per_slot(tasks, synth_tasks_dir):  # noqa: F811
    params = OracleParams(patterns={"direct": 1.0}, plain_wording=True)
    _, trajectories = _oracle_run(tasks, synth_tasks_dir, samples=4, params=params)
    firsts = {t.turns[1].text.split("</think>")[0] for t in trajectories}
    # the only words that vary name the area zoomed on: one first turn per distinct area
    assert all(text.startswith("<think>It should be in the ") for text in firsts)
    for t in trajectories:
        think = t.turns[-1].text.split("</think>")[0]
        options = t.task.get("options")
        said = f"{options[ord(t.answer) - 65]}: option {t.answer}" if options else t.answer
        assert think == f"<think>It is {said}."


def test_a_task_without_a_target_box_is_refused_by_name(tasks):
    engine = OracleEngine(OracleParams(), get_protocol("mini_o3"), seed=0, max_turns=6)
    bare = tasks[0].model_copy(update={"bbox": None})
    with pytest.raises(OracleError, match=f"{bare.doc_id}: field 'bbox'"):
        engine.prepare([bare], 1)
    with pytest.raises(OracleError, match="not prepared"):
        engine.begin("system", "a question nobody announced", [])


def test_with_deepeyes_boxes_the_oracle_calls_in_pixels_of_the_original(tasks, synth_tasks_dir):  # noqa: F811
    protocol = get_protocol("deepeyes")
    engine = OracleEngine(OracleParams(), protocol, seed=0, max_turns=6)
    engine.prepare(tasks, 2, synth_tasks_dir)
    trajectories = run_rollouts(tasks, engine, ProtocolParams(name="deepeyes"), synth_tasks_dir, samples_per_task=2,
                                max_new_tokens=96)
    zoomed = 0
    for trajectory in trajectories:
        assert trajectory.end_reason == "answered" and trajectory.num_format_errors == 0, trajectory.traj_id
        assert score_trajectory(trajectory, RewardConfig()).accuracy == 1.0
        width, height = trajectory.load_image(0).size
        bx0, by0, bx1, by1 = trajectory.task["bbox"]
        for turn in trajectory.turns:
            if turn.crop is not None:  # the last crop, in pixels of the original, holds the target
                zoomed += 1
                region = turn.crop["region_px"]
        if trajectory.num_tool_calls:
            assert contains(region, (bx0 * width, by0 * height, bx1 * width, by1 * height), slack=2.0)
    assert zoomed >= len(trajectories) // 2
    with pytest.raises(OracleError, match="image_root"):
        bare = OracleEngine(OracleParams(patterns={"direct": 1.0}), protocol, seed=0, max_turns=6)
        bare.prepare(tasks[:1], 1)
        bare.begin("s", protocol.question_text(tasks[0]), [])
