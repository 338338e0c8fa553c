"""Rollout throughput on multi-turn work: the per-trajectory loop against the round-synchronous loop it replaced
and against one turn at a time, measured in one run.

All three sides use the same engine class (the transformers engine, each dialogue's keys and values kept between
turns), model, tasks and seed:

- `sequential`: one turn generated at a time (`run_rollouts` with an engine of batch size 1): no batching;
- `round-sync`: the loop before issue 16, kept here as the baseline only: each round, every live
  trajectory's next turn goes to the engine together (`Engine.generate`: static batches of `--batch-size`, each
  decoded until its longest turn ends, as `model.generate` batches), and the round waits for all of them;
- `per-traj`: `loupe.rollout.run_rollouts`: each trajectory's next turn is queued as soon as its last one is
  handled, and rows join and leave the engine's running batch (`--batch-size` slots) at token granularity;
- `before` (`--before`, scripted workload): the round-synchronous loop on the engine as it was before issue 16's
  engine work (`ScriptedRegenerating`: one `model.generate` per static batch over the whole dialogue, every
  earlier token and image read again each turn): what the per-trajectory loop and its engine replaced.

Two workloads:

- `scripted` (the default): the transformers engine generates every turn for real (the tiny model, or
  `--model`), but each turn's length and what it *says* are scripted: each trajectory draws a turn count from
  a long-tailed law (P(k) proportional to k^-1.5 on 1..--max-turns, Mini-o3's test-time limit of 32 by default)
  and zooms until then, so contexts, crops and image processing grow as in a real long search; each turn draws
  its length from a log-normal (median a quarter of `--max-new-tokens`), as reasoning turns vary. The untrained
  tiny model would end after one turn; an RL batch's turn counts are long-tailed (Mini-o3, DeepEyes). The
  default budget, 256 new tokens, gives turns of 64 tokens at the median: still short beside Mini-o3's
  reasoning turns (its budget is 2,048 a turn), longer than the 16 of the budget of 64 this benchmark used
  to default to, where each turn's prefill (the crop's image tokens) outweighs its decoding.
- `model`: the model's own turns (`--model work/sft/model --tasks work/data/tasks` after `make run`; the SFT
  model takes 1.4-2 turns a trajectory).

    python benchmarks/rollout_throughput.py [--workload scripted|model] [--model DIR] [--tasks DIR]
        [--trajectories 128] [--samples-per-task 4] [--batch-size 16] [--max-turns 32] [--max-new-tokens 256]
        [--repeats 1]

Prints trajectories/s and turns for each side (the median of `--repeats` runs) and the ratios
(targets: per-traj >= 1.5x round-sync, >= 5x sequential). Last, the bound the machine puts on batching: one
decode step of `--batch-size` rows against one of a single row, at the mean context a generated token saw;
on a CPU a step's cost grows with its rows (attention reads every row's cache), so batching cannot give
`--batch-size` times sequential's rate. Not a test: a measurement.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
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
from loupe.rollout.hf import TokenContextEngine, TransformersEngine
from loupe.rollout.kv_batch import Batch, Row, make_cache
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
    """The transformers engine, generating for real, with each turn's length and text taken from a script.

    Each trajectory draws its turn count from P(k) ~ k^-1.5 on 1..max_turns; it zooms on a random box until
    then and answers. Each turn draws its length (new tokens) from a log-normal with median a quarter of the
    turn budget, clipped to [2, budget], so turns of one batch end at different steps as reasoning turns do.
    The model's own tokens are kept in the trace; only the text the loop parses is scripted.
    """

    def __init__(self, *args: Any, max_turns: int, seed: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.turn_weights = [k ** -1.5 for k in range(1, max_turns + 1)]
        self.seed = seed
        self.started = 0

    def begin(self, system: str, question: str, images: list) -> Any:
        return self._scripted(super().begin(system, question, images))

    def _scripted(self, state: Any) -> Any:
        """The state with its trajectory's script: [turn count drawn, turns done, trajectory index]."""
        draw = random.Random(f"turns/{self.seed}/{self.started}")
        turns = draw.choices(range(1, len(self.turn_weights) + 1), self.turn_weights)[0]
        state.trace.extras["script"] = [turns, 0, self.started]
        self.started += 1
        return state

    def turn_budget(self, state: Any, max_new_tokens: int) -> int:
        _, done, index = state.trace.extras["script"]
        draw = random.Random(f"length/{index}/{done}").lognormvariate(math.log(max(1.0, max_new_tokens / 4)), 0.8)
        return max(2, min(max_new_tokens, round(draw)))

    def _record(self, state: Any, ids: list[int], logprobs: list[float], finish: str) -> Generation:
        generation = super()._record(state, ids, logprobs, finish)
        script = state.trace.extras["script"]
        script[1] += 1
        if script[1] >= script[0]:
            text = "<think>Found it.</think>\n<answer>A</answer>"
        else:
            x, y = (int(v) for v in random.Random(f"{script[2]}/{script[1]}").choices(range(6), k=2))
            box = [x / 10, y / 10, x / 10 + 0.4, y / 10 + 0.4]
            text = f'<think>Zoom.</think>\n<grounding>{{"bbox_2d": {box}, "source": "original_image"}}</grounding>'
        return Generation(text=text, finish="stop", num_tokens=generation.num_tokens)


