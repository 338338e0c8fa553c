"""Learning, not plumbing: cold-start SFT must teach the tiny model to zoom and read, and RL must make it better.

The test runs the default pipeline itself: every stage command of dvc.yaml, in its order, with params.yaml
as it is except that `work/` moves into the test's temporary folder (DVC, Prefect and MLflow, which only
record, are left out). So what it asserts is what `make run`'s summary shows: the tiny model is built and
given its perception pretraining, zoom tasks are drawn, the oracle writes the cold start, LLaMA-Factory
fine-tunes, the rl stage runs GRPO with the crop tool, and one eval run scores the base, SFT and RL models on
the 200 held-out questions with 95% bootstrap intervals. Then the rl stage runs again from the same SFT model
with one-step overlap on (`rl.overlap`, issue 16) and its model is evaluated alone: it must clear RL's bar
too. Last, `loupe serve` on the RL model answers 24 held-out questions asked at once through the `openai` client
as the in-process loop does, and rightly. About 18 minutes on 2 cores: marked `learning` (and `slow`), outside the default run; CI runs it as its
own step (`make test-learning`). `LOUPE_LEARNING_SEED`
sets the seed (top-level `seed` and `data.zoom.seed`; 0 by default). The base model is the committed
`assets/tiny-model` at every seed, as in `make run` (docs/learning.md, "The base model as a committed
artefact"): a run's seed draws its tasks, cold start, SFT order and RL samples, not its base model. A reduced
run does not learn (160 tasks, 300 perception steps: SFT 0.16 against chance 0.25; docs/learning.md), so there
is no 3-minute version.

The same verdict, without the overlap run, is asserted at seeds 1-4 and at seed 0 with the stages' kernels
forced below AVX2 (`test_the_verdict_holds_at_other_seeds`, `..._on_a_lower_kernel_set`): marked `slow` only,
about 14 minutes each (the lower kernel set about 20), outside CI's time
(`make test-slow PYTEST_ARGS="-k verdict_holds"`).

Margins are issues 13's and 32's bar (docs/learning.md, "Four SFT epochs"; seed 0 on this
Xeon gives SFT 0.930 [0.900, 0.955] -> RL 0.995 [0.988, 1.000]): the base model follows no protocol; the SFT
model reaches twice the chance rate and reads what its zoom shows; RL is at least 10 points above SFT with its
interval above SFT's, because it searches where SFT glanced; accuracy at the turn limit that allows the whole
search (4 for the default's zoom into a zoom) is at least 10 points above the limit just short of it (2); and
RL takes more turns and tool calls than SFT. Where SFT is above 0.80 ten points do not fit under 1.0, so there
RL must instead remove half of SFT's errors (issue 13's bar read for a strong cold start; the interval
condition is unchanged).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from benchmarks.learning_probe import zoom_hits
from pipelines.dvc_runner import stage_environment, stage_names, stage_spec

REPO = Path(__file__).resolve().parent.parent
RELATIVE_WORK = re.compile(r"(?<![\w./-])work/")
"""A path relative to the repository under `work/` (not `.../work/` of an absolute path)."""


def seeded_params(params: dict, seed: int, work: Path) -> dict:
    """params.yaml's values with the run's seeds (`seed`, `data.zoom.seed`) set to `seed` and every `work/...` path
    moved under `work`; the base model stays the committed one (`model.tiny_seed` is its seed)."""
    def moved(value):
        if isinstance(value, dict):
            return {key: moved(item) for key, item in value.items()}
        if isinstance(value, list):
            return [moved(item) for item in value]
        return RELATIVE_WORK.sub(f"{work}/", value) if isinstance(value, str) else value

    params = moved(params)
    params["seed"] = params["data"]["zoom"]["seed"] = seed
    return params


def stage_command(stage: str, params: dict, params_file: Path, work: Path) -> list[str]:
    """dvc.yaml's command for `stage`, its `${section.key}` filled from `params`, on the given params file.

    By hand rather than through DVC: DVC fills a command from params.yaml at the repository's root, and this
    test's params file lives in its temporary folder."""
    def lookup(match: re.Match) -> str:
        value = params
        for key in match.group(1).split("."):
            value = value[key]
        return str(value)

    command = RELATIVE_WORK.sub(f"{work}/", stage_spec(REPO, stage)["cmd"]).replace("params.yaml", str(params_file))
    argv = shlex.split(re.sub(r"\$\{([\w.]+)\}", lookup, command))
    if argv[0] == "python":
        return [sys.executable, *argv[1:]]
    assert argv[0] == "loupe", command
    return [sys.executable, "-m", "pipelines.cli", *argv[1:]]


