"""Orchestration: dvc.yaml against the stages' code and params, lineage tags on a tiny fake DVC pipeline, the
stage runner (ran / skipped / retried / bad input), the summary table, and the GPU preset.

The fake pipeline is a real git + DVC repository in a temporary folder with two stages (`make` writes a task
JSONL, `use` reads it and writes a "model"), each a Python process that opens its MLflow run with
loupe.tracking.stage_run, exactly as the real stages do.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from loupe.config import ModelParams, ProtocolParams, RolloutParams, load_section
from loupe.tracking import digest, find_stage_run, lock_lineage, pipeline_run
from pipelines.dvc_runner import (
    RAN,
    RESTORED,
    SKIPPED,
    StageFailed,
    repro_stage,
    stage_environment,
    stage_names,
)
from pipelines.params import PipelineParams
from pipelines.summary import format_table, key_metrics

ROOT = Path(__file__).resolve().parents[1]
DVC_YAML = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
SECTION_CALL = re.compile(r"load_section\(\s*\w+\s*,\s*\"([\w.]+)\"")
SECTION_ARGUMENT = re.compile(r"section: str = \"([\w.]+)\"")
"""A function taking the section's name (`read_inputs(..., section="rl")`) and passing it to load_section."""


# ------------------------------------------------------------------------------------------------------
# dvc.yaml against the code and params.yaml


def _code_deps(stage: str) -> list[Path]:
    return [ROOT / d for d in DVC_YAML[stage]["deps"] if (ROOT / d).exists() and d != "loupe"
            and ((ROOT / d).suffix == ".py" or (ROOT / d / "__init__.py").exists())]


def sections_read_by(stage: str) -> set[str]:
    """The params sections a stage's own code validates: load_section(Model, "name") and load_seed()."""
    sections: set[str] = set()
    for code in _code_deps(stage):
        for file in [code] if code.is_file() else sorted(code.rglob("*.py")):
            text = file.read_text()
            sections |= {name.split(".")[0] for name in SECTION_CALL.findall(text)}
            if re.search(r"load_section\(\s*\w+\s*,\s*section\b", text):
                sections |= set(SECTION_ARGUMENT.findall(text))
            if "load_seed(" in text:
                sections.add("seed")
    return sections


def test_dvc_yaml_has_the_five_stages_in_dependency_order():
    assert list(DVC_YAML) == ["data", "synth", "sft", "rl", "eval"]
    produced: set[str] = set()
    for name, spec in DVC_YAML.items():
        for dep in spec["deps"]:
            if dep.startswith("work/"):
                assert dep in produced, f"{name} reads {dep} before any earlier stage writes it"
        produced |= {next(iter(o)) if isinstance(o, dict) else o for o in spec.get("outs", [])}


@pytest.mark.parametrize("stage", list(DVC_YAML))
def test_each_stage_declares_exactly_the_sections_its_code_reads(stage):
    assert _code_deps(stage), f"dvc.yaml's stage {stage} depends on no code in the tree"
    declared = set(DVC_YAML[stage]["params"])
    assert declared == sections_read_by(stage)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    missing = [s for s in declared if s not in params]
    assert not missing, f"params.yaml has no section {missing} that stage {stage} reads"


