"""Slow: the images for real. Build the synth and eval images with podman, run both stages inside them on the
tiny model, and compare every output with a local run's; build the rl image and score one case per preset in the
image that scores it (tests/grader_cases.py: the rl image for the RL sections, the eval image for eval), each case
needing its rule's grader; check every lock file against its package index.

    .venv/bin/python -m pytest tests/test_containers_slow.py -m slow -q

The first build takes minutes (the eval image holds torch: ~6 GB); later ones reuse the cached stack layer and
take seconds. Needs root to install podman when missing (containers/setup-host.sh does it) and network access
to Debian's mirror and PyPI for the base image and the wheels; the builds themselves run with no network.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CONTAINERS = ROOT / "containers"
sys.path.insert(0, str(CONTAINERS))
import grader_cases  # tests/grader_cases.py
import locks  # containers/locks.py, a script beside the Dockerfiles

# Fields that measure time, not results: equal runs differ there and nowhere else.
TIMING_KEYS = {"seconds", "elapsed_s", "wall_s", "started", "finished", "created", "tok_s", "tokens_per_s"}


def _run(command: list[str], env: dict | None = None, timeout: int = 3600) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert result.returncode == 0, (f"{' '.join(command)} failed ({result.returncode}):\n"
                                    f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    """podman set up (installed when missing) and the synth and eval images built offline, as `make images` does."""
    _run(["containers/setup-host.sh"])
    _run(["containers/build.sh", "synth", "eval"])
    labels = {}
    for stage in ("synth", "eval"):
        out = _run(["podman", "image", "inspect", "--format", "{{json .Config.Labels}}", f"loupe-{stage}:latest"])
        labels[stage] = json.loads(out.stdout)
    return labels


@pytest.fixture(scope="module")
def rl_image() -> None:
    """The rl image built offline (about 5 minutes the first time: its stack holds torch and Ray)."""
    _run(["containers/setup-host.sh"])
    _run(["containers/build.sh", "rl"])


@pytest.fixture(scope="module")
def case(tmp_path_factory, tiny_model_dir) -> dict[str, Path]:
    """A small params file, synthetic tasks and the tiny model, all outside the workspace (so mounted by path)."""
    base = tmp_path_factory.mktemp("containers")
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["data"]["zoom"].update(train=4, val=2, test=3)
    params["synth"].update(limit=4, samples_per_task=2, shard_tasks=2)
    params["eval"].update(samples=2, max_turns=4, benchmarks=[{"name": "synthetic", "path": str(base / "tasks")}])
    (base / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    _run([sys.executable, "-m", "pipelines.cli", "data", "tasks", "--out", str(base / "tasks"),
          "--params", str(base / "params.yaml")])
    return {"base": base, "params": base / "params.yaml", "tasks": base / "tasks", "model": tiny_model_dir}


def _comparable(value):
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items() if k not in TIMING_KEYS}
    if isinstance(value, list):
        return [_comparable(v) for v in value]
    return value


def _contents(folder: Path) -> dict[str, object]:
    """Every file under folder: parsed JSON (timings dropped) for .json/.jsonl, bytes otherwise."""
    contents = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = str(path.relative_to(folder))
        if path.suffix == ".json":
            contents[rel] = _comparable(json.loads(path.read_text()))
        elif path.suffix == ".jsonl":
            contents[rel] = [_comparable(json.loads(line)) for line in path.read_text().splitlines() if line]
        else:
            contents[rel] = path.read_bytes()
    return contents


def _local_then_container(stage: str, args: list[str], out: Path, tmp: Path) -> tuple[dict, dict, dict]:
    """The stage locally, then in its image, both writing to `out` (so any path they record is the same)."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}", "LOUPE_TRACKING": "on",
           "LOUPE_EXPERIMENT": "containers-test"}
    env.pop("LOUPE_CONTAINER", None)
    _run([sys.executable, "-m", "pipelines.cli", "stage", stage, "--local", *args, "--out", str(out)], env)
    local = _contents(out)
    out.rename(out.with_name(out.name + "-local"))
    result = _run([sys.executable, "-m", "pipelines.cli", "stage", stage, *args, "--out", str(out)],
                  {**env, "LOUPE_CONTAINER": "podman"})
    assert f"in loupe-{stage}:latest (podman)" in result.stderr
    return local, _contents(out), env


def _mlflow_runs(tmp: Path, stage: str) -> list:
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp / 'mlflow.db'}")
    return mlflow.search_runs(experiment_names=["containers-test"], filter_string=f"tags.`loupe.stage` = '{stage}'",
                              output_format="list")


