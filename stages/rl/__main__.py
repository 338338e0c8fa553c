"""Train the policy with GRPO-family RL on multi-turn zoom-in rollouts, on Ray (`python -m stages.rl`).

Reads the `rl` section of params.yaml (or the one `--section` names: an earlier RL stage of a two-stage recipe,
such as LMM-R1's `rl_fre`), plus the shared `seed`, `protocol` and `rollout` sections, starts
(or joins, with RAY_ADDRESS) Ray, and trains the model in --model on the train split of --tasks. Writes
into --out:

    model/                the final policy as a Hugging Face model directory (what the eval stage reads)
    metrics.json          first and last step's reward, accuracy, entropy, KL, ...; last validation
    metrics.jsonl         one row per training step and per validation (everything logged to MLflow)
    plots/train.json      per-step reward, accuracy, response length, KL, entropy, clip fraction (DVC plots)
    plots/val.json        validation accuracy per step; plots/reward.png, plots/update.png
    samples/step_N.html   sampled training trajectories every `sample_trajectories_every` steps
    viewer.html           the last step's trajectories
    checkpoints/step_N/   atomic checkpoints; a rerun after a kill resumes from the newest

Launch:
    python -m stages.rl --params params.yaml --model work/sft/model --tasks work/data/tasks --out work/rl
    python -m stages.rl ... rl.lr=1e-6 rl.kl.coef=0.01     # values set on top of the file, as verl users write them
On a cluster: `ray start --head` on one node and `ray start --address HEAD:6379` on the others, then run
the same command on the head with RAY_ADDRESS=auto and `rl.ray.gpus_per_node`/`nodes` set (docs/rl.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loupe.config import ParamsError, params_with_overrides
from loupe.tracking import stage_run
from stages.rl.inputs import read_inputs
from stages.rl.trainer import Trainer


def train(params_path: Path, model_path: Path, tasks_dir: Path, out_dir: Path, progress: bool = True,
          use_ray: bool | None = None, section: str = "rl") -> dict:
    """Validate the inputs, then train inside the stage's MLflow run; returns what metrics.json holds."""
    inputs = read_inputs(params_path, model_path, tasks_dir, section)
    logged = {"rl": inputs.params.model_dump(mode="json"), "model": str(model_path), "tasks": str(tasks_dir),
              "seed": inputs.seed, "rollout": inputs.rollout.model_dump(mode="json"), "section": section}
    with stage_run("rl" if section == "rl" else section, params=logged) as run:
        metrics = Trainer(inputs, out_dir, run, progress=progress, use_ray=use_ray).run_loop()
        run.log_metrics({"final": metrics.get("last", {}), "best_val_accuracy": metrics.get("best_val_accuracy")})
        for artefact in ("metrics.json", "metrics.jsonl", "plots", "viewer.html"):
            run.log_artifact(out_dir / artefact)
        return metrics


def _print_summary(metrics: dict, out_dir: Path) -> None:
    first, last = metrics.get("first", {}), metrics.get("last", {})

    def show(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    print(
        f"rl: {metrics['steps']} steps; reward {show(first.get('reward/mean'))} -> {show(last.get('reward/mean'))}, "
        f"accuracy {show(first.get('reward/accuracy'))} -> {show(last.get('reward/accuracy'))}, "
        f"best val accuracy {show(metrics.get('best_val_accuracy'))}"
    )
    print(f"model: {out_dir / 'model'}\nmetrics: {out_dir / 'metrics.json'}\ntrajectories: {out_dir / 'viewer.html'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stages.rl", description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=Path, default=Path("params.yaml"), help="params file (default: params.yaml)")
    parser.add_argument("--model", type=Path, required=True, help="Hugging Face model directory to start from")
    parser.add_argument("--tasks", type=Path, required=True, help="task folder holding <split>.jsonl files")
    parser.add_argument("--out", type=Path, required=True, help="output folder (resumes from its checkpoints)")
    parser.add_argument("--section", default="rl",
                        help="params section to train with (default: rl; a second RL stage reads its own, e.g. rl_fre)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("overrides", nargs="*", metavar="KEY.PATH=VALUE",
                        help="params set on top of the file, as in it (e.g. rl.lr=1e-6); recorded in MLflow")
    args = parser.parse_args(argv)
    try:
        args.params = params_with_overrides(args.params, args.overrides)
        metrics = train(args.params, args.model, args.tasks, args.out, progress=not args.no_progress,
                        section=args.section)
    except (ParamsError, FileNotFoundError, ValueError) as err:
        print(f"rl: {err}", file=sys.stderr)
        return 2
    _print_summary(metrics, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
