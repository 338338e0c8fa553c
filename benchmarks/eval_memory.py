"""Eval's peak host memory against benchmark size: streamed in chunks, one chunk, and the pre-streaming stage.

Measures the peak resident memory (max RSS, read with wait4 from a fresh child process per run, so no run sees
another's memory) of the eval stage on the embedded tiny model over a synthetic benchmark of N questions with
high-resolution canvases (1500-2000 px a side by default, about 9 MB each once decoded), for N = 50 and 500.
Three ways of running the same benchmark:

    chunked     the stage as shipped, eval.chunk_size 32: a chunk's originals, crops and trajectories at a time
    one-chunk   the stage with chunk_size >= N: every question's original is decoded and live at once
    unstreamed  what the stage did before it streamed: one run_rollouts call, every trajectory (token trace,
                pixel values, crops) held to the end and written at the end

For each way it prints the peak at each N and the ratio peak(500) / peak(50): near 1 means eval's memory does
not grow with the benchmark. The settings are printed with the figures; they keep the model's work small
(1 sample, 2 turns, 8 new tokens a turn) so 500 questions take a few minutes on 2 cores, while every question
still decodes its full-resolution original, which is what grows with the benchmark.

    python benchmarks/eval_memory.py [--questions 50 500] [--ways chunked one-chunk unstreamed] [--model DIR]

Without --model the tiny model is built in a temporary folder. Not a test: a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
WAYS = ("chunked", "one-chunk", "unstreamed")
SETTINGS = {"samples": 1, "max_turns": 2, "max_new_tokens": 8, "temperature": 1.0, "chunk_size": 32}
"""Eval settings of every run (one-chunk raises chunk_size to N)."""


def write_params(folder: Path, tasks: Path, questions: int, chunk_size: int) -> Path:
    params = {
        "seed": 0,
        "rollout": {"max_new_tokens": SETTINGS["max_new_tokens"], "temperature": SETTINGS["temperature"]},
        "eval": {
            "benchmarks": [{"name": "synthetic", "path": str(tasks), "limit": questions}],
            "samples": SETTINGS["samples"],
            "max_turns": SETTINGS["max_turns"],
            "chunk_size": chunk_size,
        },
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def unstreamed(params_path: Path, model: Path, out: Path) -> None:
    """The eval stage's computation before streaming, kept here as the baseline: hold everything, write at the end."""
    from loupe.config import ProtocolParams, RolloutParams, load_section, load_seed
    from loupe.data.benchmarks import load_benchmark
    from loupe.io import atomic_write_json, atomic_write_text
    from loupe.rewards import build_judge, score_trajectory
    from loupe.rollout import make_engine, run_rollouts
    from loupe.trajectory import write_trajectories
    from loupe.viewer import render_html
    from loupe.sample_metrics import result_rows, summarize
    from stages.eval.params import EvalParams

    protocol = load_section(ProtocolParams, "protocol", params_path)
    rollout = load_section(RolloutParams, "rollout", params_path)
    params = load_section(EvalParams, "eval", params_path)
    [spec] = params.benchmarks
    benchmark = load_benchmark(spec.name, spec.path, out / "benchmark_cache")
    tasks = benchmark.tasks[: spec.limit]
    engine = make_engine(rollout, protocol, model_path=str(model), seed=load_seed(params_path))
    judge = build_judge(params.reward)
    trajectories = run_rollouts(tasks, engine, protocol, benchmark.image_root, samples_per_task=params.samples,
                                max_turns=params.max_turns, max_new_tokens=rollout.max_new_tokens)
    for trajectory in trajectories:
        score_trajectory(trajectory, params.reward, judge)
    write_trajectories(trajectories, out / "trajectories" / f"{spec.name}.jsonl")
    summary = summarize(trajectories, params.turn_limits)
    rows = result_rows(spec.name, trajectories)
    engine.close()
    atomic_write_text(out / "results.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    render_html(trajectories[: params.viewer_trajectories], out / "viewer.html")
    atomic_write_json(out / "metrics.json", {"benchmarks": {spec.name: summary}})


def child(way: str, params_path: Path, model: Path, out: Path) -> None:
    """One measured run, in its own process."""
    if way == "unstreamed":
        unstreamed(params_path, model, out)
    else:
        from stages.eval.__main__ import evaluate

        evaluate(params_path, model, out, progress=False)


def measure(way: str, params_path: Path, model: Path, out: Path) -> tuple[float, float]:
    """(peak RSS in MiB, seconds) of one run in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LOUPE_TRACKING": "off", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--child", way, str(params_path), str(model), str(out)],
                            cwd=ROOT, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{way} run failed with exit code {proc.returncode}")
    return usage.ru_maxrss / 1024, time.perf_counter() - started  # Linux reports KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--questions", type=int, nargs="+", default=[50, 500])
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: build the tiny model)")
    parser.add_argument("--canvas", type=int, nargs=2, default=[1500, 2000], metavar=("MIN", "MAX"),
                        help="canvas side range in pixels (1024..4096); width and height drawn independently")
    parser.add_argument("--child", nargs=4, metavar=("WAY", "PARAMS", "MODEL", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        way, params_path, model, out = args.child
        child(way, Path(params_path), Path(model), Path(out))
        return

    from loupe.data.synthetic import SyntheticConfig, generate_tasks

    with tempfile.TemporaryDirectory(prefix="eval-memory-") as tmp:
        work = Path(tmp)
        model = args.model
        if model is None:
            from loupe.models.tiny import build_tiny_model

            model = build_tiny_model(work / "tiny", seed=0)
        tasks = work / "tasks"
        started = time.perf_counter()
        generate_tasks(tasks, SyntheticConfig(seed=0, train=0, val=0, test=max(args.questions), canvas_side=tuple(args.canvas)),
                       workers=min(2, os.cpu_count() or 1))
        records = [json.loads(line) for line in (tasks / "test.jsonl").read_text().splitlines() if line.strip()]
        from PIL import Image

        pixels = [Image.open(tasks / r["images"][0]).size for r in records]
        mean_mb = sum(w * h * 3 for w, h in pixels) / len(pixels) / 2**20
        print(f"benchmark: {len(records)} synthetic questions drawn in {time.perf_counter() - started:.0f} s, canvases "
              f"{args.canvas[0]}-{args.canvas[1]} px a side, {mean_mb:.1f} MiB each decoded (RGB) on average")
        print(f"settings: {json.dumps(SETTINGS)}; engine transformers on CPU, tiny model; one fresh process per run\n")

        peaks: dict[str, dict[int, float]] = {}
        for way in args.ways:
            peaks[way] = {}
            for n in args.questions:
                chunk = n if way == "one-chunk" else SETTINGS["chunk_size"]
                params_path = write_params(work / f"{way}-{n}", tasks, n, chunk)
                peak, seconds = measure(way, params_path, Path(model), work / f"{way}-{n}" / "out")
                peaks[way][n] = peak
                print(f"{way:>10} {n:>5} questions: peak RSS {peak:7.0f} MiB  ({seconds:.0f} s)", flush=True)

        if len(args.questions) >= 2:
            small, large = min(args.questions), max(args.questions)
            print(f"\npeak RSS ratio {large}/{small} questions (1.0 = flat):")
            for way, by_n in peaks.items():
                print(f"{way:>10}: {by_n[large] / by_n[small]:.2f}  ({by_n[small]:.0f} -> {by_n[large]:.0f} MiB)")


if __name__ == "__main__":
    main()
