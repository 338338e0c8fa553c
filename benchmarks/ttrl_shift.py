"""Test-time RL on a shifted, unlabeled question set: does the `ttrl` stage raise accuracy where it has room?

TTRL (and Pixelis' test-time stage) trains on questions without their answers, rewarding each sample by whether
it agrees with the vote of its group. That can only help where the model's samples disagree and the vote is
right more often than one sample: maj@K above Avg@K, not only pass@K. On the Pixelis operations twin's own
held-out questions the model answers nearly every question the same way each time, so this script builds the
set, of the nine tried (docs/learning.md, "Test-time RL on a shifted set"), where it disagrees most:

- **the shift**: the twin's shape and moving-square questions (`loupe.data.operation_tasks`), from another seed,
  with the objects filled in colours training never showed (orange and purple join red and blue, replacing
  green and yellow). The operations still work (their tools read any palette colour), but the model copies the
  shape or direction out of their results less reliably: the RL model answers 0.664 of them, and is right at
  least once in four samples on 0.919.
- **the run**: the `ttrl` stage (`python -m stages.rl --section ttrl`: the recipe's own section, Pixelis'
  conservative update included, with the overrides below) on the set's questions without their labels, from
  the run's RL model; then the eval stage scores the RL and TTRL models on the same questions, K samples each.

Measured (2026-11-28): TTRL 0.688 [0.636, 0.738] against RL 0.664 [0.609, 0.714]. The gate's labels were right
97 % of the time, but maj@4 is 0.668: the model's errors are confusions its vote shares (left for right,
square for circle), so the intervals do not come apart.

It prints the per-kind table with bootstrap intervals (benchmarks/kind_table.py), pass@K and maj@K, and the
stage's log per step: the vote's agreement with the withheld answer (`ttrl/pseudo_label_accuracy`), that of the
labels the confidence gate kept (`ttrl/kept_label_accuracy`), the gate's pass rate (`ttrl/groups_kept`), the
buffer's neighbours per group (`ttrl/buffer_hits`) and the update's rate. It writes all of it to
`<out>/shift.json`.

Launch, after `loupe run --params params/pixelis-operations-cpu.yaml` (about 15 minutes on 2 cores; this script
takes about 10 more):

    python -m benchmarks.ttrl_shift --run work/runs/pixelis-operations-cpu     # from the repository root

A finished part (the ttrl model, the eval) is reused when the script runs again; the ttrl stage resumes from its
last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from statistics import mean
from typing import Any

import yaml

from benchmarks.kind_table import kind_accuracies
from loupe.data.operation_tasks import OperationTaskConfig, generate_operation_tasks

SHIFT: dict[str, Any] = {
    "kinds": ["shape", "motion"],
    "shape_colours": ["orange", "purple", "red", "blue"],
    "train": 0,
    "val": 0,
    "test": 160,
    "seed": 1,
}
"""The shifted set, over the run's `data.operations`: the two kinds whose answers the model copies out of an
operation's result (signs are read by OCR and copied nearly always right), new fill colours, a new seed."""

TTRL_OVERRIDES: tuple[str, ...] = ("ttrl.steps=20", "ttrl.prompts_per_step=16")
"""Over the recipe's `ttrl` section: 20 steps of 16 questions, each question about twice, where the twin's own
run takes 8 of 8 (its 15-minute budget)."""

SAMPLES = 4
"""K: samples per question in the eval."""


def write_shifted_set(params: dict[str, Any], out: Path) -> Path:
    """The shifted questions under `out/tasks` (test.jsonl and images), from the run's params; reused when
    already there."""
    config = OperationTaskConfig(**{**params["data"]["operations"], **SHIFT})
    tasks = out / "tasks"
    if not (tasks / "test.jsonl").is_file():
        generate_operation_tasks(tasks, config)
    return tasks


def shifted_params(params: dict[str, Any], tasks: Path, out: Path) -> Path:
    """The run's params with the eval pointed at the shifted set, K samples a question, written to `out`."""
    shifted = {**params, "eval": {**params["eval"], "samples": SAMPLES,
                                  "benchmarks": [{"name": "synthetic", "path": str(tasks.resolve())}]}}
    path = out / "params.yaml"
    path.write_text(yaml.safe_dump(shifted, sort_keys=False), encoding="utf-8")
    return path


def _stage(args: list[str], log: Path, cwd: Path) -> None:
    with log.open("w", encoding="utf-8") as sink:
        done = subprocess.run([sys.executable, "-m", *args], cwd=cwd, stdout=sink, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"{args[0]} failed ({done.returncode}); its log: {log}")