class ScriptedRegenerating(ScriptedTurns):
    """The same script on the engine as it was before issue 16's engine work: each turn one `model.generate`
    call per static batch over the *whole* dialogue (every earlier token prefilled and every earlier image
    encoded again), run until the batch's longest turn ends. Kept here only as a baseline."""

    def begin(self, system: str, question: str, images: list) -> Any:
        # No prompt prefill: generate re-reads the whole dialogue anyway.
        return self._scripted(TokenContextEngine.begin(self, system, question, images))

    @torch.inference_mode()
    def generate(self, states: list[Any], max_new_tokens: int) -> list[Generation]:
        out: list[Generation] = []
        for start in range(0, len(states), self.batch_size):
            out += self._generate_whole(states[start : start + self.batch_size], max_new_tokens)
        return out

    def _generate_whole(self, states: list[Any], max_new_tokens: int) -> list[Generation]:
        self.model.eval()
        budgets = [self.turn_budget(state, max_new_tokens) for state in states]
        width = max(len(s.trace) for s in states)
        input_ids = torch.full((len(states), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(states), width), dtype=torch.long)
        for row, state in enumerate(states):
            ids = state.trace.input_ids
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention[row, width - len(ids):] = 1
        inputs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention,
                                  "pixel_values": torch.cat([p for s in states for p in s.pixel_values]),
                                  "image_grid_thw": torch.cat([g for s in states for g in s.grid_thw]),
                                  "mm_token_type_ids": (input_ids == self.image_token_id).long()}
        sampling: dict[str, Any] = {"do_sample": False}
        if self.temperature > 0:
            sampling = {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": 0}
        result = self.model.generate(**inputs, **sampling, max_new_tokens=max(budgets), eos_token_id=self.end_ids,
                                     pad_token_id=self.pad_id, suppress_tokens=self.suppressed or None, use_cache=True,
                                     output_logits=True, return_dict_in_generate=True)
        new_tokens = result.sequences[:, width:]
        scale = self.temperature if self.temperature > 0 else 1.0
        logprobs = torch.stack([step.float().div(scale).log_softmax(-1).gather(1, new_tokens[:, t:t + 1]).squeeze(1)
                                for t, step in enumerate(result.logits)], dim=1)
        return [self._record(state, new_tokens[row, :budget].tolist(), logprobs[row, :budget].tolist(), "length")
                for row, (state, budget) in enumerate(zip(states, budgets))]


def measure(label: str, run, repeats: int) -> tuple[float, RolloutStats]:
    """The median wall time of `repeats` runs of one side, and the first run's stats (every run of a side
    generates the same turns: the engines are seeded)."""
    times, first = [], None
    for _ in range(repeats):
        stats = RolloutStats()
        started = time.perf_counter()
        run(stats)
        times.append(time.perf_counter() - started)
        first = first or stats
    seconds = statistics.median(times)
    spread = f" (runs {', '.join(f'{t:.1f}' for t in times)} s)" if repeats > 1 else ""
    print(f"{label:>11}: {first.trajectories} trajectories, {first.turns} turns ({first.turns / first.trajectories:.2f} "
          f"a trajectory), {first.generated_tokens} tokens in {seconds:.2f} s = "
          f"{first.trajectories / seconds:.2f} traj/s{spread}", flush=True)
    return seconds, first


def decode_step_seconds(engine: TransformersEngine, rows: int, context: int, steps: int = 20) -> float:
    """Seconds a decode step of `rows` rows over `context` cached tokens takes on `engine` (random keys and
    values, nothing else running): a full batch against one row bounds what batching alone can gain here."""
    config = getattr(engine.model.config, "text_config", engine.model.config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = (rows, config.num_key_value_heads, context, head_dim)
    layers = [(torch.randn(shape), torch.randn(shape)) for _ in range(config.num_hidden_layers)]
    batch = Batch([Row(i, None, budget=1 << 30, new_ids=[engine.pad_id], position=context) for i in range(rows)],
                  make_cache(layers), torch.ones((rows, context), dtype=torch.bool))
    with torch.inference_mode():
        engine._decode_step(batch)
        started = time.perf_counter()
        for _ in range(steps):
            engine._decode_step(batch)
    return (time.perf_counter() - started) / steps


def mean_context(trajectories: list[Trajectory]) -> int:
    """Cached tokens a generated token saw on average: each assistant turn's context, weighted by its length."""
    seen = weight = 0
    for trajectory in trajectories:
        context = 0
        for turn in trajectory.turns:
            if turn.role == "assistant":
                seen += (context + turn.num_tokens / 2) * turn.num_tokens
                weight += turn.num_tokens
            context += turn.num_tokens
    return round(seen / max(1, weight))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=("scripted", "model"), default="scripted")
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--tasks", type=Path, default=None, help="a task folder (default: zoom tasks generated here)")
    parser.add_argument("--trajectories", type=int, default=128)
    parser.add_argument("--samples-per-task", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-turns", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each side, one after another; the median is kept")
    parser.add_argument("--before", action=argparse.BooleanOptionalAction, default=True,
                        help="also time `before`: the round-synchronous loop on the engine as it was (scripted only)")
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
            run_rollouts(tasks, engine(1), protocol, data, args.samples_per_task, max_new_tokens=args.max_new_tokens,
                         stats=stats)

        def round_sync_before(stats: RolloutStats) -> None:
            engine = ScriptedRegenerating(model, processor, stop, max_turns=args.max_turns, temperature=args.temperature,
                                          top_p=1.0, batch_size=args.batch_size, seed=args.seed)
            round_synchronous_rollouts(tasks, engine, protocol, data, args.samples_per_task,
                                       max_new_tokens=args.max_new_tokens, stats=stats)

        def round_sync(stats: RolloutStats) -> None:
            round_synchronous_rollouts(tasks, engine(args.batch_size), protocol, data, args.samples_per_task,
                                       max_new_tokens=args.max_new_tokens, stats=stats)

        per_trajectory_runs: list[list[Trajectory]] = []

        def per_trajectory(stats: RolloutStats) -> None:
            per_trajectory_runs.append(run_rollouts(tasks, engine(args.batch_size), protocol, data,
                                                    args.samples_per_task, max_new_tokens=args.max_new_tokens,
                                                    stats=stats))

        print(f"workload {args.workload}, {len(tasks)} tasks x {args.samples_per_task} samples, batch size "
              f"{args.batch_size}, turn limit {args.max_turns}, {args.max_new_tokens} new tokens a turn, "
              f"torch threads {torch.get_num_threads()}", flush=True)
        run_rollouts(tasks[:1], engine(1), protocol, data, max_new_tokens=4)  # warm-up: first-call costs
        if args.before and args.workload == "scripted":
            before_s, before_stats = measure("before", round_sync_before, args.repeats)
        sequential_s, sequential_stats = measure("sequential", sequential, args.repeats)
        round_s, round_stats = measure("round-sync", round_sync, args.repeats)
        async_s, async_stats = measure("per-traj", per_trajectory, args.repeats)

        def rate(seconds: float, stats: RolloutStats) -> float:
            return stats.trajectories / seconds

        fast = rate(async_s, async_stats)
        print(f"per-traj vs round-sync: {fast / rate(round_s, round_stats):.2f}x trajectories/s (target >= 1.5x); "
              f"vs sequential: {fast / rate(sequential_s, sequential_stats):.2f}x (target >= 5x)")
        if args.before and args.workload == "scripted":
            print(f"per-traj vs before (round-sync loop on the engine before issue 16's engine work): "
                  f"{fast / rate(before_s, before_stats):.2f}x")
        context = mean_context(per_trajectory_runs[0])
        one, full = (decode_step_seconds(engine(args.batch_size), rows, context) for rows in (1, args.batch_size))
        print(f"decode-step bound at the mean context a token saw ({context} tokens): a step of {args.batch_size} "
              f"rows takes {full / one:.2f}x a step of 1 ({full * 1e3:.2f} ms against {one * 1e3:.2f} ms), so batching "
              f"alone gives at most {args.batch_size * one / full:.2f}x sequential's decode rate on this machine")


if __name__ == "__main__":
    main()
