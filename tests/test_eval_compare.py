"""The eval stage's verdict: several models on the same questions, the bootstrap interval, the comparison's
metrics, table, plot and DVC plot data, and the flow's reading of it (pipelines.summary.comparison_text).

The interval and the table are checked on hand-made numbers; the stage runs with engines that answer from a key
(no model load) and, once, with the embedded tiny model under two names.
"""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
import time
import weakref
from pathlib import Path

import numpy as np
import psutil
import pytest
import yaml
from PIL import Image
from test_rollout_loop import ScriptedEngine

import stages.eval.__main__ as eval_stage
import stages.eval.one_model as one_model
from loupe.compare import comparison_table, is_comparison, verdict
from loupe.data.tasks import TaskRecord
from pipelines.summary import comparison_text, key_metrics, stage_metrics
from stages.eval.comparison import bootstrap_interval, compare, question_accuracies
from loupe.sample_metrics import SampleRecord, summarize

# --- The interval -----------------------------------------------------------------------------------------------


def sample(doc_id: str, index: int, right: bool, turns: int = 1, valid: bool = True) -> SampleRecord:
    return SampleRecord(doc_id=doc_id, sample=index, category=None, solution="a", answer="a" if right else "b",
                        accuracy=(1.0 if right else 0.0) if valid else None, valid=valid, end_reason="answered",
                        turns=turns, valid_turns=turns, tool_calls=turns - 1, format_errors=0, generated_tokens=10)


def test_the_interval_holds_the_estimate_and_narrows_with_more_questions():
    pattern = [1.0, 0.0, 1.0, 0.5, 1.0, 0.0, 0.5, 1.0, 0.0, 1.0]  # per-question means, mean 0.6
    few, many = pattern * 2, pattern * 20
    low_few, high_few = bootstrap_interval(few, seed=0)
    low_many, high_many = bootstrap_interval(many, seed=0)
    for low, high, values in ((low_few, high_few, few), (low_many, high_many, many)):
        assert low < float(np.mean(values)) < high
    assert high_many - low_many < (high_few - low_few) / 2  # 10x the questions: about 1/sqrt(10) the width
    # Seeded: the same values and seed give the same interval to the bit.
    assert bootstrap_interval(few, seed=0) == (low_few, high_few)


def test_an_all_correct_or_all_wrong_model_has_a_point_interval():
    assert bootstrap_interval([1.0] * 50, seed=3) == (1.0, 1.0)
    assert bootstrap_interval([0.0] * 50, seed=3) == (0.0, 0.0)
    assert bootstrap_interval([0.5], seed=3) == (0.5, 0.5)  # one question: every resample is that question
    assert bootstrap_interval([], seed=3) == (None, None)


def test_the_interval_resamples_questions_not_samples():
    """Four samples per question that always agree are one observation, not four: the interval over questions is
    wider than one that (wrongly) treated every sample as independent."""
    records = [sample(f"q{q}", k, right=q % 2 == 0) for q in range(40) for k in range(4)]
    per_question = question_accuracies(records, turn_limit=8)
    assert len(per_question) == 40 and set(per_question.values()) == {0.0, 1.0}
    low, high = bootstrap_interval(list(per_question.values()), seed=0)
    naive_low, naive_high = bootstrap_interval([float(r.accuracy) for r in records], seed=0)
    assert low < 0.5 < high
    assert (high - low) > 1.5 * (naive_high - naive_low)


def test_question_accuracy_counts_only_scored_samples_within_the_turn_limit():
    records = [sample("a", 0, True, turns=1), sample("a", 1, True, turns=3), sample("b", 0, True, valid=False),
               sample("b", 1, False)]
    assert question_accuracies(records, turn_limit=2) == {"a": 0.5, "b": 0.0}
    assert question_accuracies(records, turn_limit=4) == {"a": 1.0, "b": 0.0}
    assert question_accuracies([sample("c", 0, True, valid=False)], turn_limit=4) == {}


# --- The comparison's metrics and table -------------------------------------------------------------------------


def task(doc_id: str, solution: str) -> TaskRecord:
    return TaskRecord(doc_id=doc_id, images=["x.png"], problem=f"Say {solution}", solution=solution)


