"""Pixelis' rewards (loupe/rewards/pixelis.py, stages/rl/pixelis.py), worked out by hand from its
`core/modules/reward_shaping.py` @ 08a98fe (the line of each rule is in the functions' docstrings)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from loupe.rewards.pixelis import (
    ANSWER,
    REASONING,
    VISUAL_OPERATION,
    PixelisAction,
    coherence_reward,
    has_repetitions,
    logical_flow,
    pixelis_actions,
    semantic_coherence,
    task_reward,
    tool_pattern,
    tool_penalty,
)
from loupe.rollout.engine import TokenTrace
from loupe.trajectory import Trajectory, Turn
from stages.rl.params import RLParams
from stages.rl.pixelis import PixelisShaper, action_vectors, step_embeddings

R = PixelisAction(REASONING)
A = PixelisAction(ANSWER)


def op(name: str) -> PixelisAction:
    return PixelisAction(VISUAL_OPERATION, name)


def dialogue(calls: list[dict | None], think: bool = True, answer: str = "red", images: bool = True) -> Trajectory:
    """A trajectory whose assistant turns make `calls` (None: a broken turn), then answer."""
    t = Trajectory(traj_id="t#0", task={"doc_id": "t", "problem": "q", "solution": "red"}, protocol="pixelis", system="")
    pictures = [Image.new("RGB", (32, 32), (40 * i % 256, 100, 200 - 30 * i)) for i in range(len(calls) + 1)]
    t.turns.append(Turn("user", "<image>What colour?", images=[0]))
    prefix = "<think>look</think>\n" if think else ""
    for i, call in enumerate(calls):
        if call is None:
            t.turns.append(Turn("assistant", prefix + "???", action="error"))
            t.turns.append(Turn("user", "Error: no action"))
            continue
        t.turns.append(Turn("assistant", prefix + "CALL", action="call", call=call))
        t.turns.append(Turn("user", f"observation_{i + 1}: <image>", images=[i + 1]))
    t.turns.append(Turn("assistant", prefix + f"<answer>{answer}</answer>", action="answer"))
    if images:
        t.trace = TokenTrace(images=pictures)
    t.rewards = {"total": 1.0}
    return t


SEGMENT = {"tool": "segment_at", "arguments": {"point": [0.2, 0.3]}}
PROPERTIES = {"tool": "get_properties", "arguments": {"mask": "mask_1"}}
ZOOM = {"tool": "crop", "arguments": {"bbox_2d": [0.1, 0.1, 0.4, 0.4]}}


def test_a_dialogue_reads_as_pixelis_actions():
    actions = pixelis_actions(dialogue([SEGMENT, PROPERTIES]))
    assert actions == [R, op("SEGMENT_OBJECT_AT"), R, op("GET_PROPERTIES"), R, A]
    assert pixelis_actions(dialogue([ZOOM], think=False)) == [op("ZOOM_IN"), A]


def test_logical_flow_by_hand():
    # R->V +0.1; V->R +0.1 +0.2; R->V +0.1; V->R +0.3; R->A +0.1 = 0.9 over 5 pairs.
    assert logical_flow([R, op("SEGMENT_OBJECT_AT"), R, op("GET_PROPERTIES"), R, A]) == pytest.approx(0.18)
    # Two reasoning steps in a row count as the same operation again: -0.2 (upstream compares None == None).
    assert logical_flow([R, R]) == pytest.approx(-0.2)
    assert logical_flow([op("ZOOM_IN")] * 12) == pytest.approx(-0.2)


def test_tool_pattern_by_hand():
    assert tool_pattern([R, A]) == 0.0
    # Two distinct operations: 0.2; the SEGMENT -> GET_PROPERTIES bonus only for adjacent actions.
    assert tool_pattern([R, op("SEGMENT_OBJECT_AT"), R, op("GET_PROPERTIES"), A]) == pytest.approx(0.2)
    assert tool_pattern([op("SEGMENT_OBJECT_AT"), op("GET_PROPERTIES"), A]) == pytest.approx(0.4)
    # Seven zooms: 0.1 for one operation, -0.2 for two past five, +0.2 for ZOOM_IN -> READ_TEXT.
    assert tool_pattern([op("ZOOM_IN")] * 7 + [op("READ_TEXT")]) == pytest.approx(0.1 + 0.1 - 0.2 + 0.2)


def test_repetition_skips_reasoning_between_operations():
    assert has_repetitions([op("ZOOM_IN"), R, op("ZOOM_IN")])
    assert not has_repetitions([op("ZOOM_IN"), R, op("READ_TEXT"), R, op("ZOOM_IN")])


def test_semantic_coherence_bands():
    a = np.array([1.0, 0.0])
    assert semantic_coherence([a]) == 0.0
    assert semantic_coherence([a, np.array([0.0, 1.0])]) == -0.5  # similarity 0
    assert semantic_coherence([a, a]) == -0.3  # similarity 1: no progress
    assert semantic_coherence([a, np.array([0.6, 0.8])]) == pytest.approx((0.6 - 0.3) / 0.6)


def test_coherence_reward_is_the_mean_of_its_parts():
    actions = [R, op("SEGMENT_OBJECT_AT"), R, op("GET_PROPERTIES"), R, A]
    assert coherence_reward(actions) == pytest.approx((0.18 + 0.2) / 2)
    repeated = [op("ZOOM_IN"), op("ZOOM_IN"), A]
    # -0.5 for the repetition; flow (-0.2 + 0.1) / 2; pattern 0.1.
    assert coherence_reward(repeated) == pytest.approx((-0.5 - 0.05 + 0.1) / 3)
    assert coherence_reward([A]) == 0.0  # under min_length


def test_tool_penalty_by_hand():
    assert tool_penalty([R, op("SEGMENT_OBJECT_AT"), R, op("GET_PROPERTIES"), A]) == 0.0
    # 12 zooms in a row: 2 past 10 x -0.2, a repetition -0.1, 11 zoom-after-zoom x -0.05.
    assert tool_penalty([op("ZOOM_IN")] * 12 + [A]) == pytest.approx(-0.4 - 0.1 - 0.55)


def test_task_reward_is_exact_or_half_the_similarity():
    assert task_reward("red", "red") == 1.0
    assert task_reward("Red", "red") == pytest.approx(0.5 * 2 * 2 / 6)
    assert task_reward(None, "red") == 0.0


def pixelis_params(**keys) -> RLParams:
    return RLParams.model_validate({"pixelis": {"enabled": True, **keys}}).pixelis


def test_the_curriculum_brings_curiosity_then_coherence_in():
    shaper = PixelisShaper(pixelis_params(curriculum=[{"step": 0, "weights": {"task": 1.0}},
                                                      {"step": 3, "weights": {"curiosity": 0.3}},
                                                      {"step": 6, "weights": {"coherence": 0.2}}]))
    assert shaper.weights(1) == {"task": 1.0, "curiosity": 0.0, "coherence": 0.0}
    assert shaper.weights(3) == {"task": 1.0, "curiosity": 0.3, "coherence": 0.0}
    assert shaper.weights(7) == {"task": 1.0, "curiosity": 0.3, "coherence": 0.2}
    with pytest.raises(ValueError, match="step order"):
        pixelis_params(curriculum=[{"step": 5}, {"step": 2}])


def test_step_embeddings_and_actions_follow_the_dialogue():
    t = dialogue([SEGMENT, None, ZOOM])
    states, actions = step_embeddings(t), action_vectors(t)
    assert len(states) == 4 and len(actions) == 4  # question + 3 user turns; 3 turns + the answer
    assert all(abs(np.linalg.norm(s) - 1) < 1e-5 for s in states)
    assert not np.allclose(states[0], states[1])
    assert actions[1].argmax() != actions[0].argmax() != actions[2].argmax()


def test_curiosity_is_high_for_a_novel_dialogue_and_low_for_a_familiar_one():
    """The forward model's error on a transition it keeps seeing rises while the encoder moves, then falls as the
    forward model catches up; a dialogue of other operations on other images surprises it."""
    shaper = PixelisShaper(pixelis_params(normalize=False, weights={"task": 0.0, "curiosity": 1.0, "coherence": 0.0},
                                          curiosity={"lr": 1e-2, "eta": 100.0}))
    seen = []
    for _ in range(60):
        batch = [dialogue([ZOOM])]
        shaper.shape(batch, step=1)
        seen.append(batch[0].rewards["pixelis_curiosity_raw"])
    assert seen[-1] < max(seen) / 10
    assert batch[0].rewards["total"] == pytest.approx(seen[-1])  # curiosity alone, no penalty
    novel = dialogue([SEGMENT, PROPERTIES, ZOOM])
    novel.trace.images = [Image.new("RGB", (32, 32), (250 - 60 * i, 10, 40 * i)) for i in range(4)]
    shaper.shape([novel], step=1)
    assert novel.rewards["pixelis_curiosity_raw"] > 10 * seen[-1]


def test_the_total_is_replaced_and_the_state_round_trips():
    params = pixelis_params(weights={"task": 1.0, "curiosity": 0.0, "coherence": 1.0})
    shaper = PixelisShaper(params)
    t, broken = dialogue([SEGMENT, PROPERTIES]), dialogue([ZOOM])
    broken.rewards = {"total": None}
    shaper.shape([t, broken], step=1)
    expected = 1.0 + coherence_reward(pixelis_actions(t), step_embeddings(t))
    assert t.rewards["total"] == pytest.approx(expected)
    assert broken.rewards == {"total": None}  # an invalid score stays invalid
    twin = PixelisShaper(params, seed=99)
    twin.load_bytes(shaper.state_bytes())
    for a, b in zip(shaper.curiosity.parameters(), twin.curiosity.parameters()):
        assert (a == b).all()
    assert twin.stats["task"].count == 1


def test_normalisation_starts_at_the_tenth_value():
    """Upstream's order: each value joins the statistics, then is z-scored; from the 10th on."""
    shaper = PixelisShaper(pixelis_params(weights={"task": 1.0, "curiosity": 0.0, "coherence": 0.0},
                                          statistics_update="trajectory"))
    totals = []
    for k in range(12):
        t = dialogue([ZOOM])
        t.rewards = {"total": float(k % 2)}
        shaper.shape([t], step=1)
        totals.append(t.rewards["total"])
    assert totals[:9] == [float(k % 2) for k in range(9)]
    assert totals[9] != 1.0 and -3.0 <= totals[9] <= 3.0


