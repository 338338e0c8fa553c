"""Evaluate one model directory on a list of benchmarks with the shared multi-turn rollout loop.

Reads the `eval` section of params.yaml (plus the shared `seed`, `protocol` and `rollout` sections), runs
every benchmark's questions K times up to the eval turn limit, scores the answers with loupe.rewards, and
writes into --out:

    metrics.json              per benchmark: Avg@K, pass@K, per category, turns, end reasons, turn scaling
    results.jsonl             one row per sample
    trajectories/<name>.jsonl every trajectory, crops under trajectories/images/
    viewer.html               the trajectories turn by turn with every crop, for a person to look at
    plots/turn_scaling.json   accuracy vs turn limit (DVC plot data), and plots/turn_scaling.png

Memory does not grow with the benchmark: questions run `eval.chunk_size` at a time, each chunk's trajectories
are scored, appended to hidden temporary files (`JsonlWriter`) and dropped; only a few numbers per sample
(`SampleRecord`) and the viewer's trajectories stay. The files are renamed into place when every benchmark is
done, so a run that dies leaves no half file under a final name (benchmarks/eval_memory.py measures the peak).

Launch:
    python -m stages.eval --params params.yaml --model work/models/tiny --out work/eval
On a GPU node set `rollout.engine: vllm`; against a served model, `rollout.engine: openai`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from tqdm import tqdm

from loupe.config import (
    ParamsError,
    ProtocolParams,
    RolloutParams,
    load_section,
    load_seed,
)
from loupe.data.benchmarks import load_benchmark
from loupe.data.tasks import TaskRecord
from loupe.io import atomic_write_json
from loupe.plots import line_plot
from loupe.rewards import LLMJudge, build_judge, score_trajectory
from loupe.rollout import Engine, RolloutStats, make_engine, run_rollouts
from loupe.tracking import stage_run
from loupe.trajectory import JsonlWriter, Trajectory
from loupe.viewer import render_html
from stages.eval.metrics import SampleRecord, summarize
from stages.eval.params import EvalParams


def evaluate(params_path: Path, model_path: Path, out_dir: Path, progress: bool = True) -> dict:
    """Run the whole evaluation inside the stage's MLflow run; returns the metrics written to metrics.json."""
    load_seed(params_path)  # a bad seed fails here, before a tracking run is opened
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
    shown: list[Trajectory] = []
    curves: dict[str, list[tuple[float, float | None]]] = {}
    plot_rows: list[dict] = []
    started = time.perf_counter()
    # Every writer commits (renames its file into place) only when all benchmarks are done; an error anywhere
    # discards them all, so results.jsonl and the trajectory files always come from one whole run.
    with ExitStack() as outputs:
        try:
            results = outputs.enter_context(JsonlWriter(out_dir / "results.jsonl"))
            for name, tasks, image_root in benchmarks:
                run = _BenchmarkRun(name, params, rollout, protocol, engine, judge, results, shown)
                writer = outputs.enter_context(JsonlWriter(out_dir / "trajectories" / f"{name}.jsonl"))
                records = run.run(tasks, image_root, writer, progress)
                summary = summarize(records, params.turn_limits)
                metrics["benchmarks"][name] = summary
                curves[name] = [(int(limit), acc) for limit, acc in summary["turn_scaling"].items()]
                plot_rows += [{"benchmark": name, "max_turns": x, "accuracy": y} for x, y in curves[name]]
        finally:
            engine.close()
    metrics["seconds"] = round(time.perf_counter() - started, 2)

    atomic_write_json(out_dir / "plots" / "turn_scaling.json", plot_rows)
    line_plot(curves, out_dir / "plots" / "turn_scaling.png", "Accuracy vs turn limit", "turn limit", "accuracy", log2_x=True)
    render_html(shown, out_dir / "viewer.html", title=f"Eval of {model_path}")
    atomic_write_json(out_dir / "metrics.json", metrics)
    return metrics


class _BenchmarkRun:
    """One benchmark's questions, a chunk at a time: roll out, score, write, keep only the per-sample records."""

    def __init__(
        self,
        name: str,
        params: EvalParams,
        rollout: RolloutParams,
        protocol: ProtocolParams,
        engine: Engine,
        judge: LLMJudge | None,
        results: JsonlWriter,
        shown: list[Trajectory],
    ):
        self.name, self.params, self.rollout, self.protocol = name, params, rollout, protocol
        self.engine, self.judge, self.results, self.shown = engine, judge, results, shown

    def run(self, tasks: list[TaskRecord], image_root: Path, writer: JsonlWriter, progress: bool) -> list[SampleRecord]:
        records: list[SampleRecord] = []
        stats = RolloutStats()
        # One bar over the whole benchmark, fed as each trajectory ends, whatever the chunking.
        with tqdm(total=len(tasks) * self.params.samples, desc=f"eval {self.name}", unit="traj", disable=not progress) as bar:
            started = time.perf_counter()

            def finished(trajectory: Trajectory) -> None:
                # Eval never reads the token trace; dropping it at once frees its processed pixel tensors.
                trajectory.trace = None
                bar.update(1)
                elapsed = max(time.perf_counter() - started, 1e-9)
                bar.set_postfix(turns=stats.turns, tok_s=f"{stats.generated_tokens / elapsed:.0f}", refresh=False)

            size = self.params.chunk_size
            for start in range(0, len(tasks), size):
                records += self._chunk(tasks[start : start + size], image_root, writer, stats, finished)
        return records

    def _chunk(
        self,
        tasks: list[TaskRecord],
        image_root: Path,
        writer: JsonlWriter,
        stats: RolloutStats,
        finished: Callable[[Trajectory], None],
    ) -> list[SampleRecord]:
        """Run, score and write one chunk; its trajectories die with this call, but for the viewer's share."""
        trajectories = run_rollouts(
            tasks,
            self.engine,
            self.protocol,
            image_root,
            samples_per_task=self.params.samples,
            max_turns=self.params.max_turns,
            max_new_tokens=self.rollout.max_new_tokens,
            stats=stats,
            on_finish=finished,
        )
        for trajectory in trajectories:
            score_trajectory(trajectory, self.params.reward, self.judge)
        writer.write_trajectories(trajectories)  # saves the crops to files, so the viewer's share holds none
        records = [SampleRecord.of(t) for t in trajectories]
        self.results.write_rows(r.row(self.name) for r in records)
        self.shown += trajectories[: max(0, self.params.viewer_trajectories - len(self.shown))]
        return records


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