def comparison_of(rights: dict[str, list[bool]], limits=(1, 2, 4)) -> dict:
    """Two samples a question for four questions, right where `rights[model][question]` says."""
    tasks = [task("q0", "cat"), task("q1", "cat"), task("q2", "dog"), task("q3", "owl")]
    records = {m: {"synthetic": [sample(t.doc_id, k, r) for t, r in zip(tasks, rs) for k in range(2)]}
               for m, rs in rights.items()}
    summaries = {m: {"synthetic": summarize(records[m]["synthetic"], list(limits))} for m in rights}
    return compare({m: f"/models/{m}" for m in rights}, {"synthetic": tasks}, summaries, records, list(limits), seed=0)


def test_the_comparison_holds_the_chance_rate_and_an_entry_per_model():
    comparison = comparison_of({"base": [False] * 4, "sft": [True, False, True, False], "rl": [True] * 4})
    assert is_comparison(comparison) and comparison["models"] == ["base", "sft", "rl"]
    entry = comparison["synthetic"]
    assert entry["questions"] == 4 and entry["samples_per_question"] == 2
    assert entry["chance_rate"] == pytest.approx(0.5)  # "cat" is half the answers: the best blind guess
    assert [entry[m]["accuracy"] for m in ("base", "sft", "rl")] == [0, 0.5, 1]
    assert (entry["base"]["accuracy_ci_low"], entry["base"]["accuracy_ci_high"]) == (0.0, 0.0)
    assert (entry["rl"]["accuracy_ci_low"], entry["rl"]["accuracy_ci_high"]) == (1.0, 1.0)
    assert entry["sft"]["accuracy_ci_low"] < 0.5 < entry["sft"]["accuracy_ci_high"]
    assert entry["sft"]["pass@2"] == 0.5 and entry["sft"]["turn_scaling"] == {"1": 0.5, "2": 0.5, "4": 0.5}
    assert json.loads(json.dumps(comparison)) == comparison


def test_models_asked_different_questions_are_no_comparison():
    tasks = [task("q0", "cat"), task("q1", "dog")]
    records = {"a": {"s": [sample("q0", 0, True), sample("q1", 0, True)]}, "b": {"s": [sample("q0", 0, True)]}}
    summaries = {m: {"s": summarize(records[m]["s"], [1])} for m in records}
    with pytest.raises(ValueError, match="model b was scored on 1 questions, not the 2"):
        compare({"a": "x", "b": "y"}, {"s": tasks}, summaries, records, [1], seed=0)


def test_the_table_has_a_row_per_model_and_the_chance_rate():
    comparison = comparison_of({"base": [False] * 4, "sft": [True, False, True, False], "rl": [True] * 4})
    lines = comparison_table(comparison).splitlines()
    assert lines[0] == "synthetic (4 questions x 2 samples; chance rate 0.500)"
    assert lines[1].split() == ["model", "accuracy", "[95%", "CI]", "pass@2", "valid", "turns", "acc@1", "acc@2",
                                "acc@4"]
    assert [line.split()[0] for line in lines[2:5]] == ["base", "sft", "rl"]
    assert lines[4].split()[:4] == ["rl", "1.000", "[1.000,", "1.000]"]
    for column, cell in (("pass@2", "0.500"), ("valid", "1.00"), ("turns", "1.00"), ("acc@4", "0.500")):
        assert lines[3][lines[1].index(column):].split()[0] == cell, column  # sft's row, under its header
    # base 0 [0, 0], sft 0.5 [<0.5, >0.5], rl 1 [1, 1] against chance 0.5
    assert lines[5] == ("verdict (synthetic): base 0.000, below chance; sft 0.500, at chance, not clearly different "
                        "from base (intervals overlap); rl 1.000, above chance, not clearly different from sft "
                        "(intervals overlap)")  # four questions: sft's interval reaches both 0 and 1
    assert lines[-1].startswith("accuracy: the share of right answers") and "acc@1: answering before" in lines[-1]
    with pytest.raises(ValueError):
        comparison_table({"benchmarks": {"synthetic": {}}})  # one model's metrics.json, not a comparison