@pytest.mark.parametrize("stage", list(DVC_YAML))
def test_each_stage_follows_the_stage_contract(stage):
    spec = DVC_YAML[stage]
    cmd = spec["cmd"].split()
    # A stage package runs through `loupe stage NAME` (here, or in its image under LOUPE_CONTAINER); the data
    # stage, which has no image, as a module.
    launcher = ["loupe", "stage", stage] if stage != "data" else ["python", "-m", "pipelines.data_stage"]
    assert cmd[:3] == launcher and cmd[cmd.index("--params") + 1] == "params.yaml"
    out = Path(cmd[cmd.index("--out") + 1])
    # Every input path the command names is a declared dependency, and its code is too.
    for at, word in enumerate(cmd[:-1]):
        if word in ("--tasks", "--model", "--dataset"):  # eval's --model is NAME=PATH, repeated
            assert cmd[at + 1].split("=", 1)[-1] in spec["deps"], f"{stage}: {word} {cmd[at + 1]} is not a dep"
    assert "loupe" in spec["deps"] and _code_deps(stage) or not (ROOT / "stages" / stage).exists()
    # Outputs, metrics and plots lie in its --out folder (the data stage also builds the tiny model).
    paths = [next(iter(p)) if isinstance(p, dict) else p for key in ("outs", "metrics", "plots") for p in spec[key]]
    for path in paths:
        assert Path(path).is_relative_to(out) or (stage == "data" and path == "work/models/tiny"), path
    assert spec["metrics"] == [f"{out}/metrics.json"]
    assert all(Path(p).suffix in (".json", ".png") for p in paths if "/plots/" in p)


def test_dvc_reads_the_dag_with_its_own_parser():
    from dvc.repo import Repo

    with Repo(str(ROOT)) as repo:
        stages = {s.name: s for s in repo.index.stages}
    assert set(stages) == set(DVC_YAML)
    # The templates resolved: sft trains the model params.yaml names (the data stage's tiny model by default);
    # synth and rl read the task folder the pipeline section names.
    model_path = load_section(ModelParams, "model", ROOT / "params.yaml").path
    tasks = load_section(PipelineParams, "pipeline", ROOT / "params.yaml").tasks
    assert model_path in [d.def_path for d in stages["sft"].deps]
    assert f"--model {model_path} " in stages["sft"].cmd
    for name in ("synth", "rl"):
        assert tasks in [d.def_path for d in stages[name].deps] and f"--tasks {tasks} " in stages[name].cmd
    assert stage_names(ROOT) == list(DVC_YAML)


def test_the_gpu_preset_validates_against_every_section_model():
    from loupe.data.families import DataParams
    from stages.eval.params import EvalParams

    preset = ROOT / "params" / "mini-o3.yaml"
    models = {"model": ModelParams, "protocol": ProtocolParams, "rollout": RolloutParams, "data": DataParams,
              "eval": EvalParams, "pipeline": PipelineParams}
    for stage, module, cls in (("synth", "stages.synth.params", "SynthParams"), ("sft", "stages.sft.params", "SftParams"),
                               ("rl", "stages.rl.params", "RLParams")):
        try:
            models[stage] = getattr(__import__(module, fromlist=[cls]), cls)
        except (ImportError, AttributeError):
            pass
    for name, model in models.items():
        load_section(model, name, preset)  # raises ParamsError naming the key on any mismatch
    sections = yaml.safe_load(preset.read_text())
    main = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert set(sections) == set(main), "the preset mirrors params.yaml's sections"
    protocol = load_section(ProtocolParams, "protocol", preset)
    assert (protocol.min_pixels, protocol.max_pixels, protocol.max_turns) == (40000, 2000000, 6)
    evaluation = load_section(EvalParams, "eval", preset)
    assert evaluation.max_turns == 32 and evaluation.samples == 32


# ------------------------------------------------------------------------------------------------------
# The summary table


def test_key_metrics_prefer_accuracy_and_skip_breakdowns():
    metrics = {"seconds": 3.0, "benchmarks.synthetic.turn_scaling.1": 0.1, "benchmarks.synthetic.mean_turns": 2.0,
               "benchmarks.synthetic.avg@4": 0.25, "benchmarks.synthetic.pass@4": 0.5, "loss": 1.5}
    assert list(key_metrics(metrics)) == ["benchmarks.synthetic.avg@4", "benchmarks.synthetic.pass@4", "loss"]


