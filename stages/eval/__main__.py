"""Evaluate one model directory on a list of benchmarks with the shared multi-turn rollout loop.

Reads the `eval` section of params.yaml (plus the shared `seed`, `protocol` and `rollout` sections), runs
every benchmark's questions K times up to the eval turn limit, scores the answers with loupe.rewards, and
writes into --out:

    metrics.json              per benchmark: Avg@K, pass@K, per category, turns, end reasons, turn scaling
    results.jsonl             one row per sample
    trajectories/<name>.jsonl every trajectory, crops under trajectories/images/
    viewer.html               the trajectories turn by turn with every crop, for a person to look at
    plots/turn_scaling.json   accuracy vs turn limit (DVC plot data), and plots/turn_scaling.png

Launch:
    python -m stages.eval --params params.yaml --model work/models/tiny --out work/eval
On a GPU node set `rollout.engine: vllm`; against a served model, `rollout.engine: openai`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from loupe.config import ParamsError, ProtocolParams, RolloutParams, load_section, load_seed
from loupe.data.benchmarks import load_benchmark
from loupe.io import atomic_write_json, atomic_write_text
from loupe.plots import line_plot
from loupe.rewards import build_judge, score_trajectory
from loupe.rollout import make_engine, run_rollouts
from loupe.tracking import stage_run
from loupe.trajectory import Trajectory, write_trajectories
from loupe.viewer import render_html
from stages.eval.metrics import result_rows, summarize
from stages.eval.params import EvalParams


def evaluate(params_path: Path, model_path: Path, out_dir: Path, progress: bool = True) -> dict:
    """Run the whole evaluation inside the stage's MLflow run; returns the metrics written to metrics.json."""
    seed = load_seed(params_path)
    params = load_section(EvalParams, "eval", params_path)
    with stage_run("eval", params={"eval": params.model_dump(mode="json"), "model": str(model_path)}) as run:
        metrics = _evaluate(params_path, model_path, out_dir, progress)
        for name, summary in metrics["benchmarks"].items():
            run.log_metrics({name: {k: v for k, v in summary.items() if k != "turn_scaling"}})
            for limit, accuracy in summary["turn_scaling"].items():
                if accuracy is not None:
                    run.log_metrics({f"{name}.turn_scaling": accuracy}, step=int(limit))
        for artefact in ("metrics.json", "results.jsonl", "viewer.html", "plots"):
            run.log_artifact(out_dir / artefact)
        return metrics


def _evaluate(params_path: Path, model_path: Path, out_dir: Path, progress: bool) -> dict:
    seed = load_seed(params_path)
    protocol = load_section(ProtocolParams, "protocol", params_path)
    rollout = load_section(RolloutParams, "rollout", params_path)
    params = load_section(EvalParams, "eval", params_path)
    if params.temperature is not None:
        rollout = rollout.model_copy(update={"temperature": params.temperature})

    # Every benchmark is read before any model is loaded: a bad path fails in seconds, not after an hour.
    cache_dir = out_dir / "benchmark_cache"
    benchmarks = []
    for spec in params.benchmarks:
        benchmark = load_benchmark(spec.name, spec.path, cache_dir)
        tasks = benchmark.tasks[: spec.limit] if spec.limit else benchmark.tasks
        benchmarks.append((spec.name, tasks, benchmark.image_root))

    engine = make_engine(rollout, protocol, model_path=str(model_path), seed=seed)
    judge = build_judge(params.reward)
    metrics: dict = {"model": str(model_path), "turn_limits": params.turn_limits, "benchmarks": {}}
    rows: list[dict] = []
    shown: list[Trajectory] = []
    curves: dict[str, list[tuple[float, float | None]]] = {}
    plot_rows: list[dict] = []
    started = time.perf_counter()
    try:
        for name, tasks, image_root in benchmarks:
            trajectories = run_rollouts(
                tasks,
                engine,
                protocol,
                image_root,
                samples_per_task=params.samples,
                max_turns=params.max_turns,
                max_new_tokens=rollout.max_new_tokens,
                progress=f"eval {name}" if progress else False,
            )
            for trajectory in trajectories:
                score_trajectory(trajectory, params.reward, judge)
            write_trajectories(trajectories, out_dir / "trajectories" / f"{name}.jsonl")
            summary = summarize(trajectories, params.turn_limits)
            metrics["benchmarks"][name] = summary
            rows += result_rows(name, trajectories)
            shown += trajectories[: max(0, params.viewer_trajectories - len(shown))]
            curves[name] = [(int(limit), acc) for limit, acc in summary["turn_scaling"].items()]
            plot_rows += [{"benchmark": name, "max_turns": x, "accuracy": y} for x, y in curves[name]]
    finally:
        engine.close()
    metrics["seconds"] = round(time.perf_counter() - started, 2)

    atomic_write_text(out_dir / "results.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    atomic_write_json(out_dir / "plots" / "turn_scaling.json", plot_rows)
    line_plot(curves, out_dir / "plots" / "turn_scaling.png", "Accuracy vs turn limit", "turn limit", "accuracy", log2_x=True)
    render_html(shown, out_dir / "viewer.html", title=f"Eval of {model_path}")
    atomic_write_json(out_dir / "metrics.json", metrics)
    return metrics


def _print_summary(metrics: dict, out_dir: Path) -> None:
    for name, m in metrics["benchmarks"].items():
        k = m["samples_per_question"]
        acc = m[f"avg@{k}"]
        print(
            f"{name}: avg@{k} {acc if acc is None else f'{acc:.3f}'}, pass@{k} {m[f'pass@{k}']}, "
            f"mean turns {m['mean_turns']:.2f}, answered {m['end_reasons']['answered']:.0%}, invalid {m['invalid']}"
        )
    print(f"metrics: {out_dir / 'metrics.json'}\ntrajectories: {out_dir / 'viewer.html'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stages.eval", description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=Path, default=Path("params.yaml"), help="params file (default: params.yaml)")
    parser.add_argument("--model", type=Path, required=True, help="Hugging Face model directory to evaluate")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    try:
        metrics = evaluate(args.params, args.model, args.out, progress=not args.no_progress)
    except (ParamsError, FileNotFoundError, ValueError) as err:
        print(f"eval: {err}", file=sys.stderr)
        return 2
    _print_summary(metrics, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