def test_the_verdict_says_overlap_and_a_base_model_without_valid_turns():
    comparison = comparison_of({"base": [False] * 4, "sft": [True, False, True, False], "rl": [True, True, False, True]})
    comparison["synthetic"]["base"]["valid_turn_rate"] = 0.0
    line = verdict(comparison, "synthetic")
    assert "base 0.000, below chance, no valid turn: it never learned the dialogue's format" in line
    assert "rl 0.750, at chance, not clearly different from sft (intervals overlap)" in line
    many = comparison_of({"base": [False] * 40, "rl": [True] * 40})
    assert verdict(many, "synthetic").endswith("rl 1.000, above chance, better than base (intervals apart)")


def test_the_flow_reads_the_table_from_the_metrics_dvc_yaml_declares(tmp_path):
    comparison = comparison_of({"base": [False] * 4, "sft": [True, False, True, False], "rl": [True] * 4})
    spec = {"stages": {"eval": {"cmd": "x", "metrics": ["out/eval/metrics.json"]}}}
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(spec))
    assert comparison_text(tmp_path) is None  # not run yet
    (tmp_path / "out" / "eval").mkdir(parents=True)
    (tmp_path / "out" / "eval" / "metrics.json").write_text(json.dumps(comparison))
    assert comparison_text(tmp_path) == comparison_table(comparison)
    # As `dvc metrics show` flattens it; the summary's eval row shows the models' accuracies.
    flat = stage_metrics(tmp_path, "eval")
    assert flat["synthetic.rl.accuracy"] == 1 and flat["synthetic.chance_rate"] == pytest.approx(0.5)
    assert list(key_metrics(flat)) == ["synthetic.base.accuracy", "synthetic.sft.accuracy", "synthetic.rl.accuracy"]
    (tmp_path / "out" / "eval" / "metrics.json").write_text(json.dumps({"benchmarks": {"synthetic": {"avg@1": 0.5}}}))
    assert comparison_text(tmp_path) is None  # a one-model metrics.json has no comparison to show
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"data": {"cmd": "x"}}}))
    assert comparison_text(tmp_path) is None  # no eval stage


# --- The stage with engines that answer from a key ----------------------------------------------------------------


SOLUTIONS = ["cat", "cat", "dog", "owl", "cat", "emu"]


@pytest.fixture(scope="module")
def key_tasks(tmp_path_factory) -> Path:
    """Six free-form questions on one small image; "cat" is half the answers (chance rate 0.5)."""
    folder = tmp_path_factory.mktemp("compare") / "tasks"
    folder.mkdir()
    Image.new("RGB", (64, 64), (40, 90, 160)).save(folder / "img.png")
    rows = [{"doc_id": f"q{i}", "images": ["img.png"], "problem": f"Say {s}", "solution": s}
            for i, s in enumerate(SOLUTIONS)]
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


class KeyEngine(ScriptedEngine):
    """Answers the word the question asks for when `right(word)` holds, "yak" otherwise."""

    def __init__(self, right):
        super().__init__([["<think>x</think>\n<answer>yak</answer>"]])
        self.right = right

    def begin(self, system, question, images):
        state = super().begin(system, question, images)
        word = re.search(r"Say (\w+)", question).group(1)
        if self.right(word):
            state["script"] = [f"<think>x</think>\n<answer>{word}</answer>"]
        return state


def write_params(folder: Path, tasks: Path, **eval_keys) -> Path:
    """Models one after another in this process unless `model_processes` is given: the scripted engines are
    patched into this process, which spawned processes would not see."""
    params = {"seed": 5, "protocol": {"max_turns": 2}, "rollout": {"max_new_tokens": 16},
              "eval": {"benchmarks": [{"name": "synthetic", "path": str(tasks)}], "samples": 2, "max_turns": 2,
                       "viewer_trajectories": 2, "model_processes": 1, **eval_keys}}
    (folder / "params.yaml").write_text(yaml.safe_dump(params))
    return folder / "params.yaml"


def model_dirs(root: Path, *names: str) -> list[Path]:
    for name in names:
        (root / name).mkdir(parents=True, exist_ok=True)
    return [root / name for name in names]


