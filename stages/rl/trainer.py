"""The GRPO step loop: prompts -> rollouts -> rewards -> advantages -> update -> weights to the workers.

Each step:
1. takes `prompts_per_step` prompts from a seeded, epoch-wise shuffled stream of the train split;
2. rolls out `samples_per_prompt` trajectories of each on the rollout workers (seeded from seed, step, try,
   worker) and scores them in the reward pool;
3. dynamic sampling: keeps the groups whose counted rewards differ; while the batch is short it rolls out
   fresh prompts, at most `dynamic_sampling.max_tries` rounds;
4. builds the learner's sequences: only model-generated tokens are trained, none of an over-turn trajectory
   when masking is on, none of one cut by the token budget under DAPO's overlong filter, none of one whose
   reward is invalid (a judge outage is not a wrong answer);
5. recomputes old log-probs (or takes the sampler's), reference log-probs when KL is on, the critic's values
   (ppo), and the estimator's advantages (stages/rl/estimators.py; remax rolls out one greedy trajectory a
   prompt in step 2 for its baseline; DAPO's soft overlong punishment shapes rewards right after scoring);
6. runs the PPO epochs and broadcasts the new weights to the rollout engines (loupe.rollout.weight_sync);
7. logs a row of metrics (MLflow, metrics.jsonl), validates on the val split every `val_every` steps through
   the eval stage's metrics, writes an HTML page of sampled trajectories every `sample_trajectories_every`
   steps, and checkpoints every `checkpoint_every` steps.

A run that finds a checkpoint in --out resumes from it: weights, optimiser, stream position and RNG states,
with metrics.jsonl cut back to the checkpoint's step, so a killed and resumed run ends exactly like an
uninterrupted one (on CPU, same seed, same worker count).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from loupe.data.tasks import TaskRecord
from loupe.io import atomic_write_json
from loupe.tracking import NullRun, StageRun
from loupe.trajectory import Trajectory
from loupe.viewer import render_html
from stages.rl import checkpoint as ckpt
from stages.rl.advantages import compute_advantages, gae, groups_with_signal
from stages.rl.batching import TrainSequence
from stages.rl.cluster import absolute_path
from stages.rl.inputs import Inputs
from stages.rl.loss import kl_estimate
from stages.rl.metrics import (
    MetricsLog,
    final_metrics,
    peak_device_memory,
    rollout_metrics,
    val_row,
    write_plots,
)
from stages.rl.pixelis import PixelisShaper
from stages.rl.prompt_stream import PromptStream
from stages.rl.shaping import (
    curiosity_bonus,
    longest_turn,
    overlong_penalty,
    token_rewards,
)
from stages.rl.trainable import (
    _trainable,
    reward_valid,
    to_sequence,
    wrote_vision_marker,
)
from stages.rl.ttrl import PseudoLabeler

TTRL_STATE = "ttrl_buffer.json"
"""rl.ttrl's experience buffer, in each checkpoint."""
PIXELIS_STATE = "pixelis.pt"
"""rl.pixelis' curiosity module, its optimiser and running statistics, in each checkpoint."""

VAL_SEED_TAG = 1_000_003
"""Mixed into the seed of validation rollouts so they never share a stream with training rollouts."""
GREEDY_SEED_TAG = 1_000_033
"""Mixed into the seed of remax's greedy baseline rollouts."""


