"""End to end: `loupe run` on a scratch copy of this checkout with reduced params, every stage for real.

Checks every stage's outputs, `dvc metrics show`, the MLflow parent and child runs with lineage tags equal to
dvc.lock's hashes, the data sets recorded as run inputs, the registered model; then that a second run skips
every stage, and that `dvc exp run -S eval.samples=...` reruns eval alone. Minutes on two cores: `-m slow`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from benchmarks.pipeline_overhead import scratch_copy

ROOT = Path(__file__).resolve().parents[1]
STAGES = ["data", "synth", "sft", "rl", "eval"]

# Small enough for two cores; each override names a key its section's model defines.
REDUCED = {
    "data": {"zoom": {"train": 6, "val": 2, "test": 2, "canvas_side": [1024, 1200]}},
    "synth": {"samples_per_task": 1, "viewer_trajectories": 4},
    "sft": {"max_steps": 2, "logging_steps": 1, "save_steps": 1},
    "rl": {"steps": 1, "prompts_per_step": 2, "samples_per_prompt": 2, "val_every": 0, "checkpoint_every": 1,
           "sample_trajectories_every": 0},
    "eval": {"samples": 1, "max_turns": 2, "viewer_trajectories": 4},
}


def merged(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = merged(base.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def reduced_params(dest: Path) -> Path:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    missing = [s for s in STAGES[1:] if s not in params]
    assert not missing, f"params.yaml has no {missing} section"
    for section, overrides in REDUCED.items():
        params[section] = merged(params.get(section) or {}, {k: v for k, v in overrides.items()})
    dest.write_text(yaml.safe_dump(params, sort_keys=False))
    return dest


def loupe(repo: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "LOUPE_PARENT_RUN_ID",
                                                             "PREFECT_API_URL", "PREFECT_HOME", "LOUPE_ARTIFACT_ROOT")}
    env.update(LOUPE_TRACKING="on", DVC_NO_ANALYTICS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return subprocess.run([sys.executable, "-m", *args], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=1800)


def table_rows(stdout: str) -> dict[str, str]:
    """The summary table's rows by stage: the lines under its header, up to the first that is not a row."""
    rows: dict[str, str] = {}
    for line in stdout[stdout.index("stage  status"):].splitlines()[2:]:
        if not line.split() or line.split()[0] not in STAGES:
            break
        rows[line.split()[0]] = line
    return rows