def test_three_models_each_in_its_folder_then_one_comparison(tmp_path, key_tasks, monkeypatch, capsys):
    rules = {"base": lambda w: False, "sft": lambda w: w == "cat", "rl": lambda w: True}
    events: list[str] = []
    alive: list[weakref.ref] = []

    def make_engine(rollout, protocol, model_path, seed):
        gc.collect()
        # Each model is freed before the next is loaded: no earlier engine is still alive here.
        events.append(f"load {Path(model_path).name} (alive {sum(r() is not None for r in alive)})")
        engine = KeyEngine(rules[Path(model_path).name])
        engine.close = lambda: events.append(f"close {Path(model_path).name}")
        alive.append(weakref.ref(engine))
        return engine

    monkeypatch.setattr(one_model, "make_engine", make_engine)
    params = write_params(tmp_path, key_tasks)
    base, sft, rl = model_dirs(tmp_path / "models", "base", "sft", "rl")
    out = tmp_path / "out"
    assert eval_stage.main(["--params", str(params), "--model", f"base={base}", "--model", f"sft={sft}",
                            "--model", f"rl={rl}", "--out", str(out), "--no-progress"]) == 0
    assert events == ["load base (alive 0)", "close base", "load sft (alive 0)", "close sft", "load rl (alive 0)",
                      "close rl"]

    # Every model's own outputs, as a one-model eval writes them, on the same questions.
    asked = {}
    for name in ("base", "sft", "rl"):
        rows = [json.loads(line) for line in (out / name / "results.jsonl").read_text().splitlines()]
        asked[name] = sorted((r["doc_id"], r["sample"]) for r in rows)
        own = json.loads((out / name / "metrics.json").read_text())
        assert own["model"] == str(tmp_path / "models" / name) and own["benchmarks"]["synthetic"]["trajectories"] == 12
        assert (out / name / "viewer.html").is_file() and (out / name / "trajectories" / "synthetic.jsonl").is_file()
    assert asked["base"] == asked["sft"] == asked["rl"] and len(asked["base"]) == 12

    comparison = json.loads((out / "metrics.json").read_text())
    assert comparison["models"] == ["base", "sft", "rl"] and comparison["benchmarks"] == ["synthetic"]
    entry = comparison["synthetic"]
    assert entry["questions"] == 6 and entry["chance_rate"] == pytest.approx(0.5)
    assert [entry[m]["accuracy"] for m in ("base", "sft", "rl")] == [0, 0.5, 1]
    assert entry["sft"]["accuracy_ci_low"] < 0.5 < entry["sft"]["accuracy_ci_high"]
    assert entry["sft"]["valid_turn_rate"] == 1 and entry["sft"]["mean_turns"] == 1

    plot = json.loads((out / "plots" / "turn_scaling.json").read_text())
    assert plot == [{"benchmark": "synthetic", "max_turns": 1, "base": 0, "sft": 0.5, "rl": 1},
                    {"benchmark": "synthetic", "max_turns": 2, "base": 0, "sft": 0.5, "rl": 1}]
    assert (out / "plots" / "comparison.png").read_bytes().startswith(b"\x89PNG")

    printed = capsys.readouterr().out.rstrip("\n")
    assert printed.endswith(comparison_table(comparison))  # the output ends with the table
    assert printed.splitlines()[-3].split()[:2] == ["rl", "1.000"]
    assert printed.splitlines()[-2].startswith("verdict (synthetic): base 0.000")


def test_a_bare_model_path_is_named_model(tmp_path, key_tasks, monkeypatch):
    monkeypatch.setattr(one_model, "make_engine", lambda *a, **k: KeyEngine(lambda w: w != "owl"))
    [model] = model_dirs(tmp_path, "some-model")
    out = tmp_path / "out"
    assert eval_stage.main(["--params", str(write_params(tmp_path, key_tasks)), "--model", str(model),
                            "--out", str(out), "--no-progress"]) == 0
    comparison = json.loads((out / "metrics.json").read_text())
    assert comparison["models"] == ["model"] and comparison["synthetic"]["model"]["accuracy"] == pytest.approx(5 / 6)
    assert len((out / "model" / "results.jsonl").read_text().splitlines()) == 12


