"""Evaluate models on a list of benchmarks with the shared multi-turn rollout loop, and compare them.

Reads the `eval` section of params.yaml (plus the shared `seed`, `protocol` and `rollout` sections), runs
every benchmark's questions K times up to the eval turn limit with each model in turn, scores the answers with
loupe.rewards, and writes into --out:

    metrics.json              the comparison (shape in loupe/compare.py): per benchmark the split's chance rate;
                              per model accuracy (Avg@K) with a 95% bootstrap interval over questions, pass@K,
                              valid-turn rate, mean turns and the turn-scaling curve
    plots/comparison.png      per benchmark: accuracy per model with its interval and the chance rate; accuracy
                              vs turn limit per model
    plots/turn_scaling.json   accuracy vs turn limit, a row per (benchmark, limit), a column per model (DVC plot)
    <name>/                   each model's own evaluation, exactly what a one-model eval always wrote:
      metrics.json              per benchmark: Avg@K, pass@K, per category, turns, end reasons, turn scaling
      results.jsonl             one row per sample
      trajectories/<b>.jsonl    every trajectory, crops under trajectories/images/
      viewer.html               the trajectories turn by turn with every crop, for a person to look at
      plots/turn_scaling.json   this model's accuracy vs turn limit, and plots/turn_scaling.png

Models are given as `--model NAME=PATH`, repeated, and run in that order; a bare `--model PATH` is named `model`.
Every model answers the same questions with the same seed, sampling and chunking, so the numbers differ only by
the model. They run one after another in this one process, each model's engine closed and freed before the
next model is loaded; on a CPU with the transformers engine, from 100 trajectories a model, they run side by
side instead, one process each (`eval.model_processes`, stages/eval/side_by_side.py), with the same files. The
terminal output ends with the comparison table (loupe.compare.comparison_table).

Memory does not grow with the benchmark: questions run `eval.chunk_size` at a time, each chunk's trajectories
are scored, appended to hidden temporary files (`JsonlWriter`) and dropped; only a few numbers per sample
(`SampleRecord`) and the viewer's trajectories stay. A model's files are renamed into place when all its
benchmarks are done, so a run that dies leaves no half file under a final name (benchmarks/eval_memory.py
measures the peak).

Launch:
    python -m stages.eval --params params.yaml --model base=work/models/tiny --model sft=work/sft/model \
        --model rl=work/rl/model --out work/eval
On a GPU node set `rollout.engine: vllm`; against a served model (one model only), `rollout.engine: openai`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import time
from pathlib import Path

from loupe.compare import comparison_table
from loupe.config import (
    ParamsError,
    RolloutParams,
    load_section,
    load_seed,
    params_with_overrides,
)
from loupe.io import atomic_write_json
from loupe.sample_metrics import SampleRecord
from loupe.tracking import stage_run
from stages.eval.comparison import compare, comparison_plot, turn_scaling_rows
from stages.eval.one_model import evaluate_model, load_benchmarks
from stages.eval.params import EvalParams
from stages.eval.side_by_side import evaluate_side_by_side, model_processes

BARE_MODEL_NAME = "model"
"""The name of a model given as a bare `--model PATH`."""
MODEL_NAME = re.compile(r"[A-Za-z0-9_-]+")
"""A model name: a folder under --out, a key of metrics.json and a column of the DVC plot data."""
RESERVED_NAMES = frozenset({"plots", "benchmark_cache", "benchmark", "max_turns", "questions", "samples_per_question",
                            "chance_rate"})
"""Names a model cannot take: folders of --out, columns of plots/turn_scaling.json and keys of a benchmark's entry."""

