"""The `rl` section of params.yaml: the GRPO algorithm, its schedule, checkpoints and the Ray layout."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from loupe.config import Section
from loupe.rewards import RewardConfig


class KLParams(Section):
    """Optional KL divergence to the frozen starting policy (the reference)."""

    coef: float = Field(0.0, ge=0)
    """Weight of the KL term; 0 switches it off and no reference model is loaded (Mini-o3 and DAPO use 0)."""
    form: Literal["loss", "reward"] = "loss"
    """`loss`: a per-token penalty added to the policy loss (GRPO); `reward`: the sequence's summed KL is
    subtracted from its reward before advantages are computed (PPO / REINFORCE++ style)."""
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token estimator of KL(policy || reference) from sampled tokens: k1 = log-ratio, k2 = half its
    square, k3 = exp(-r) + r - 1 (non-negative, low variance; GRPO's choice)."""


class DynamicSamplingParams(Section):
    """DAPO's dynamic sampling: groups whose rewards all agree carry no signal, so sample more prompts."""

    enabled: bool = True
    """Drop groups with zero reward spread and roll out fresh prompts until the batch is full."""
    max_tries: int = Field(3, ge=1)
    """Rollout rounds per step, the first included; after the last one the step trains on the groups it has
    (none: the update is skipped and the step is logged as such)."""


class RayParams(Section):
    """Where the actors run. Without Ray everything runs in this process (tests, debugging)."""

    enabled: bool = True
    """Run rollout workers and the reward pool as Ray actors; off runs them in-process with the same code."""
    address_env: str = "RAY_ADDRESS"
    """Environment variable naming an existing cluster to join (`ray://...` or `host:port`); when it is unset
    a local Ray starts with this machine's CPUs."""
    colocate: bool = False
    """Colocated mode, for one node and few GPUs: the rollout engine shares the learner's GPU(s). The
    transformers engine runs in the learner's process on its very module (no second copy, no weight sync; one
    worker, one learner rank). vLLM runs as Ray actors on a share of the GPU (`gpus_per_worker` below 1,
    `rollout.gpu_memory_utilization` sized to fit beside the learner), sleeps through each update (weights
    and KV cache freed) and wakes for the weights, which arrive over gloo (NCCL refuses two ranks on one GPU)."""
    num_workers: int = Field(1, ge=1)
    """Rollout workers; each owns one engine and rolls out its share of the step's prompts."""
    cpus_per_worker: float = Field(0.5, gt=0)
    """CPUs reserved per rollout worker (fractional so several fit on a laptop)."""
    gpus_per_worker: float = Field(0.0, ge=0)
    """GPUs per rollout worker (vLLM on GPU: 1, or a fraction to share a GPU with the learner)."""
    gpus_per_node: int = Field(0, ge=0)
    """GPUs of each node given to the learner; more than one GPU in all shards the policy with FSDP2."""
    nodes: int = Field(1, ge=1)
    """Nodes the learner spans (learner ranks = nodes x gpus_per_node)."""
    reward_concurrency: int = Field(8, ge=1)
    """Trajectories the reward pool scores at once (LLM-judge calls overlap; rules are instant)."""
    placement_timeout_s: float = Field(120.0, gt=0)
    """Seconds to wait for the cluster to reserve the learner's and rollout workers' resources before failing
    with what was asked and what each node has (a request no node can meet would otherwise wait forever)."""
    worker_resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each rollout worker also reserves (those of `ray start --resources`), to pin workers
    to the nodes that advertise them; e.g. {rollout_slot: 1} with one slot per node puts one worker per node."""
    learner_resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each learner rank also reserves, to pin the learner to the nodes that advertise them."""
    pass_env: list[str] = Field(default_factory=list)
    """More environment variables of the driver handed to every actor: names, or prefixes ending in `*`. NCCL_*,
    GLOO_*, TORCH_*, HF_*, TRANSFORMERS_*, VLLM_*, OMP_* and the like pass anyway; secrets (names holding KEY,
    TOKEN, SECRET, PASSWORD) never do: set them in the environment of `ray start` (stages/rl/cluster.py)."""


