"""RL steps per second with and without one-step overlap of rollout and update (`rl.overlap`), measured in one run.

Both sides run the rl stage itself (`stages.rl.__main__.train`) from the same model on the same tasks, at the same
batch (`--prompts` x `--samples`), seed and step count, with the sampler's log-probs as the old ones on both sides
(what overlap needs), so they differ only in whether step k+1's rollout runs while step k's update does:

- `sync`: roll out, score, update, send the weights, then the next step;
- `overlap`: the next step's rollout starts on the rollout workers before the update and is collected after it.

The params are this repository's params.yaml with the rl section's batch, steps and switches overridden: the
zoom tasks, the mini_o3 protocol, the default turn limit and token budget, validation and checkpoints off. By
default the rollout worker is a Ray actor (`--ray`, the stage's default), so rollout and update are separate
processes; `--no-ray` runs the rollout in a thread beside the learner. The first step (no batch ahead yet, and
first-call costs) is left out of the rate.

    python benchmarks/rl_overlap.py [--model DIR] [--tasks DIR] [--steps 6] [--prompts 8] [--samples 8] [--no-ray]

Without `--model`, the embedded tiny model (random, so most trajectories end in format errors after a few
turns); after `make run`, `--model work/sft/model --tasks work/data/tasks` gives the SFT model's own multi-turn
searches. Prints each side's seconds a step (rollout, update and what the step waited for the rollout ahead)
and the steps-per-second ratio (target >= 1.3x). Not a test: a measurement.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import yaml

os.environ.setdefault("LOUPE_TRACKING", "off")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

REPO = Path(__file__).resolve().parents[1]


def params_file(path: Path, args: argparse.Namespace, overlap: bool) -> Path:
    data = yaml.safe_load((REPO / "params.yaml").read_text(encoding="utf-8"))
    rl = data["rl"]
    rl.update({
        "steps": args.steps, "prompts_per_step": args.prompts, "samples_per_prompt": args.samples,
        "overlap": overlap, "logprob_source": "rollout", "val_every": 0, "val_before_train": False,
        "sample_trajectories_every": 0, "checkpoint_every": 1000,
        "dynamic_sampling": {**rl.get("dynamic_sampling", {}), "enabled": False},
    })
    rl.setdefault("ray", {})["enabled"] = args.ray
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--tasks", type=Path, default=None, help="a task folder (default: zoom tasks generated here)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--ray", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()

    from stages.rl.__main__ import train

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = args.model
        if model is None:
            from loupe.models.tiny import build_tiny_model

            model = build_tiny_model(root / "tiny", seed=0, text_hidden=128, text_layers=4)
        tasks = args.tasks
        if tasks is None:
            from loupe.data.zoom_tasks import ZoomTaskConfig, generate_zoom_tasks

            tasks = root / "tasks"
            generate_zoom_tasks(tasks, ZoomTaskConfig(seed=0, train=args.prompts * args.steps, val=4, test=0))
        rates = {}
        for name, overlap in (("sync", False), ("overlap", True)):
            out = root / name
            train(params_file(root / f"{name}.yaml", args, overlap), model, tasks, out, progress=False)
            rows = [row for row in map(yaml.safe_load, (out / "metrics.jsonl").read_text().splitlines())
                    if row["kind"] == "train"][1:]
            seconds = sum(row["time/step"] for row in rows)
            rates[name] = len(rows) / seconds

            def each(key: str) -> float:
                return statistics.mean(row[key] for row in rows)

            print(f"{name:>8}: {len(rows)} steps in {seconds:.2f} s = {rates[name]:.3f} steps/s; a step: rollout "
                  f"{each('time/rollout'):.2f} s, rollout ahead {each('time/rollout_ahead'):.2f} s, update "
                  f"{each('time/update'):.2f} s, waited {each('time/ahead_wait'):.2f} s, sync {each('time/sync'):.2f} s",
                  flush=True)
        print(f"overlap vs sync: {rates['overlap'] / rates['sync']:.2f}x steps/s (target >= 1.3x), batch "
              f"{args.prompts} x {args.samples}, {'Ray worker' if args.ray else 'in-process thread'}")


if __name__ == "__main__":
    main()