def _with_option(argv: list[str], option: str, value: str) -> list[str]:
    """`argv` with `option`'s value replaced."""
    index = argv.index(option)
    return [*argv[: index + 1], value, *argv[index + 2 :]]


def _rl_with_overlap(params: dict, tmp_path: Path, work: Path, env: dict) -> dict:
    """Run dvc.yaml's rl stage again with `rl.overlap` on (and the sampler's log-probs, which overlap needs) into
    work/rl_overlap, evaluate that model alone into work/eval_overlap, and return its held-out figures."""
    params = json.loads(json.dumps(params))
    # One learner thread: with overlap the rollout worker computes beside the update (params.yaml, cpu_threads).
    params["rl"].update(overlap=True, logprob_source="rollout", cpu_threads=1)
    params_file = tmp_path / "params_overlap.yaml"
    params_file.write_text(yaml.safe_dump(params, sort_keys=False))
    rl = _with_option(stage_command("rl", params, params_file, work), "--out", str(work / "rl_overlap"))
    evaluate = stage_command("eval", params, params_file, work)
    evaluate = [*evaluate[: evaluate.index("--model")], "--model", f"rl_overlap={work / 'rl_overlap' / 'model'}",
                "--out", str(work / "eval_overlap")]
    for name, argv in (("rl_overlap", rl), ("eval_overlap", evaluate)):
        log = tmp_path / f"{name}.log"
        with log.open("w") as handle:
            code = subprocess.call(argv, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT)
        assert code == 0, f"{name} failed; end of {log}:\n{log.read_text(errors='replace')[-3000:]}"
    return json.loads((work / "eval_overlap" / "metrics.json").read_text())["synthetic"]["rl_overlap"]


def run_default_pipeline(tmp_path: Path, seed: int, kernels: dict[str, str] | None = None,
                         model: dict | None = None) -> tuple[dict, Path, dict]:
    """Every stage of dvc.yaml on params.yaml at `seed` under tmp_path (with `kernels` in the stages'
    environment, and `model` set over the model section); returns the params, the work folder and the
    environment."""
    work = tmp_path / "work"
    params_file = tmp_path / "params.yaml"
    params = seeded_params(yaml.safe_load((REPO / "params.yaml").read_text()), seed, work)
    params["model"].update(model or {})
    params_file.write_text(yaml.safe_dump(params, sort_keys=False))
    env = dict(stage_environment({**os.environ, **(kernels or {})}), LOUPE_TRACKING="off", RAY_AUTH_MODE="disabled")
    for stage in stage_names(REPO):
        log = tmp_path / f"{stage}.log"
        with log.open("w") as handle:
            code = subprocess.call(stage_command(stage, params, params_file, work), cwd=REPO, env=env,
                                   stdout=handle, stderr=subprocess.STDOUT)
        assert code == 0, f"stage {stage} failed; end of {log}:\n{log.read_text(errors='replace')[-3000:]}"
    return params, work, env


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_the_verdict_holds_at_other_seeds(tmp_path, seed):
    params, work, _ = run_default_pipeline(tmp_path, seed)
    assert_the_verdict(work, task_depth(params))


