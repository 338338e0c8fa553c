"""Test-time RL (stages/rl/ttrl.py): votes, the experience buffer, gating, and the rl stage run without labels."""

from __future__ import annotations

import json

import numpy as np
import pytest

from loupe.data.tasks import TaskRecord
from loupe.trajectory import Trajectory
from stages.rl.params import RLParams
from stages.rl.ttrl import (
    UNLABELED,
    Experience,
    ExperienceBuffer,
    PseudoLabeler,
    agreement_factor,
    normalised_answer,
    unlabeled,
    vote,
)
from rl_helpers import make_toy_tasks, one_torch_thread, votes_by_first_letter, write_params  # noqa: F401 (fixtures)


def sample(answer: str | None, problem: str = "What colour?", options: list[str] | None = None) -> Trajectory:
    task = {"doc_id": problem, "problem": problem, "solution": UNLABELED, **({"options": options} if options else {})}
    t = Trajectory(traj_id=f"{problem}#0", task=task, protocol="mini_o3", system="")
    t.answer, t.end_reason = answer, "answered" if answer is not None else "format_error"
    return t


def test_answers_vote_as_letters_or_lowercased_words():
    assert normalised_answer(sample("  Blue ")) == "blue"
    assert normalised_answer(sample("The answer is (B)", options=["red", "green", "blue"])) == "B"
    assert normalised_answer(sample(None)) is None


@pytest.mark.parametrize("agreeing, total, factor", [(10, 10, 1.0), (8, 10, 0.8 + 0.2 * 0.1 / 0.3),
                                                     (5, 10, 0.7), (1, 10, 0.6 + 0.2 * 0.1 / 0.3), (0, 10, 0.6)])
def test_agreement_factor_is_pixelis_piecewise_rule(agreeing, total, factor):
    assert agreement_factor(agreeing, total) == pytest.approx(factor)


def test_the_majority_of_the_samples_is_the_label():
    label, confidence = vote(["red", "red", "red", "blue"], [], step=1, strategy="majority", min_votes=3,
                             recency_steps=24)
    assert (label, confidence) == ("red", 0.75)
    label, confidence = vote(["red", "red", "red", "blue"], [], step=1, strategy="weighted", min_votes=3,
                             recency_steps=24)
    assert label == "red" and confidence == pytest.approx(0.75 * (0.8 + 0.2 * 0.05 / 0.3))


def test_recent_confident_neighbours_can_tip_the_vote_and_old_ones_fade():
    neighbours = [(Experience(np.ones(2), "blue", 1.0, step=10), 0.99) for _ in range(3)]
    fresh, _ = vote(["red", "red", "blue", "blue"], neighbours, step=10, strategy="weighted", min_votes=3,
                    recency_steps=24)
    stale, _ = vote(["red", "red", "red", "blue"], neighbours, step=200, strategy="weighted", min_votes=3,
                    recency_steps=24)
    assert fresh == "blue" and stale == "red"


def test_too_few_votes_give_the_first_answer_at_half_confidence():
    assert vote(["red", None, None, None], [], 1, "weighted", 3, 24) == ("red", 0.5)
    assert vote([None, None], [], 1, "weighted", 3, 24) == (None, 0.0)


def test_the_buffer_retrieves_near_repeats_and_forgets_the_oldest():
    buffer = ExperienceBuffer(capacity=3)
    for k, vector in enumerate(([1.0, 0.0], [0.0, 1.0], [0.7, 0.7], [1.0, 0.05])):
        buffer.add(Experience(np.asarray(vector) / np.linalg.norm(vector), f"a{k}", 0.9, k))
    assert [e.answer for e in buffer.entries] == ["a1", "a2", "a3"]
    found = buffer.nearest(np.array([1.0, 0.0]), k=3, min_similarity=0.95)
    assert [e.answer for e, _ in found] == ["a3"]
    again = ExperienceBuffer(capacity=3)
    again.load(json.loads(json.dumps(buffer.state())))
    assert [e.answer for e in again.entries] == ["a1", "a2", "a3"]


def test_the_labeler_writes_labels_and_gates_unsure_groups():
    params = RLParams.model_validate({"ttrl": {"enabled": True, "confidence_gate": 0.6}}).ttrl
    sure = [sample(a, "q1") for a in ("red", "red", "red", "red")]
    unsure = [sample(a, "q2") for a in ("red", "blue", "green", "yellow")]
    labeler = PseudoLabeler(params)
    figures, gated = labeler.label(sure + unsure, group_size=4, step=1)
    assert all(t.task["solution"] == "red" for t in sure)
    assert all(t.task["solution"] == UNLABELED for t in unsure) and gated == {4, 5, 6, 7}
    assert figures["ttrl/groups_kept"] == 0.5 and len(labeler.buffer.entries) == 2


def test_questions_are_read_without_their_labels():
    tasks = [TaskRecord(doc_id="a", images=[], problem="2 + 2?", solution="4")]
    assert [t.solution for t in unlabeled(tasks)] == [UNLABELED] and tasks[0].solution == "4"


def test_the_rl_stage_trains_on_votes_without_labels(tiny_model_dir, tmp_path, votes_by_first_letter):
    """The stage reads its questions without their solutions, labels each group by vote, trains on agreement
    (the toy's reward: the label's letter in the response) and keeps its buffer in each checkpoint. The untrained
    tiny model writes no `<answer>`, so a sample's vote here is the first option letter in its text."""
    from stages.rl.inputs import read_inputs
    from stages.rl.trainer import Trainer

    toy = make_toy_tasks(tmp_path / "toy")
    params = write_params(tmp_path / "params.yaml", {
        "steps": 3, "ttrl": {"enabled": True, "confidence_gate": 0.0}, "checkpoint_every": 2,
    })
    inputs = read_inputs(params, tiny_model_dir, toy)
    assert {t.solution for t in inputs.train} == {UNLABELED}
    trainer = Trainer(inputs, tmp_path / "out", progress=False, use_ray=False)
    trainer.run_loop()
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 3 and all(0.0 <= r["ttrl/confidence"] <= 1.0 for r in train)
    assert any(r["ttrl/groups_kept"] > 0 for r in train)  # the gate is open: every group with a vote trains
    assert all(t.task["solution"] in ("A", "B", "C", "D", UNLABELED) for t in trainer.last_batch)
    assert (tmp_path / "out" / "checkpoints" / "step_000002" / "ttrl_buffer.json").is_file()
