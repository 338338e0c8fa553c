"""The `data` stage: the embedded tiny model and the synthetic visual-search task set, the pipeline's inputs.

Reads `seed`, `model` (the tiny model's seed) and `data` (the synthetic task generator) from params.yaml and
writes:

    <tiny-model>/             the embedded tiny Qwen2.5-VL (Hugging Face directory; `model.path` points at it
                              by default; a run on a real model still builds it, about a megabyte, in seconds)
    <out>/tasks/              {train,val,test}.jsonl task records and their canvases
    <out>/metrics.json        tasks per split, kind and difficulty; the tiny model's parameter count
    <out>/plots/tasks.json    tasks per category (DVC bar plot data), and plots/tasks.png

Both folders are built beside their final place and swapped in, so a killed run leaves nothing half-written.

Launch (dvc.yaml does this as stage `data`):
    python -m pipelines.data_stage --params params.yaml --tiny-model work/models/tiny --out work/data
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

from loupe.config import ModelParams, ParamsError, load_section
from loupe.data.synthetic import SyntheticConfig, generate_tasks
from loupe.data.tasks import read_tasks
from loupe.io import atomic_directory, atomic_write_json
from loupe.tracking import stage_run


def build_tiny(model_out: Path, seed: int) -> int:
    """Build the tiny model into `model_out` atomically; returns its parameter count."""
    from safetensors import safe_open

    from loupe.models.tiny import build_tiny_model

    with atomic_directory(model_out) as tmp:
        build_tiny_model(tmp, seed=seed)
    count = 0
    for weights in model_out.glob("*.safetensors"):
        with safe_open(str(weights), "np") as f:
            count += sum(_numel(f.get_slice(name).get_shape()) for name in f.keys())
    return count


def _numel(shape: list[int]) -> int:
    total = 1
    for side in shape:
        total *= side
    return total


def task_metrics(tasks_dir: Path) -> tuple[dict, list[dict]]:
    """Counts per split, kind and difficulty, and the bar-plot rows (tasks per category over all splits)."""
    metrics: dict = {"tasks": {}, "kinds": Counter(), "difficulties": Counter(), "choice_fraction": 0.0}
    per_category: Counter = Counter()
    choice = total = 0
    for jsonl in sorted(tasks_dir.glob("*.jsonl")):
        records = read_tasks(jsonl)
        metrics["tasks"][jsonl.stem] = len(records)
        for record in records:
            kind, _, difficulty = (record.category or "unknown/unknown").partition("/")
            metrics["kinds"][kind] += 1
            metrics["difficulties"][difficulty] += 1
            per_category[record.category or "unknown"] += 1
            choice += record.options is not None
            total += 1
    metrics["kinds"] = dict(sorted(metrics["kinds"].items()))
    metrics["difficulties"] = dict(sorted(metrics["difficulties"].items()))
    metrics["choice_fraction"] = round(choice / total, 4) if total else 0.0
    rows = [{"category": name, "tasks": count} for name, count in sorted(per_category.items())]
    return metrics, rows


def _bar_png(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 0.25 * max(4, len(rows)) + 1))
    ax.barh([r["category"] for r in rows], [r["tasks"] for r in rows])
    ax.set_xlabel("tasks")
    ax.set_title("Synthetic tasks per category")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def prepare(params_path: Path, tiny_model: Path, out_dir: Path, progress: bool = True) -> dict:
    """Build the tiny model and the task set inside the stage's MLflow run; returns metrics.json's content."""
    model = load_section(ModelParams, "model", params_path)
    data = load_section(SyntheticConfig, "data", params_path)
    started = time.perf_counter()
    with stage_run("data", params={"data": data.model_dump(mode="json"), "model": model.model_dump(mode="json")}) as run:
        parameters = build_tiny(tiny_model, model.tiny_seed)
        generate_tasks(out_dir / "tasks", data, progress=progress)
        metrics, rows = task_metrics(out_dir / "tasks")
        metrics["tiny_model_parameters"] = parameters
        metrics["seconds"] = round(time.perf_counter() - started, 2)
        atomic_write_json(out_dir / "plots" / "tasks.json", rows)
        _bar_png(rows, out_dir / "plots" / "tasks.png")
        atomic_write_json(out_dir / "metrics.json", metrics)
        run.log_metrics(metrics)
        for artefact in ("metrics.json", "plots"):
            run.log_artifact(out_dir / artefact)
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.data_stage", description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--tiny-model", type=Path, required=True, help="where the tiny model is built")
    parser.add_argument("--out", type=Path, required=True, help="output folder (tasks/, metrics.json, plots/)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    try:
        metrics = prepare(args.params, args.tiny_model, args.out, progress=not args.no_progress)
    except (ParamsError, FileNotFoundError, ValueError) as err:
        print(f"data: {err}", file=sys.stderr)
        return 2
    splits = ", ".join(f"{split} {n}" for split, n in metrics["tasks"].items())
    print(f"tasks: {splits} in {args.out / 'tasks'}\ntiny model: {args.tiny_model} "
          f"({metrics['tiny_model_parameters']:,} parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