def test_summary_table_lines_up_its_columns():
    rows = [{"stage": "data", "status": "skipped", "seconds": 0.7, "key_metrics": {"tasks.train": 32},
             "outputs": ["work/data/tasks", "work/data/metrics.json"], "mlflow_run": "abc"},
            {"stage": "eval", "status": "ran (2 tries)", "seconds": 61.25, "key_metrics": {"avg@2": 0.125},
             "outputs": [], "mlflow_run": None}]
    lines = format_table(rows).splitlines()
    assert lines[0].split() == ["stage", "status", "seconds", "key", "metrics", "outputs", "MLflow", "run"]
    assert "work/data/tasks +1" in lines[2] and "ran (2 tries)" in lines[3] and "61.2" in lines[3]
    assert lines[2].index("skipped") == lines[3].index("ran (2 tries)") == lines[0].index("status")


# ------------------------------------------------------------------------------------------------------
# A fake two-stage DVC pipeline with real MLflow runs

FAKE_STAGE = textwrap.dedent('''
    """A stand-in stage: `make` writes task records, `use` reads them and writes a model folder."""
    import json, os, sys
    from pathlib import Path
    import yaml
    from loupe.tracking import stage_run

    name = sys.argv[1]
    section = yaml.safe_load(Path("params.yaml").read_text())[name]
    if section.get("in_image"):  # what a stage in a container image sees: no DVC, so no DVC_STAGE
        os.environ.pop("DVC_STAGE", None)
    with stage_run(name, params={name: section}) as run:
        if section.get("exit"):
            print(f"{name}: bad input", file=sys.stderr)
            sys.exit(section["exit"])
        if section.get("flaky") and not Path("flaky.marker").exists():
            Path("flaky.marker").write_text("failed once")
            sys.exit(1)
        if name == "make":
            tasks = Path("out/tasks")
            tasks.mkdir(parents=True, exist_ok=True)
            rows = [{"doc_id": f"t{i}", "images": ["a.png"], "problem": "q?", "solution": "A"} for i in range(section["n"])]
            (tasks / "train.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
            metrics = {"tasks": {"train": len(rows)}}
        else:
            count = len(Path("out/tasks/train.jsonl").read_text().splitlines())
            model = Path("out/use/model")
            model.mkdir(parents=True, exist_ok=True)
            (model / "config.json").write_text(json.dumps({"tasks": count, "scale": section["scale"]}))
            metrics = {"accuracy": count * section["scale"], "seconds": 0.1}
        Path(f"out/{name}").mkdir(parents=True, exist_ok=True)
        Path(f"out/{name}/metrics.json").write_text(json.dumps(metrics))
        run.log_metrics(metrics)
        print(f"{name}: done")
''')

FAKE_DVC_YAML = {
    "stages": {
        "make": {"cmd": "python fake_stage.py make", "deps": ["fake_stage.py"], "params": ["make"],
                 "outs": ["out/tasks"], "metrics": ["out/make/metrics.json"]},
        "use": {"cmd": "python fake_stage.py use", "deps": ["fake_stage.py", "out/tasks"], "params": ["use"],
                "outs": ["out/use/model"], "metrics": ["out/use/metrics.json"]},
    }
}


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout


def write_params(repo: Path, make: dict | None = None, use: dict | None = None, pipeline: dict | None = None) -> None:
    params = {"make": make or {"n": 3}, "use": use or {"scale": 0.5},
              "pipeline": pipeline or {"model_stage": "use", "model_path": "out/use/model", "retry_delay_s": 0}}
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def make_fake_repo(repo: Path) -> Path:
    repo.mkdir(parents=True)
    (repo / "fake_stage.py").write_text(FAKE_STAGE)
    (repo / "dvc.yaml").write_text(yaml.safe_dump(FAKE_DVC_YAML, sort_keys=False))
    (repo / ".gitignore").write_text("/out/\n/work/\n/flaky.marker\n")
    write_params(repo)
    _git(repo, "init", "-q")
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=repo, check=True,
                   env={**os.environ, "DVC_NO_ANALYTICS": "1"})
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "fake pipeline")
    return repo


