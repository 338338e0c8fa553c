"""Each recipe's CPU twin end to end (marked slow): `loupe run --params params/<recipe>-cpu.yaml` on a fresh clone
of this repository, through the Prefect flow, DVC and MLflow, in its own workspace; its RL stages must raise
their training reward (Pixelis': its task accuracy). About 6-12 minutes a recipe on 2 cores, the Pixelis twin
about 20, the operations twin about 21 and its test-time RL on a shifted set about 10 more (docs/recipes.md has
the figures).

    pytest -m slow tests/test_recipes_slow.py -k r1-v -s      # one recipe, with its figures printed
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelines.dvc_runner import stage_environment

REPO = Path(__file__).resolve().parent.parent
TWINS = ("r1-v", "lmm-r1", "easyr1-geo", "deepeyes", "pixel-reasoner", "mini-o3", "pixelis")
REWARD_KEY = {"pixelis": "reward/accuracy"}
"""The figure a twin's RL must raise: its total, except Pixelis', whose total is z-scored by running statistics
(about 0 by design), so its task accuracy."""


def training_rewards(stage_dir: Path, key: str = "reward/mean") -> list[float]:
    rows = [json.loads(line) for line in (stage_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row[key] for row in rows if row.get(key) is not None]


def improvement(rewards: list[float]) -> tuple[float, float]:
    """Mean training reward over the first and the last third of the steps (one step's batch is noisy)."""
    third = max(1, len(rewards) // 3)
    return statistics.mean(rewards[:third]), statistics.mean(rewards[-third:])


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("recipe", TWINS)
def test_the_cpu_twin_runs_end_to_end_and_rl_raises_its_reward(recipe, tmp_path):
    clone = tmp_path / "loupe"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(clone)], check=True)
    # The clone's code, not the checkout the virtual environment's editable install points at.
    env = stage_environment({**os.environ, "LOUPE_TRACKING": "on", "PYTHONPATH": str(clone),
                             "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    env.pop("LOUPE_PARENT_RUN_ID", None)
    env.pop("MLFLOW_TRACKING_URI", None)  # the clone's workspace keeps its own store
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "pipelines.cli", "run", "--params", f"params/{recipe}-cpu.yaml"],
                         cwd=clone, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    work = clone / "work" / "runs" / f"{recipe}-cpu" / "work"
    stages = sorted(p.parent.name for p in work.glob("rl*/metrics.jsonl"))
    assert "rl" in stages
    figures = {"seconds": round(seconds), "stages": {}}
    for stage in stages:
        first, last = improvement(training_rewards(work / stage, REWARD_KEY.get(recipe, "reward/mean")))
        figures["stages"][stage] = {"reward_first_third": round(first, 3), "reward_last_third": round(last, 3)}
        assert last > first, f"{recipe} {stage}: training reward {first:.3f} -> {last:.3f}"
    evaluation = json.loads((work / "eval" / "metrics.json").read_text())
    figures["eval"] = {k: v for k, v in _flatten(evaluation).items() if k.endswith(".accuracy")}
    assert figures["eval"], evaluation
    print(f"\n{recipe}-cpu: {json.dumps(figures)}")


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


OPERATION_OF_CATEGORY = {"operations/sign": "READ_TEXT(", "operations/shape": "SEGMENT_OBJECT_AT(",
                         "operations/motion": "TRACK_OBJECT("}


@pytest.fixture(scope="module")
def operations_twin(tmp_path_factory) -> tuple[Path, Path, dict[str, str]]:
    """params/pixelis-operations-cpu.yaml run once end to end on a fresh clone: (clone, run folder, environment),
    shared by the twin's test and the test-time RL scenario on its shifted set."""
    clone = tmp_path_factory.mktemp("operations") / "loupe"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(clone)], check=True)
    env = stage_environment({**os.environ, "LOUPE_TRACKING": "on", "PYTHONPATH": str(clone),
                             "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    env.pop("LOUPE_PARENT_RUN_ID", None)
    env.pop("MLFLOW_TRACKING_URI", None)
    run = subprocess.run([sys.executable, "-m", "pipelines.cli", "run", "--params",
                          "params/pixelis-operations-cpu.yaml"], cwd=clone, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return clone, clone / "work" / "runs" / "pixelis-operations-cpu", env


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_the_pixelis_operations_twin_runs_every_operation_and_learns_which_to_call(operations_twin):
    """params/pixelis-operations-cpu.yaml end to end: what the tiny model learns there is the operation each kind
    of question needs (docs/recipes.md), so that is what is checked, on the held-out questions, after SFT."""
    work = operations_twin[1] / "work"
    assert {"rl", "ttrl"} <= {p.parent.name for p in work.glob("*/metrics.jsonl")}
    rows = [json.loads(line) for line in (work / "eval" / "sft" / "trajectories" / "synthetic.jsonl").open()]
    asked = [r for r in rows if r["task"].get("category") in OPERATION_OF_CATEGORY]
    assert len(asked) == 160  # 80 operation questions x 2 samples
    right = sum(OPERATION_OF_CATEGORY[r["task"]["category"]] in next(
        (t["text"] for t in r["turns"] if t["role"] == "assistant"), "") for r in asked)
    # Measured 0.84 (2026-11-27); picking among the four calls a question could start with is 0.25.
    assert right / len(asked) >= 0.6, f"the right operation first in {right} of {len(asked)}"
    results = [t for r in asked for t in r["turns"] if t["role"] == "user" and t["text"].startswith("Result:")]
    assert results, "no operation's result reached the model"
    evaluation = json.loads((work / "eval" / "metrics.json").read_text())
    assert evaluation["synthetic"]["sft"]["accuracy_ci_low"] > evaluation["synthetic"]["chance_rate"]
    # Issue 45's bar, kind by kind on the 200 held-out questions: SFT at least twice each kind's chance (its
    # answers are balanced: 1 / its answer count), and RL keeping every kind within SFT's interval.
    from benchmarks.kind_table import kind_accuracies

    sft, rl = (kind_accuracies(work / "eval" / model / "results.jsonl") for model in ("sft", "rl"))
    chance = {"zoom": 1 / 4, "sign": 1 / 4, "shape": 1 / 3, "motion": 1 / 4}
    for kind, rate in chance.items():
        assert sft[kind]["accuracy"] >= 2 * rate, f"SFT {kind}: {sft[kind]}"
        assert rl[kind]["accuracy"] >= sft[kind]["low"], f"RL {kind} fell out of SFT's interval: {rl[kind]} vs {sft[kind]}"
    print(f"\npixelis-operations-cpu: right operation {right / len(asked):.2f}; "
          f"{json.dumps({m: evaluation['synthetic'][m]['accuracy'] for m in evaluation['models']})}")


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_test_time_rl_on_the_shifted_set_keeps_its_labels_right_and_does_no_harm(operations_twin):
    """Issue 45's scenario (benchmarks/ttrl_shift.py; docs/learning.md, "Test-time RL on a shifted set"): on shape
    and motion questions in colours training never showed, the twin's RL model is between 0.4 and 0.8 with
    pass@K well above it. The ttrl stage, with Pixelis' conservative update, trains on those questions without
    their labels: the confidence gate's labels must be right, and the update must not lower the accuracy out
    of the RL model's interval. (That it raises it with the intervals apart, the issue's bar, is not met at this
    scale: maj@K stays at Avg@K, measured 0.668 against 0.664.)"""
    clone, run, env = operations_twin
    done = subprocess.run([sys.executable, "-m", "benchmarks.ttrl_shift", "--run", str(run)], cwd=clone, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads((run / "work" / "shift" / "shift.json").read_text())
    rl, ttrl = figures["rl"], figures["ttrl"]
    k = figures["samples"]
    # Measured 0.664, pass@4 0.919 (2026-11-28).
    assert 0.4 <= rl["kinds"]["all"]["accuracy"] <= 0.8, rl["kinds"]["all"]
    assert rl[f"pass@{k}"] >= rl["kinds"]["all"]["accuracy"] + 0.15, rl
    log = figures["ttrl_log"]
    assert len(log) == 20 and all({"ttrl/pseudo_label_accuracy", "ttrl/groups_kept", "ttrl/buffer_hits"} <= set(row)
                                  for row in log), log
    kept = [row["ttrl/kept_label_accuracy"] for row in log if "ttrl/kept_label_accuracy" in row]
    assert kept and statistics.mean(kept) >= 0.9, kept  # measured 0.97
    # Measured 0.688 against the RL model's [0.609, 0.714].
    assert ttrl["kinds"]["all"]["accuracy"] >= rl["kinds"]["all"]["low"], (ttrl["kinds"]["all"], rl["kinds"]["all"])
    print(f"\nshifted set:\n{done.stdout}")
