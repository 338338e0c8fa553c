"""The eval stage: metrics logic on hand-made trajectories, and `python -m stages.eval` on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from loupe.data.synthetic import SyntheticConfig, generate_tasks
from loupe.trajectory import Trajectory, Turn, read_trajectories
from stages.eval.__main__ import main as eval_main
from loupe.sample_metrics import SampleRecord, correct_within, majority_right, summarize, valid_turn_rate
from stages.eval.params import EvalParams


def finished(doc_id: str, sample: int, turns: int, end: str, accuracy: float | None, category="c") -> Trajectory:
    t = Trajectory(traj_id=f"{doc_id}#{sample}", task={"doc_id": doc_id, "solution": "A", "category": category},
                   protocol="mini_o3", system="s", sample_index=sample, end_reason=end)
    t.turns.append(Turn("user", "q"))
    for i in range(turns):
        t.turns.append(Turn("assistant", "x", action="answer" if i == turns - 1 and end == "answered" else "call"))
    t.rewards = {"accuracy": accuracy, "valid": accuracy is not None}
    return t


def three_questions() -> list[Trajectory]:
    """Two samples each of three questions, ending in every way the summary counts."""
    return [
        finished("a", 0, 1, "answered", 1.0),
        finished("a", 1, 3, "answered", 1.0),
        finished("b", 0, 5, "answered", 1.0),
        finished("b", 1, 2, "answered", 0.0),
        finished("c", 0, 8, "over_turn", 0.0),
        finished("c", 1, 2, "answered", None),  # a judge failure: invalid, left out of every denominator
    ]


def test_turn_scaling_follows_from_where_each_trajectory_ended():
    trajectories = three_questions()
    summary = summarize(trajectories, [1, 2, 4, 8])
    assert summary["turn_scaling"] == {"1": 0.2, "2": 0.2, "4": 0.4, "8": 0.6}
    assert summary["avg@2"] == pytest.approx(0.6) and summary["invalid"] == 1
    assert summary["pass@2"] == pytest.approx(2 / 3)  # a and b have a right sample; c has none
    assert summary["end_reasons"]["over_turn"] == pytest.approx(1 / 6)
    assert not correct_within(trajectories[1], 2) and correct_within(trajectories[1], 3)


def test_summary_from_compact_records_is_byte_for_byte_the_summary_of_whole_trajectories():
    """Eval keeps a SampleRecord per sample, not the trajectory; metrics.json must read as it did when the summary
    was computed from trajectories (the literal is what that implementation wrote, ints where statistics.mean
    gave ints)."""
    trajectories = three_questions()
    records = [SampleRecord.of(t) for t in trajectories]
    before = (
        '{"questions": 3, "samples_per_question": 2, "trajectories": 6, "invalid": 1, "avg@2": 0.6, '
        '"pass@2": 0.6666666666666666, "maj@2": 0.6666666666666666, "accuracy": 0.6, "by_category": {"c": 0.6}, "mean_turns": 3.5, '
        '"valid_turn_rate": 1, "mean_tool_calls": 0, "mean_generated_tokens": 0, "end_reasons": '
        '{"answered": 0.8333333333333334, "over_turn": 0.16666666666666666, "format_error": 0.0, "length": 0.0}, '
        '"turn_scaling": {"1": 0.2, "2": 0.2, "4": 0.4, "8": 0.6}}'
    )
    assert json.dumps(summarize(records, [1, 2, 4, 8])) == before
    assert json.dumps(summarize(trajectories, [1, 2, 4, 8])) == before  # the rl stage still passes trajectories
    trajectories[1].turns[1].action = "error"
    assert json.dumps(valid_turn_rate([SampleRecord.of(t) for t in trajectories])) == str(20 / 21)


def test_the_majority_vote_counts_right_answers_against_each_wrong_one_and_shares_a_tie():
    def record(answer: str | None, accuracy: float) -> SampleRecord:
        return SampleRecord("q", 0, None, "red", answer, accuracy, True, "answered" if answer else "format_error",
                            2, 2, 1, 0, 10)

    right, blue, green = record("red", 1.0), record("Blue ", 0.0), record("green", 0.0)
    assert majority_right([right, blue, green, record("blue", 0.0)], 8) == 0.0  # blue has two votes
    assert majority_right([right, record("red", 1.0), blue, green], 8) == 1.0  # two against one each
    assert majority_right([right, blue, green], 8) == pytest.approx(1 / 3)  # a three-way tie
    assert majority_right([right, record(None, 0.0), record(None, 0.0)], 8) == 1.0  # no answer, no vote
    assert majority_right([blue, green], 8) == 0.0
    # maj@K beside pass@K and Avg@K: question b's vote is right (its wrong sample gave no answer), c's has none
    assert summarize(three_questions(), [1, 2, 4, 8])["maj@2"] == pytest.approx(2 / 3)


def test_valid_turn_rate_counts_calls_and_answers():
    t = finished("a", 0, 3, "answered", 1.0)
    t.turns[1].action = "error"
    assert valid_turn_rate([t]) == pytest.approx(2 / 3)


def test_turn_limits_double_up_to_the_maximum():
    assert EvalParams(max_turns=32).turn_limits == [1, 2, 4, 8, 16, 32]
    assert EvalParams(max_turns=6).turn_limits == [1, 2, 4, 6]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model_dir) -> Path:
    root = tmp_path_factory.mktemp("eval")
    generate_tasks(root / "tasks", SyntheticConfig(seed=3, train=0, val=0, test=3, canvas_side=(1024, 1100)))
    params = {
        "seed": 5,
        "protocol": {"max_turns": 4},
        "rollout": {"max_new_tokens": 24, "temperature": 1.0},
        "eval": {"benchmarks": [{"name": "synthetic", "path": str(root / "tasks")}], "samples": 2, "max_turns": 4},
    }
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    return root


def run_eval(workspace: Path, model: Path, out: str) -> Path:
    """The stage on one bare model path, which it names `model`: returns that model's folder."""
    assert eval_main(["--params", str(workspace / "params.yaml"), "--model", str(model), "--out", str(workspace / out),
                      "--no-progress"]) == 0
    return workspace / out / "model"