@pytest.fixture
def tracked(tmp_path, monkeypatch):
    """MLflow on, with its store in the test's folder; returns the mlflow module pointed at it."""
    import mlflow

    monkeypatch.setenv("LOUPE_TRACKING", "on")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("LOUPE_ARTIFACT_ROOT", (tmp_path / "artifacts").as_uri())
    monkeypatch.setenv("LOUPE_EXPERIMENT", "fake")
    monkeypatch.delenv("LOUPE_PARENT_RUN_ID", raising=False)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    return mlflow


def test_stage_runs_carry_the_lineage_dvc_lock_records(tmp_path, tracked):
    from pipelines.flow import _stage_runs

    repo = make_fake_repo(tmp_path / "repo")
    write_params(repo, make={"n": 3, "in_image": True})  # `make` runs as in a container: no DVC inside
    _git(repo, "commit", "-q", "-am", "make runs in an image")
    with pipeline_run("pipeline") as parent:
        results = [repro_stage(s, repo, stage_environment(), echo=False) for s in ("make", "use")]
        assert "dvc.outs_md5" not in find_stage_run("make", parent_run_id=parent.run_id).data.tags
        runs = _stage_runs(repo, results, parent.run_id)  # the flow fills in dvc.lock's hashes
    assert [r.status for r in results] == [RAN, RAN]
    assert find_stage_run("make", parent_run_id=parent.run_id).data.tags["dvc.lineage_source"] == "dvc.lock"
    assert "dvc.lineage_source" not in find_stage_run("use", parent_run_id=parent.run_id).data.tags
    assert runs == {s: find_stage_run(s, parent_run_id=parent.run_id).info.run_id for s in ("make", "use")}
    lines: list[str] = []
    again = [repro_stage(s, repo, stage_environment(), on_line=lines.append, echo=False) for s in ("make", "use")]
    assert [r.status for r in again] == [SKIPPED, SKIPPED]
    assert any("didn't change" in line for line in lines)

    commit = _git(repo, "rev-parse", "HEAD").strip()
    for stage in ("make", "use"):
        run = find_stage_run(stage, parent_run_id=parent.run_id)
        lock = lock_lineage(stage, repo / "dvc.lock")
        tags = run.data.tags
        assert tags["mlflow.parentRunId"] == parent.run_id and tags["dvc.stage"] == stage
        assert tags["git_commit"] == commit and tags["git_dirty"] == "false"  # dvc.lock and outputs don't count
        assert {k.removeprefix("dvc.dep."): v for k, v in tags.items() if k.startswith("dvc.dep.")} == lock.deps
        assert {k.removeprefix("dvc.out."): v for k, v in tags.items() if k.startswith("dvc.out.")} == lock.outs
        assert tags["dvc.params_md5"] == digest(lock.params)
        # A skipped stage's outputs trace back to the run that made them.
        assert find_stage_run(stage, outs_md5=digest(lock.outs)).info.run_id == run.info.run_id
    use_run = find_stage_run("use", parent_run_id=parent.run_id)
    assert use_run.data.params["dvc.params.use.scale"] == "0.5"
    [dataset] = use_run.inputs.dataset_inputs
    task_file = repo / "out" / "tasks" / "train.jsonl"
    import hashlib

    assert dataset.dataset.name == "tasks/train" and dataset.dataset.digest == hashlib.md5(task_file.read_bytes()).hexdigest()
    assert {t.key: t.value for t in dataset.tags}["records"] == "3"

    # Changing one stage's params puts that stage alone out of date.
    write_params(repo, make={"n": 3, "in_image": True}, use={"scale": 0.25})
    status = subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], cwd=repo, capture_output=True,
                            text=True, check=True, env=stage_environment()).stdout
    assert set(json.loads(status)) == {"use"}
    # Outputs lost but inputs unchanged: DVC's run cache restores them without running the stage.
    write_params(repo, make={"n": 3, "in_image": True}, use={"scale": 0.5})
    import shutil

    shutil.rmtree(repo / "out" / "use")
    assert repro_stage("use", repo, stage_environment(), echo=False).status == RESTORED
    assert json.loads((repo / "out" / "use" / "model" / "config.json").read_text()) == {"tasks": 3, "scale": 0.5}


