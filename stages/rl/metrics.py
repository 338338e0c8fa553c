"""What the rl stage records each step: rollout statistics, the metrics file, plot data and PNGs.

`rollout_metrics(trajectories)` summarises a step's trajectories (reward and its parts, accuracy, turns,
end-reason shares, over-turn rate, response length). `MetricsLog` keeps `metrics.jsonl` (one row per step,
rewritten atomically so a kill never leaves a torn line) and can cut it back to a checkpoint's step on
resume, so a resumed run's file reads exactly like an uninterrupted run's. `write_plots` turns the rows into
DVC plot data (`plots/train.json`, `plots/val.json`) and PNGs.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from statistics import mean, pstdev
from typing import Any

from loupe.io import atomic_write_json, atomic_write_text
from loupe.plots import line_plot
from loupe.sample_metrics import summarize
from loupe.trajectory import END_REASONS, Trajectory


def _mean(values: list[float]) -> float | None:
    return mean(values) if values else None


def rollout_metrics(trajectories: list[Trajectory]) -> dict[str, float | None]:
    """Reward, accuracy and behaviour of a step's trajectories (all of them, dropped groups included)."""
    rewards = [t.rewards for t in trajectories]
    totals = [float(r["total"]) for r in rewards if r.get("valid", True) and r.get("total") is not None]
    reasons = Counter(t.end_reason for t in trajectories)
    n = max(len(trajectories), 1)
    actions = [turn.action for t in trajectories for turn in t.turns if turn.role == "assistant"]
    out: dict[str, float | None] = {
        "reward/mean": _mean(totals),
        "reward/std": pstdev(totals) if len(totals) > 1 else 0.0,
        "reward/accuracy": _mean([float(r["accuracy"]) for r in rewards if r.get("accuracy") is not None]),
        "reward/format": _mean([float(r.get("format", 0.0)) for r in rewards]),
        "reward/tool": _mean([float(r.get("tool", 0.0)) for r in rewards]),
        "reward/invalid": sum(1 for r in rewards if not r.get("valid", True)) / n,
        "rollout/turns": _mean([float(t.num_turns) for t in trajectories]),
        "rollout/tool_calls": _mean([float(t.num_tool_calls) for t in trajectories]),
        "rollout/format_errors": _mean([float(t.num_format_errors) for t in trajectories]),
        "rollout/response_length": _mean([float(t.generated_tokens) for t in trajectories]),
        "rollout/valid_turn_rate": _mean([float(a in ("call", "answer")) for a in actions]),
        "rollout/over_turn_rate": reasons.get("over_turn", 0) / n,
        "rollout/trajectories": float(len(trajectories)),
    }
    # Estimator-specific parts: DAPO's overlong punishment, remax's greedy baseline, Pixelis' terms (rl.pixelis;
    # absent otherwise).
    for key in ("overlong_penalty", "greedy_baseline", "curiosity", "pixelis_task", "pixelis_curiosity",
                "pixelis_coherence", "pixelis_tool_penalty", "pixelis_curiosity_raw", "pixelis_coherence_raw"):
        found = [float(r[key]) for r in rewards if r.get(key) is not None]
        if found:
            out[f"reward/{key}"] = _mean(found)
    for reason in END_REASONS:
        out[f"end_reason/{reason}"] = reasons.get(reason, 0) / n
    out.update(metrics_by_kind(trajectories))
    return out


KIND_KEYS = ("total", "accuracy", "pixelis_task", "pixelis_curiosity", "pixelis_coherence", "pixelis_tool_penalty",
             "pixelis_curiosity_raw", "pixelis_coherence_raw")
"""The reward parts reported per kind of question: with several kinds in one set, a term that favours one kind's
dialogue over another's shows here and not in the step's means (docs/learning.md, Pixelis' reward terms)."""


def question_kind(trajectory: Trajectory) -> str:
    """The question's kind: its task's category (`operations/sign`, `zoom/single`, ...), else its data source."""
    return str(trajectory.task.get("category") or trajectory.task.get("data_source") or "unknown")


def metrics_by_kind(trajectories: list[Trajectory], prefix: str = "by_kind") -> dict[str, float]:
    """`{prefix}/{kind}/{part}`: each reward part's mean over the valid trajectories of each kind of question
    (and `{prefix}/{kind}/trajectories`, and `{prefix}/{kind}/turns`, its mean assistant turns: a kind offered no
    tool answers in one); nothing when the step holds a single kind."""
    kinds: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        kinds.setdefault(question_kind(t), []).append(t)
    if len(kinds) < 2:
        return {}
    out: dict[str, float] = {}
    for kind, group in sorted(kinds.items()):
        out[f"{prefix}/{kind}/trajectories"] = float(len(group))
        out[f"{prefix}/{kind}/turns"] = mean(sum(turn.role == "assistant" for turn in t.turns) for t in group)
        for key in KIND_KEYS:
            found = [float(t.rewards[key]) for t in group
                     if t.rewards.get(key) is not None and t.rewards.get("valid", True)]
            if found:
                out[f"{prefix}/{kind}/{key}"] = mean(found)
    return out


