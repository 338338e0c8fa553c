"""The learner: the policy, its optimiser, the frozen reference, and one PPO-style update over a batch.

`Learner.update(sequences, step)` runs `ppo_epochs` passes; each pass splits the batch into `mini_batches`
optimiser steps, and each mini-batch into micro-batches of `micro_batch_size` sequences whose gradients
accumulate (the loss normaliser is the mini-batch's, so accumulation changes nothing but memory). Log-probs
come from `batching.token_logprobs` (packed or padded), the loss from `loss.policy_loss`.

One process owns the whole policy on CPU or one GPU. With several learner ranks (one per GPU, started by
workers.LearnerGroup under a torch.distributed process group), the policy is sharded with FSDP2
(`torch.distributed.fsdp.fully_shard`, per decoder layer and vision block, then the root); each rank runs
its own share of the micro-batches and gradients are summed across ranks (each rank's loss uses the global
normaliser and is scaled by the rank count, which FSDP's gradient averaging divides back out).

Precision (`rl.mixed_precision`, stages/rl/precision.py): the policy's weights and AdamW's moments stay float32;
with bf16 on (the default on GPU) the forward and backward compute in bf16: FSDP2's `MixedPrecisionPolicy`
(bf16 parameters, float32 gradient reduction) when sharded, `torch.autocast` otherwise.

Weights leave the learner by broadcast to the rollout engines (`send_weights`, loupe/rollout/weight_sync.py);
checkpoints are written and read in place by every rank (`save_checkpoint`, torch.distributed.checkpoint).
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from loupe.io import atomic_directory, make_readable
from loupe.models import load_model, load_processor, resolve_device
from loupe.models.family import write_published_layout
from loupe.rollout.weight_sync import (
    SyncGroup,
    device_identity,
    free_address,
    send_weights,
)
from stages.rl.batching import TrainSequence, split_evenly, token_logprobs
from stages.rl.loss import LossConfig, loss_normaliser, policy_loss
from stages.rl.optimizer import (
    lr_scheduler,
    move_optimizer_state,
    optimizer_steps_taken,
)
from stages.rl.params import RLParams
from stages.rl.sharding import shard_model

SUMMED_STATS = (
    "tokens", "pg_loss_sum", "clipped_sum", "clipped_high_sum", "clipped_low_sum", "ratio_sum", "policy_kl_sum",
    "kl_sum", "entropy_sum", "critic_tokens", "critic_loss_sum", "critic_clipped_sum", "critic_value_sum",
    "critic_error_sum", "critic_return_sum", "critic_return_sq_sum", "conservative_kl_sum",
)
"""Per-token statistic sums of `loss.policy_loss` that sharded ranks add up (ratio_max is reduced by max)."""


@contextlib.contextmanager
def _single_process_checkpoint(distributed: bool) -> Iterator[None]:
    """torch.distributed.checkpoint warns that it assumes one process when no group exists; here that is the
    intent (the single-process learner), so the warning is silenced for that case only."""
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def critic_folder(learner_folder: Path) -> Path:
    """Where a checkpoint keeps the critic: `critic/` beside the policy's `learner/` (stages/rl/checkpoint.py)."""
    return Path(learner_folder).with_name("critic")