def test_a_failing_stage_reports_its_exit_status_and_log(tmp_path, monkeypatch):
    monkeypatch.setenv("LOUPE_TRACKING", "off")
    repo = make_fake_repo(tmp_path / "repo")
    write_params(repo, make={"n": 1, "exit": 2})
    with pytest.raises(StageFailed) as failed:
        repro_stage("make", repo, stage_environment(), echo=False)
    assert failed.value.result.exit_status == 2 and "make: bad input" in failed.value.result.log_tail
    assert "stage make failed" in str(failed.value)


# ------------------------------------------------------------------------------------------------------
# The Prefect flow on the fake pipeline


def test_retry_decision_spares_bad_input():
    from types import SimpleNamespace

    from pipelines.dvc_runner import FAILED, StageResult
    from pipelines.flow import _worth_retrying

    def state(error):
        return SimpleNamespace(data=error)

    bad_input = StageFailed(StageResult("sft", FAILED, 1.0, 255, exit_status=2))
    crashed = StageFailed(StageResult("sft", FAILED, 1.0, 255, exit_status=137))
    assert not _worth_retrying(None, None, state(bad_input))
    assert _worth_retrying(None, None, state(crashed)) and _worth_retrying(None, None, state(OSError("disk")))


def run_flow(repo: Path, prefect_home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_HOME": str(prefect_home)}
    env.pop("PREFECT_API_URL", None)
    return subprocess.run([sys.executable, "-m", "pipelines.flow", *args], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow  # two flow runs, each starting Prefect's temporary server: about a minute
def test_the_flow_retries_summarises_registers_and_skips_on_rerun(tmp_path, tracked):
    repo = make_fake_repo(tmp_path / "repo")
    write_params(repo, use={"scale": 0.5, "flaky": True})
    first = run_flow(repo, tmp_path / "prefect")
    assert first.returncode == 0, first.stdout + first.stderr
    table = first.stdout[first.stdout.index("stage  status"):]
    rows = {line.split()[0]: line for line in table.splitlines()[2:4]}
    assert "ran" in rows["make"] and "ran (2 tries)" in rows["use"] and "accuracy=1.5" in rows["use"]
    assert "registered model: loupe v1" in first.stdout
    assert "use: done" in first.stdout  # the stage's own log came through

    [parent] = tracked.search_runs(experiment_names=["fake"], filter_string="tags.`loupe.pipeline` = 'true'",
                                   output_format="list")
    children = {r.data.tags["loupe.stage"]: r for r in tracked.search_runs(
        experiment_names=["fake"], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'",
        output_format="list") if r.info.status == "FINISHED"}
    assert set(children) == {"make", "use"}
    assert parent.data.tags["stage.use.status"] == "ran" and parent.data.tags["stage.use.run"] == children["use"].info.run_id
    [version] = tracked.MlflowClient().search_model_versions("name = 'loupe'")
    assert version.run_id == children["use"].info.run_id
    assert version.tags["dvc.md5"] == lock_lineage("use", repo / "dvc.lock").outs["out/use/model"]
    downloaded = Path(tracked.artifacts.download_artifacts(f"models:/loupe/{version.version}", dst_path=str(tmp_path / "dl")))
    assert json.loads((downloaded / "config.json").read_text())["tasks"] == 3

    second = run_flow(repo, tmp_path / "prefect")
    assert second.returncode == 0, second.stdout + second.stderr
    table = second.stdout[second.stdout.index("stage  status"):]
    rows = {line.split()[0]: line for line in table.splitlines()[2:4]}
    assert "skipped" in rows["make"] and "skipped" in rows["use"]
    assert children["use"].info.run_id in rows["use"]  # the run that made the outputs the table points at
    assert "already registered" in second.stdout
    assert len(tracked.MlflowClient().search_model_versions("name = 'loupe'")) == 1


@pytest.mark.slow  # a flow run with Prefect's temporary server; test_retry_decision covers the rule quickly
def test_the_flow_does_not_retry_bad_input(tmp_path, tracked):
    repo = make_fake_repo(tmp_path / "repo")
    write_params(repo, make={"n": 2, "exit": 2}, pipeline={"retries": 3, "retry_delay_s": 0})
    failed = run_flow(repo, tmp_path / "prefect")
    assert failed.returncode == 1
    assert failed.stdout.count("make: bad input") + failed.stderr.count("make: bad input") >= 1
    assert "Retry" not in failed.stdout + failed.stderr  # exit status 2: one attempt only
    assert re.search(r"make\s+failed", failed.stdout)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, seconds: float = 180) -> None:
    import time
    import urllib.request

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"no Prefect server at {url}")