def derive_seed(*parts: int) -> int:
    """A 31-bit seed from integers, the same in every process (no Python hash randomisation)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0] & 0x7FFFFFFF)


def logprob_gap(engine: list[torch.Tensor], learner: list[torch.Tensor]) -> dict[str, float]:
    """How far the engine's log-probs of its sampled tokens are from the learner's on the same tokens: the mean,
    99th percentile and largest absolute difference over every trained token.

    The one number that shows the rollout engine and the learner agree: the same weights (the sync), the same
    prompt tokens and images, the same temperature, the same sampler's log-prob form. A broken sync or a stale
    vision-encoder cache shows as a gap of whole nats; numerics alone (bf16 against float32, fused kernels)
    leave hundredths (docs/rl.md, "The engine/learner log-prob gap").
    """
    diffs = [(a.float() - b.float()).abs() for a, b in zip(engine, learner) if a.numel()]
    if not diffs:
        return {}
    flat = torch.cat(diffs)
    return {"logprob_gap_mean": float(flat.mean()), "logprob_gap_p99": float(torch.quantile(flat, 0.99)),
            "logprob_gap_max": float(flat.max())}


@dataclass
class RolloutAhead:
    """A step's first batch, generated during the step before (rl.overlap), with the weights of before its update."""

    step: int
    trajectories: list[Trajectory]
    generated_tokens: int
    seconds: float
    """Wall time from its start to its end, mostly hidden behind the update."""