def test_model_arguments(tmp_path):
    assert eval_stage.parse_models(["base=a/b", "x-1=/c=d", "./e=f"]) == {
        "base": Path("a/b"), "x-1": Path("/c=d"), "model": Path("./e=f")}  # "./e" is no name: a path holding "="
    for specs, message in ((["a", "b"], "'model' is given twice"), (["m=a", "m=b"], "'m' is given twice"),
                           (["plots=a"], "reserved"), (["m="], "no path")):
        with pytest.raises(ValueError, match=message):
            eval_stage.parse_models(specs)


def test_a_missing_model_fails_before_any_model_runs(tmp_path, key_tasks, monkeypatch, capsys):
    loaded: list[str] = []
    monkeypatch.setattr(one_model, "make_engine", lambda r, p, model_path, seed: loaded.append(model_path) or
                        KeyEngine(lambda w: True))
    [base] = model_dirs(tmp_path, "base")
    code = eval_stage.main(["--params", str(write_params(tmp_path, key_tasks)), "--model", f"base={base}",
                            "--model", f"rl={tmp_path / 'no-such-model'}", "--out", str(tmp_path / "out"),
                            "--no-progress"])
    assert code == 2 and loaded == [] and "model rl" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_endpoint_engine_compares_no_models(tmp_path, key_tasks, capsys):
    params = yaml.safe_load(write_params(tmp_path, key_tasks).read_text())
    params["rollout"]["engine"] = "openai"
    (tmp_path / "openai.yaml").write_text(yaml.safe_dump(params))
    code = eval_stage.main(["--params", str(tmp_path / "openai.yaml"), "--model", "a=x", "--model", "b=y",
                            "--out", str(tmp_path / "out"), "--no-progress"])
    assert code == 2 and "give one --model" in capsys.readouterr().err


# --- The tiny model under two names: the same seed and sampling for every model ---------------------------------


def test_the_same_model_twice_gives_the_same_numbers_side_by_side_as_in_turn(tmp_path, tiny_model_dir, monkeypatch):
    """On the CPU the two models run side by side in spawned processes at one torch thread each
    (`model_processes: 2`; the default does so from 100 trajectories a model), and in turn in this process at
    torch's threads: the same files either way."""
    from loupe.data.synthetic import SyntheticConfig, generate_tasks
    from stages.eval import side_by_side

    generate_tasks(tmp_path / "tasks", SyntheticConfig(seed=3, train=0, val=0, test=3, canvas_side=(1024, 1100)))
    started: list[int] = []
    real = side_by_side.evaluate_side_by_side
    monkeypatch.setattr(eval_stage, "evaluate_side_by_side", lambda *a, **k: started.append(a[-2]) or real(*a, **k))
    outputs = {}
    for processes in (2, 1):
        params = write_params(tmp_path, tmp_path / "tasks", temperature=1.0, model_processes=processes)
        out = outputs[processes] = tmp_path / f"out-{processes}"
        assert eval_stage.main(["--params", str(params), "--model", f"first={tiny_model_dir}",
                                "--model", f"second={tiny_model_dir}", "--out", str(out), "--no-progress"]) == 0
    assert started == [2]  # model_processes 2 ran both models at once; 1 in turn
    # Sampled at temperature 1, yet byte for byte the same: each model starts from the same seed on the same tasks.
    for name in ("results.jsonl", "trajectories/synthetic.jsonl", "viewer.html"):
        texts = {(p, m): (outputs[p] / m / name).read_text() for p in outputs for m in ("first", "second")}
        assert len(set(texts.values())) == 1, name
    files = sorted(p.relative_to(outputs[2]) for p in outputs[2].rglob("*") if p.is_file())
    assert {f.relative_to(outputs[1]) for f in outputs[1].rglob("*") if f.is_file()} == set(files)
    timed = [f for f in files if f.name == "metrics.json"]  # they hold the seconds each took
    assert all((outputs[2] / f).read_bytes() == (outputs[1] / f).read_bytes() for f in files if f not in timed)
    comparison = json.loads((outputs[2] / "metrics.json").read_text())
    first, second = comparison["synthetic"]["first"], comparison["synthetic"]["second"]
    assert first == second and set(first["turn_scaling"]) == {"1", "2"}
    assert json.loads((outputs[1] / "metrics.json").read_text())["synthetic"]["first"] == first


