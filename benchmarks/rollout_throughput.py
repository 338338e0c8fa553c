"""Rollout throughput: the batched transformers engine against one trajectory at a time.

Both sides use the same engine class, model, tasks and seed; the baseline runs the 32 trajectories one after
another (each to its end), the batched side runs all 32 through the loop together, one `generate` call per
round. Prints trajectories/s, generated tokens/s for each and the ratio (target: at least 5x on the tiny model).

    python benchmarks/rollout_throughput.py [--model DIR] [--trajectories 32] [--max-new-tokens 64]

Without --model the tiny model is built in a temporary folder. Not a test: a measurement.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from loupe.config import ProtocolParams
from loupe.data.synthetic import SyntheticConfig, generate_tasks
from loupe.data.tasks import read_tasks
from loupe.models import load_model, load_processor
from loupe.protocol import get_protocol
from loupe.rollout import RolloutStats, run_rollouts
from loupe.rollout.hf import TransformersEngine


def measure(label, run) -> tuple[float, RolloutStats]:
    stats = RolloutStats()
    started = time.perf_counter()
    run(stats)
    seconds = time.perf_counter() - started
    print(
        f"{label:>10}: {stats.trajectories} trajectories, {stats.turns} turns, {stats.generated_tokens} tokens in "
        f"{seconds:.2f} s = {stats.trajectories / seconds:.2f} traj/s, {stats.generated_tokens / seconds:.0f} tok/s"
    )
    return seconds, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--samples-per-task", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from loupe.models.tiny import build_tiny_model

            model_dir = build_tiny_model(Path(tmp) / "tiny", seed=args.seed)
        n_tasks = max(1, args.trajectories // args.samples_per_task)
        data = Path(tmp) / "tasks"
        generate_tasks(data, SyntheticConfig(seed=args.seed, train=0, val=0, test=n_tasks))
        tasks = read_tasks(data / "test.jsonl")
        model, processor = load_model(model_dir), load_processor(model_dir)
        protocol = ProtocolParams()
        stop = get_protocol(protocol.name).stop

        def engine(batch_size: int) -> TransformersEngine:
            return TransformersEngine(model, processor, stop, temperature=1.0, top_p=1.0, batch_size=batch_size, seed=args.seed)

        def one_at_a_time(stats: RolloutStats) -> None:
            eng = engine(1)
            for task in tasks:
                for _ in range(args.samples_per_task):
                    run_rollouts([task], eng, protocol, data, max_new_tokens=args.max_new_tokens, stats=stats)

        def batched(stats: RolloutStats) -> None:
            run_rollouts(tasks, engine(args.trajectories), protocol, data, samples_per_task=args.samples_per_task,
                         max_new_tokens=args.max_new_tokens, stats=stats)

        run_rollouts(tasks[:1], engine(1), protocol, data, max_new_tokens=4)  # warm-up: first-call costs
        base_s, base = measure("sequential", one_at_a_time)
        fast_s, fast = measure("batched", batched)
        traj_ratio = (fast.trajectories / fast_s) / (base.trajectories / base_s)
        tok_ratio = (fast.generated_tokens / fast_s) / (base.generated_tokens / base_s)
        print(f"speed-up: {traj_ratio:.1f}x trajectories/s, {tok_ratio:.1f}x generated tokens/s (target >= 5x)")


if __name__ == "__main__":
    main()