class RLParams(Section):
    """How the rl stage trains the policy with GRPO-family reinforcement learning."""

    estimator: Literal["grpo", "rloo", "reinforce_pp", "dr_grpo"] = "grpo"
    """Advantage estimator: grpo (group mean and std), rloo (leave-one-out mean), reinforce_pp (REINFORCE++:
    batch-whitened rewards), dr_grpo (group mean only, no std; pairs with token_sum aggregation)."""
    samples_per_prompt: int = Field(4, ge=2)
    """n: trajectories per prompt, one GRPO group (Mini-o3: 16)."""
    prompts_per_step: int = Field(4, ge=1)
    """Prompts (groups) in one step's batch after dynamic sampling."""
    steps: int = Field(4, ge=1)
    """Training steps (one batch, rollout then update, each)."""
    max_turns: int | None = Field(None, ge=1)
    """Assistant turns per trajectory in training; None keeps protocol.max_turns (Mini-o3: 6)."""
    max_new_tokens: int | None = Field(None, ge=1)
    """New tokens per assistant turn; None keeps rollout.max_new_tokens."""
    temperature: float | None = Field(None, gt=0)
    """Sampling temperature of training rollouts; None keeps rollout.temperature. The learner scales logits
    by the same temperature, so importance ratios compare like with like."""

    clip_low: float = Field(0.2, ge=0, lt=1)
    """Lower clip of the importance ratio: 1 - clip_low (Mini-o3: 0.2)."""
    clip_high: float = Field(0.3, ge=0)
    """Upper clip of the importance ratio: 1 + clip_high (Mini-o3 / DAPO clip-higher: 0.3)."""
    loss_aggregation: Literal["auto", "token_mean", "token_sum"] = "auto"
    """token_mean: mean over every trained token of the batch (Mini-o3, DAPO); token_sum: sum over tokens
    divided by a constant (sequences x generation budget), Dr. GRPO's length-unbiased form; auto picks
    token_sum for dr_grpo and token_mean otherwise."""
    kl: KLParams = KLParams()
    """KL regularisation to the starting policy."""
    entropy_coef: float = Field(0.0, ge=0)
    """Weight of an entropy bonus (subtracted from the loss); 0 is off."""
    over_turn_masking: bool = True
    """Mini-o3's over-turn masking: trajectories that hit the turn, image or context limit contribute no
    policy gradient (they are not punished for needing more turns than training allows)."""
    over_turn_in_group_stats: bool = True
    """Whether masked over-turn trajectories still count in their group's reward mean and std. Mini-o3's paper
    and its released code read differently here (its verl code zeroes the over-turn rows' loss mask and leaves
    the grouped rewards alone, which is `true`); both are available."""
    dynamic_sampling: DynamicSamplingParams = DynamicSamplingParams()
    """Drop zero-signal groups and refill the batch."""
    logprob_source: Literal["rollout", "recompute"] = "recompute"
    """Old log-probs of the importance ratio: the sampler's own (`rollout`), or recomputed by the learner
    before the update (`recompute`: exact for the learner's numerics; needed when vLLM samples in bf16)."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each batch."""
    mini_batches: int = Field(1, ge=1)
    """Optimiser steps per pass: the batch is split into this many mini-batches (1 is on-policy GRPO)."""
    micro_batch_size: int = Field(4, ge=1)
    """Sequences per forward/backward; gradients accumulate over a mini-batch's micro-batches."""
    batching: Literal["auto", "packed", "padded"] = "auto"
    """packed: a micro-batch's sequences concatenated into one row with per-sequence positions, no padding
    (with flash-attention each sequence attends only to itself; with sdpa/eager the row gets a block-diagonal
    mask, which computes attention over the whole row: slower on CPU, see benchmarks/grpo_step.py); padded:
    one right-padded row each; auto: packed when the model runs flash-attention, padded otherwise."""
    lr: float = Field(1e-6, gt=0)
    """AdamW learning rate (Mini-o3: 1e-6 on the 7B model)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradients are clipped to this global norm before each optimiser step."""
    sync_bucket_mb: int = Field(256, ge=1)
    """Weight sync to the rollout engines: largest broadcast bucket in MiB. Each bucket is one message over the
    weight-sync group (NCCL on GPU, gloo on CPU) and bounds the extra memory either side holds while syncing."""
    sync_timeout_s: float = Field(600.0, gt=0)
    """Seconds a weight-sync collective may wait for a peer before it fails (a dead rollout worker or learner)."""
    learner_device: str = "auto"
    """Torch device of the single-process learner: auto (cuda when present), cpu, cuda:N."""
    attn_implementation: str | None = None
    """Attention kernel of the learner's policy (`flash_attention_2` on GPU, where installed, makes `auto`
    batching packed); None keeps the model's default (sdpa)."""
    cpu_threads: int | None = Field(None, ge=1)
    """Torch CPU threads of the stage's own process (learner and in-process workers); None keeps torch's default.
    On a small shared CPU 1 is often fastest: OpenMP threads that wait on a busy core stall every op."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (saves memory on large models); non-reentrant
    `torch.utils.checkpoint`, the form torch recommends (the reentrant one sends no gradient to tensors passed by keyword)."""
    mixed_precision: Literal["auto", "bf16", "off"] = "auto"
    """Learner arithmetic: bf16 computes forward and backward in bfloat16 over float32 master weights and float32
    AdamW moments (FSDP2's MixedPrecisionPolicy when sharded, torch.autocast otherwise; gradients are reduced in
    float32); off runs float32 throughout; auto is bf16 when the learner's device is CUDA, off on CPU. The learner
    holds 16 bytes a parameter either way (weights, gradients, two moments), divided over its FSDP ranks."""
    image_cache_mb: int = Field(1024, ge=0)
    """MiB of pixel values the learner keeps, per image object, so an image shared by a group's samples (and
    reused by the old-log-prob, reference and update passes) is processed once (float32: 24 bytes a pixel)."""

    checkpoint_every: int = Field(2, ge=1)
    """Steps between checkpoints (policy, optimiser, data position, RNG states); the last step always saves."""
    keep_checkpoints: int = Field(2, ge=1)
    """Checkpoints kept on disk; older ones are deleted once a newer one is complete."""
    val_every: int = Field(2, ge=0)
    """Steps between validations on the val split through the eval stage's metrics; 0 is never."""
    val_prompts: int | None = Field(8, ge=1)
    """Val questions used (the first N); None for the whole split."""
    val_samples: int = Field(1, ge=1)
    """Samples per val question."""
    val_temperature: float | None = Field(None, ge=0)
    """Sampling temperature of validation (the eval stage's, say, so the curve and the final verdict measure
    the same thing); None samples as training does. verl samples validation apart too (`val_kwargs`)."""
    val_before_train: bool = True
    """Validate the starting model before step 1 (verl's `val_before_train`): the curve's first point is where
    RL began. Not repeated when a run resumes."""
    sample_trajectories_every: int = Field(2, ge=0)
    """Steps between HTML pages of sampled training trajectories (out/samples/step_N.html); 0 is never."""
    viewer_trajectories: int = Field(16, ge=1)
    """Trajectories shown on each sampled page."""

    reward: RewardConfig = RewardConfig()
    """How trajectories are scored (accuracy, format, tool bonus/penalty, LLM judge)."""
    custom_reward: str | None = None
    """A reward function as 'path/to/file.py:function' replacing the built-in score (loupe.rewards'
    load_custom_reward); a function that also takes `trajectory=` receives the whole trajectory."""
    train_split: str = "train"
    """Task file of the --tasks folder to train on (<split>.jsonl)."""
    val_split: str = "val"
    """Task file of the --tasks folder to validate on."""
    ray: RayParams = RayParams()
    """Actors and placement."""

    @model_validator(mode="after")
    def _consistent(self) -> RLParams:
        if self.clip_high <= 0 and self.clip_low <= 0:
            raise ValueError("clip_low/clip_high: at least one clip range must be positive")
        if self.mini_batches > self.prompts_per_step * self.samples_per_prompt:
            raise ValueError("mini_batches: more mini-batches than sequences in a batch")
        return self

    @property
    def aggregation(self) -> str:
        """The loss aggregation after resolving `auto`."""
        if self.loss_aggregation != "auto":
            return self.loss_aggregation
        return "token_sum" if self.estimator == "dr_grpo" else "token_mean"

    @property
    def learner_ranks(self) -> int:
        """Learner processes: one per GPU given to the learner, or one on CPU."""
        return max(1, self.ray.nodes * self.ray.gpus_per_node)