def parse_models(specs: list[str]) -> dict[str, Path]:
    """`NAME=PATH` or a bare `PATH` (named `model`) per --model, in order. A text whose part before the first "="
    is not a name (letters, digits, _ and -) is a path."""
    models: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not MODEL_NAME.fullmatch(name):
            name, path = BARE_MODEL_NAME, spec
        if not path:
            raise ValueError(f"--model {spec!r}: no path after the name")
        if name in RESERVED_NAMES:
            raise ValueError(f"--model {spec!r}: {name!r} is reserved ({', '.join(sorted(RESERVED_NAMES))})")
        if name in models:
            bare = " (a bare path is named 'model': give NAME=PATH)" if name == BARE_MODEL_NAME else ""
            raise ValueError(f"--model: the name {name!r} is given twice{bare}")
        models[name] = Path(path)
    return models


def evaluate(params_path: Path, model_path: Path, out_dir: Path, progress: bool = True) -> dict:
    """One model into `out_dir` itself (no comparison), inside the stage's MLflow run; returns the metrics
    written to its metrics.json. The command line goes through `evaluate_models`; this serves callers that
    evaluate one model in-process (the rl stage's tests, benchmarks/eval_memory.py)."""
    load_seed(params_path)  # a bad seed fails here, before a tracking run is opened
    params = load_section(EvalParams, "eval", params_path)
    with stage_run("eval", params={"eval": params.model_dump(mode="json"), "model": str(model_path)}) as run:
        benchmarks = load_benchmarks(params, out_dir / "benchmark_cache")
        metrics, _ = evaluate_model(params_path, model_path, out_dir, benchmarks, progress)
        for name, summary in metrics["benchmarks"].items():
            run.log_metrics({name: {k: v for k, v in summary.items() if k != "turn_scaling"}})
            for limit, accuracy in summary["turn_scaling"].items():
                if accuracy is not None:
                    run.log_metrics({f"{name}.turn_scaling": accuracy}, step=int(limit))
        for artefact in ("metrics.json", "results.jsonl", "viewer.html", "plots"):
            run.log_artifact(out_dir / artefact)
        return metrics


def evaluate_models(params_path: Path, models: dict[str, Path], out_dir: Path, progress: bool = True) -> dict:
    """Every model into `out_dir/<name>/`, in order, then the comparison into `out_dir` (metrics.json and
    plots/), all inside one MLflow run of the stage; returns the comparison metrics."""
    if not models:
        raise ValueError("no model to evaluate")
    seed = load_seed(params_path)  # a bad seed fails here, before a tracking run is opened
    params = load_section(EvalParams, "eval", params_path)
    rollout = load_section(RolloutParams, "rollout", params_path)
    if rollout.engine == "openai" and len(models) > 1:
        raise ValueError(f"rollout.engine openai asks the one model its endpoint serves; it cannot compare "
                         f"{len(models)} models ({', '.join(models)}): give one --model")
    if rollout.engine != "openai":
        # Every model is found before any is loaded: a typo fails in seconds, not after the first model's hour.
        for name, path in models.items():
            if not path.exists():
                raise FileNotFoundError(f"model {name}: {path} does not exist")
    logged = {"eval": params.model_dump(mode="json"), "models": {name: str(path) for name, path in models.items()}}
    with stage_run("eval", params=logged) as run:
        started = time.perf_counter()
        benchmarks = load_benchmarks(params, out_dir / "benchmark_cache")
        summaries: dict[str, dict] = {}
        records: dict[str, dict[str, list[SampleRecord]]] = {}
        trajectories = sum(len(tasks) for _, tasks, _ in benchmarks) * params.samples
        processes = model_processes(params.model_processes, rollout.engine, rollout.device, len(models), trajectories)
        if processes > 1:
            done = evaluate_side_by_side(params_path, models, out_dir, benchmarks, params.samples, processes, progress)
        for name, path in models.items():
            if processes > 1:
                metrics, records[name] = done[name]
            else:
                metrics, records[name] = evaluate_model(params_path, path, out_dir / name, benchmarks, progress, label=name)
                _release_memory()
            summaries[name] = metrics["benchmarks"]
        comparison = compare({name: str(path) for name, path in models.items()},
                             {name: tasks for name, tasks, _ in benchmarks}, summaries, records, params.turn_limits, seed)
        comparison["seconds"] = round(time.perf_counter() - started, 2)
        atomic_write_json(out_dir / "plots" / "turn_scaling.json", turn_scaling_rows(comparison))
        comparison_plot(comparison, out_dir / "plots" / "comparison.png")
        atomic_write_json(out_dir / "metrics.json", comparison)

        for benchmark in comparison["benchmarks"]:
            entry = comparison[benchmark]
            run.log_metrics({benchmark: {"chance_rate": entry["chance_rate"], "questions": entry["questions"]}})
            for name in models:
                summary = summaries[name][benchmark]
                interval = {k: entry[name][k] for k in ("accuracy_ci_low", "accuracy_ci_high")}
                run.log_metrics({benchmark: {name: {**{k: v for k, v in summary.items() if k != "turn_scaling"},
                                                    **interval}}})
                for limit, accuracy in summary["turn_scaling"].items():
                    if accuracy is not None:
                        run.log_metrics({f"{benchmark}.{name}.turn_scaling": accuracy}, step=int(limit))
        for artefact in ("metrics.json", "plots"):
            run.log_artifact(out_dir / artefact)
        for name in models:
            for artefact in ("metrics.json", "results.jsonl", "viewer.html"):
                run.log_artifact(out_dir / name / artefact, artifact_path=name)
        return comparison