class Learner:
    """Owns the policy and optimiser; computes log-probs and applies updates."""

    def __init__(
        self,
        model_path: str | Path,
        params: RLParams,
        temperature: float,
        generation_budget: int,
        device: str | None = None,
        distributed: bool = False,
        seed: int = 0,
    ):
        """`seed`: the adapters' initialisation with LoRA (drawn from its own generator, so a resumed run starts
        from the same adapters as the run it resumes before loading its checkpoint)."""
        from stages.rl.batching import ImageEncoder
        from stages.rl.precision import fsdp_mixed_precision

        self.params = params
        self.temperature = temperature
        self.generation_budget = generation_budget
        self.distributed = distributed
        self.rank = torch.distributed.get_rank() if distributed else 0
        self.world = torch.distributed.get_world_size() if distributed else 1
        self.device = resolve_device(device or params.learner_device)
        # Float32 master weights, hence float32 AdamW moments, on every device; bf16 compute comes from the
        # precision policy (stages/rl/precision.py). Loaded on CPU first when sharding: fully_shard moves each
        # rank's shard to its GPU, so no rank ever holds the whole model there.
        self.precision = fsdp_mixed_precision(params.mixed_precision, self.device)
        # With LoRA the base is frozen: no optimiser step rounds into it, so it is held in the compute dtype
        # (bf16 on a GPU: 15 GB for 7B instead of 30); the adapters stay float32 (stages/rl/lora.py).
        base_dtype = self.precision.param_dtype if params.lora.rank and self.precision is not None else torch.float32
        self.model = load_model(model_path, device="cpu" if distributed else self.device, dtype=base_dtype)
        self.model.config.use_cache = False
        if params.attn_implementation:
            self.model.set_attn_implementation(params.attn_implementation)
        if params.gradient_checkpointing:
            # Non-reentrant, the form torch.utils.checkpoint recommends: the reentrant one gives a layer no
            # gradient unless one of its positional inputs requires grad, and none to tensors passed by keyword.
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.lora = None
        """The `PeftModel` around `model` when rl.lora is on (adapters injected into `model` in place)."""
        if params.lora.rank:
            from stages.rl.lora import attach_lora

            cuda = torch.device(self.device).type == "cuda"
            devices = [torch.device(self.device).index or 0] if cuda else []
            with torch.random.fork_rng(devices=devices):  # peft draws lora_A from torch's global generators
                torch.manual_seed(seed)
                self.lora = attach_lora(self.model, params.lora)
        if distributed:
            shard_model(self.model, mp_policy=self.precision)
        # A sharded model casts itself (the policy went to fully_shard); an unsharded one autocasts its forward.
        self.autocast = None if distributed else self.precision
        self.model.train()
        self.batching = params.batching
        if self.batching == "auto":  # only flash-attention's varlen kernels skip the cross-sequence attention
            attention = str(getattr(self.model.config, "_attn_implementation", "") or "")
            self.batching = "packed" if attention.startswith("flash_attention") else "padded"
        processor = load_processor(model_path)
        self.pad_id = processor.tokenizer.pad_token_id or 0
        # Pixel values are computed here, in the learner's process, from the traces' uint8 images.
        self.images = ImageEncoder(
            processor.image_processor, getattr(self.model.config, "image_token_id", None), params.image_cache_mb
        )
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        """What the optimiser steps: every weight, or the adapters alone with LoRA."""
        self.optimizer = torch.optim.AdamW(
            self.trainable, lr=params.lr, betas=params.betas, weight_decay=params.weight_decay
        )
        self.has_reference = params.kl.coef > 0
        self.reference = None
        """A frozen copy of the starting policy for KL; with LoRA the policy itself, adapters off."""
        if self.has_reference and self.lora is None:
            # Never updated, so kept in the compute dtype (bf16 under mixed precision, as verl's
            # ActorRolloutRefWorker._build_model_optimizer loads its reference) and autocast like the policy.
            ref_dtype = self.precision.param_dtype if self.precision is not None else torch.float32
            self.reference = load_model(model_path, device=self.device, dtype=ref_dtype).eval()
            self.reference.requires_grad_(False)
        mode = params.recipe.policy_loss
        if mode == "gspo" and params.gspo_variant == "token":
            mode = "gspo_token"
        self.loss_cfg = LossConfig(
            clip_low=params.clip_low,
            clip_high=params.clip_high,
            kl_coef=params.kl.coef if params.kl.form == "loss" else 0.0,
            kl_estimator=params.kl.estimator,
            entropy_coef=params.entropy_coef,
            mode=mode,
            aggregation=params.aggregation,
            dual_clip=params.dual_clip,
        )
        self.scheduler = lr_scheduler(self.optimizer, params)
        self.adaptive_kl = self.ema = None
        """Pixelis' conservative update (rl.ttrl.conservative; stages/rl/conservative.py), test-time RL only."""
        if params.ttrl.enabled and params.ttrl.conservative.enabled:
            from stages.rl.conservative import AdaptiveKL, WeightEMA

            self.adaptive_kl = AdaptiveKL(params.ttrl.conservative)
            self.ema = WeightEMA(self.trainable, params.ttrl.conservative.ema_decay)
        self.critic = None
        if params.recipe.critic:
            from stages.rl.critic import Critic

            self.critic = Critic(
                model_path, params.critic, params.max_grad_norm, self.device, distributed, self.precision,
                params.gradient_checkpointing, params.attn_implementation,
            )

    # --- log-probs ------------------------------------------------------------------------------------------

    def _micro_batches(self, sequences: list[TrainSequence]) -> list[list[TrainSequence] | None]:
        """Micro-batches of `sequences`; when sharded, padded with None so every rank runs as many forwards
        as the busiest one (each forward gathers the sharded weights, a collective all ranks must join)."""
        size = self.params.micro_batch_size
        micros: list[list[TrainSequence] | None] = [sequences[i : i + size] for i in range(0, len(sequences), size)]
        if self.distributed:
            count = torch.tensor([len(micros)], device=self.device)
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
            micros += [None] * (int(count) - len(micros))
        return micros

    @torch.no_grad()
    def logprobs(
        self, sequences: list[TrainSequence], filler: list[TrainSequence] | None = None, reference: bool = False
    ) -> list[torch.Tensor]:
        """Per sequence, the log-probs of its trained tokens under the policy (or the reference), on CPU.

        `filler` (sharded runs) is a sequence to run, and discard, where this rank has fewer micro-batches.
        """
        if reference and not self.has_reference:
            raise ValueError("no reference model: kl.coef is 0")
        if reference and self.lora is not None:
            with self.lora.disable_adapter():
                return self._logprobs(self.model, self.autocast, sequences, filler)
        if reference:
            return self._logprobs(self.reference, self.precision, sequences, filler)  # the reference is never sharded
        return self._logprobs(self.model, self.autocast, sequences, filler)

    def _logprobs(self, model: Any, precision: Any, sequences: list[TrainSequence],
                  filler: list[TrainSequence] | None) -> list[torch.Tensor]:
        trained = [s for s in sequences if s.num_trained]
        flat: list[torch.Tensor] = []
        for micro in self._micro_batches(trained):
            found, _ = token_logprobs(
                model, micro or filler or [], self.batching, self.temperature, self.pad_id,
                images=self.images, precision=precision,
            )
            if micro is not None:
                flat += list(found.cpu().split([s.num_trained for s in micro]))
        it = iter(flat)
        return [next(it) if s.num_trained else torch.zeros(0) for s in sequences]

    @torch.no_grad()
    def values(self, sequences: list[TrainSequence], filler: list[TrainSequence] | None = None) -> list[torch.Tensor]:
        """Per sequence, the critic's value before each of its trained tokens, on CPU (estimator ppo)."""
        if self.critic is None:
            raise ValueError("no critic: only estimator ppo trains a value model")
        trained = [s for s in sequences if s.num_trained]
        flat: list[torch.Tensor] = []
        for micro in self._micro_batches(trained):
            found = self.critic.values(micro or filler or [], self.batching, self.pad_id, self.images)
            if micro is not None:
                flat += list(found.cpu().split([s.num_trained for s in micro]))
        it = iter(flat)
        return [next(it) if s.num_trained else torch.zeros(0) for s in sequences]

    # --- the update -----------------------------------------------------------------------------------------

    def update(self, sequences: list[TrainSequence], filler: list[TrainSequence] | None = None,
               train_policy: bool = True, lr: float | None = None) -> dict[str, float]:
        """PPO epochs over `sequences` (this rank's share when sharded); returns averaged statistics.

        `filler` (sharded runs): a sequence whose forward and backward run with zero weight where this rank has
        fewer micro-batches than another, so every rank joins the same collectives. With a critic, each
        mini-batch also steps the critic on the same micro-batches; `train_policy` False (the critic's warm-up)
        steps the critic alone. `lr` (the conservative update's rate from the vote's confidence) replaces the
        schedule's rate for this call's optimiser steps.
        """
        started = time.perf_counter()
        self.model.train()  # a colocated engine generates with this module in eval mode between updates
        move_optimizer_state(self.optimizer, self.device)  # back from the host after `offload_optimizer`
        p = self.params
        # Rows trained on no token leave the update, unless rl.masked_rows_in_loss keeps them in their mini-batch,
        # where they count in seq_mean_token_mean's divisor as verl counts them.
        kept = sequences if p.masked_rows_in_loss else [s for s in sequences if s.num_trained]
        totals: dict[str, float] = {}
        grad_norms: list[float] = []
        critic_norms: list[float] = []
        if not any(s.num_trained for s in kept) and not self.distributed:
            return {"skipped_update": 1.0}
        minis = split_evenly(kept, p.mini_batches)
        if not self.distributed:
            minis = [m for m in minis if any(s.num_trained for s in m)]
        for _ in range(p.ppo_epochs):
            for mini in minis:
                tokens, count = sum(s.num_trained for s in mini), len(mini)
                mini = [s for s in mini if s.num_trained]
                micros = self._micro_batches(mini)
                real_micros = len([m for m in micros if m])
                if self.distributed:
                    counts = torch.tensor([tokens, count, real_micros], dtype=torch.float64, device=self.device)
                    torch.distributed.all_reduce(counts)
                    tokens, count, real_micros = int(counts[0]), int(counts[1]), int(counts[2])
                normaliser = loss_normaliser(p.aggregation, tokens, count, self.generation_budget)
                self.optimizer.zero_grad(set_to_none=True)
                mini_kl = 0.0
                for micro in micros:
                    stats: dict[str, float] = {}
                    if p.aggregation == "micro_token_mean":  # each micro-batch's token mean, averaged over them
                        normaliser = float(max(sum(s.num_trained for s in micro or []), 1) * max(real_micros, 1))
                    if train_policy:
                        stats.update(self._backward(micro or filler or [], normaliser, scale=1.0 if micro else 0.0,
                                                    kl_tokens=float(max(tokens, 1))))
                        mini_kl += stats.get("conservative_kl_sum", 0.0)
                    if self.critic is not None:
                        stats.update(self.critic.backward(micro or filler or [], float(max(tokens, 1)), self.batching,
                                                          self.pad_id, self.images, self.world, 1.0 if micro else 0.0))
                    for key, value in stats.items():
                        totals[key] = max(totals.get(key, 0.0), value) if key.endswith("_max") else totals.get(key, 0.0) + value
                if self.critic is not None:
                    critic_norms.append(self.critic.step())
                if not train_policy:
                    continue
                if self.adaptive_kl is not None:
                    kl = self._global_sum(mini_kl) / max(tokens, 1)
                    if self.adaptive_kl.skips(kl):  # Pixelis refuses an update this far from the policy
                        totals["conservative_skipped"] = totals.get("conservative_skipped", 0.0) + 1
                        self.optimizer.zero_grad(set_to_none=True)
                        continue
                norm = torch.nn.utils.clip_grad_norm_(self.trainable, p.max_grad_norm)
                norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
                grad_norms.append(norm)
                if math.isfinite(norm):
                    if lr is not None:
                        for group in self.optimizer.param_groups:
                            group["lr"] = lr
                    self.optimizer.step()
                    self.scheduler.step()
                    if self.adaptive_kl is not None and self.ema is not None:
                        self.ema.update()
                        self.adaptive_kl.record(kl)
                else:  # a non-finite gradient would poison the weights; skip the step and say so
                    totals["nonfinite_grad_steps"] = totals.get("nonfinite_grad_steps", 0.0) + 1
                self.optimizer.zero_grad(set_to_none=True)
        summary = self._summarise(totals, grad_norms, time.perf_counter() - started)
        if lr is not None:
            summary["lr"] = lr
        if self.adaptive_kl is not None:
            summary.update(conservative_beta=self.adaptive_kl.beta,
                           conservative_kl=totals.get("conservative_kl_sum", 0.0) / max(summary["update_tokens"], 1.0),
                           conservative_skipped=totals.get("conservative_skipped", 0.0))
        if self.critic is not None:
            from stages.rl.critic import summarise_critic

            summary.update(summarise_critic(totals, critic_norms))
        if not train_policy:
            summary["critic_warmup"] = 1.0
        return summary

    def _global_sum(self, value: float) -> float:
        """`value` summed over the ranks (itself when not sharded)."""
        if not self.distributed:
            return value
        found = torch.tensor([value], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(found)
        return float(found[0])

    def _backward(self, micro: list[TrainSequence], normaliser: float, scale: float = 1.0,
                  kl_tokens: float = 1.0) -> dict[str, float]:
        # The entropy keeps its graph only when the loss has an entropy bonus; otherwise it is computed without
        # one, chunk by chunk, for update/entropy alone.
        logprobs, entropy = token_logprobs(
            self.model, micro, self.batching, self.temperature, self.pad_id,
            entropy="grad" if self.loss_cfg.entropy_coef > 0 else "detached", images=self.images, precision=self.autocast,
        )
        device = logprobs.device
        old = torch.cat([s.old_logprobs for s in micro]).to(device)
        advantages = torch.cat([s.advantages() for s in micro]).to(device)
        seq_ids = torch.cat([torch.full((s.num_trained,), i, dtype=torch.long) for i, s in enumerate(micro)]).to(device)
        ref = None
        if self.has_reference and all(s.ref_logprobs is not None for s in micro):
            ref = torch.cat([s.ref_logprobs for s in micro]).to(device)  # type: ignore[misc]
        loss, stats = policy_loss(logprobs, old, advantages, normaliser, self.loss_cfg, ref, entropy, seq_ids)
        if self.adaptive_kl is not None:  # Pixelis' KL to the pre-update policy, a token mean over the mini-batch
            from stages.rl.conservative import k3_forward_kl

            kl = k3_forward_kl(logprobs, old)
            loss = loss + self.adaptive_kl.beta * kl.sum() / kl_tokens
            stats["conservative_kl_sum"] = float(kl.detach().sum())
        # Each rank's loss is divided by the global normaliser, so the batch's gradient is the ranks' sum; FSDP
        # averages over ranks (with whatever reduction the backend supports), hence the factor `world`.
        (loss * (scale * self.world)).backward()
        return stats if scale else {}

    def _summarise(self, totals: dict[str, float], grad_norms: list[float], seconds: float) -> dict[str, float]:
        tokens = totals.get("tokens", 0.0)
        if self.distributed:
            # A fixed list of keys: a rank that trained nothing has no statistics of its own, and tensors of
            # different lengths in one all-reduce would hang or mix values. The gradient norm, and so the count
            # of skipped steps, is already global.
            summed = torch.tensor([totals.get(k, 0.0) for k in SUMMED_STATS], dtype=torch.float64, device=self.device)
            torch.distributed.all_reduce(summed)
            largest = torch.tensor([totals.get("ratio_max", 0.0)], dtype=torch.float64, device=self.device)
            torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX)
            totals.update(dict(zip(SUMMED_STATS, summed.tolist())), ratio_max=float(largest))
            if not self.has_reference:
                totals.pop("kl_sum", None)
            tokens = totals.get("tokens", 0.0)
        per_token = max(tokens, 1.0)
        out = {
            "update_tokens": tokens,
            "pg_loss": totals.get("pg_loss_sum", 0.0) / per_token,
            "clip_frac": totals.get("clipped_sum", 0.0) / per_token,
            "clip_frac_high": totals.get("clipped_high_sum", 0.0) / per_token,
            "clip_frac_low": totals.get("clipped_low_sum", 0.0) / per_token,
            "ratio_mean": totals.get("ratio_sum", 0.0) / per_token,
            "ratio_max": totals.get("ratio_max", 0.0),
            "policy_kl": totals.get("policy_kl_sum", 0.0) / per_token,
            "entropy": totals.get("entropy_sum", 0.0) / per_token,
            "grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
            "optimizer_steps": float(len(grad_norms)),
            "lr": float(self.scheduler.get_last_lr()[0]),
            "update_seconds": seconds,
        }
        if "kl_sum" in totals:
            out["kl"] = totals["kl_sum"] / per_token
        if "nonfinite_grad_steps" in totals:
            out["nonfinite_grad_steps"] = totals["nonfinite_grad_steps"]
        if "dual_clipped_sum" in totals:
            out["dual_clip_frac"] = totals["dual_clipped_sum"] / per_token
        return out

    # --- weights and state ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full policy weights on CPU (for rollout workers and saving); gathered across ranks when sharded."""
        if self.distributed:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {k: v.detach().to("cpu", copy=True) for k, v in self.policy_weights()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.distributed:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
            )

            set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True))
        else:
            self.model.load_state_dict(state)

    def save_checkpoint(self, folder: Path) -> None:
        """Write the policy and optimiser into `folder` with torch.distributed.checkpoint: each rank writes its
        own shard (no gather, nothing through the driver). All ranks call it with the same absolute folder on a
        filesystem they share; the trainer renames the enclosing checkpoint folder once every rank is done."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=self._checkpoint_options())
        model_state = self._checkpointed(model_state)
        with _single_process_checkpoint(self.distributed):
            dcp.save({"model": model_state, "optimizer": optimizer_state, **self._conservative_state()},
                     checkpoint_id=str(folder), no_dist=not self.distributed)
            if self.critic is not None:
                dcp.save(self.critic.state(), checkpoint_id=str(critic_folder(folder)), no_dist=not self.distributed)

    def _conservative_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The EMA and beta with its KL window, checkpointed beside the weights so a resumed run goes on alike."""
        if self.ema is None or self.adaptive_kl is None:
            return {}
        return {"ema": self.ema.state(), "adaptive_kl": self.adaptive_kl.state()}

    def _checkpoint_options(self) -> Any:
        """With LoRA a checkpoint holds the adapters and their moments only: the frozen base is the --model
        directory's, read again at start (for 7B, megabytes a checkpoint instead of 15 GB)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(ignore_frozen_params=self.lora is not None, strict=self.lora is None)

    def _checkpointed(self, model_state: dict[str, Any]) -> dict[str, Any]:
        """With LoRA, the trained tensors alone: `ignore_frozen_params` still keeps a head tied to the frozen
        embeddings (a state-dict entry that is no parameter of its own)."""
        if self.lora is None:
            return model_state
        trained = {name for name, p in self.model.named_parameters() if p.requires_grad}
        return {k: v for k, v in model_state.items() if k in trained}

    def load_checkpoint(self, folder: Path) -> None:
        """Load a `save_checkpoint` folder in place: each rank reads its own shard into its own tensors."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_state_dict,
            set_state_dict,
        )

        if not (Path(folder) / ".metadata").is_file():
            raise FileNotFoundError(f"{folder}: not a checkpoint of this version (no torch.distributed.checkpoint .metadata)")
        options = self._checkpoint_options()
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=options)
        state = {"model": self._checkpointed(model_state), "optimizer": optimizer_state, **self._conservative_state()}
        with _single_process_checkpoint(self.distributed):
            dcp.load(state, checkpoint_id=str(folder), no_dist=not self.distributed)
        if self.ema is not None and self.adaptive_kl is not None:
            self.ema.load(state["ema"])
            self.adaptive_kl.load(state["adaptive_kl"])
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=options)
        self.scheduler = lr_scheduler(self.optimizer, self.params, optimizer_steps_taken(self.optimizer))
        if self.critic is not None:
            if not (critic_folder(folder) / ".metadata").is_file():
                raise FileNotFoundError(f"{critic_folder(folder)}: estimator ppo resumes its critic from here, but the "
                                        "checkpoint has none (written by a run without a critic?)")
            critic_state = self.critic.state()
            with _single_process_checkpoint(self.distributed):
                dcp.load(critic_state, checkpoint_id=str(critic_folder(folder)), no_dist=not self.distributed)
            self.critic.set_state(critic_state)

    # --- weights to the rollout engines (loupe.rollout.weight_sync) ----------------------------------------

    def policy_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's tensors by Hugging Face name, as the engines and the final model hold them (with LoRA the
        adapters merged into their layers, stages/rl/lora.py)."""
        if self.lora is not None:
            from stages.rl.lora import merged_weights

            return merged_weights(self.lora)
        return iter(self.model.state_dict().items())

    def weight_specs(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(name, dtype, full shape) of every tensor the engines receive, in the order `send_weights` walks."""
        return [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in self.policy_weights()]

    def cast_weights(self, manifest: list) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's tensors in the engines' dtype, one at a time, for an engine in this process (no transport)."""
        from loupe.rollout.weight_sync import cast_weights

        with torch.no_grad(), self._served():
            yield from cast_weights(self.policy_weights(), manifest)

    def sync_address(self) -> tuple[str, int]:
        """Where the weight-sync group meets: this node and a free port (called on rank 0)."""
        return free_address()

    def init_weight_sync(self, host: str, port: int, world_size: int, backend: str, timeout_s: float) -> None:
        """Rank 0 joins the weight-sync group as its rank 0, the sender; other ranks only help gather."""
        self.sync_group = None
        if self.rank == 0:
            device = self.device if backend in ("nccl", "ipc") else torch.device("cpu")
            self.sync_group = SyncGroup(host, port, 0, world_size, backend, timeout_s, device)

    def offload_optimizer(self) -> int:
        """Before a colocated vLLM wakes: AdamW's moments (twice the policy's float32 size) to the host, and the
        allocator's cached blocks back to the driver, so the engine's `wake_up` finds the memory it gave up.
        verl's hybrid engine does the same before waking its rollout (`offload_fsdp_optimizer`, then
        `empty_cache`); `update` brings the moments back. Returns the bytes moved."""
        moved = move_optimizer_state(self.optimizer, "cpu")
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        return moved

    def device_identity(self) -> str:
        """This rank's (node, device) key (weight_sync.device_identity): the transport choice compares it with
        the engines'."""
        return device_identity(self.device)

    def send_weights(self, manifest: list) -> int:
        """Broadcast the policy to the engines, bucket by bucket; every rank walks the tensors (sharded ones
        are gathered collectively), rank 0 sends. Returns the bytes sent."""
        with torch.no_grad(), self._served():
            return send_weights(getattr(self, "sync_group", None), self.policy_weights(), manifest)

    def _served(self) -> Any:
        """The weights the engines and the saved model get: the conservative update's EMA when it is on (swapped
        in for the block), else the trained ones."""
        return self.ema.swapped_in() if self.ema is not None else contextlib.nullcontext()

    def save_model(self, final: Path, model_path: str | Path) -> None:
        with self._served():
            self._save_model(final, model_path)

    def _save_model(self, final: Path, model_path: str | Path) -> None:
        """Write the policy as a Hugging Face model directory (weights, config, processor) that eval loads.

        The process that writes it renames it into place (rank 0 of a sharded group, after gathering the full
        weights, which every rank joins): no folder written on one node is renamed from another.
        """
        if self.distributed or self.lora is not None:
            with torch.no_grad():
                state = self.state_dict()
            if self.rank != 0:
                return
            from transformers import AutoModelForImageTextToText

            # With LoRA: merged, in the base's dtype (bf16 on a GPU: what vLLM and eval load anyway).
            dtype = next(self.model.parameters()).dtype if self.lora is not None else torch.float32
            model = AutoModelForImageTextToText.from_pretrained(str(model_path), dtype=dtype)
            model.load_state_dict({k: v.to(dtype) for k, v in state.items()})
        else:
            model = self.model
        with atomic_directory(Path(final)) as tmp:
            model.config.use_cache = True  # saved for generation; training keeps it off
            try:
                model.save_pretrained(tmp)
            finally:
                self.model.config.use_cache = False
            load_processor(model_path).save_pretrained(tmp)
            write_published_layout(tmp)  # Qwen3-VL-MoE's experts as its checkpoints store them (vLLM reads those)
            if self.lora is not None:  # the adapters apart too, for peft or vLLM's LoRA serving
                self.lora.save_pretrained(tmp / "adapter")
            make_readable(tmp)