@pytest.mark.slow
def test_the_verdict_holds_on_a_lower_kernel_set(tmp_path):
    """Seed 0 with torch's, MKL's and oneDNN's kernels below the AVX2 the stages pin (SSE4.2-era paths)."""
    lower = {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"}
    params, work, _ = run_default_pipeline(tmp_path, 0, kernels=lower)
    assert_the_verdict(work, task_depth(params))


@pytest.mark.slow
def test_a_tiny_qwen3_vl_learns_the_default_task(tmp_path):
    """The default pipeline on a tiny Qwen3-VL instead of the committed Qwen2.5-VL: the data stage builds it
    offline with the same size and perception pretraining as the default's (`model.tiny_family: qwen3_vl`; its
    images and crops on Qwen3-VL's 32-px grid, SFT on LLaMA-Factory's qwen3_vl template), then every stage as
    `make run`. The bar is issue 53's: SFT above chance with its interval clear of chance and of the base model,
    and RL at or above SFT. About 30 minutes on 2 cores (the perception pretraining runs here): `-m slow`."""
    from loupe.models.family import read_family

    _, work, _ = run_default_pipeline(tmp_path, 0, model={"tiny_family": "qwen3_vl"})
    assert read_family(work / "rl" / "model").name == "qwen3_vl"
    held_out = json.loads((work / "eval" / "metrics.json").read_text())["synthetic"]
    chance, base, sft, rl = (held_out[k] for k in ("chance_rate", "base", "sft", "rl"))
    print(f"tiny Qwen3-VL: base {base['accuracy']:.3f}, SFT {sft['accuracy']:.3f} [{sft['accuracy_ci_low']:.3f}, "
          f"{sft['accuracy_ci_high']:.3f}], RL {rl['accuracy']:.3f} [{rl['accuracy_ci_low']:.3f}, "
          f"{rl['accuracy_ci_high']:.3f}], chance {chance}")
    assert sft["accuracy_ci_low"] > chance and sft["accuracy_ci_low"] > base["accuracy_ci_high"], (base, sft)
    assert rl["accuracy"] >= sft["accuracy"], (sft, rl)


def assert_the_verdict(work: Path, depth: int) -> tuple[dict, dict, Callable[[dict], None]]:
    """Issues 13's and 32's bar on the eval stage's comparison (module docstring); returns SFT's, RL's figures
    and the check for another RL model against SFT."""
    comparison = json.loads((work / "eval" / "metrics.json").read_text())
    assert comparison["models"] == ["base", "sft", "rl"]
    held_out = comparison["synthetic"]
    chance, base, sft, rl = (held_out[k] for k in ("chance_rate", "base", "sft", "rl"))
    assert held_out["questions"] >= 200 and chance == 0.25
    assert base["accuracy"] < chance / 2 and base["valid_turn_rate"] < 0.5  # no protocol before the cold start

    assert sft["valid_turn_rate"] > 0.9
    assert sft["accuracy"] >= 2 * chance, sft
    sft_hits = zoom_hits(work / "eval" / "sft", work / "data" / "tasks")
    assert sft_hits["accuracy_when_held"] > 0.9, sft_hits  # it reads what its zoom shows

    def assert_beats_sft(model: dict) -> None:
        # Ten points better, or, where SFT is above 0.80 and ten points cannot fit, half of SFT's errors gone;
        # and the interval above SFT's.
        assert model["accuracy"] >= min(sft["accuracy"] + 0.10, (1 + sft["accuracy"]) / 2), (sft, model)
        assert model["accuracy_ci_low"] > sft["accuracy_ci_high"], (sft, model)

    assert_beats_sft(rl)
    figures = {name: next(iter(json.loads((work / "eval" / name / "metrics.json").read_text())["benchmarks"]
                                .values())) for name in ("sft", "rl")}
    turns = {name: (f["mean_turns"], f["mean_tool_calls"]) for name, f in figures.items()}
    assert turns["rl"][0] > turns["sft"][0] and turns["rl"][1] > turns["sft"][1], turns  # RL searches longer
    for model in (sft, rl):
        assert_zooming_needs_turns(model, depth)
    return sft, rl, assert_beats_sft


def task_depth(params: dict) -> int:
    """Zooms a default task needs (`data.zoom.depth`: 2 for a zoom into a zoom)."""
    return int(params["data"]["zoom"].get("depth", 1))


def assert_zooming_needs_turns(model: dict, depth: int) -> None:
    """Issue 32's bar: accuracy at the turn limit that allows the whole search (depth zooms and the answer) is at
    least 10 points above the limit just short of it (acc@2 -> acc@4 at depth 2), and no higher limit loses it."""
    curve = model["turn_scaling"]
    short, enough = ("1", "2") if depth == 1 else ("2", "4")
    assert curve[enough] >= curve[short] + 0.10 and curve["8"] >= curve[enough] - 0.02, curve


SERVED_QUESTIONS = 24
"""Held-out questions the trained model answers through `loupe serve` at the end of the learning test."""


def assert_the_served_model_searches_as_in_process(work: Path, params_file: Path, depth: int) -> None:
    """`loupe serve` on the RL model: concurrent requests through the `openai` client give the answers and end
    reasons of the in-process rollout loop (greedy, both), the answers are right, and each search zooms `depth`
    times on average (issue 43's parity on a model that searches)."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    from loupe.config import ProtocolParams, RolloutParams, load_section
    from loupe.data.tasks import read_tasks
    from loupe.models import load_model, load_processor
    from loupe.protocol import get_protocol
    from loupe.rollout import run_rollouts
    from loupe.rollout.hf import TransformersEngine
    from loupe.serve.main import build_server, serving_in_thread
    sys.path.insert(0, str(REPO / "tests"))
    from serve_helpers import question

    tasks = work / "data" / "tasks"
    records = read_tasks(tasks / "test.jsonl")[:SERVED_QUESTIONS]
    server = build_server(work / "rl" / "model", params_file, ["rollout.device=cpu"])
    try:
        with serving_in_thread(server.app) as base:
            client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)

            def ask(record):
                reply = client.chat.completions.create(model=server.model, messages=question(
                    tasks / record.images[0], record.problem))
                extension = reply.model_extra["loupe"]
                crops = sum("crop" in turn for turn in extension["trajectory"])
                return reply.choices[0].message.content, extension["end_reason"], crops

            with ThreadPoolExecutor(8) as pool:
                served = list(pool.map(ask, records))
    finally:
        server.scheduler.close()
    protocol = load_section(ProtocolParams, "protocol", params_file)
    rollout = load_section(RolloutParams, "rollout", params_file)
    model = work / "rl" / "model"
    engine = TransformersEngine(load_model(model, device="cpu"), load_processor(model), get_protocol(protocol.name).stop,
                                temperature=0.0, batch_size=rollout.batch_size)
    local = run_rollouts(records, engine, protocol, tasks, max_new_tokens=rollout.max_new_tokens)
    assert [(answer, end) for answer, end, _ in served] == [(t.answer or "", t.end_reason) for t in local]
    right = sum(answer.strip().lower() == record.solution for (answer, _, _), record in zip(served, records))
    assert right >= 0.8 * len(records), served
    assert sum(crops for _, _, crops in served) >= depth * len(records) * 0.9, served


@pytest.mark.slow
@pytest.mark.learning
def test_sft_then_rl_make_the_tiny_model_better_on_held_out_questions(tmp_path):
    params, work, env = run_default_pipeline(tmp_path, int(os.environ.get("LOUPE_LEARNING_SEED", "0")))
    _, _, assert_beats_sft = assert_the_verdict(work, task_depth(params))
    assert_the_served_model_searches_as_in_process(work, tmp_path / "params.yaml", task_depth(params))
    # The same RL stage with one-step overlap (rl.overlap, issue 16), from the same SFT model: each step after
    # the first trains on a batch sampled with the weights of one update before. It must clear the same bar.
    overlap_rl = _rl_with_overlap(params, tmp_path, work, env)
    assert_beats_sft(overlap_rl)
    assert_zooming_needs_turns(overlap_rl, task_depth(params))