def _assert_same(local: dict, container: dict) -> None:
    assert sorted(local) == sorted(container)
    differing = [name for name in local if local[name] != container[name]]
    assert not differing, f"outputs differ between the local and the container run: {differing}"


def test_images_are_labelled_and_run_as_non_root(images):
    for stage, labels in images.items():
        assert labels["io.loupe.stage"] == stage and labels["io.loupe.stack"] == "cpu"
        assert labels["org.opencontainers.image.version"] == "0.1.0"
        assert len(labels["org.opencontainers.image.revision"].split("-")[0]) == 40
    user = _run(["podman", "run", "--rm", "--entrypoint", "id", "loupe-eval:latest", "-u"]).stdout.strip()
    assert user == "10001"


def test_synth_in_its_image_matches_a_local_run(images, case):
    out = case["base"] / "synth"
    local, container, _ = _local_then_container(
        "synth", ["--params", str(case["params"]), "--tasks", str(case["tasks"])], out, case["base"])
    assert "dataset/loupe_synth.json" in local and "dataset/dataset_info.json" in local
    assert any(name.startswith("dataset/images/") for name in local)
    _assert_same(local, container)
    # Both runs were tracked in the one store the container reached through the passed-through variables.
    runs = _mlflow_runs(case["base"], "synth")
    assert len(runs) == 2 and all(r.data.tags.get("git_commit", "unknown") != "unknown" for r in runs)


def test_eval_in_its_image_matches_a_local_run(images, case):
    out = case["base"] / "eval"
    local, container, _ = _local_then_container(
        "eval", ["--params", str(case["params"]), "--model", str(case["model"])], out, case["base"])
    assert local["metrics.json"]["synthetic"]["samples_per_question"] == 2  # the comparison, of one model
    assert "model/trajectories/synthetic.jsonl" in local and "model/plots/turn_scaling.png" in local
    _assert_same(local, container)
    assert len(_mlflow_runs(case["base"], "eval")) == 2


def test_container_outputs_belong_to_the_caller(images, case):
    out = case["base"] / "eval"
    owners = {(p.stat().st_uid, p.stat().st_gid) for p in out.rglob("*")}
    assert owners == {(os.getuid(), os.getgid())}


@pytest.mark.parametrize("image", ["rl", "eval"])
def test_each_preset_scores_in_the_image_that_scores_it(image, request, tmp_path):
    """Every grader case of the sections `image` scores, run by tests/grader_cases.py inside the image (no network:
    the judge cases' fake server is on the container's loopback), on the image's own code and stack: each scores
    its expected total, with its graders imported there. The rl image scores a case of every preset."""
    request.getfixturevalue("rl_image" if image == "rl" else "images")
    cases = [c for c in grader_cases.CASES
             if grader_cases.scoring_sections(grader_cases.read_preset(c.preset))[c.section] == image]
    payload = tmp_path / "payload.json"
    payload.write_text(json.dumps([grader_cases.payload(c) for c in cases]))
    result = _run(["podman", "run", "--rm", "--network", "none", "--user", f"{os.getuid()}:{os.getgid()}",
                   "--volume", f"{ROOT}:{ROOT}:ro", "--volume", f"{tmp_path}:{tmp_path}:ro", "--workdir", str(ROOT),
                   "--entrypoint", "python", f"loupe-{image}:latest", "tests/grader_cases.py", str(payload)])
    runs = {r["id"]: r for r in (json.loads(line) for line in result.stdout.splitlines() if line.startswith("{"))}
    for c in cases:
        run = runs[c.id]
        assert "error" not in run, f"{c.id} in loupe-{image}: {run.get('traceback') or run.get('error')}"
        assert run["total"] == pytest.approx(c.total) and run["accuracy"] == pytest.approx(c.accuracy), \
            f"{c.id} in loupe-{image}: {run['total']} ({run['matched_by']}), expected {c.total}: {c.why}"
        assert set(c.graders) <= set(run["distributions"]), (c.id, c.graders, run["distributions"])
    if image == "rl":
        assert {c.preset for c in cases} == {c.preset for c in grader_cases.CASES}


@pytest.mark.parametrize("name", list(locks.TARGETS))
def test_lock_resolves_against_its_index(name):
    """Every pinned file is on the index at its hash for the image's interpreter and platform, and the lock
    holds every dependency its packages declare (GPU locks included, though they cannot run here)."""
    problems = locks.check(locks.TARGETS[name])
    assert not problems, "\n".join(problems)