@pytest.mark.slow  # a Prefect server, a deployment and a worker: a few minutes
def test_the_deployment_runs_on_a_prefect_server_through_a_worker(tmp_path, tracked):
    import shutil

    repo = make_fake_repo(tmp_path / "repo")
    shutil.copytree(ROOT / "pipelines", repo / "pipelines", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "prefect.yaml", repo / "prefect.yaml")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "flow code")
    api = f"http://127.0.0.1:{_free_port()}/api"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": api,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    prefect = [sys.executable, "-m", "prefect"]
    port = api.rsplit(":", 1)[1].split("/")[0]
    server = subprocess.Popen([*prefect, "server", "start", "--host", "127.0.0.1", "--port", port], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    worker = None
    try:
        _wait_healthy(api)
        for command in (["work-pool", "create", "loupe", "--type", "process"], ["--no-prompt", "deploy", "--all"]):
            subprocess.run([*prefect, *command], cwd=repo, env=env, check=True, capture_output=True, timeout=300)
        worker = subprocess.Popen([*prefect, "worker", "start", "--pool", "loupe"], cwd=tmp_path, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        run = subprocess.run([*prefect, "deployment", "run", "loupe-pipeline/loupe-pipeline", "--watch"], cwd=repo,
                             env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0 and "Completed" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
        flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", run.stdout).group(1)
        logs = subprocess.run([*prefect, "flow-run", "logs", flow_run_id], env=env, capture_output=True, text=True,
                              timeout=120).stdout
        assert "Running stage 'make'" in logs and "use: done" in logs  # the stages' own output reached the API
        assert (repo / "out" / "use" / "model" / "config.json").is_file()
        [parent] = tracked.search_runs(experiment_names=["fake"], filter_string="tags.`loupe.pipeline` = 'true'",
                                       output_format="list")
        assert parent.data.tags["stage.make.status"] == "ran"
    finally:
        for process in (worker, server):
            if process is not None:
                process.terminate()
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    process.kill()


def test_the_registered_model_is_tagged_with_its_own_column_of_the_comparison(tmp_path):
    from pipelines.flow import _eval_tags

    comparison = {"models": ["base", "rl"], "benchmarks": ["synthetic"], "turn_limits": [1, 2],
                  "synthetic": {"chance_rate": 0.25,
                                "base": {"accuracy": 0.0, "pass@2": 0.0, "turn_scaling": {"1": 0.0}},
                                "rl": {"accuracy": 0.8, "accuracy_ci_low": 0.75, "pass@2": 0.9,
                                       "turn_scaling": {"1": 0.25}}}}
    (tmp_path / "metrics.json").write_text(json.dumps(comparison))
    for name, path in (("base", "work/models/tiny"), ("rl", "work/rl/model")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.json").write_text(json.dumps({"model": path}))
    assert _eval_tags(tmp_path, "work/rl/model") == {"eval.synthetic.accuracy": 0.8,
                                                      "eval.synthetic.accuracy_ci_low": 0.75,
                                                      "eval.synthetic.pass_at_2": 0.9}
    assert _eval_tags(tmp_path, "work/other/model") == {}