def test_how_many_models_run_at_once():
    from stages.eval.side_by_side import model_processes

    assert model_processes(None, "transformers", "cpu", 3, 400) == 3
    assert model_processes(None, "transformers", "cpu", 3, 99) == 1  # a process's start would cost more than it saves
    assert model_processes(None, "transformers", "cpu", 1, 400) == 1
    assert model_processes(None, "vllm", "cpu", 3, 400) == 1
    assert model_processes(None, "transformers", "cuda", 3, 400) == 1
    assert model_processes(2, "transformers", "cpu", 3, 6) == 2
    assert model_processes(8, "vllm", "cuda", 3, 6) == 3  # a setting is taken as given, up to the models there are


def test_a_model_failing_side_by_side_fails_the_stage_naming_it(tmp_path, key_tasks, tiny_model_dir, capsys):
    (tmp_path / "empty").mkdir()  # no config, no weights: its process fails to load it
    params = write_params(tmp_path, key_tasks, model_processes=2)
    code = eval_stage.main(["--params", str(params), "--model", f"good={tiny_model_dir}",
                            "--model", f"bad={tmp_path / 'empty'}", "--out", str(tmp_path / "out"), "--no-progress"])
    assert code == 2
    assert f"{tmp_path / 'empty'}: not a Hugging Face model directory" in capsys.readouterr().err
    assert not (tmp_path / "out" / "metrics.json").exists()


def test_one_model_in_process_still_writes_into_its_folder(tmp_path, key_tasks, monkeypatch):
    """`evaluate` (one model, no comparison) is what the rl stage's tests and benchmarks/eval_memory.py call."""
    monkeypatch.setattr(one_model, "make_engine", lambda *a, **k: KeyEngine(lambda w: w == "cat"))
    metrics = eval_stage.evaluate(write_params(tmp_path, key_tasks), tmp_path / "model", tmp_path / "out",
                                  progress=False)
    assert metrics["benchmarks"]["synthetic"]["accuracy"] == 0.5
    assert json.loads((tmp_path / "out" / "metrics.json").read_text()) == metrics
    assert len((tmp_path / "out" / "results.jsonl").read_text().splitlines()) == 12


def test_killing_the_stage_stops_the_models_it_runs_side_by_side(tmp_path, tiny_model_dir):
    """SIGKILL to the stage alone (what a scheduler or `kill -9` does) ends its model processes too."""
    from loupe.data.synthetic import SyntheticConfig, generate_tasks

    # 40 questions x 64 samples: thousands of trajectories, minutes of work for each model on any CPU, so the stage is
    # killed mid-computation however fast the machine (the wait below is on the models' own CPU time, not a clock).
    generate_tasks(tmp_path / "tasks", SyntheticConfig(seed=3, train=0, val=0, test=40, canvas_side=(1024, 1100)))
    params = write_params(tmp_path, tmp_path / "tasks", temperature=1.0, model_processes=2, samples=64)
    stage = subprocess.Popen([sys.executable, "-m", "stages.eval", "--params", str(params), "--model",
                              f"a={tiny_model_dir}", "--model", f"b={tiny_model_dir}", "--out", str(tmp_path / "out"),
                              "--no-progress"], cwd=Path(__file__).resolve().parent.parent,
                             env={**os.environ, "LOUPE_TRACKING": "off"}, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        models: list[psutil.Process] = []
        while len(models) < 2 and time.monotonic() < deadline and stage.poll() is None:
            time.sleep(0.2)
            models = [c for c in psutil.Process(stage.pid).children()
                      if "spawn_main" in " ".join(c.cmdline()) and "resource_tracker" not in " ".join(c.cmdline())]
        assert len(models) == 2, "the two model processes never started"
        while time.monotonic() < deadline and min(sum(m.cpu_times()[:2]) for m in models) < 3.0:
            time.sleep(0.2)  # until each has computed for 3 s of CPU: loaded and rolling out
        assert all(m.is_running() for m in models) and stage.poll() is None
    finally:
        stage.kill()
        stage.wait()
    _, alive = psutil.wait_procs(models, timeout=5)
    assert not alive, [m.pid for m in alive]
    assert not (tmp_path / "out" / "metrics.json").exists()
