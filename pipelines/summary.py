"""The flow's closing summary: one row per stage (ran or skipped, seconds, key metrics, outputs, MLflow run),
then the eval stage's comparison of the models (`comparison_text`).

Key metrics are read from each stage's `metrics.json` files as dvc.yaml declares them, so the table shows what
`dvc metrics show` shows, cut to the few numbers a person looks at first.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loupe.compare import comparison_table, is_comparison
from pipelines.dvc_runner import StageResult, stage_spec

# Metric names that matter most, best first; a stage shows the first few it has (the stages' metrics.json:
# eval's per-model accuracy (`synthetic.rl.accuracy`, ranked first by `_is_model_accuracy`), rl's last step,
# sft's final loss, synth's kept trajectories, data's tiny model's held-out colour accuracy and task counts).
_PREFERRED = ("avg@", "pass@", "last.reward/mean", "last.reward/accuracy", "best_val", "held_out_accuracy",
              "final_loss", "accepted", "records", "tasks.", "accuracy", "reward", "loss", "trajectories", "steps")
_SKIPPED_KEYS = ("turn_scaling", "seconds", "per_category", "by_category", "categories", "end_reasons", "kinds",
                 "difficulties", "histogram", "first.", "first_", "patterns.", "_ci_", "bootstrap.", "from_artifact",
                 "perception.final_loss", "perception.steps")
_KEY_METRICS = 3


def _flatten(prefix: str, value: Any, out: dict[str, float]) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), inner, out)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        out[prefix] = value


def _paths(entries: list) -> list[str]:
    """dvc.yaml lists outs/metrics/plots as strings or one-key mappings (path: {options})."""
    return [next(iter(e)) if isinstance(e, dict) else str(e) for e in entries or []]


def stage_outputs(root: Path, stage: str) -> list[str]:
    spec = stage_spec(root, stage)
    return _paths(spec.get("outs")) + _paths(spec.get("metrics")) + _paths(spec.get("plots"))


def stage_metrics(root: Path, stage: str) -> dict[str, float]:
    """Every number of the stage's metrics files, flattened to dotted keys."""
    flat: dict[str, float] = {}
    for path in _paths(stage_spec(root, stage).get("metrics")):
        file = root / path
        if file.is_file():
            _flatten("", json.loads(file.read_text()), flat)
    return flat


def _is_model_accuracy(key: str) -> bool:
    """`benchmark.model.accuracy`: a model's accuracy in eval's comparison."""
    parts = key.split(".")
    return len(parts) == 3 and parts[2] == "accuracy"


def key_metrics(metrics: dict[str, float], count: int = _KEY_METRICS) -> dict[str, float]:
    """The few numbers worth a glance: preferred names first, never the long per-category breakdowns."""
    usable = {k: v for k, v in metrics.items() if not any(part in k for part in _SKIPPED_KEYS)}

    def rank(key: str) -> int:
        if _is_model_accuracy(key):
            return -1
        return next((i for i, p in enumerate(_PREFERRED) if p in key), len(_PREFERRED))

    ranked = sorted(usable, key=rank)
    return {k: usable[k] for k in ranked[:count]}


def comparison_text(root: Path) -> str | None:
    """The eval stage's comparison table (loupe.compare), from the metrics file dvc.yaml declares for the stage:
    a block per benchmark with its chance rate and a row per model. None when there is none to show (no eval
    stage, not run yet, or a metrics file of another shape)."""
    try:
        paths = _paths(stage_spec(root, "eval").get("metrics"))
    except (OSError, KeyError, TypeError, ValueError):
        return None
    for path in paths:
        file = root / path
        try:
            metrics = json.loads(file.read_text()) if file.is_file() else None
        except (OSError, ValueError):
            continue
        if is_comparison(metrics):
            return comparison_table(metrics)
    return None


def _format_number(value: float) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def summary_rows(root: Path, results: list[StageResult], runs: dict[str, str | None]) -> list[dict]:
    rows = []
    for result in results:
        outputs = stage_outputs(root, result.stage)
        rows.append({
            "stage": result.stage,
            "status": result.status + (f" ({result.attempts} tries)" if result.attempts > 1 else ""),
            "seconds": result.seconds,
            # "benchmarks.synthetic.avg@2" reads as "synthetic.avg@2" in a table.
            "key_metrics": {k.removeprefix("benchmarks."): v for k, v in key_metrics(stage_metrics(root, result.stage)).items()},
            "outputs": outputs,
            "mlflow_run": runs.get(result.stage),
        })
    return rows


def format_table(rows: list[dict]) -> str:
    """A plain-text table (no dependency): stage | status | seconds | key metrics | outputs | MLflow run."""
    header = ("stage", "status", "seconds", "key metrics", "outputs", "MLflow run")
    lines = [header]
    for row in rows:
        metrics = ", ".join(f"{k}={_format_number(v)}" for k, v in row["key_metrics"].items()) or "-"
        outputs = row["outputs"][0] + (f" +{len(row['outputs']) - 1}" if len(row["outputs"]) > 1 else "") \
            if row["outputs"] else "-"
        lines.append((row["stage"], row["status"], f"{row['seconds']:.1f}", metrics, outputs, row["mlflow_run"] or "-"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines]
    text.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(text)