def test_eval_writes_every_output_and_repeats_exactly(workspace, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("LOUPE_TRACKING", "on")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{workspace / 'mlflow.db'}")
    out = run_eval(workspace, tiny_model_dir, "first")
    metrics = json.loads((out / "metrics.json").read_text())
    synthetic = metrics["benchmarks"]["synthetic"]
    assert synthetic["questions"] == 3 and synthetic["trajectories"] == 6 and synthetic["samples_per_question"] == 2
    assert set(synthetic["turn_scaling"]) == {"1", "2", "4"} and "avg@2" in synthetic and "pass@2" in synthetic
    assert sum(synthetic["end_reasons"].values()) == pytest.approx(1.0)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and {r["doc_id"] for r in rows} == {f"synth-test-00000{i}" for i in range(3)}
    trajectories = read_trajectories(out / "trajectories" / "synthetic.jsonl")
    assert len(trajectories) == 6 and all(t.rewards["valid"] for t in trajectories)
    plot = json.loads((out / "plots" / "turn_scaling.json").read_text())
    assert [p["max_turns"] for p in plot] == [1, 2, 4]
    assert (out / "plots" / "turn_scaling.png").read_bytes().startswith(b"\x89PNG")
    page = (out / "viewer.html").read_text()
    assert page.count("synth-test-000000") >= 1 and "data:image/jpeg;base64," in page

    import mlflow

    [run] = mlflow.search_runs(experiment_names=["loupe"], output_format="list")
    assert run.data.tags["loupe.stage"] == "eval" and run.data.params["eval.samples"] == "2"
    assert run.data.metrics["synthetic.questions"] == 3.0 and 0 <= run.data.metrics["synthetic.chance_rate"] <= 1
    assert run.data.metrics["synthetic.model.trajectories"] == 6.0 and "synthetic.model.avg_at_2" in run.data.metrics
    assert run.data.metrics["synthetic.model.accuracy_ci_low"] <= run.data.metrics["synthetic.model.accuracy_ci_high"]
    history = mlflow.MlflowClient().get_metric_history(run.info.run_id, "synthetic.model.turn_scaling")
    assert sorted(m.step for m in history) == [1, 2, 4]
    artefacts = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id)}
    assert {"metrics.json", "plots", "model"} <= artefacts
    model_artefacts = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id, "model")}
    assert {"model/metrics.json", "model/results.jsonl", "model/viewer.html"} <= model_artefacts

    monkeypatch.setenv("LOUPE_TRACKING", "off")
    again = run_eval(workspace, tiny_model_dir, "second")
    assert (again / "results.jsonl").read_text() == (out / "results.jsonl").read_text()
    assert (again / "trajectories" / "synthetic.jsonl").read_text() == (out / "trajectories" / "synthetic.jsonl").read_text()


def test_missing_benchmark_is_an_error_not_a_skip(workspace, tiny_model_dir, capsys):
    params = yaml.safe_load((workspace / "params.yaml").read_text())
    params["eval"]["benchmarks"].append({"name": "vstar", "path": str(workspace / "no-such-vstar")})
    (workspace / "bad.yaml").write_text(yaml.safe_dump(params))
    code = eval_main(["--params", str(workspace / "bad.yaml"), "--model", str(tiny_model_dir),
                      "--out", str(workspace / "bad"), "--no-progress"])
    assert code == 2
    err = capsys.readouterr().err
    assert "vstar" in err and "no-such-vstar" in err
    assert not (workspace / "bad" / "metrics.json").exists() and not (workspace / "bad" / "model").exists()


def test_unknown_eval_key_names_its_path(workspace, tiny_model_dir, capsys):
    params = yaml.safe_load((workspace / "params.yaml").read_text())
    params["eval"]["sample"] = 3
    (workspace / "typo.yaml").write_text(yaml.safe_dump(params))
    code = eval_main(["--params", str(workspace / "typo.yaml"), "--model", str(tiny_model_dir),
                      "--out", str(workspace / "typo"), "--no-progress"])
    assert code == 2 and "eval.sample" in capsys.readouterr().err


def test_an_override_on_the_stage_command_is_what_runs_and_what_mlflow_records(workspace, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("LOUPE_TRACKING", "on")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{workspace / 'mlflow-overrides.db'}")
    monkeypatch.delenv("LOUPE_PARAMS_OVERRIDES", raising=False)
    assert eval_main(["--params", str(workspace / "params.yaml"), "--model", str(tiny_model_dir), "--out",
                      str(workspace / "overridden"), "--no-progress", "eval.samples=1"]) == 0
    metrics = json.loads((workspace / "overridden" / "model" / "metrics.json").read_text())
    assert metrics["benchmarks"]["synthetic"]["samples_per_question"] == 1  # the file says 2

    import mlflow

    [run] = mlflow.search_runs(experiment_names=["loupe"], output_format="list")
    assert run.data.tags["loupe.overrides"] == "eval.samples=1" and run.data.params["eval.samples"] == "1"
