"""Slow: the images for real. Build the synth and eval images with podman, run both stages inside them on the
tiny model, and compare every output with a local run's; build the rl image and score one case per preset in the
image that scores it (tests/grader_cases.py: the rl image for the RL sections, the eval image for eval), each case
needing its rule's grader; run every visual operation (`read_text` on a drawn sign among them) inside the synth, rl
and eval images (tests/visual_ops_cases.py); serve the tiny model from the eval image (`loupe serve`, as docs/containers.md runs it)
and ask it a question from the host; check every lock file against its package index.

    .venv/bin/python -m pytest tests/test_containers_slow.py -m slow -q

The first build takes minutes (the eval image holds torch: ~6 GB); later ones reuse the cached stack layer and
take seconds. Needs root to install podman when missing (containers/setup-host.sh does it) and network access
to Debian's mirror and PyPI for the base image and the wheels; the builds themselves run with no network.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
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


@pytest.mark.parametrize("image", ["synth", "rl", "eval"])
def test_the_visual_operations_run_in_each_image_that_runs_rollouts(image, request):
    """tests/visual_ops_cases.py inside each image that runs rollouts (synth's teachers, rl and its ttrl, eval),
    with no network, as the caller, on the image's own code and stack: `read_text` reads the drawn sign with the
    RapidOCR models inside the image's wheel, and every other operation gives its known result on the image's
    OpenCV (the headless build, which needs no libGL)."""
    import visual_ops_cases  # tests/visual_ops_cases.py

    request.getfixturevalue("rl_image" if image == "rl" else "images")
    result = _run(["podman", "run", "--rm", "--network", "none", "--user", f"{os.getuid()}:{os.getgid()}",
                   "--volume", f"{ROOT}:{ROOT}:ro", "--workdir", str(ROOT), "--entrypoint", "python",
                   f"loupe-{image}:latest", "tests/visual_ops_cases.py"], timeout=600)
    run = json.loads(result.stdout.strip().splitlines()[-1])
    assert not run["errors"], f"loupe-{image}: {run['errors']}"
    assert run["results"]["read_text"] == [visual_ops_cases.SIGN]
    assert run["results"] == visual_ops_cases.EXPECTED
    assert {"rapidocr-onnxruntime", "onnxruntime", "opencv-python-headless"} <= set(run["distributions"])


# --- serving from the eval image ------------------------------------------------------------------------------

TINY_MODEL = ROOT / "assets" / "tiny-model"
SERVE_SETTINGS = {"protocol": {"max_turns": 2}, "rollout": {"max_new_tokens": 16, "device": "cpu", "batch_size": 2},
                  "serve": {"max_turns": 2}}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def served_from_image(image: str, model: Path, params: Path, run_args: tuple[str, ...] = (),
                      command: tuple[str, ...] = ("loupe",), timeout: float = 600) -> Iterator[str]:
    """`loupe serve` in `image` as docs/containers.md runs it (`command`, the image's `loupe`, as entrypoint; model
    and params mounted read-only; the image's user; the container's port 8000 published, here on the host's
    loopback only); yields the host's base URL once GET /health answers, and removes the container after."""
    import httpx

    name = f"loupe-serve-test-{uuid.uuid4().hex[:8]}"
    port = _free_port()
    _run(["podman", "run", "--detach", "--name", name, "--publish", f"127.0.0.1:{port}:8000",
          "--volume", f"{model}:/model:ro", "--volume", f"{params}:/params.yaml:ro", *run_args,
          "--entrypoint", command[0], image, *command[1:],
          "serve", "--model", "/model", "--params", "/params.yaml", "--host", "0.0.0.0"])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            running = subprocess.run(["podman", "inspect", "--format", "{{.State.Running}}", name],
                                     capture_output=True, text=True, check=False).stdout.strip() == "true"
            if not running or time.monotonic() > deadline:
                logs = subprocess.run(["podman", "logs", name], capture_output=True, text=True, check=False)
                why = "exited" if not running else f"did not answer /health in {timeout:.0f} s"
                pytest.fail(f"loupe serve in {image} {why}:\n{logs.stdout[-3000:]}{logs.stderr[-5000:]}")
            time.sleep(1)
        yield url
    finally:
        subprocess.run(["podman", "rm", "--force", "--time", "2", name], capture_output=True, check=False)


def _png_data_url() -> str:
    from PIL import Image

    image = Image.new("RGB", (224, 160), (128, 128, 128))
    image.paste((220, 30, 30), (100, 68, 124, 92))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def check_serving(url: str) -> None:
    """/health answers, and a chat completion with an image comes back whole in OpenAI's shape with Loupe's
    extension (the untrained tiny model's answer itself may well be empty)."""
    import httpx

    health = httpx.get(url + "/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["model"] == "model"
    request = {"model": "model", "max_tokens": 16,
               "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png_data_url()}},
                                                         {"type": "text", "text": "What colour is the square?"}]}]}
    reply = httpx.post(url + "/v1/chat/completions", json=request, timeout=600)
    assert reply.status_code == 200, reply.text[:2000]
    body = reply.json()
    assert body["object"] == "chat.completion" and body["model"] == "model" and body["id"]
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"]
    assert body["loupe"]["end_reason"] and body["loupe"]["turns"] >= 1
    usage = body["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_the_eval_image_serves_a_model(images, tmp_path):
    """The eval image serves (docs/containers.md, "Serving"): its `loupe` command runs `loupe serve` on the tiny
    model mounted read-only, from its own code and stack, as its own non-root user, and answers from the host
    through the published port."""
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(SERVE_SETTINGS))
    params.chmod(0o644)  # read by the image's user (uid 10001)
    exposed = _run(["podman", "image", "inspect", "--format", "{{json .Config.ExposedPorts}}", "loupe-eval:latest"])
    assert "8000/tcp" in json.loads(exposed.stdout)
    with served_from_image("loupe-eval:latest", TINY_MODEL, params) as url:
        check_serving(url)


@pytest.mark.parametrize("name", list(locks.TARGETS))
def test_lock_resolves_against_its_index(name):
    """Every pinned file is on the index at its hash for the image's interpreter and platform, and the lock
    holds every dependency its packages declare (GPU locks included, though they cannot run here)."""
    problems = locks.check(locks.TARGETS[name])
    assert not problems, "\n".join(problems)
