"""Every published benchmark layout through the eval stage: the right answer scores 1.0, a wrong one 0.0.

The stage runs as `python -m stages.eval` would (params file, benchmark readers, rollout loop, scoring, metrics),
with its engine replaced by one that answers each question from the fixture's answer key.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from published_benchmarks import PublishedCopy, build_all
from test_rollout_loop import ScriptedEngine

import stages.eval.__main__ as eval_stage
import stages.eval.one_model as one_model
from loupe.data.benchmarks import load_benchmark
from loupe.data.tasks import OPTION_LETTERS
from loupe.protocol import IMAGE_PLACEHOLDER, get_protocol


class AnswerKeyEngine(ScriptedEngine):
    """Answers each dialogue from an answer key keyed by the first user turn, in the protocol's answer format."""

    name = "answer-key"

    def __init__(self, answers: dict[str, str], protocol: str):
        super().__init__([[]])
        self.answers = answers
        self.protocol = get_protocol(protocol)

    def begin(self, system, question, images):
        # A real engine pairs each placeholder with an image; a question text holding its own would break that.
        assert question.count(IMAGE_PLACEHOLDER) == len(images), question
        state = super().begin(system, question, images)
        state["script"] = [self.protocol.render_answer("I looked closely.", self.answers[question])]
        return state


def answer_key(copies: list[PublishedCopy], cache: Path, right: bool, protocol: str) -> dict[str, str]:
    """First user turn -> answer, for every question of every copy.

    The right answer comes from the fixture, not from what the reader made of it: a choice question's letter is
    where the fixture's right option text landed among the options as read.
    """
    render = get_protocol(protocol).question_text
    key: dict[str, str] = {}
    for copy in copies:
        tasks = load_benchmark(copy.benchmark, copy.path, cache).tasks
        for question in copy.questions:
            [task] = [t for t in tasks if t.problem == question.problem and set(t.options or []) == set(question.options or [])
                      and (question.letter is None or t.solution == question.letter)]
            if question.is_choice:
                answer = OPTION_LETTERS[task.options.index(question.answer)] if right else question.wrong_answer(task.options)
            else:
                answer = question.answer if right else question.wrong_answer()
            key[render(task)] = answer
    return key


@pytest.mark.parametrize("variant", [0, 1], ids=["as-downloaded", "other-published-shapes"])
@pytest.mark.parametrize("right", [True, False], ids=["oracle", "wrong"])
def test_every_benchmark_scores_through_the_eval_stage(tmp_path, monkeypatch, variant, right):
    copies = build_all(tmp_path / "data", variant)
    assert len({c.benchmark for c in copies}) == 8  # every reader the eval stage accepts
    params = {
        "seed": 0,
        "protocol": {"max_turns": 2},
        "eval": {"benchmarks": [{"name": c.benchmark, "path": str(c.path)} for c in copies], "max_turns": 2},
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    engine = AnswerKeyEngine(answer_key(copies, tmp_path / "key-cache", right, "mini_o3"), "mini_o3")
    monkeypatch.setattr(one_model, "make_engine", lambda *args, **kwargs: engine)
    (tmp_path / "model").mkdir()

    out = tmp_path / "out"
    assert eval_stage.main(["--params", str(tmp_path / "params.yaml"), "--model", str(tmp_path / "model"),
                            "--out", str(out), "--no-progress"]) == 0

    metrics = json.loads((out / "model" / "metrics.json").read_text())["benchmarks"]
    assert set(metrics) == {c.benchmark for c in copies}
    for copy in copies:
        summary = metrics[copy.benchmark]
        assert summary["questions"] == len(copy.questions) and summary["invalid"] == 0, copy.benchmark
        assert summary["end_reasons"]["answered"] == 1.0, copy.benchmark
        assert summary["avg@1"] == (1.0 if right else 0.0), copy.benchmark
    rows = [json.loads(line) for line in (out / "model" / "results.jsonl").read_text().splitlines()]
    assert len(rows) == sum(len(c.questions) for c in copies) == engine.started
    assert {r["accuracy"] for r in rows} == {1.0 if right else 0.0}