@pytest.mark.parametrize("order", ["step", "trajectory"])
def test_a_group_of_equal_rewards_gets_no_advantage_only_with_statistics_updated_by_step(order):
    """After 20 warm-up values, a step of 8 correct answers to one question (a GRPO group). With the statistics
    updated after the step, they get one total, so GRPO gives them no advantage. In upstream's order the running
    mean moves between them: eight different totals, and GRPO's division by their small std makes advantages
    of about +-1 out of the drift alone."""
    from stages.rl.advantages import compute_advantages

    shaper = PixelisShaper(pixelis_params(weights={"task": 1.0, "curiosity": 0.0, "coherence": 0.0},
                                          statistics_update=order))
    for k in range(20):
        t = dialogue([ZOOM])
        t.rewards = {"total": float(k % 2)}
        shaper.shape([t], step=1)
    group = [dialogue([ZOOM]) for _ in range(8)]
    for t in group:
        t.rewards = {"total": 1.0}
    shaper.shape(group, step=2)
    totals = [t.rewards["total"] for t in group]
    advantages = compute_advantages(totals, ["g"] * 8, "grpo", [True] * 8)
    if order == "step":
        assert len(set(totals)) == 1 and max(abs(a) for a in advantages) == 0.0
        assert shaper.stats["task"].count == 28  # the step's values joined after it
    else:
        assert len(set(totals)) == 8 and max(abs(a) for a in advantages) > 1.0