@pytest.mark.slow
def test_loupe_run_end_to_end_then_everything_is_skipped(tmp_path):
    import mlflow

    repo = scratch_copy(tmp_path / "repo", reduced_params(tmp_path / "params.yaml"))
    first = loupe(repo, "pipelines.cli", "run")
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    rows = table_rows(first.stdout)
    assert list(rows) == STAGES and all(" ran " in rows[s] for s in STAGES), first.stdout[-3000:]
    assert "dvc metrics show" in first.stdout and "make ui" in first.stdout and "viewer.html" in first.stdout

    # Every stage's outputs.
    work = repo / "work"
    for path in ("models/tiny/config.json", "data/tasks/train.jsonl", "synth/dataset/dataset_info.json",
                 "synth/viewer.html", "sft/model/config.json", "rl/model/config.json", "eval/metrics.json",
                 "eval/rl/viewer.html", "eval/sft/metrics.json", "eval/base/results.jsonl",
                 "eval/plots/turn_scaling.json", "eval/plots/comparison.png"):
        assert (work / path).is_file(), path
    from transformers import AutoModelForImageTextToText

    assert AutoModelForImageTextToText.from_pretrained(work / "rl" / "model") is not None
    shown = json.loads(subprocess.run([sys.executable, "-m", "dvc", "metrics", "show", "--json"], cwd=repo,
                                      capture_output=True, text=True, check=True).stdout)
    files = next(iter(shown.values()))["data"]
    assert {f"work/{s}/metrics.json" for s in STAGES} <= set(files)
    plots = subprocess.run([sys.executable, "-m", "dvc", "plots", "show", "-o", str(tmp_path / "plots")], cwd=repo,
                           capture_output=True, text=True, check=True)
    page = (tmp_path / "plots" / "index.html").read_text()
    assert "Accuracy vs turn limit" in page and "SFT training loss" in page, plots.stdout

    # MLflow: one parent, a finished child per stage, lineage tags equal to dvc.lock.
    mlflow.set_tracking_uri(f"sqlite:///{work / 'mlflow.db'}")
    [parent] = mlflow.search_runs(experiment_names=["loupe"], filter_string="tags.`loupe.pipeline` = 'true'",
                                  output_format="list")
    children = {r.data.tags["loupe.stage"]: r for r in mlflow.search_runs(
        experiment_names=["loupe"], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'",
        output_format="list")}
    assert set(children) == set(STAGES) and all(r.info.status == "FINISHED" for r in children.values())
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    for stage, run in children.items():
        tags = run.data.tags
        assert tags["git_commit"] == commit and tags["git_dirty"] == "false"
        for dep in lock[stage]["deps"]:
            assert tags[f"dvc.dep.{dep['path']}"] == dep["md5"], (stage, dep["path"])
        for out in lock[stage]["outs"]:
            assert tags[f"dvc.out.{out['path']}"] == out["md5"], (stage, out["path"])
    # The chain: eval's model is rl's output, rl's is sft's, sft's data is synth's.
    assert children["eval"].data.tags["dvc.dep.work/rl/model"] == children["rl"].data.tags["dvc.out.work/rl/model"]
    assert children["rl"].data.tags["dvc.dep.work/sft/model"] == children["sft"].data.tags["dvc.out.work/sft/model"]
    assert children["sft"].data.tags["dvc.dep.work/synth/dataset"] == \
        children["synth"].data.tags["dvc.out.work/synth/dataset"]
    inputs = {stage: {d.dataset.name for d in run.inputs.dataset_inputs} for stage, run in children.items()}
    assert "tasks/train" in inputs["synth"] and "loupe_synth" in inputs["sft"] and "tasks/test" in inputs["eval"]
    [version] = mlflow.MlflowClient().search_model_versions("name = 'loupe'")
    assert version.run_id == children["rl"].info.run_id
    assert version.tags["dvc.md5"] == children["rl"].data.tags["dvc.out.work/rl/model"]

    # A second run finds nothing to do.
    second = loupe(repo, "pipelines.cli", "run")
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-4000:]
    rows = table_rows(second.stdout)
    assert all(" skipped " in rows[s] for s in STAGES), second.stdout[-3000:]
    for stage in STAGES:  # each row points at the run that made the outputs in the workspace
        assert children[stage].info.run_id in rows[stage]
    assert len(mlflow.MlflowClient().search_model_versions("name = 'loupe'")) == 1

    # An eval parameter through `dvc exp run -S` reruns eval and nothing else.
    # (DVC runs `loupe stage ...`: the project's environment comes first on PATH, as with an activated venv.)
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    experiment = subprocess.run([sys.executable, "-m", "dvc", "exp", "run", "-S", "eval.samples=2"], cwd=repo,
                                capture_output=True, text=True,
                                env={**os.environ, "LOUPE_TRACKING": "off", "DVC_NO_ANALYTICS": "1", "PATH": path})
    assert experiment.returncode == 0, experiment.stdout[-3000:] + experiment.stderr[-3000:]
    ran = [s for s in STAGES if f"Running stage '{s}'" in experiment.stdout]
    assert ran == ["eval"], experiment.stdout[-3000:]
    assert json.loads((work / "eval" / "metrics.json").read_text())["synthetic"]["samples_per_question"] == 2


FAMILY_TEMPLATES = {"qwen3_vl": "qwen3_vl_nothink", "qwen3_vl_moe": "qwen3_vl_nothink", "qwen3_5": "qwen3_5_nothink"}


@pytest.mark.families
@pytest.mark.parametrize("family", sorted(FAMILY_TEMPLATES))
def test_each_family_runs_the_five_stages_through_loupe_run(family, tmp_path):
    """A tiny model of each current family, built offline by the data stage, through every stage of `loupe run` (a
    few steps each; the default's Qwen2.5-VL runs above): SFT on LLaMA-Factory's template for the family, RL on
    the transformers engine (Qwen3.5's linear-attention states kept between turns), eval of base, SFT and RL."""
    from loupe.models.family import read_family

    params = yaml.safe_load(reduced_params(tmp_path / "params.yaml").read_text())
    params["model"].update(tiny_family=family, tiny_perception_steps=0)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    repo = scratch_copy(tmp_path / "repo", tmp_path / "params.yaml")
    run = loupe(repo, "pipelines.cli", "run")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    rows = table_rows(run.stdout)
    assert list(rows) == STAGES and all(" ran " in rows[s] for s in STAGES), run.stdout[-3000:]
    work = repo / "work"
    for model in ("models/tiny", "sft/model", "rl/model"):
        assert read_family(work / model).name == family, model
    train_yaml = yaml.safe_load((work / "sft" / "llamafactory" / "train.yaml").read_text())
    assert train_yaml["template"] == FAMILY_TEMPLATES[family]
    assert read_family(work / "rl" / "model").image_factor == 32  # 16-px patches merged 2 x 2
    evaluated = json.loads((work / "eval" / "metrics.json").read_text())
    assert {"base", "sft", "rl"} <= set(evaluated["models"]), evaluated