class Trainer:
    """Owns the actors and the loop; `run()` trains to `rl.steps` and leaves the model in `out/model`."""

    def __init__(self, inputs: Inputs, out_dir: Path, run: StageRun | NullRun | None = None, progress: bool = True, use_ray: bool | None = None):
        self.inputs = inputs
        self.params = inputs.params
        self.out_dir = absolute_path(out_dir)
        self.run = run or NullRun()
        self.progress = progress
        self.use_ray = self.params.ray.enabled if use_ray is None else use_ray
        passes = self.params.run_length == "passes"
        self.stream = PromptStream(len(inputs.train), inputs.seed,
                                   whole_batches=self.params.prompts_per_step if passes else None)
        self.batch_budget = (self.params.epochs or 1) * (len(inputs.train) // self.params.prompts_per_step) if passes else None
        """rl.run_length: passes: the generation batches the run may draw (epochs x whole batches a pass)."""
        self.log = MetricsLog(self.out_dir / "metrics.jsonl")
        self.step = 0
        self.last_batch: list[Trajectory] = []
        self._ray_started = False
        self.ahead: RolloutAhead | None = None
        """With rl.overlap: the next step's first batch, started before this step's update."""
        self.pixelis = PixelisShaper(self.params.pixelis, inputs.seed) if self.params.pixelis.enabled else None
        """Pixelis' combined reward (rl.pixelis), stateful: its curiosity module learns as RL goes."""
        self.ttrl = PseudoLabeler(self.params.ttrl) if self.params.ttrl.enabled else None
        """Test-time RL (rl.ttrl): labels each group by vote, with an experience buffer of earlier votes."""
        self.ttrl_figures: dict[str, float] = {}
        """The last labelled batch's test-time RL figures, logged with its step."""

    # --- set-up and tear-down -------------------------------------------------------------------------------

    def _start(self) -> None:
        from stages.rl.cluster import start_ray
        from stages.rl.learner import Learner
        from stages.rl.workers import LearnerGroup, RewardService, WorkerSet

        i, p = self.inputs, self.params
        if p.cpu_threads:
            torch.set_num_threads(p.cpu_threads)
        if self.use_ray:
            self._ray_started = start_ray(p.ray)
        self.reward = RewardService(p, self.use_ray)
        if p.learner_ranks > 1:
            if not self.use_ray:
                raise ValueError("rl.ray: a learner on several GPUs needs Ray (rl.ray.enabled: true)")
            self.learner: Any = LearnerGroup(str(i.model_path), p, i.rollout.temperature, i.generation_budget, p.learner_ranks)
        else:
            self.learner = Learner(i.model_path, p, i.rollout.temperature, i.generation_budget, seed=i.seed)
        # Only the transformers engine generates with the learner's own module; colocated vLLM is a Ray actor on
        # a share of the learner's GPU that sleeps through updates and receives weights like any engine.
        colocated = self.learner.model if p.ray.colocate and i.rollout.engine == "transformers" else None
        if colocated is not None and p.ttrl.enabled and p.ttrl.conservative.enabled:
            raise ValueError("rl.ttrl.conservative: the weight EMA reaches the engines through the weight sync, but a "
                             "colocated transformers engine generates with the trained module itself; set "
                             "ray.colocate: false")
        precision = getattr(self.learner, "precision", None)  # bf16 on a GPU: the engine generates as the learner computes
        self.workers = WorkerSet(
            str(i.model_path), i.rollout, i.protocol, str(i.tasks_dir), p, i.seed, self.use_ray, colocated_model=colocated,
            colocated_dtype=precision.param_dtype if precision is not None else None,
        )
        self._connect_weights()
        found = ckpt.latest_checkpoint(self.out_dir)
        if found is not None:
            learner_dir, state = ckpt.load_checkpoint(found)
            self.learner.load_checkpoint(learner_dir)
            self.workers.sync_weights(self.learner, self.manifest)
            self.step = int(state["step"])
            self.stream.position = int(state["stream_position"])
            self.ahead = ckpt.load_ahead(found)
            if self.pixelis is not None and (found / PIXELIS_STATE).is_file():
                self.pixelis.load_bytes((found / PIXELIS_STATE).read_bytes())
            if self.ttrl is not None and (found / TTRL_STATE).is_file():
                self.ttrl.buffer.load(json.loads((found / TTRL_STATE).read_text()))
            self.log.truncate(self.step)
            self.run.set_tags({"rl.resumed_from_step": self.step})
        else:
            self.log.truncate(0)

    def _connect_weights(self) -> None:
        """Form the weight-sync group (learner rank 0 + one rank per rollout engine) and plan its buckets."""
        from loupe.rollout.weight_sync import (
            choose_backend,
            dtype_from_name,
            plan_manifest,
        )

        p = self.params
        dtype, _ = self.workers.weights_format()
        self.manifest = plan_manifest(self.learner.weight_specs(), dtype_from_name(dtype), p.sync_bucket_mb << 20)
        if self.workers.colocated:  # the engine generates with the learner's own module: nothing to send
            self.sync_backend = "none"
            return
        if self.workers.direct:  # the engines' models are in this process: the learner hands its tensors over
            self.sync_backend = "direct"
            self.run.set_tags({"rl.weight_sync_backend": self.sync_backend})
            return
        # By where each rank's weights live, not by configuration: NCCL refuses two ranks on one GPU, which a
        # one-rank learner on cuda:0 and a worker Ray put on GPU 0 would be (weight_sync.choose_backend).
        identities = self.workers.device_identities()
        engines = [identity for found in identities for identity in found]
        self.sync_backend = choose_backend(self.learner.device_identity(), engines)
        self.workers.connect_weights(self.learner, identities, self.sync_backend, p.sync_timeout_s)
        self.run.set_tags({"rl.weight_sync_backend": self.sync_backend})

    def _stop(self) -> None:
        for part in ("workers", "learner"):
            closer = getattr(getattr(self, part, None), "close", None)
            if callable(closer):
                closer()
        if self._ray_started:
            import ray

            ray.shutdown()

    # --- one step -------------------------------------------------------------------------------------------

    def _collect(self, step: int) -> tuple[list[list[Trajectory]], list[Trajectory], dict[str, float]]:
        """Kept groups (at most prompts_per_step), every trajectory rolled out, and timing."""
        i, p = self.inputs, self.params
        kept: list[list[Trajectory]] = []
        everything: list[Trajectory] = []
        timing = {"rollout": 0.0, "reward": 0.0, "generated_tokens": 0.0, "tries": 0.0, "groups_seen": 0.0}
        tries = p.dynamic_sampling.max_tries if p.dynamic_sampling.enabled else 1
        for attempt in range(1, tries + 1):
            if attempt == 1 and self.ahead is not None:
                if self.ahead.step != step:
                    raise RuntimeError(f"rl: the batch generated ahead is step {self.ahead.step}'s, not step {step}'s")
                trajectories = self._scored(self.ahead.trajectories, self.ahead.generated_tokens, 0.0, timing,
                                            p.samples_per_prompt)
                timing["rollout_ahead"] = self.ahead.seconds
                self.ahead = None
            else:
                if not self._prompts_left():
                    timing["out_of_prompts"] = 1.0
                    break
                tasks = [i.train[k] for k in self.stream.take(p.prompts_per_step)]
                seeds = [derive_seed(i.seed, step, attempt, w) for w in range(p.ray.num_workers)]
                trajectories = self._rollout_scored(tasks, p.samples_per_prompt, seeds, timing)
            if p.recipe.greedy_baseline:
                self._greedy_baselines(tasks, trajectories, step, attempt, timing)
            timing["tries"] = attempt
            everything += trajectories
            n = p.samples_per_prompt
            groups = [trajectories[g : g + n] for g in range(0, len(trajectories), n)]
            timing["groups_seen"] += len(groups)
            if p.invalid_reward == "group":  # Mini-o3: a judge failure drops its prompt's whole group
                groups = [group for group in groups if all(reward_valid(t) for t in group)]
            if p.dynamic_sampling.enabled:
                flat = [t for g in groups for t in g]
                labels = [g for g, group in enumerate(groups) for _ in group]
                counted = [_trainable(t, p)[1] for t in flat]
                totals = [float(t.rewards.get("total") or 0.0) for t in flat]
                signal = groups_with_signal(totals, labels, counted)
                groups = [group for g, group in enumerate(groups) if g in signal]
            kept += groups[: p.prompts_per_step - len(kept)]
            if len(kept) >= p.prompts_per_step:
                break
        return kept, everything, timing

    def _prompts_left(self) -> bool:
        """Whether the run may draw another batch of prompts (always, unless rl.run_length: passes has drawn its
        epochs' batches)."""
        return self.batch_budget is None or self.stream.batches_drawn < self.batch_budget

    def _rollout_scored(self, tasks: list[TaskRecord], samples: int, seeds: list[int], timing: dict[str, float],
                        temperature: float | None = None) -> list[Trajectory]:
        """Roll `samples` trajectories a task out on the workers, score and shape them; adds to `timing`."""
        i = self.inputs
        started = time.perf_counter()
        trajectories, stats = self.workers.rollout(tasks, samples, seeds, i.max_turns, i.rollout.max_new_tokens,
                                                   temperature)
        return self._scored(trajectories, stats.generated_tokens, time.perf_counter() - started, timing,
                            samples)

    def _scored(self, trajectories: list[Trajectory], generated_tokens: int, rollout_seconds: float,
                timing: dict[str, float], group_size: int) -> list[Trajectory]:
        """Score and shape rolled-out trajectories; adds the rollout's time and tokens to `timing`."""
        timing["rollout"] += rollout_seconds
        timing["generated_tokens"] += generated_tokens
        started = time.perf_counter()
        scorable = trajectories
        if self.ttrl is not None:  # test-time RL: pseudo-labels by vote; an unsure group is not trained
            self.ttrl_figures, gated = self.ttrl.label(trajectories, group_size, self.step + 1,
                                                       self.inputs.withheld_labels)
            for k in gated:
                trajectories[k].rewards = {"total": None, "valid": False, "reason": "ttrl: the vote was unsure"}
            scorable = [t for k, t in enumerate(trajectories) if k not in gated]
        for t, rewards in zip(scorable, self.reward.score(scorable) if scorable else []):
            t.rewards = rewards
        if self.params.rescore_invalid and any(not t.rewards.get("valid", True) for t in scorable):
            timing["rescored_batches"] = timing.get("rescored_batches", 0.0) + 1
            for t, rewards in zip(scorable, self.reward.score(scorable)):  # DeepEyes: the whole batch, once
                t.rewards = rewards
        self._shape(trajectories, group_size)
        if self.pixelis is not None:
            self.pixelis.shape(trajectories, self.step + 1)
        timing["reward"] += time.perf_counter() - started
        return trajectories

    def _shape(self, trajectories: list[Trajectory], group_size: int) -> None:
        """DAPO's soft overlong punishment and Pixel-Reasoner's curiosity bonus (over groups of `group_size`),
        added to each valid total (shaping.overlong_penalty, shaping.curiosity_bonus)."""
        curiosity = self.params.curiosity
        if curiosity.enabled and group_size > 1:
            for start in range(0, len(trajectories), group_size):
                group = trajectories[start : start + group_size]
                bonuses = curiosity_bonus([t.num_tool_calls for t in group], curiosity.threshold, curiosity.coef,
                                          curiosity.rate_scale)
                for t, bonus in zip(group, bonuses):
                    if t.rewards.get("total") is not None:
                        t.rewards["curiosity"] = bonus
                        t.rewards["total"] = float(t.rewards["total"]) + bonus
        overlong = self.params.overlong
        if not overlong.soft_punishment:
            return
        budget = self.inputs.rollout.max_new_tokens
        buffer = overlong.buffer_tokens or max(1, budget // 5)
        for t in trajectories:
            if t.rewards.get("total") is None:
                continue
            penalty = overlong_penalty(longest_turn(t), budget, buffer, overlong.penalty_factor)
            t.rewards["overlong_penalty"] = penalty
            t.rewards["total"] = float(t.rewards["total"]) + penalty

    def _greedy_baselines(self, tasks: list[TaskRecord], trajectories: list[Trajectory], step: int, attempt: int,
                          timing: dict[str, float]) -> None:
        """ReMax: one greedy rollout a prompt through the same loop, scored and shaped like the samples; its total
        becomes each sample's `greedy_baseline` (None when the greedy score is invalid)."""
        i, p = self.inputs, self.params
        seeds = [derive_seed(i.seed, step, attempt, GREEDY_SEED_TAG, w) for w in range(p.ray.num_workers)]
        greedy = self._rollout_scored(tasks, 1, seeds, timing, temperature=0.0)
        n = p.samples_per_prompt
        for g, baseline in enumerate(greedy):
            total = baseline.rewards.get("total") if baseline.rewards.get("valid", True) else None
            for t in trajectories[g * n : (g + 1) * n]:
                t.rewards["greedy_baseline"] = None if total is None else float(total)

    def _ppo_advantages(self, sequences: list[TrainSequence], rewards: list[float]) -> None:
        """GAE over each trained sequence's generated tokens from the critic's values (advantages.gae), whitened over
        the batch's trained tokens; sets token_advantages, returns and old_values."""
        p = self.params
        trained = [(s, r) for s, r in zip(sequences, rewards) if s.num_trained]
        values = self.learner.values([s for s, _ in trained])
        found = []
        for (s, reward), v in zip(trained, values):
            kl = None
            if p.kl.coef > 0 and p.kl.form == "reward" and s.ref_logprobs is not None:
                kl = kl_estimate(s.old_logprobs, s.ref_logprobs, p.kl.estimator).numpy()
            advantages, returns = gae(token_rewards(reward, kl, p.kl.coef, s.num_trained), v.numpy(), p.critic.gamma, p.critic.lam)
            s.old_values, s.returns = v.float(), torch.tensor(returns, dtype=torch.float32)
            found.append(advantages)
        flat = np.concatenate(found) if found else np.zeros(0)
        if p.critic.whiten_advantages and flat.size > 1:
            mean, std = flat.mean(), flat.std()
            found = [(a - mean) / (std + 1e-8) for a in found]
        for (s, _), advantages in zip(trained, found):
            s.token_advantages = torch.tensor(advantages, dtype=torch.float32)

    def train_step(self, step: int) -> dict[str, Any] | None:
        """One step; None when the prompts ran out before it had a whole batch (rl.run_length: passes), which
        ends the run untrained, as verl's loop ends with a short batch."""
        started = time.perf_counter()
        p = self.params
        kept, everything, timing = self._collect(step)
        if timing.get("out_of_prompts") and len(kept) < p.prompts_per_step:
            self.last_batch = everything or self.last_batch
            return None
        batch = [t for group in kept for t in group]
        self.last_batch = batch or everything
        flags = [_trainable(t, p, self.inputs.vision_markers) for t in batch]
        labels = [f"{g}" for g, group in enumerate(kept) for _ in group]
        cut = p.cut_turn == "masked"
        sequences = [to_sequence(t, trained, label, cut, self.inputs.end_of_turn_id)
                     for t, (trained, _), label in zip(batch, flags, labels)]
        trained = [s for s in sequences if s.num_trained]

        update_started = time.perf_counter()
        update: dict[str, float] = {}
        started_ahead = self._start_ahead(step + 1) if p.overlap and step < p.steps and self._prompts_left() else None
        self.workers.sleep()  # colocated vLLM gives the GPU to the learner until the weights are back
        if trained:
            if p.logprob_source == "recompute":
                recomputed = self.learner.logprobs(trained)
                timing.update(logprob_gap([s.old_logprobs for s in trained], recomputed))
                for s, old in zip(trained, recomputed):
                    s.old_logprobs = old
            if p.kl.coef > 0:
                for s, ref in zip(trained, self.learner.logprobs(trained, reference=True)):
                    s.ref_logprobs = ref
            rewards = [float(t.rewards.get("total") or 0.0) for t in batch]
            kind = p.recipe.advantage
            if kind == "gae":
                self._ppo_advantages(sequences, rewards)  # its KL, if any, is a per-token reward
            else:
                if p.kl.coef > 0 and p.kl.form == "reward":
                    for k, s in enumerate(sequences):
                        if s.num_trained and s.ref_logprobs is not None:
                            rewards[k] -= p.kl.coef * float(kl_estimate(s.old_logprobs, s.ref_logprobs, p.kl.estimator).sum())
                baselines = [t.rewards.get("greedy_baseline") for t in batch] if kind == "remax" else None
                counts = [s.num_trained for s in sequences] if kind == "reinforce_baseline" else None
                advantages = compute_advantages(rewards, labels, kind, [c for _, c in flags], baselines=baselines,
                                                token_counts=counts)
                for s, a in zip(sequences, advantages):
                    s.advantage = float(a)
            train_policy = not (p.recipe.critic and step <= p.critic.warmup_steps)
            # chosen here, before a learner group shares rows out by rank, so untrained rows neither travel nor
            # unbalance the shares (the learner's own choice covers a direct caller)
            rows = sequences if p.masked_rows_in_loss else trained
            update = self.learner.update(rows, train_policy=train_policy, lr=self._conservative_lr())
            if self.workers.sleeps:  # a colocated vLLM is about to take its memory back
                self.learner.offload_optimizer()
            timing["ahead_wait"] = self._finish_ahead(started_ahead)
            if train_policy:
                sync_started = time.perf_counter()
                self.workers.wake_up(["weights"])
                timing["sync_bytes"] = self.workers.sync_weights(self.learner, self.manifest)
                self.workers.wake_up(["kv_cache"])
                timing["sync"] = time.perf_counter() - sync_started
            else:  # the critic's warm-up: the policy did not change, so there is nothing to send
                self.workers.wake_up(None)
        else:
            update = {"skipped_update": 1.0}
            timing["ahead_wait"] = self._finish_ahead(started_ahead)
            self.workers.wake_up(None)
        timing["update"] = (time.perf_counter() - update_started - timing.get("sync", 0.0)
                            - timing.get("ahead_wait", 0.0))

        row: dict[str, Any] = {"step": step, "kind": "train", **rollout_metrics(everything), **self.ttrl_figures}
        if self.pixelis is not None:
            row.update({f"pixelis/weight_{k}": v for k, v in self.pixelis.weights(step).items()})
        row.update({f"update/{k}": v for k, v in update.items()})
        step_seconds = time.perf_counter() - started
        processed = sum(len(s) for s in trained) * p.ppo_epochs
        row.update(
            {
                "batch/groups": len(kept),
                "batch/groups_dropped": timing["groups_seen"] - len(kept),
                "batch/tries": timing["tries"],
                "batch/rescored": timing.get("rescored_batches", 0.0),
                "batch/trained_sequences": len(trained),
                "batch/trained_tokens": sum(s.num_trained for s in trained),
                "batch/over_turn_masked": sum(1 for t, (tr, _) in zip(batch, flags) if not tr and t.end_reason == "over_turn"),
                "batch/overlong_masked": sum(1 for t, (tr, _) in zip(batch, flags) if not tr and t.end_reason == "length"),
                "batch/vision_marker_masked": sum(1 for t in batch if wrote_vision_marker(t, self.inputs.vision_markers)),
                "rollout/logprob_gap_mean": timing.get("logprob_gap_mean"),
                "rollout/logprob_gap_p99": timing.get("logprob_gap_p99"),
                "rollout/logprob_gap_max": timing.get("logprob_gap_max"),
                "time/rollout": timing["rollout"],
                "time/reward": timing["reward"],
                "time/update": timing["update"],
                "time/sync": timing.get("sync", 0.0),
                "time/ahead_wait": timing.get("ahead_wait", 0.0),
                "time/rollout_ahead": timing.get("rollout_ahead", 0.0),
                "time/step": step_seconds,
                "throughput/rollout_tokens_per_s": timing["generated_tokens"] / max(timing["rollout"], 1e-9),
                "throughput/update_tokens_per_s": processed / max(timing["update"], 1e-9) if trained else 0.0,
                "stream/position": self.stream.position,
                **peak_device_memory(),
            }
        )
        if self.batch_budget is not None:
            row["stream/batches_drawn"] = self.stream.batches_drawn
        return row

    def _start_ahead(self, step: int) -> tuple[int, list[Any], float]:
        """Start step `step`'s first rollout on the workers' current weights (the update's, one behind)."""
        i, p = self.inputs, self.params
        tasks = [i.train[k] for k in self.stream.take(p.prompts_per_step)]
        seeds = [derive_seed(i.seed, step, 1, w) for w in range(p.ray.num_workers)]
        pending = self.workers.start_rollout(tasks, p.samples_per_prompt, seeds, i.max_turns, i.rollout.max_new_tokens,
                                             background=True)
        return step, pending, time.perf_counter()

    def _finish_ahead(self, started: tuple[int, list[Any], float] | None) -> float:
        """Wait for the rollout started ahead (before the weights change); returns the seconds waited."""
        if started is None:
            return 0.0
        step, pending, began = started
        waited = time.perf_counter()
        trajectories, stats = self.workers.finish_rollout(pending)
        done = time.perf_counter()
        self.ahead = RolloutAhead(step, trajectories, stats.generated_tokens, done - began)
        return done - waited

    # --- validation, samples, checkpoints -------------------------------------------------------------------

    def validate(self, step: int) -> dict[str, Any]:
        i, p = self.inputs, self.params
        # Spread over every rollout worker, each with its own stream.
        seeds = [derive_seed(i.seed, step, VAL_SEED_TAG, w) for w in range(p.ray.num_workers)]
        trajectories, _ = self.workers.rollout(i.val, p.val_samples, seeds, i.max_turns, i.rollout.max_new_tokens,
                                               p.val_temperature)
        for t, rewards in zip(trajectories, self.reward.score(trajectories)):
            t.rewards = rewards
        return val_row(step, trajectories, i.max_turns)

    def _validate_shown(self, bar: tqdm, step: int) -> dict[str, Any]:
        """`validate`, said on the progress bar while it runs (a pass over the val questions takes a while)."""
        bar.set_postfix_str(f"validating on {len(self.inputs.val)} questions x {self.params.val_samples}", refresh=True)
        row = self.validate(step)
        bar.set_postfix_str(f"val acc={_fmt(row.get('val/accuracy'))}", refresh=True)
        return row

    def _checkpoint(self, step: int) -> None:
        state = {"stream_position": self.stream.position, "seed": self.inputs.seed}
        extras = {PIXELIS_STATE: self.pixelis.state_bytes()} if self.pixelis is not None else {}
        if self.ttrl is not None:
            extras[TTRL_STATE] = json.dumps(self.ttrl.buffer.state()).encode()
        ckpt.save_checkpoint(self.out_dir, step, self.learner.save_checkpoint, state, self.params.keep_checkpoints,
                             ahead=self.ahead, extras=extras)

    def _conservative_lr(self) -> float | None:
        """rl.ttrl.conservative's rate for this step, from the mean confidence of the groups the gate let
        through (stages/rl/conservative.py); None leaves the schedule's."""
        c = self.params.ttrl.conservative
        if self.ttrl is None or not c.enabled or "ttrl/kept_confidence" not in self.ttrl_figures:
            return None
        from stages.rl.conservative import confidence_lr

        return confidence_lr(self.ttrl_figures["ttrl/kept_confidence"], c.max_lr, c.min_lr)

    def _due(self, every: int, step: int) -> bool:
        return bool(every) and (step % every == 0 or step == self.params.steps)

    # --- the run --------------------------------------------------------------------------------------------

    def run_loop(self) -> dict[str, Any]:
        """Train from the last checkpoint (or the start) to rl.steps; returns the contents of metrics.json."""
        p = self.params
        run_started = time.perf_counter()
        self._start()
        try:
            bar = tqdm(total=p.steps, initial=self.step, desc="rl", unit="step", disable=not self.progress)
            if p.val_every and p.val_before_train and self.step == 0:
                self._record(self._validate_shown(bar, 0))
            for step in range(self.step + 1, p.steps + 1):
                row = self.train_step(step)
                if row is None:
                    tqdm.write(f"rl: the train split's {p.epochs} passes are drawn after {self.step} steps "
                               f"({self.stream.batches_drawn} batches of {p.prompts_per_step} prompts; rl.run_length: "
                               f"passes); a last batch short of {p.prompts_per_step} kept groups is not trained")
                    if self.step:  # the stream's position past the untrained draws: a resumed run finds nothing left
                        self._checkpoint(self.step)
                    break
                self._record(row)
                if self._due(p.val_every, step):
                    self._record(self._validate_shown(bar, step))
                if self._due(p.sample_trajectories_every, step):
                    render_html(self.last_batch, self.out_dir / "samples" / f"step_{step:06d}.html",
                                title=f"rl step {step}", max_trajectories=p.viewer_trajectories)
                if self._due(p.checkpoint_every, step):
                    self._checkpoint(step)
                self.step = step
                bar.set_postfix(reward=_fmt(row.get("reward/mean")), acc=_fmt(row.get("reward/accuracy")))
                bar.update(1)
            bar.close()
            self.learner.save_model(self.out_dir / "model", self.inputs.model_path)
            if self.last_batch or not (self.out_dir / "viewer.html").exists():
                render_html(self.last_batch, self.out_dir / "viewer.html", title=f"rl step {self.step}",
                            max_trajectories=p.viewer_trajectories)
        finally:
            self._stop()
        metrics = final_metrics(self.log.rows, self.step, time.perf_counter() - run_started)
        atomic_write_json(self.out_dir / "metrics.json", metrics)
        write_plots(self.log.rows, self.out_dir)
        return metrics

    def _record(self, row: dict[str, Any]) -> None:
        self.log.append(row)
        self.run.log_metrics({k: v for k, v in row.items() if k not in ("step", "kind") and v is not None}, step=row["step"])


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