def ttrl_log(metrics_jsonl: Path) -> list[dict[str, float]]:
    """The stage's per-step TTRL figures."""
    keep = ("ttrl/pseudo_label_accuracy", "ttrl/kept_label_accuracy", "ttrl/groups_kept", "ttrl/buffer_hits",
            "ttrl/kept_confidence", "update/lr")
    rows = []
    for line in metrics_jsonl.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        if "step" in row and any(k in row for k in keep):
            rows.append({"step": row["step"], **{k: row[k] for k in keep if k in row}})
    return rows


def run_scenario(run: Path, out: Path, repo: Path) -> dict[str, Any]:
    """Write the set, run ttrl from the run's RL model, evaluate both; return the figures (also shift.json)."""
    out.mkdir(parents=True, exist_ok=True)
    run_params = yaml.safe_load((run / "params.yaml").read_text(encoding="utf-8"))
    tasks = write_shifted_set(run_params, out)
    params = shifted_params(run_params, tasks, out)
    work = run / "work"
    if not (out / "ttrl" / "model" / "config.json").is_file():
        _stage(["stages.rl", "--params", str(params), "--section", "ttrl", "--model", str(work / "rl" / "model"),
                "--tasks", str(tasks), "--out", str(out / "ttrl"), "--no-progress", *TTRL_OVERRIDES],
               out / "ttrl.log", repo)
    if not (out / "eval" / "metrics.json").is_file():
        _stage(["stages.eval", "--params", str(params), "--model", f"rl={work / 'rl' / 'model'}",
                "--model", f"ttrl={out / 'ttrl' / 'model'}", "--out", str(out / "eval"), "--no-progress"],
               out / "eval.log", repo)
    figures: dict[str, Any] = {"set": SHIFT, "ttrl_overrides": list(TTRL_OVERRIDES), "samples": SAMPLES}
    for model in ("rl", "ttrl"):
        summary = json.loads((out / "eval" / model / "metrics.json").read_text(encoding="utf-8"))
        bench = summary["benchmarks"]["synthetic"]
        figures[model] = {
            "kinds": kind_accuracies(out / "eval" / model / "results.jsonl"),
            f"pass@{SAMPLES}": bench[f"pass@{SAMPLES}"],
            f"maj@{SAMPLES}": bench[f"maj@{SAMPLES}"],
        }
    figures["ttrl_log"] = ttrl_log(out / "ttrl" / "metrics.jsonl")
    (out / "shift.json").write_text(json.dumps(figures, indent=1), encoding="utf-8")
    return figures


def report(figures: dict[str, Any]) -> str:
    """The tables a person reads: per kind with intervals, then the stage's log per step."""
    lines = [f"| model | all | shape | motion | pass@{SAMPLES} | maj@{SAMPLES} |", "|---|---|---|---|---|---|"]
    for model in ("rl", "ttrl"):
        m = figures[model]
        cells = [f"{k['accuracy']:.3f} [{k['low']:.3f}, {k['high']:.3f}]"
                 for k in (m["kinds"][kind] for kind in ("all", "shape", "motion"))]
        lines.append(f"| {model} | {' | '.join(cells)} | {m[f'pass@{SAMPLES}']:.3f} | {m[f'maj@{SAMPLES}']:.3f} |")
    lines += ["", "| step | vote right | kept labels right | gate passed | buffer hits | rate |",
              "|---|---|---|---|---|---|"]
    for row in figures["ttrl_log"]:
        lines.append("| {} | {} | {} | {} | {} | {} |".format(row["step"], *(
            "-" if row.get(k) is None else f"{row[k]:.3g}" for k in (
                "ttrl/pseudo_label_accuracy", "ttrl/kept_label_accuracy", "ttrl/groups_kept", "ttrl/buffer_hits",
                "update/lr"))))
    voted = [r["ttrl/pseudo_label_accuracy"] for r in figures["ttrl_log"] if "ttrl/pseudo_label_accuracy" in r]
    if voted:
        lines.append(f"\nthe vote's label was right in {mean(voted):.2f} of the groups on average")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, default=Path("work/runs/pixelis-operations-cpu"),
                        help="the operations twin's run folder (holds params.yaml and work/rl/model)")
    parser.add_argument("--out", type=Path, help="output folder (default: <run>/work/shift)")
    args = parser.parse_args(argv)
    repo = Path(__file__).resolve().parent.parent
    if not (args.run / "work" / "rl" / "model" / "config.json").is_file():
        parser.error(f"{args.run}/work/rl/model is missing: run `loupe run --params "
                     "params/pixelis-operations-cpu.yaml` first")
    print(report(run_scenario(args.run.resolve(), (args.out or args.run / "work" / "shift").resolve(), repo)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