def _release_memory() -> None:
    """Free what the last model's engine held before the next one loads (its module, the CUDA cache)."""
    gc.collect()
    torch = sys.modules.get("torch")  # never imported for an endpoint
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _summary_lines(metrics: dict, prefix: str = "") -> list[str]:
    """One line per benchmark of one model's metrics."""
    lines = []
    for name, m in metrics["benchmarks"].items():
        k = m["samples_per_question"]
        acc = m[f"avg@{k}"]
        lines.append(
            f"{prefix}{name}: avg@{k} {acc if acc is None else f'{acc:.3f}'}, pass@{k} {m[f'pass@{k}']}, "
            f"maj@{k} {m.get(f'maj@{k}')}, "
            f"mean turns {m['mean_turns']:.2f}, answered {m['end_reasons']['answered']:.0%}, invalid {m['invalid']}"
        )
    return lines


def _print_comparison(comparison: dict, out_dir: Path) -> None:
    """Each model's one-liners and files, then the comparison table last."""
    for name in comparison["models"]:
        metrics = json.loads((out_dir / name / "metrics.json").read_text())
        print("\n".join(_summary_lines(metrics, prefix=f"{name} ")))
        print(f"{name} trajectories: {out_dir / name / 'viewer.html'}")
    print(f"metrics: {out_dir / 'metrics.json'}\nplot: {out_dir / 'plots' / 'comparison.png'}\n")
    if os.environ.get("LOUPE_PARENT_RUN_ID"):  # under the flow: its summary prints the table, once, at the end
        print("eval: the comparison and its verdict are in the run's summary below")
    else:
        print(comparison_table(comparison))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stages.eval", description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=Path, default=Path("params.yaml"), help="params file (default: params.yaml)")
    parser.add_argument("--model", action="append", required=True, metavar="[NAME=]PATH",
                        help="Hugging Face model directory to evaluate, as NAME=PATH; repeat to compare models "
                             "(evaluated in order into OUT/NAME/); a bare PATH is named 'model'")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("overrides", nargs="*", metavar="KEY.PATH=VALUE",
                        help="params set on top of the file, as in it (e.g. rl.lr=1e-6); recorded in MLflow")
    args = parser.parse_args(argv)
    try:
        args.params = params_with_overrides(args.params, args.overrides)
        models = parse_models(args.model)
        comparison = evaluate_models(args.params, models, args.out, progress=not args.no_progress)
    except (ParamsError, FileNotFoundError, ValueError) as err:
        print(f"eval: {err}", file=sys.stderr)
        return 2
    _print_comparison(comparison, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