class MetricsLog:
    """`metrics.jsonl`: one JSON row per step (and per validation), in step order."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.rows: list[dict[str, Any]] = []
        if self.path.is_file():
            self.rows = [json.loads(line) for line in self.path.read_text(encoding="utf-8").splitlines() if line.strip()]

    def truncate(self, step: int) -> None:
        """Forget rows after `step` (steps a resumed run will redo)."""
        self.rows = [row for row in self.rows if row.get("step", 0) <= step]
        self._write()

    def append(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        self._write()

    def _write(self) -> None:
        atomic_write_text(self.path, "".join(json.dumps(row, sort_keys=True) + "\n" for row in self.rows))


TRAIN_PLOT_KEYS = (
    "reward/mean",
    "reward/accuracy",
    "rollout/response_length",
    "rollout/turns",
    "rollout/over_turn_rate",
    "update/kl",
    "update/entropy",
    "update/clip_frac",
    "update/grad_norm",
)


def peak_device_memory() -> dict[str, float]:
    """The GPU memory high-water marks since the last call (allocated by tensors, reserved by the caching
    allocator), in GiB, and a reset for the next step; nothing without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return {}
    peak = {"memory/peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "memory/peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}
    torch.cuda.reset_peak_memory_stats()
    return peak


def write_plots(rows: list[dict[str, Any]], out_dir: Path) -> None:
    """DVC plot data (train.json, val.json under plots/) and PNGs of reward, accuracy and validation."""
    plots = Path(out_dir) / "plots"
    train = [row for row in rows if row.get("kind") == "train"]
    val = [row for row in rows if row.get("kind") == "val"]
    train_points = [
        {"step": row["step"], **{key.replace("/", "_"): row.get(key) for key in TRAIN_PLOT_KEYS if key in row}}
        for row in train
    ]
    val_points = [{"step": row["step"], "accuracy": row.get("val/accuracy"), "reward": row.get("val/reward")} for row in val]
    atomic_write_json(plots / "train.json", train_points)
    atomic_write_json(plots / "val.json", val_points)
    line_plot(
        {
            "reward": [(row["step"], row.get("reward/mean")) for row in train],
            "accuracy": [(row["step"], row.get("reward/accuracy")) for row in train],
            "val accuracy": [(row["step"], row.get("val/accuracy")) for row in val],
        },
        plots / "reward.png",
        "Reward and accuracy",
        "step",
        "value",
    )
    line_plot(
        {
            "entropy": [(row["step"], row.get("update/entropy")) for row in train],
            "clip fraction": [(row["step"], row.get("update/clip_frac")) for row in train],
            "kl": [(row["step"], row.get("update/kl")) for row in train],
        },
        plots / "update.png",
        "Update statistics",
        "step",
        "value",
    )


def val_row(step: int, trajectories: list[Trajectory], max_turns: int) -> dict[str, Any]:
    """A validation pass's row: accuracy, reward, turns and end reasons, and accuracy per kind of question."""
    summary = summarize(trajectories, [max_turns])
    totals = [float(t.rewards["total"]) for t in trajectories if t.rewards.get("total") is not None]
    by_kind = {k: v for k, v in metrics_by_kind(trajectories, "val/by_kind").items()
               if k.endswith(("/accuracy", "/trajectories"))}
    return {
        **by_kind,
        "step": step,
        "kind": "val",
        "val/accuracy": summary["accuracy"],
        "val/reward": mean(totals) if totals else None,
        "val/mean_turns": summary["mean_turns"],
        "val/valid_turn_rate": summary["valid_turn_rate"],
        "val/answered": summary["end_reasons"]["answered"],
        "val/over_turn": summary["end_reasons"]["over_turn"],
        "val/questions": summary["questions"],
    }


def final_metrics(rows: list[dict[str, Any]], steps: int, seconds: float) -> dict[str, Any]:
    """`metrics.json`: the first and last training rows' headline figures, the last validation, the best
    validation accuracy and the mean step time."""
    train = [r for r in rows if r.get("kind") == "train"]
    val = [r for r in rows if r.get("kind") == "val"]
    keys = ("reward/mean", "reward/accuracy", "rollout/turns", "rollout/over_turn_rate", "rollout/response_length",
            "update/entropy", "update/kl", "update/clip_frac", "update/grad_norm")
    accuracies = [r["val/accuracy"] for r in val if r.get("val/accuracy") is not None]
    return {
        "steps": steps,
        "first": {k: train[0].get(k) for k in keys} if train else {},
        "last": {k: train[-1].get(k) for k in keys} if train else {},
        "val": {k: v for k, v in val[-1].items() if k.startswith("val/")} if val else {},
        "best_val_accuracy": max(accuracies) if accuracies else None,
        "mean_step_seconds": mean(r["time/step"] for r in train) if train else None,
        "seconds_this_run": round(seconds, 2),
    }
