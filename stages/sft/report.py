"""What training did, from the trainer's own record: metrics.json values and the loss curve.

The source is `trainer_state.json`'s `log_history`, written by the trainer at the end of training. After a
resume it holds the history restored from the checkpoint followed by the new steps, each step once (unlike
`trainer_log.jsonl`, which a killed and resumed run appends to twice).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loupe.io import atomic_write_json
from loupe.plots import line_plot


def read_log_history(train_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(loss records by step, the closing record with runtime and throughput) from trainer_state.json."""
    state_path = Path(train_dir) / "trainer_state.json"
    if not state_path.is_file():
        raise RuntimeError(f"{state_path}: missing; the trainer did not finish")
    state = json.loads(state_path.read_text(encoding="utf-8"))
    history = state.get("log_history", [])
    points = [h for h in history if "loss" in h and "step" in h]
    final = next((h for h in reversed(history) if "train_runtime" in h), {})
    return points, {**final, "global_step": state.get("global_step"), "epoch": state.get("epoch")}


def summarize(points: list[dict[str, Any]], final: dict[str, Any]) -> dict[str, Any]:
    """first/final loss, steps, throughput of the finished training."""
    losses = [float(p["loss"]) for p in points]
    return {
        "steps": final.get("global_step"),
        "epochs": final.get("epoch"),
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "min_loss": min(losses) if losses else None,
        "mean_train_loss": final.get("train_loss"),
        "samples_per_second": final.get("train_samples_per_second"),
        "steps_per_second": final.get("train_steps_per_second"),
        "train_runtime_s": final.get("train_runtime"),
    }


def write_loss_plots(points: list[dict[str, Any]], plots_dir: Path) -> None:
    """plots/loss.json (DVC plot data: step, loss, learning rate) and plots/loss.png."""
    rows = [
        {"step": int(p["step"]), "loss": float(p["loss"]), "learning_rate": p.get("learning_rate")}
        for p in points
    ]
    atomic_write_json(Path(plots_dir) / "loss.json", rows)
    line_plot(
        {"training loss": [(r["step"], r["loss"]) for r in rows]},
        Path(plots_dir) / "loss.png",
        "SFT training loss",
        "step",
        "loss",
    )
