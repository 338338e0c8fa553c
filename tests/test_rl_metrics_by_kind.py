"""Reward parts and validation accuracy per kind of question (stages/rl/metrics.py, `metrics_by_kind`)."""

from __future__ import annotations

import pytest

from loupe.trajectory import Trajectory, Turn
from stages.rl.metrics import metrics_by_kind, val_row


def scored(category: str | None, total: float | None, accuracy: float, valid: bool = True, **parts) -> Trajectory:
    t = Trajectory(traj_id="t#0", task={"doc_id": "t", "problem": "q", "solution": "red", "category": category,
                                        "data_source": "toy"}, protocol="mini_o3", system="")
    t.turns.append(Turn("user", "q"))
    t.turns.append(Turn("assistant", "<answer>red</answer>", action="answer"))
    t.end_reason = "answered"
    t.rewards = {"total": total, "accuracy": accuracy, "valid": valid, **parts}
    return t


def test_each_kind_gets_its_own_means_and_invalid_samples_are_left_out():
    batch = [scored("zoom/single", 1.0, 1.0, pixelis_coherence=-0.5),
             scored("zoom/single", 0.0, 0.0, pixelis_coherence=0.5),
             scored("operations/sign", 0.2, 0.0, pixelis_coherence=1.5),
             scored("operations/sign", None, 1.0, valid=False),
             scored(None, 0.4, 1.0)]  # no category: its data source names the kind
    found = metrics_by_kind(batch)
    assert found["by_kind/zoom/single/total"] == pytest.approx(0.5)
    assert found["by_kind/zoom/single/pixelis_coherence"] == pytest.approx(0.0)
    assert found["by_kind/operations/sign/trajectories"] == 2.0
    assert found["by_kind/operations/sign/accuracy"] == 0.0  # the invalid sample's 1.0 is not counted
    assert found["by_kind/toy/total"] == pytest.approx(0.4)
    assert "by_kind/toy/pixelis_coherence" not in found
    two_turns = scored("zoom/single", 1.0, 1.0)
    two_turns.turns[1:1] = [Turn("assistant", "<grounding>...</grounding>"), Turn("user", "<image>")]
    assert metrics_by_kind(batch + [two_turns])["by_kind/zoom/single/turns"] == pytest.approx(4 / 3)
    assert found["by_kind/toy/turns"] == 1.0


def test_one_kind_adds_nothing_and_validation_keeps_only_accuracy_by_kind():
    assert metrics_by_kind([scored("zoom/nested", 1.0, 1.0), scored("zoom/nested", 0.0, 0.0)]) == {}
    row = val_row(4, [scored("zoom/single", 1.0, 1.0), scored("operations/shape", 0.0, 0.0)], max_turns=4)
    assert row["val/by_kind/zoom/single/accuracy"] == 1.0 and row["val/by_kind/operations/shape/accuracy"] == 0.0
    assert not [k for k in row if k.startswith("val/by_kind") and k.endswith("/total")]
    assert row["step"] == 4 and row["kind"] == "val" and row["val/accuracy"] == pytest.approx(0.5)
