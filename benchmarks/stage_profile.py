"""Where each stage's time goes on the embedded default: its parts, measured by profiling the stage itself.

Each stage runs as `make run` runs it (the same params, model and data, from `make run`'s `work/`), shortened to
a fixed amount of its own work, under cProfile in a child process (`python -m cProfile -o FILE -m ...`), with the
stages' pinned CPU kernels (`pipelines.dvc_runner.stage_environment`). The profile is then split into parts by
the functions the time is spent under (cumulative time of the outermost call of each part's functions, so a
part nested in another is taken out of it):

- sft (LLaMA-Factory, `--sft-steps` optimiser steps): image processing (the Qwen2-VL image processor the
  collator calls each step), collation (the rest of the collator), forward, backward, optimizer, logging and
  saving, and the start (imports, model and data loading, the dataset's tokenisation);
- rl (`--rl-steps` steps, Ray off, the transformers engine in process): rollout decode, prefill, crops and image
  processing, reward, the update (its own image processing apart), weight sync, validation, checkpointing, start;
- eval (`--eval-questions` questions x eval.samples, one model): decode, prefill, crops and image processing,
  scoring, writing (trajectories, viewer, plots), start.

Each table gives seconds, the share of the stage's wall time, and seconds per unit of work (per step, per
trajectory). Parts are measured on the same run, so their shares compare within a stage; cProfile's own
overhead inflates Python-heavy parts somewhat (each run prints its wall time with and without the profiler's
overhead estimate). The orchestration around the stages (Prefect, DVC, MLflow) is measured by
`benchmarks/pipeline_overhead.py`.

    python benchmarks/stage_profile.py --stages sft rl eval --out benchmarks/results/stage_profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipelines.dvc_runner import stage_environment  # noqa: E402

# Each part: (name, level, [(file fragment, function name or "*")...]). Level-0 parts partition the stage's wall
# time (what they leave is "other"); level-1 parts break down the level-0 part above them, across every call
# (the rl stage's rollout details add its validation rollouts' to its training rollouts').
SFT_PARTS = [
    ("start: imports", 0, [("llamafactory/extras/misc.py", "<module>"), ("llamafactory/hparams/parser.py", "<module>"),
                           ("llamafactory/train/tuner.py", "<module>")]),
    ("start: the dataset's tokenisation (images counted)", 0, [("llamafactory/data/loader.py", "get_dataset")]),
    ("start: model loading", 0, [("llamafactory/model/loader.py", "load_model")]),
    ("training loop", 0, [("transformers/trainer.py", "_inner_training_loop")]),
    ("data: collation and image processing", 1, [("llamafactory/data/collator.py", "__call__")]),
    ("forward", 1, [("transformers/trainer.py", "compute_loss")]),
    ("backward", 1, [("torch/autograd/__init__.py", "backward")]),
    ("optimizer (clip and step)", 1, [("torch/optim/optimizer.py", "wrapper"), ("clip_grad.py", "clip_grad_norm_")]),
    ("logging and saving", 1, [("transformers/trainer.py", "_maybe_log_save_evaluate"),
                               ("transformers/trainer.py", "_save_checkpoint")]),
]
ENGINE_PARTS = [
    ("crops and image processing", 1, [("loupe/tools.py", "run_tool"), ("loupe/rollout/hf.py", "_encode"),
                                       ("loupe/tools.py", "fit_to_budget"), ("loupe/images.py", "open_image")]),
    ("prefill", 1, [("loupe/rollout/hf.py", "_prefill"), ("loupe/rollout/hf.py", "_prefill_prompt")]),
    ("decode (forward passes)", 1, [("loupe/rollout/hf.py", "_decode_step")]),
    ("sampling and stop checks", 1, [("loupe/rollout/kv_batch.py", "sample"), ("loupe/rollout/hf.py", "_settle")]),
]
RL_PARTS = [
    ("learner start (policy and reference loaded)", 0, [("stages/rl/learner.py", "__init__")]),
    ("training rollouts", 0, [("stages/rl/trainer.py", "_rollout_scored")]),
    ("validation (its rollouts included)", 0, [("stages/rl/trainer.py", "validate")]),
    *[(f"rollouts, all: {name}", level, patterns) for name, level, patterns in ENGINE_PARTS],
    ("old and reference log-probs", 0, [("stages/rl/learner.py", "logprobs")]),
    ("update", 0, [("stages/rl/learner.py", "update")]),
    ("update and log-probs: image processing (cached)", 1, [("stages/rl/batching.py", "encode")]),
    ("update and log-probs: forward passes", 1, [("stages/rl/batching.py", "token_logprobs")]),
    ("update: backward", 1, [("torch/autograd/__init__.py", "backward")]),
    ("update: optimizer", 1, [("torch/optim/optimizer.py", "wrapper"), ("clip_grad.py", "clip_grad_norm_")]),
    ("weight sync", 0, [("loupe/rollout/weight_sync.py", "*")]),
    ("checkpointing", 0, [("stages/rl/checkpoint", "*")]),
]
EVAL_PARTS = [
    ("rollouts", 0, [("loupe/rollout/loop.py", "run_rollouts")]),
    *ENGINE_PARTS,
    ("scoring", 0, [("loupe/rewards/score.py", "*"), ("loupe/sample_metrics.py", "*")]),
    ("writing (trajectories, viewer, plots)", 0, [("loupe/trajectory.py", "write_trajectories"),
                                                   ("loupe/viewer.py", "*"), ("loupe/plots.py", "*")]),
]


def _matches(key: tuple[str, int, str], patterns: list[tuple[str, str]]) -> bool:
    file, _, function = key
    return any(fragment in file and (name == "*" or function == name) for fragment, name in patterns)


def split(profile: Path, parts: list[tuple[str, int, list[tuple[str, str]]]]) -> dict[str, float]:
    """Seconds under each part: the cumulative time of its functions, counted where they are entered from outside
    the part (a function of the part called from within it adds nothing)."""
    stats = pstats.Stats(str(profile)).stats  # key -> (calls, primitive calls, total, cumulative, callers)
    out: dict[str, float] = {}
    for name, _, patterns in parts:
        seconds = 0.0
        for key, (_, _, _, cumulative, callers) in stats.items():
            if not _matches(key, patterns):
                continue
            inside = sum(timing[3] for caller, timing in callers.items() if _matches(caller, patterns))
            seconds += max(0.0, cumulative - inside)
        out[name] = seconds
    return out


def _run(command: list[str], profile: Path, log: Path, env: dict[str, str]) -> float:
    started = time.perf_counter()
    with log.open("w") as sink:
        code = subprocess.call([sys.executable, "-m", "cProfile", "-o", str(profile), *command], cwd=ROOT, env=env,
                               stdout=sink, stderr=subprocess.STDOUT)
    if code != 0:
        raise SystemExit(f"{' '.join(command)} failed ({code}); see {log}")
    return time.perf_counter() - started


def profile_sft(work: Path, steps: int, folder: Path, env: dict[str, str]) -> tuple[float, float, Path]:
    config = yaml.safe_load((work / "sft" / "llamafactory" / "train.yaml").read_text())
    config.update(max_steps=steps, output_dir=str(folder / "sft"), report_to="none", save_steps=max(steps // 2, 1),
                  logging_steps=10, overwrite_output_dir=True)
    path = folder / "sft.yaml"
    path.write_text(yaml.safe_dump(config))
    profile = folder / "sft.prof"
    return _run(["-m", "llamafactory.cli", "train", str(path)], profile, folder / "sft.log", env), steps, profile


def profile_rl(work: Path, steps: int, folder: Path, env: dict[str, str]) -> tuple[float, float, Path]:
    profile = folder / "rl.prof"
    wall = _run(["-m", "stages.rl", "--params", str(ROOT / "params.yaml"), "--model", str(work / "sft" / "model"),
                 "--tasks", str(work / "data" / "tasks"), "--out", str(folder / "rl"), "--no-progress",
                 f"rl.steps={steps}", "rl.ray.enabled=false"], profile, folder / "rl.log", env)
    return wall, steps, profile


def profile_eval(work: Path, questions: int, folder: Path, env: dict[str, str]) -> tuple[float, float, Path]:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    benchmarks = [dict(b, path=str(ROOT / b["path"]), limit=questions) for b in params["eval"]["benchmarks"]]
    profile = folder / "eval.prof"
    overrides = [f"eval.benchmarks={json.dumps(benchmarks)}"]
    wall = _run(["-m", "stages.eval", "--params", str(ROOT / "params.yaml"), "--model", f"rl={work / 'rl' / 'model'}",
                 "--out", str(folder / "eval"), "--no-progress", *overrides], profile, folder / "eval.log", env)
    return wall, questions * params["eval"]["samples"], profile


STAGES = {"sft": (profile_sft, SFT_PARTS, "step"), "rl": (profile_rl, RL_PARTS, "step"),
          "eval": (profile_eval, EVAL_PARTS, "trajectory")}


def table(stage: str, wall: float, units: float, unit: str, parts: list, seconds: dict[str, float]) -> str:
    lines = [f"{stage}: {wall:.1f} s wall under the profiler, {units:g} {unit}s",
             f"  {'part':<52} {'seconds':>8} {'share':>6} {'s/' + unit:>13}"]
    top = sum(seconds[name] for name, level, _ in parts if level == 0)
    rows = [(("    " if level else "") + name, seconds[name]) for name, level, _ in parts]
    for name, value in [*rows, ("other (interpreter start, the stage's own setup, the rest)", max(0.0, wall - top))]:
        lines.append(f"  {name:<52} {value:8.1f} {value / wall:6.1%} {value / units:13.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", nargs="+", choices=sorted(STAGES), default=["sft", "rl", "eval"])
    parser.add_argument("--work", type=Path, default=ROOT / "work", help="make run's work folder")
    parser.add_argument("--sft-steps", type=int, default=120)
    parser.add_argument("--rl-steps", type=int, default=3)
    parser.add_argument("--eval-questions", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None, help="write the tables' figures as JSON here")
    parser.add_argument("--keep", type=Path, default=None, help="keep the profiles and logs in this folder")
    args = parser.parse_args(argv)
    env = dict(stage_environment(dict(os.environ)), LOUPE_TRACKING="off", RAY_AUTH_MODE="disabled")
    folder = args.keep or Path(tempfile.mkdtemp(prefix="loupe-profile-"))
    folder.mkdir(parents=True, exist_ok=True)
    amounts = {"sft": args.sft_steps, "rl": args.rl_steps, "eval": args.eval_questions}
    figures = {"cpu": platform.processor() or platform.machine(), "stages": {}}
    for stage in args.stages:
        run, parts, unit = STAGES[stage]
        wall, units, profile = run(args.work, amounts[stage], folder, env)
        seconds = split(profile, parts)
        print(table(stage, wall, units, unit, parts, seconds), flush=True)
        figures["stages"][stage] = {"wall_s": wall, "units": units, "unit": unit, "parts_s": seconds}
    if args.out is not None:
        args.out.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
