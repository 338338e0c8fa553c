"""The update time of every `rl.estimator` on one and the same batch, against GRPO's, measured in one run.

One batch of multi-turn trajectories is rolled out once (the rl stage's `RolloutWorker`, mini_o3 protocol) and
scored; then, for each estimator, a fresh `Learner` built with `rl.estimator: <name>` (PPO's with its critic)
starts from the same weights and runs what that estimator adds before the update (old log-probs for all;
the critic's values and GAE for ppo; remax's greedy rollout, one per prompt, timed apart as rollout work)
and the update itself, `--repeats` times (median). Printed: seconds per part and the update's ratio to GRPO's.

    python benchmarks/estimator_update.py [--model DIR] [--tasks DIR] [--prompts 4] [--samples 4]
                                          [--max-new-tokens 32] [--repeats 3] [--threads 1] [--device cpu]

Without --model the tiny model is built in a temporary folder and synthetic tasks are generated; its
trajectories end after about one turn. For multi-turn work give an SFT model and its task folder, e.g.
`--model work/sft/model --tasks work/data/tasks` after `make run` (the default zoom tasks take 3 turns). Not a test.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from loupe.config import ProtocolParams, RolloutParams
from loupe.data.synthetic import SyntheticConfig, generate_tasks
from loupe.data.tasks import read_tasks
from stages.rl.advantages import compute_advantages
from stages.rl.estimators import ESTIMATOR_NAMES
from stages.rl.learner import Learner
from stages.rl.params import RLParams
from stages.rl.trainer import Trainer, to_sequence
from stages.rl.workers import RewardPool, RolloutWorker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--tasks", type=Path, default=None, help="a task folder with train.jsonl (default: synthetic)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from loupe.models.tiny import build_tiny_model

            model_dir = build_tiny_model(Path(tmp) / "tiny", seed=args.seed)
        data = args.tasks
        if data is None:
            data = Path(tmp) / "tasks"
            generate_tasks(data, SyntheticConfig(seed=args.seed, train=args.prompts, val=0, test=0))
        tasks = read_tasks(data / "train.jsonl")[: args.prompts]
        protocol = ProtocolParams(name="mini_o3", max_turns=args.max_turns)
        rollout = RolloutParams(device=args.device, max_new_tokens=args.max_new_tokens)
        worker = RolloutWorker(str(model_dir), rollout, protocol, str(data), seed=args.seed)
        pool = RewardPool(RLParams().reward)
        trajectories, stats = worker.rollout(tasks, args.samples, args.seed, protocol.max_turns, args.max_new_tokens)
        for t, parts in zip(trajectories, pool.score(trajectories)):
            t.rewards = parts
        # Rewards with a spread (an untrained policy earns little), the same for every estimator.
        rewards = [float(k % 3) for k in range(len(trajectories))]
        turns = statistics.mean(t.num_turns for t in trajectories)
        print(f"device {args.device}, torch threads {torch.get_num_threads()}; batch: {len(tasks)} prompts x {args.samples} "
              f"samples, {stats.generated_tokens} generated tokens, {turns:.2f} assistant turns a trajectory")
        budget = args.max_new_tokens * protocol.max_turns

        results: dict[str, dict[str, float]] = {}
        for name in ESTIMATOR_NAMES:
            params = RLParams(estimator=name, lr=1e-4, micro_batch_size=4, learner_device=args.device,
                              ray={"enabled": False})
            learner = Learner(model_dir, params, rollout.temperature, budget)
            start = learner.state_dict()
            prep_runs, update_runs, extra = [], [], 0.0
            for _ in range(args.repeats):
                learner.load_state_dict(start)
                learner.optimizer = torch.optim.AdamW(learner.model.parameters(), lr=params.lr)
                sequences = [to_sequence(t, True, str(k // args.samples)) for k, t in enumerate(trajectories)]
                started = time.perf_counter()
                for s, old in zip(sequences, learner.logprobs(sequences)):
                    s.old_logprobs = old
                if params.recipe.critic:
                    trainer = Trainer.__new__(Trainer)
                    trainer.params, trainer.learner = params, learner
                    trainer._ppo_advantages(sequences, rewards)
                else:
                    baselines = None
                    if params.recipe.greedy_baseline:
                        rolled = time.perf_counter()
                        greedy, _ = worker.rollout(tasks, 1, args.seed, protocol.max_turns, args.max_new_tokens, 0.0)
                        extra = time.perf_counter() - rolled
                        baselines = [float(k % 2) for k in range(len(tasks)) for _ in range(args.samples)]
                    kind = params.recipe.advantage
                    for s, a in zip(sequences, compute_advantages(rewards, [s.group for s in sequences], kind, baselines=baselines)):
                        s.advantage = float(a)
                prep_runs.append(time.perf_counter() - started - extra)
                started = time.perf_counter()
                learner.update(sequences)
                update_runs.append(time.perf_counter() - started)
            results[name] = {"prep": statistics.median(prep_runs), "update": statistics.median(update_runs), "rollout": extra}
            del learner

        base = results["grpo"]["update"]
        print(f"\n{'estimator':>12} {'prep s':>8} {'update s':>9} {'vs grpo':>8} {'extra rollout s':>16}")
        for name, found in results.items():
            print(f"{name:>12} {found['prep']:8.3f} {found['update']:9.3f} {found['update'] / base:7.2f}x "
                  f"{found['rollout']:16.3f}")
        print("prep: old log-probs (all), critic values + GAE (ppo); update: the PPO epochs (policy, and critic for ppo); "
              "extra rollout: remax's greedy baseline, one a prompt")


if __name__ == "__main__":
    main()
