"""What the synth stage reports: acceptance rate, rejection reasons, turns histogram, end reasons, patterns.

Written as `metrics.json` (DVC metrics), `plots/turns.json` and `plots/rejections.json` (DVC plot data) with
their PNGs, and printed as a short summary.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from statistics import mean
from typing import Any

from loupe.io import atomic_write_json
from loupe.plots import bar_plot
from loupe.trajectory import END_REASONS, Trajectory
from stages.synth.dataset import DatasetSummary


def is_kept(trajectory: Trajectory) -> bool:
    return bool(trajectory.meta.get("synth", {}).get("kept"))


def summarize(trajectories: list[Trajectory], dataset: DatasetSummary, teacher: str) -> dict[str, Any]:
    """Metrics of a whole run (every shard's trajectories, kept and rejected)."""
    kept = [t for t in trajectories if is_kept(t)]
    reasons = Counter(t.meta["synth"]["reason"] for t in trajectories if not is_kept(t))
    ends = Counter(t.end_reason for t in trajectories)
    top = max((t.num_turns for t in trajectories), default=0)
    histogram = Counter(t.num_turns for t in kept)
    histogram_all = Counter(t.num_turns for t in trajectories)
    return {
        "teacher": teacher,
        "tasks": len({t.task.get("doc_id") for t in trajectories}),
        "trajectories": len(trajectories),
        "accepted": len(kept),
        "acceptance_rate": len(kept) / len(trajectories) if trajectories else None,
        "duplicates": dataset.duplicates,
        "records": dataset.records,
        "images": dataset.images,
        "image_mb": round(dataset.image_bytes / 1e6, 2),
        "rejections": dict(sorted(reasons.items())),
        "end_reasons": {r: ends.get(r, 0) for r in END_REASONS},
        "turns_histogram": {str(n): histogram.get(n, 0) for n in range(1, top + 1)},
        "turns_histogram_all": {str(n): histogram_all.get(n, 0) for n in range(1, top + 1)},
        "mean_turns": mean(t.num_turns for t in kept) if kept else None,
        "mean_tool_calls": mean(t.num_tool_calls for t in kept) if kept else None,
        "patterns": dict(sorted(Counter(t.meta["pattern"] for t in kept if t.meta.get("pattern")).items())),
    }


def write_plots(metrics: dict[str, Any], plots_dir: Path) -> None:
    turns = [
        {"turns": int(n), "kept": metrics["turns_histogram"][n], "all": metrics["turns_histogram_all"][n]}
        for n in metrics["turns_histogram_all"]
    ]
    atomic_write_json(plots_dir / "turns.json", turns)
    bar_plot(
        {"all": metrics["turns_histogram_all"], "kept": metrics["turns_histogram"]},
        plots_dir / "turns.png", "Assistant turns per trajectory", "turns", "trajectories",
    )
    rejections = [{"reason": r, "count": c} for r, c in metrics["rejections"].items()]
    atomic_write_json(plots_dir / "rejections.json", rejections)
    bar_plot({"rejected": metrics["rejections"] or {"none": 0}}, plots_dir / "rejections.png",
             "Rejected trajectories by reason", "reason", "trajectories")


def summary_lines(metrics: dict[str, Any], out_dir: Path) -> list[str]:
    rate = metrics["acceptance_rate"]
    lines = [
        (f"synth ({metrics['teacher']}): {metrics['trajectories']} trajectories from {metrics['tasks']} tasks, "
         f"accepted {metrics['accepted']} ({rate:.1%})") if rate is not None else "synth: no trajectories",
        (f"dataset: {metrics['records']} records ({metrics['duplicates']} duplicates dropped), "
         f"{metrics['images']} images, in {out_dir / 'dataset'}"),
        "rejected: " + (", ".join(f"{r} {c}" for r, c in metrics["rejections"].items()) or "none"),
        "turns (kept): " + "  ".join(f"{n}: {c}" for n, c in metrics["turns_histogram"].items() if c),
        "end reasons: " + ", ".join(f"{r} {c}" for r, c in metrics["end_reasons"].items() if c),
    ]
    if metrics["patterns"]:
        lines.append("patterns (kept): " + ", ".join(f"{p} {c}" for p, c in metrics["patterns"].items()))
    usage = metrics.get("teacher_usage")
    if usage:
        lines.append(
            f"teacher: {usage['requests']} requests, {usage['prompt_tokens']} prompt + {usage['completion_tokens']} "
            f"completion tokens, cost {usage['cost']:.4f}; {usage['cached_requests']} replies from the cache "
            f"(saved {usage['cost_saved_by_cache']:.4f})"
        )
    lines.append(f"metrics: {out_dir / 'metrics.json'}  viewer: {out_dir / 'viewer.html'}")
    return lines
