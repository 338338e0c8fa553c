"""Rollout throughput on multi-turn work: the per-trajectory loop against the round-synchronous loop it replaced
and against one trajectory at a time, measured in one run.

All three sides use the same engine class, model, tasks, seed and batch size:

- `sequential`: one trajectory at a time, each to its end (`run_rollouts` on a single task and sample);
- `round-sync`: the loop before issue 16, kept here as the baseline only: each round, every live
  trajectory's next turn goes to the engine together, and the round waits for all of them;
- `per-traj`: `loupe.rollout.run_rollouts`: each trajectory's next turn is queued as soon as its last one is
  handled, and the engine's batches are refilled first in, first out from whatever waits.

Two workloads:

- `scripted` (the default): the transformers engine generates every turn for real (the tiny model, or
  `--model`), but what the turn *says* is scripted: each trajectory draws a turn count from a long-tailed law
  (P(k) proportional to k^-1.5 on 1..--max-turns, Mini-o3's test-time limit of 32 by default) and zooms until
  then, so contexts, crops and image processing grow as in a real long search. The untrained tiny model
  would end after one turn; an RL batch's turn counts are long-tailed (Mini-o3, DeepEyes).
- `model`: the model's own turns (`--model work/sft/model --tasks work/data/tasks` after `make run`; the SFT
  model takes 1.4-2 turns a trajectory).

    python benchmarks/rollout_throughput.py [--workload scripted|model] [--model DIR] [--tasks DIR]
        [--trajectories 64] [--samples-per-task 4] [--batch-size 8] [--max-turns 32] [--max-new-tokens 16]

Prints trajectories/s and turns for each side and the ratios (targets: per-traj >= 1.5x round-sync, >= 5x
sequential). Not a test: a measurement.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from loupe.config import ProtocolParams
from loupe.data.tasks import TaskRecord, read_tasks
from loupe.models import load_model, load_processor
from loupe.protocol import get_protocol
from loupe.rollout import RolloutStats, run_rollouts
from loupe.rollout.engine import Engine, Generation
from loupe.rollout.hf import TransformersEngine
from loupe.rollout.loop import Rollout
from loupe.trajectory import Trajectory


def round_synchronous_rollouts(tasks: list[TaskRecord], engine: Engine, protocol_params: ProtocolParams,
                               image_root: Path, samples_per_task: int = 1, max_turns: int | None = None,
                               max_new_tokens: int = 256, stats: RolloutStats | None = None) -> list[Trajectory]:
    """The round-synchronous loop: one `engine.generate` call a round over every live trajectory (the engine
    chunks it by `batch_size`); the next round starts when the whole round is back. Same bookkeeping as
    `run_rollouts` (`loupe.rollout.loop.Rollout`), so the two differ only in when a turn is asked for."""
    run = Rollout(tasks, engine, protocol_params, image_root, samples_per_task, max_turns, max_new_tokens, False,
                  stats, None)
    live = run.live
    while live:
        generations = engine.generate([item.state for item in live], max_new_tokens)
        live = [item for item, generation in zip(live, generations) if run.take(item, generation)]
    return run.close()


class ScriptedTurns(TransformersEngine):
    """The transformers engine, generating for real, with each turn's text replaced by a script: a zoom on a
    random box until the trajectory's drawn turn count, then an answer. Turn counts follow P(k) ~ k^-1.5."""

    def __init__(self, *args: Any, max_turns: int, seed: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        weights = [k ** -1.5 for k in range(1, max_turns + 1)]
        self.rng = random.Random(seed)
        self.turn_counts = [self.rng.choices(range(1, max_turns + 1), weights)[0] for _ in range(100_000)]
        self.started = 0

    def begin(self, system: str, question: str, images: list) -> Any:
        state = super().begin(system, question, images)
        state.trace.extras["script"] = [self.turn_counts[self.started], 0, self.started]
        self.started += 1
        return state

    def generate(self, states: list[Any], max_new_tokens: int) -> list[Generation]:
        generations = super().generate(states, max_new_tokens)
        scripted = []
        for state, generation in zip(states, generations):
            script = state.trace.extras["script"]
            script[1] += 1
            if script[1] >= script[0]:
                text = "<think>Found it.</think>\n<answer>A</answer>"
            else:
                x, y = (int(v) for v in random.Random(f"{script[2]}/{script[1]}").choices(range(6), k=2))
                box = [x / 10, y / 10, x / 10 + 0.4, y / 10 + 0.4]
                text = f'<think>Zoom.</think>\n<grounding>{{"bbox_2d": {box}, "source": "original_image"}}</grounding>'
            scripted.append(Generation(text=text, finish="stop", num_tokens=generation.num_tokens))
        return scripted


def measure(label: str, run) -> tuple[float, RolloutStats]:
    stats = RolloutStats()
    started = time.perf_counter()
    run(stats)
    seconds = time.perf_counter() - started
    print(f"{label:>11}: {stats.trajectories} trajectories, {stats.turns} turns ({stats.turns / stats.trajectories:.2f} "
          f"a trajectory), {stats.generated_tokens} tokens in {seconds:.2f} s = "
          f"{stats.trajectories / seconds:.2f} traj/s", flush=True)
    return seconds, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=("scripted", "model"), default="scripted")
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--tasks", type=Path, default=None, help="a task folder (default: zoom tasks generated here)")
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--samples-per-task", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-turns", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from loupe.models.tiny import build_tiny_model

            model_dir = build_tiny_model(Path(tmp) / "tiny", seed=args.seed)
        data = args.tasks
        if data is None:
            from loupe.data.zoom_tasks import ZoomTaskConfig, generate_zoom_tasks

            data = Path(tmp) / "tasks"
            generate_zoom_tasks(data, ZoomTaskConfig(seed=args.seed, train=0, val=0, test=max(1, args.trajectories // args.samples_per_task)))
        tasks = read_tasks(data / "test.jsonl")[: max(1, args.trajectories // args.samples_per_task)]
        model, processor = load_model(model_dir), load_processor(model_dir)
        protocol = ProtocolParams(max_turns=args.max_turns, max_images=args.max_turns + 1,
                                  max_context_tokens=1 << 20)
        stop = get_protocol(protocol.name).stop

        def engine(batch_size: int) -> TransformersEngine:
            common = dict(temperature=args.temperature, top_p=1.0, batch_size=batch_size, seed=args.seed)
            if args.workload == "scripted":
                return ScriptedTurns(model, processor, stop, max_turns=args.max_turns, **common)
            return TransformersEngine(model, processor, stop, **common)

        def sequential(stats: RolloutStats) -> None:
            eng = engine(args.batch_size)
            for task in tasks:
                for _ in range(args.samples_per_task):
                    run_rollouts([task], eng, protocol, data, max_new_tokens=args.max_new_tokens, stats=stats)

        def round_sync(stats: RolloutStats) -> None:
            round_synchronous_rollouts(tasks, engine(args.batch_size), protocol, data, args.samples_per_task,
                                       max_new_tokens=args.max_new_tokens, stats=stats)

        def per_trajectory(stats: RolloutStats) -> None:
            run_rollouts(tasks, engine(args.batch_size), protocol, data, args.samples_per_task,
                         max_new_tokens=args.max_new_tokens, stats=stats)

        print(f"workload {args.workload}, {len(tasks)} tasks x {args.samples_per_task} samples, batch size "
              f"{args.batch_size}, turn limit {args.max_turns}, {args.max_new_tokens} new tokens a turn, "
              f"torch threads {torch.get_num_threads()}", flush=True)
        run_rollouts(tasks[:1], engine(1), protocol, data, max_new_tokens=4)  # warm-up: first-call costs
        sequential_s, sequential_stats = measure("sequential", sequential)
        round_s, round_stats = measure("round-sync", round_sync)
        async_s, async_stats = measure("per-traj", per_trajectory)

        def rate(seconds: float, stats: RolloutStats) -> float:
            return stats.trajectories / seconds

        fast = rate(async_s, async_stats)
        print(f"per-traj vs round-sync: {fast / rate(round_s, round_stats):.2f}x trajectories/s (target >= 1.5x); "
              f"vs sequential: {fast / rate(sequential_s, sequential_stats):.2f}x (target >= 5x)")


if __name__ == "__main__":
    main()
