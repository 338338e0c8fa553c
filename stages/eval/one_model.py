"""One model evaluated on every benchmark into its own folder: the work the eval stage does for each model, whether
the models run one after another in the stage's process (stages/eval/__main__.py) or side by side, one process each
(stages/eval/side_by_side.py). Both import it; it imports neither.

`evaluate_model` rolls out each benchmark a chunk at a time (`_BenchmarkRun`), scores and writes every
trajectory, and reports each finished one to `count_trajectory`, which moves the parent's progress bar when the
models run side by side (`set_progress_counter`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from tqdm import tqdm

from loupe.config import ProtocolParams, RolloutParams, load_section, load_seed
from loupe.data.benchmarks import load_benchmark
from loupe.data.tasks import TaskRecord
from loupe.io import atomic_write_json
from loupe.plots import line_plot
from loupe.rewards import LLMJudge, build_judge, score_trajectory
from loupe.rollout import Engine, RolloutStats, make_engine, run_rollouts
from loupe.sample_metrics import SampleRecord, summarize
from loupe.trajectory import JsonlWriter, Trajectory
from loupe.viewer import render_html
from stages.eval.params import EvalParams

Benchmarks = list[tuple[str, list[TaskRecord], Path]]
"""(name, tasks, image root) of every benchmark, read once for all models."""

_COUNTER: Any = None
"""The parent's shared count of finished trajectories, in a child process of side_by_side (None elsewhere)."""


def set_progress_counter(counter: Any) -> None:
    """In a child process: report every finished trajectory to the parent's shared `counter`."""
    global _COUNTER
    _COUNTER = counter


def count_trajectory() -> None:
    """One trajectory finished, in a child: the parent's bar moves."""
    if _COUNTER is not None:
        with _COUNTER.get_lock():
            _COUNTER.value += 1


def load_benchmarks(params: EvalParams, cache_dir: Path) -> Benchmarks:
    """Every benchmark is read before any model is loaded: a bad path fails in seconds, not after an hour."""
    benchmarks = []
    for spec in params.benchmarks:
        benchmark = load_benchmark(spec.name, spec.path, cache_dir)
        tasks = benchmark.tasks[: spec.limit] if spec.limit else benchmark.tasks
        benchmarks.append((spec.name, tasks, benchmark.image_root))
    return benchmarks


def evaluate_model(params_path: Path, model_path: Path, out_dir: Path, benchmarks: Benchmarks, progress: bool,
              label: str | None = None) -> tuple[dict, dict[str, list[SampleRecord]]]:
    """One model on every benchmark into `out_dir`: its metrics (also written to metrics.json) and, per
    benchmark, its scored samples. The engine is closed before this returns."""
    seed = load_seed(params_path)
    protocol = load_section(ProtocolParams, "protocol", params_path)
    rollout = load_section(RolloutParams, "rollout", params_path)
    params = load_section(EvalParams, "eval", params_path)
    if params.temperature is not None:
        rollout = rollout.model_copy(update={"temperature": params.temperature})

    engine = make_engine(rollout, protocol, model_path=str(model_path), seed=seed)
    judge = build_judge(params.reward)
    metrics: dict = {"model": str(model_path), "turn_limits": params.turn_limits, "benchmarks": {}}
    records_by_benchmark: dict[str, list[SampleRecord]] = {}
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
                run = _BenchmarkRun(name, params, rollout, protocol, engine, judge, results, shown, label)
                writer = outputs.enter_context(JsonlWriter(out_dir / "trajectories" / f"{name}.jsonl"))
                records = run.run(tasks, image_root, writer, progress)
                summary = summarize(records, params.turn_limits)
                metrics["benchmarks"][name] = summary
                records_by_benchmark[name] = records
                curves[name] = [(int(limit), acc) for limit, acc in summary["turn_scaling"].items()]
                plot_rows += [{"benchmark": name, "max_turns": x, "accuracy": y} for x, y in curves[name]]
        finally:
            engine.close()
    metrics["seconds"] = round(time.perf_counter() - started, 2)

    atomic_write_json(out_dir / "plots" / "turn_scaling.json", plot_rows)
    line_plot(curves, out_dir / "plots" / "turn_scaling.png", "Accuracy vs turn limit", "turn limit", "accuracy", log2_x=True)
    render_html(shown, out_dir / "viewer.html", title=f"Eval of {model_path}")
    atomic_write_json(out_dir / "metrics.json", metrics)
    return metrics, records_by_benchmark


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
        label: str | None = None,
    ):
        self.name, self.params, self.rollout, self.protocol = name, params, rollout, protocol
        self.engine, self.judge, self.results, self.shown = engine, judge, results, shown
        self.desc = f"eval {label} {name}" if label else f"eval {name}"

    def run(self, tasks: list[TaskRecord], image_root: Path, writer: JsonlWriter, progress: bool) -> list[SampleRecord]:
        records: list[SampleRecord] = []
        stats = RolloutStats()
        # One bar over the whole benchmark, fed as each trajectory ends, whatever the chunking.
        with tqdm(total=len(tasks) * self.params.samples, desc=self.desc, unit="traj", disable=not progress) as bar:
            started = time.perf_counter()

            def finished(trajectory: Trajectory) -> None:
                # Eval never reads the token trace; dropping it at once frees its processed pixel tensors.
                trajectory.trace = None
                bar.update(1)
                count_trajectory()  # the parent's bar when models run side by side
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
