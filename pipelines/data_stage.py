"""The `data` stage: the embedded tiny model and a procedural task set, the pipeline's inputs.

Reads `model` (the tiny model's seed) and `data` (the task family, zoom or synthetic, and its generator's
knobs: loupe.data.families) from params.yaml and writes:

    <tiny-model>/             the embedded tiny model (Hugging Face directory, Qwen2.5-VL or `model.tiny_family`;
                              `model.path` points at it by default); with `model.build_tiny: false`, a run on
                              another model, only a note saying no model was built
    <out>/tasks/              {train,val,test}.jsonl task records and their canvases
    <out>/tasks_<family>/     the same for each of `data.extra_families` (a two-stage recipe's second data set)
    <out>/metrics.json        tasks per split, kind and difficulty, each split's chance rate (the accuracy of
                              the best answer given without looking); the tiny model's parameter count
    <out>/plots/tasks.json    tasks per category (DVC bar plot data), and plots/tasks.png

Both folders are built beside their final place and swapped in, so a killed run leaves nothing half-written.

Launch (dvc.yaml does this as stage `data`):
    python -m pipelines.data_stage --params params.yaml --tiny-model work/models/tiny --out work/data
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from pathlib import Path

from loupe.config import ModelParams, ParamsError, load_section
from loupe.data.families import DataParams, generate_families
from loupe.data.tasks import chance_rate, read_tasks
from loupe.io import atomic_directory, atomic_write_json
from loupe.tracking import stage_run


def build_tiny(model_out: Path, model: ModelParams, progress: bool = False) -> tuple[int, dict]:
    """Put the tiny model `model` describes into `model_out` atomically: the committed artefact
    (`model.tiny_artifact`, checked by hash) when it was built with the same settings, else built here with its
    perception pretraining; returns its parameter count and the pretraining's report (empty without one)."""
    from dataclasses import asdict

    from safetensors import safe_open

    from loupe.models.tiny import build_tiny_model
    from loupe.models.tiny_artifact import build_settings, copy_artifact, read_manifest
    from loupe.models.tiny_perception import pretrain_perception

    if not model.build_tiny:  # a run on another model: no minutes spent pretraining a model nobody reads
        with atomic_directory(model_out) as tmp:
            (tmp / "NOT_BUILT.txt").write_text(f"model.build_tiny is false: the pipeline trains model.path = "
                                                f"{model.path}, and no tiny model was built here.\n")
        print(f"tiny model: not built (model.build_tiny: false; model.path is {model.path})")
        return 0, {}
    settings = build_settings(model.tiny_seed, model.tiny_text_hidden, model.tiny_text_layers,
                              model.tiny_perception_steps, model.tiny_family)
    artifact = Path(model.tiny_artifact) if model.tiny_artifact else None
    manifest = read_manifest(artifact) if artifact is not None and artifact.is_dir() else None
    if artifact is not None and manifest is None:
        print(f"tiny model: no artefact at {artifact}; building it here (`make tiny-model` writes one)")
    elif manifest is not None and manifest["build"] != settings:
        print(f"tiny model: {artifact} was built with {manifest['build']}, the model section asks for {settings}; "
              "building it here")
    report: dict = {}
    with atomic_directory(model_out) as tmp:
        if manifest is not None and manifest["build"] == settings:
            copy_artifact(artifact, tmp, manifest)  # type: ignore[arg-type]
            report = {**manifest["perception"], "from_artifact": 1}
            held_out = manifest["perception"].get("held_out_accuracy")
            print(f"tiny model: {artifact}, checked by hash (built with torch {manifest['built_with']['torch']} on "
                  f"{manifest['built_with']['cpu_capability']} kernels; held-out colour accuracy {held_out})")
        else:
            build_tiny_model(tmp, seed=model.tiny_seed, text_hidden=model.tiny_text_hidden,
                             text_layers=model.tiny_text_layers, family=model.tiny_family)
            if model.tiny_perception_steps:
                report = asdict(pretrain_perception(tmp, steps=model.tiny_perception_steps, seed=model.tiny_seed,
                                                    progress=progress))
    count = 0
    for weights in model_out.glob("*.safetensors"):
        with safe_open(str(weights), "np") as f:
            count += sum(_numel(f.get_slice(name).get_shape()) for name in f.keys())
    return count, report


def _numel(shape: list[int]) -> int:
    total = 1
    for side in shape:
        total *= side
    return total


def task_metrics(tasks_dir: Path) -> tuple[dict, list[dict]]:
    """Counts per split, kind and difficulty, and the bar-plot rows (tasks per category over all splits)."""
    metrics: dict = {"tasks": {}, "chance_rate": {}, "kinds": Counter(), "difficulties": Counter(),
                     "choice_fraction": 0.0}
    per_category: Counter = Counter()
    choice = total = 0
    for jsonl in sorted(tasks_dir.glob("*.jsonl")):
        records = read_tasks(jsonl)
        metrics["tasks"][jsonl.stem] = len(records)
        metrics["chance_rate"][jsonl.stem] = round(chance_rate(records), 4)
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
    ax.set_title("Tasks per category")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def prepare(params_path: Path, tiny_model: Path, out_dir: Path, progress: bool = True, workers: int = 1) -> dict:
    """Build the tiny model and the task set inside the stage's MLflow run; returns metrics.json's content.

    `workers` processes draw the tasks; the files are byte-identical for any count (loupe.data.splits), so it is
    an argument, not a parameter: changing it must not rerun the stage."""
    model = load_section(ModelParams, "model", params_path)
    data = load_section(DataParams, "data", params_path)
    started = time.perf_counter()
    with stage_run("data", params={"data": data.model_dump(mode="json"), "model": model.model_dump(mode="json")}) as run:
        parameters, perception = build_tiny(tiny_model, model, progress)
        generate_families(out_dir, data, progress=progress, workers=workers)
        metrics, rows = task_metrics(out_dir / "tasks")
        metrics["tiny_model_parameters"] = parameters
        if perception:
            metrics["tiny_model_perception"] = perception
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
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="processes drawing the tasks (default: one per core; the output is the same for any)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    try:
        metrics = prepare(args.params, args.tiny_model, args.out, progress=not args.no_progress,
                          workers=max(1, args.workers))
    except (ParamsError, FileNotFoundError, ValueError) as err:
        print(f"data: {err}", file=sys.stderr)
        return 2
    splits = ", ".join(f"{split} {n}" for split, n in metrics["tasks"].items())
    print(f"tasks: {splits} in {args.out / 'tasks'}\ntiny model: {args.tiny_model} "
          f"({metrics['tiny_model_parameters']:,} parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
