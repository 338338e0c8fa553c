"""The `rl` section of params.yaml: the GRPO algorithm, its schedule, checkpoints and the Ray layout."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from loupe.config import Section
from loupe.remote_reward import RemoteRewardConfig
from loupe.rewards import RewardConfig
from stages.rl.estimators import ESTIMATOR_NAMES, recipe
from stages.rl.pixelis_params import PixelisRewardParams


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


class OverlongParams(Section):
    """DAPO's overlong treatment (its paper, section 3.4): what happens to trajectories that run into the
    per-turn token budget. In a multi-turn dialogue a trajectory is cut when one assistant turn exhausts
    `rollout.max_new_tokens` (end reason `length`), so the length measured is that of its longest turn."""

    filter: bool = False
    """Overlong filtering: a trajectory cut by the token budget trains nothing (its loss mask is empty) and stays
    out of its group's statistics, so a long but unfinished answer is not punished as a wrong one.
    Default: on under `estimator: dapo`, off otherwise."""
    soft_punishment: bool = False
    """Soft overlong punishment: a trajectory whose longest turn passes `max_new_tokens - buffer_tokens` loses
    up to `penalty_factor` of reward, linearly over the buffer (and the whole factor once cut).
    Default: on under `estimator: dapo`, off otherwise."""
    buffer_tokens: int | None = Field(None, ge=1)
    """The punishment's buffer in tokens; None is a fifth of the per-turn budget (DAPO: 4096 of 20480)."""
    penalty_factor: float = Field(1.0, ge=0)
    """Reward lost at the end of the buffer (DAPO and verl's `overlong_penalty_factor`: 1.0)."""


class CuriosityParams(Section):
    """Pixel-Reasoner's curiosity bonus (arXiv 2505.15966; its code: `curiosity_driven_rl/openrlhf/trainer/
    ppo_utils/experience_maker.py`, the multi-turn rollout's reward loop): a trajectory that used the tool earns
    `coef * max(threshold - rate, 0)`, times `rate_scale / rate` when `rate_scale` > 0, where `rate` is the
    share of its group (the prompt's samples) that used the tool. Pixel-Reasoner's efficiency penalty is the
    reward's `tool_call_penalty: 0.05` with `free_tool_calls: 1`."""

    enabled: bool = False
    """Add the bonus to each valid total of a trajectory with a tool call."""
    threshold: float = Field(0.3, ge=0, le=1)
    """H: the rate of tool use below which the bonus is paid (Pixel-Reasoner: 0.3)."""
    coef: float = Field(0.5, ge=0)
    """alpha, the bonus weight (Pixel-Reasoner: 0.5 on images)."""
    rate_scale: float = Field(0.25, ge=0)
    """Pixel-Reasoner's code also multiplies by 0.25 / rate (so rarer tool use earns more); 0 leaves the
    paper's form, `coef * max(threshold - rate, 0)`."""


class ConservativeParams(Section):
    """Pixelis' guardrails on each test-time update (stages/rl/conservative.py; `core/engine/update_worker.py`,
    `KLConfig`, and `inference_engine.py`, `_calculate_adaptive_lr`, @ 991bb06)."""

    enabled: bool = False
    """Add beta x KL(pre-update policy || current) to the loss, skip an update whose KL is past `skip_factor` x
    the target, average the weights (the EMA serves), and set each step's rate from the vote's confidence."""
    initial_beta: float = Field(0.01, ge=0)
    """The KL coefficient to start from (`initial_beta` 0.01)."""
    target_kl: float = Field(0.05, gt=0)
    """The KL beta steers toward (`target_kl` 0.05): a per-token mean here (the module's docstring)."""
    tolerance: float = Field(0.01, ge=0)
    """Beta moves only when the window's mean KL is further than this from the target (`kl_tolerance`)."""
    increase_factor: float = Field(1.2, ge=1)
    """Beta's growth when the KL runs high (`beta_increase_factor`)."""
    decrease_factor: float = Field(1.2, ge=1)
    """Beta's shrinking when the KL runs low (`beta_decrease_factor`)."""
    min_beta: float = Field(1e-4, ge=0)
    """Beta's floor (`min_beta`)."""
    max_beta: float = Field(1.0, ge=0)
    """Beta's ceiling (`max_beta`)."""
    window: int = Field(100, ge=1)
    """The KLs of the last this many applied updates whose mean moves beta (`kl_window_size`)."""
    min_history: int = Field(10, ge=1)
    """Beta moves only once the window holds this many (`_adjust_beta`: 10)."""
    skip_factor: float = Field(2.0, gt=0)
    """An update whose KL exceeds this x `target_kl` is not applied (upstream: twice the target)."""
    ema_decay: float = Field(0.999, ge=0, lt=1)
    """ema = decay x ema + (1 - decay) x weights after each applied update (`ema_decay` 0.999); the EMA is what
    the rollouts answer with and what the stage saves."""
    max_lr: float = Field(1e-4, gt=0)
    """lr = clip(max_lr x (1 - confidence), min_lr, max_lr) each step (`max_learning_rate` 1e-4); replaces
    the section's `lr` and schedule."""
    min_lr: float = Field(1e-6, gt=0)
    """The rate's floor (`min_learning_rate` 1e-6)."""

    @model_validator(mode="after")
    def _bounds_in_order(self) -> ConservativeParams:
        if self.min_beta > self.max_beta:
            raise ValueError(f"min_beta {self.min_beta} is above max_beta {self.max_beta}")
        if self.min_lr > self.max_lr:
            raise ValueError(f"min_lr {self.min_lr} is above max_lr {self.max_lr}")
        return self


class TTRLParams(Section):
    """Test-time RL (stages/rl/ttrl.py): unlabeled questions, pseudo-labels by vote, confidence-gated updates."""

    enabled: bool = False
    """Read the training questions without their solutions and reward agreement with the vote's label."""
    strategy: Literal["weighted", "majority"] = "weighted"
    """Pixelis' weighted vote (its default) or a plain majority (TTRL's) over the samples and neighbours."""
    neighbours: int = Field(5, ge=0)
    """Earlier questions retrieved from the experience buffer whose labels also vote (0: the samples alone;
    Pixelis' `k_neighbors` 5)."""
    min_similarity: float = Field(0.95, ge=-1, le=1)
    """Only neighbours at least this cosine-similar vote: near-repeats of the question, not just alike ones."""
    min_votes: int = Field(3, ge=1)
    """Fewer votes than this: the first answer wins at half confidence (Pixelis' `min_votes_required` 3)."""
    recency_steps: float = Field(24.0, gt=0)
    """A neighbour's vote decays as exp(-age / recency_steps), age in RL steps (Pixelis: 24 hours)."""
    confidence_gate: float = Field(0.7, ge=0, le=1)
    """A group trains only when its vote's confidence reaches this (Pixelis' engine: 0.7)."""
    buffer_size: int = Field(10000, ge=1)
    """Pseudo-labelled questions kept for retrieval; the oldest leave first."""
    conservative: ConservativeParams = ConservativeParams()
    """Pixelis' conservative update: adaptive KL, the skip, the weight EMA, the confidence-scaled rate."""


class CriticParams(Section):
    """The value model of `estimator: ppo` (stages/rl/critic.py): the policy's architecture with a scalar head on
    its last hidden state, trained on the same batches with its own AdamW and checkpointed beside the policy."""

    path: str | None = None
    """Hugging Face directory the critic's body starts from; None starts it from the policy (--model). The value
    head always starts fresh."""
    lr: float = Field(9e-6, gt=0)
    """The critic's AdamW learning rate (OpenRLHF's `--critic_learning_rate` default, 9e-6)."""
    gamma: float = Field(1.0, ge=0, le=1)
    """GAE's discount per generated token (1.0: outcome rewards are not discounted, as in OpenRLHF and verl)."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE's lambda (OpenRLHF's and verl's default 0.95; 1.0 is Monte Carlo returns)."""
    value_clip: float | None = Field(0.2, gt=0)
    """Clipped value loss: a new value may move at most this far from the rollout's before the clipped term takes
    over (OpenRLHF's `--value_clip` 0.2); None trains on the plain squared error."""
    warmup_steps: int = Field(0, ge=0)
    """First steps that train the critic only, so the policy's first advantages do not come from a fresh head."""
    whiten_advantages: bool = True
    """Whiten GAE advantages over the batch's trained tokens (mean 0, std 1), as OpenRLHF and verl do."""


class LoraParams(Section):
    """Low-rank adapters on the policy (peft's LoRA), so a 7B policy trains on one 80 GB GPU: the base weights are
    frozen (held in the compute dtype, bf16 on a GPU), only the adapters and their AdamW moments are float32.
    The reference for KL is the same model with its adapters switched off, not a second copy. The engines get
    merged weights; checkpoints hold the adapters; the final `model/` is merged (its `adapter/` keeps them apart).
    Field names follow verl's `actor_rollout_ref.model.lora_rank`/`lora_alpha`/`target_modules`/`exclude_modules`."""

    rank: int = Field(0, ge=0)
    """LoRA rank; 0 trains every weight (no adapters)."""
    alpha: float = Field(16.0, gt=0)
    """LoRA's alpha: the adapters' update is scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training (0 keeps the learner's and the engine's policy the same)."""
    target_modules: list[str] | str = "all-linear"
    """Modules that get adapters: peft's `all-linear` (every linear layer but the output head), a list of module
    names (`[q_proj, k_proj, v_proj, o_proj]`) or a regular expression over full module names."""
    exclude_modules: list[str] | str | None = r".*\bvisual\b.*"
    """Modules kept without adapters, as peft's `exclude_modules` reads it (a regular expression over full names,
    or a list of names). The default freezes the vision tower and its merger, as LLaMA-Factory's
    `freeze_vision_tower` does; null adapts them too."""


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

    estimator: Literal["grpo", "rloo", "reinforce_pp", "reinforce_baseline", "dr_grpo", "dapo", "gspo", "cispo", "remax",
                       "ppo"] = "grpo"
    """The RL algorithm (stages/rl/estimators.py): grpo (group mean and std), rloo (leave-one-out mean),
    reinforce_pp (REINFORCE++: batch-whitened rewards), reinforce_baseline (OpenRLHF's: group mean subtracted,
    then whitened over the batch's tokens), dr_grpo (group mean only; token_sum), dapo (grpo with
    clip-higher and the overlong treatment), gspo (sequence-level ratio and clip), cispo (clipped stop-gradient
    IS weights on a REINFORCE loss), remax (a greedy rollout's reward as baseline) or ppo (GAE over a critic).
    It also sets the defaults of clip_low, clip_high, loss_aggregation, overlong and dynamic_sampling.enabled
    (off for remax, ppo and reinforce_baseline); keys you set win."""
    samples_per_prompt: int = Field(4, ge=2)
    """n: trajectories per prompt, one GRPO group (Mini-o3: 16)."""
    prompts_per_step: int = Field(4, ge=1)
    """Prompts (groups) in one step's batch after dynamic sampling."""
    steps: int = Field(4, ge=1)
    """Training steps (one batch, rollout then update, each)."""
    epochs: int | None = Field(None, ge=1)
    """The run's length in passes over the train split instead of `steps`: steps = epochs x (train prompts //
    prompts_per_step), the last partial batch of each pass dropped (verl's `len(train_dataloader) x total_epochs`
    with `drop_last=True`: Mini-o3's verl/trainer/ppo/ray_trainer.py:580-581,623-628). None: `steps`."""
    run_length: Literal["steps", "passes"] = "steps"
    """How `epochs` ends a run. `steps`: it fixes the step count (above), and dynamic sampling draws fresh prompts
    past the passes. `passes`: verl's loop as Mini-o3 runs it (ray_trainer.py:1318-1321,1435-1470,1559-1570): the
    prompt stream makes `epochs` passes over the train split, each pass in a new order with its last partial batch
    dropped, and each generation round of dynamic sampling takes a batch of them; the run ends when the passes
    are drawn (a step still short of `prompts_per_step` kept groups then is not trained) or at the steps above,
    whichever comes first. With half the groups uniform, a run trains about half the steps `steps` gives. As in
    verl's loop, a run that ends this way is not validated after its last step unless that step was due."""
    max_turns: int | None = Field(None, ge=1)
    """Assistant turns per trajectory in training; None keeps protocol.max_turns (Mini-o3: 6)."""
    max_new_tokens: int | None = Field(None, ge=1)
    """New tokens per assistant turn; None keeps rollout.max_new_tokens."""
    temperature: float | None = Field(None, gt=0)
    """Sampling temperature of training rollouts; None keeps rollout.temperature. The learner scales logits
    by the same temperature, so importance ratios compare like with like."""

    clip_low: float = Field(0.2, ge=0, le=1)
    """Lower clip of the importance ratio: 1 - clip_low. Default: the estimator's (0.2; gspo 3e-4; cispo 1.0,
    that is no lower bound, as MiniMax-M1 sets none)."""
    clip_high: float = Field(0.3, ge=0)
    """Upper clip of the importance ratio: 1 + clip_high. Default: the estimator's (0.3, Mini-o3's; dapo and
    cispo 0.28; gspo 4e-4; ppo 0.2)."""
    dual_clip: float | None = Field(None, gt=1)
    """Dual-clip PPO (Ye et al., arXiv 1912.09729; verl `compute_policy_loss`, `clip_ratio_c`, 3.0 in its
    config): for a negative advantage the token's loss is capped at -A x dual_clip, so a ratio far above 1 on a
    bad token cannot blow the loss up. None is off (OpenRLHF's and Loupe's default)."""
    loss_aggregation: Literal["auto", "token_mean", "token_sum", "seq_mean_token_mean", "micro_token_mean"] = "auto"
    """token_mean: mean over every trained token of the batch (DAPO); token_sum: sum over tokens divided by a
    constant (sequences x generation budget), Dr. GRPO's length-unbiased form; seq_mean_token_mean: each
    sequence's token mean, averaged over sequences (GSPO; Mini-o3's token-mean over one-sequence micro-batches);
    micro_token_mean: each micro-batch's (`micro_batch_size`) token mean, averaged over the mini-batch's
    micro-batches (verl's token-mean as DeepEyes runs it, 4 sequences a micro-batch); auto: the estimator's."""
    masked_rows_in_loss: bool = False
    """Whether a row trained on no token (an over-turn or cut trajectory masked whole) stays in its mini-batch,
    counted in the divisor of `seq_mean_token_mean`, as verl keeps it there with a zero mask (Mini-o3:
    dp_actor.py:284-286,316-322,394); false leaves it out. Micro-batches are formed of trained rows either way."""
    gspo_variant: Literal["sequence", "token"] = "sequence"
    """gspo only: `sequence` clips each sequence's length-normalised ratio (GSPO); `token` is GSPO-token, whose
    token ratio has the sequence ratio's value and its own token's gradient (equal to GSPO when every token of a
    sequence has the same advantage, as here; verl's `compute_policy_loss_gspo` implements this form)."""
    overlong: OverlongParams = OverlongParams()
    """DAPO's overlong filtering and soft punishment."""
    curiosity: CuriosityParams = CuriosityParams()
    """Pixel-Reasoner's curiosity bonus for tool use while the group rarely uses the tool."""
    ttrl: TTRLParams = TTRLParams()
    """Test-time RL on unlabeled questions (`train_split` names them, e.g. test)."""
    pixelis: PixelisRewardParams = PixelisRewardParams()
    """Pixelis' reward: curiosity and coherence brought in by a curriculum, tool-misuse penalties."""
    lora: LoraParams = LoraParams()
    """Low-rank adapters instead of full fine-tuning (`rank` above 0): one GPU for a 7B policy."""
    critic: CriticParams = CriticParams()
    """The value model (estimator ppo only)."""
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
    cut_turn: Literal["trained", "masked"] = "trained"
    """A trajectory whose last turn did not end with the chat template's end of turn (<|im_end|>): cut by the
    token budget (end reason `length`), or ended by another stop token (<|endoftext|>). Every generated token
    trained (`trained`), or that last turn's tokens masked while its earlier turns train and its reward still
    counts in its group (`masked`: Mini-o3, whose response mask ends at the dialogue's last <|im_end|>:
    vllm_async_engine.py:508-510,916, verl/utils/torch_functional.py:171-198 `get_final_eos_mask`,
    dp_actor.py:312). DAPO's overlong filter, when on, masks the whole of a cut trajectory instead."""
    invalid_reward: Literal["trajectory", "group"] = "trajectory"
    """What a trajectory whose reward is invalid (a judge that gave no verdict after its retries) takes out of
    the step: itself, its group staying (`trajectory`); or its whole group (`group`: Mini-o3 drops every row of
    the prompt, naive_multithreads_tool.py:162-164, function_tools.py:217-220 `get_valid_mask`)."""
    rescore_invalid: bool = False
    """When a generation batch holds an invalid reward, score the whole batch again once, every trajectory asked
    anew (DeepEyes' trainer calls its reward function a second time when the first raises: ray_trainer.py:
    1023-1030). What is still invalid then follows `invalid_reward`; upstream's run ends there instead (the second
    call raises and nothing catches it)."""
    max_prompt_tokens: int | None = Field(None, ge=1)
    """Train prompts longer than this are left out before the run, counted on the chat template's text of the
    system and question turns with each image one `<image>` (verl's `filter_overlong_prompts` and Mini-o3's
    dataset filter: `max_prompt_length` 8192, counted on the templated text with images unexpanded:
    DeepEyes' rl_dataset.py:110-118, Mini-o3's multimodal_dataset.py:201-204). None keeps every prompt."""
    dynamic_sampling: DynamicSamplingParams = DynamicSamplingParams()
    """Drop zero-signal groups and refill the batch."""
    overlap: bool = False
    """One-step overlap of rollout and update: while the learner updates on step k's batch, the rollout workers
    already generate step k+1's first batch with the weights of before the update (one step off-policy, as
    verl's one-step-off-policy recipe and AReaL do). The importance ratio is taken against the sampler's
    log-probs, which carry that lag, so it needs `logprob_source: rollout`. Not with ReMax (its greedy baseline
    must come from the sampling policy) nor with `ray.colocate` (the engines share the learner's weights).
    Exact resume holds: a checkpoint keeps the batch generated ahead."""
    logprob_source: Literal["rollout", "recompute"] = "recompute"
    """Old log-probs of the importance ratio: the sampler's own (`rollout`), or recomputed by the learner
    before the update (`recompute`: exact for the learner's numerics; needed when vLLM samples in bf16)."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each batch."""
    mini_batches: int = Field(1, ge=1)
    """Optimiser steps per pass: the batch is split into this many mini-batches (1 is on-policy GRPO)."""
    samples_per_update: int | None = Field(None, ge=1)
    """The same in the units OpenRLHF's `train_batch_size` counts: sequences per optimiser step; mini_batches
    is then prompts_per_step x samples_per_prompt / this (it must divide). Leave mini_batches unset with it."""
    prompts_per_update: int | None = Field(None, ge=1)
    """The same in the units verl's and EasyR1's `ppo_mini_batch_size` count: prompts (each with all its
    samples) per optimiser step; mini_batches is then prompts_per_step / this (it must divide)."""
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
    """AdamW betas (OpenRLHF's scripts: 0.9, 0.95; verl and EasyR1: 0.9, 0.999)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning rate over the run's optimiser steps (steps x ppo_epochs x mini_batches), after the warm-up:
    constant (verl's and EasyR1's default), linear decay to 0, or cosine down to `min_lr_ratio` x lr
    (OpenRLHF's `cosine_with_min_lr`, min 0.1 x lr). transformers' `get_scheduler` computes it; it resumes
    from the optimiser's own step count."""
    warmup_ratio: float = Field(0.0, ge=0, lt=1)
    """Share of the optimiser steps over which the rate rises linearly from 0 (OpenRLHF `--lr_warmup_ratio`,
    verl `lr_warmup_steps_ratio`)."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """The cosine schedule's floor as a share of lr (OpenRLHF: 0.1)."""
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
    Where another process computes beside the learner (a rollout worker with `overlap`, other jobs) 1 is often
    fastest: OpenMP threads that wait on a busy core stall every op. Where the rollout worker waits during the
    update, as in the default, the learner's update is a third faster at 2 on 2 cores (docs/speed.md)."""
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
    load_custom_reward); a function that also takes `trajectory=` receives the whole trajectory, and a verl
    reward function, `compute_score(data_source, solution_str, ground_truth, extra_info)`, is called as verl
    calls it, with the response's text."""
    remote_reward: RemoteRewardConfig | None = None
    """A reward server in OpenRLHF's `--remote_rm_url` format ({url, name, batch_size, concurrency, timeout_s,
    max_retries, backoff_s, max_backoff_s, cache_dir}; loupe.remote_reward) whose reward replaces the total
    above; accuracy and format are still measured by `reward` for the metrics. A sample the server still fails
    after its retries is invalid and dropped, never scored 0. None: no server."""
    train_split: str = "train"
    """Task file of the --tasks folder to train on (<split>.jsonl)."""
    val_split: str = "val"
    """Task file of the --tasks folder to validate on."""
    ray: RayParams = RayParams()
    """Actors and placement."""

    @model_validator(mode="before")
    @classmethod
    def _estimator_defaults(cls, data: Any) -> Any:
        """Fill the keys the user left out with the estimator's defaults (estimators.RECIPES)."""
        if not isinstance(data, dict):
            return data
        name = data.get("estimator", "grpo")
        if name not in ESTIMATOR_NAMES:
            return data  # the Literal check names the field and the allowed values
        found = recipe(name)
        data = dict(data)
        data.setdefault("clip_low", found.clip_low)
        data.setdefault("clip_high", found.clip_high)
        if not found.dynamic_sampling and isinstance(data.get("dynamic_sampling", {}), dict):
            data["dynamic_sampling"] = {"enabled": False, **(data.get("dynamic_sampling") or {})}
        if found.overlong and isinstance(data.get("overlong", {}), dict):
            overlong = dict(data.get("overlong") or {})
            overlong.setdefault("filter", True)
            overlong.setdefault("soft_punishment", True)
            data["overlong"] = overlong
        return data

    @model_validator(mode="before")
    @classmethod
    def _updates_in_upstream_units(cls, data: Any) -> Any:
        """mini_batches from samples_per_update or prompts_per_update, when one is given."""
        if not isinstance(data, dict):
            return data
        given = [name for name in ("samples_per_update", "prompts_per_update") if data.get(name) is not None]
        if not given:
            return data
        if len(given) > 1 or "mini_batches" in data:
            raise ValueError(f"{', '.join(given + (['mini_batches'] if 'mini_batches' in data else []))}: give the "
                             "optimiser steps one way")
        prompts = data.get("prompts_per_step", cls.model_fields["prompts_per_step"].default)
        samples = data.get("samples_per_prompt", cls.model_fields["samples_per_prompt"].default)
        per = data[given[0]]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (prompts, samples, per)):
            return data  # the fields' own checks name what is wrong
        total = prompts * samples if given[0] == "samples_per_update" else prompts
        if total % per:
            raise ValueError(f"{given[0]}: {per} does not divide the batch's {total}")
        return {**data, "mini_batches": total // per}

    @model_validator(mode="after")
    def _consistent(self) -> RLParams:
        if self.estimator != "ppo" and "critic" in self.model_fields_set:
            raise ValueError("critic: only estimator ppo trains a value model; remove the critic section or set estimator: ppo")
        if self.custom_reward and self.remote_reward is not None:
            raise ValueError("custom_reward, remote_reward: both replace the reward's total; keep one of them")
        if self.clip_high <= 0 and self.clip_low <= 0:
            raise ValueError("clip_low/clip_high: at least one clip range must be positive")
        if self.mini_batches > self.prompts_per_step * self.samples_per_prompt:
            raise ValueError("mini_batches: more mini-batches than sequences in a batch")
        if self.run_length == "passes" and self.epochs is None:
            raise ValueError("run_length: passes counts passes over the train split; set epochs")
        if self.epochs is not None and "steps" in self.model_fields_set:
            raise ValueError("steps, epochs: give the run's length one way (epochs derives the steps from the train split)")
        if self.lora.rank and self.learner_ranks > 1:
            raise ValueError("lora: adapters train in a single-process learner (one GPU or the CPU); set "
                             "ray.nodes x ray.gpus_per_node to 1, or lora.rank to 0 for the sharded learner")
        if self.overlap:
            if self.logprob_source != "rollout":
                raise ValueError("overlap: the batch is sampled one update behind, so the importance ratio must use the "
                                 "sampler's log-probs; set logprob_source: rollout")
            if self.recipe.greedy_baseline:
                raise ValueError("overlap: ReMax's greedy baseline must come from the sampling policy; set overlap: false")
            if self.ray.colocate:
                raise ValueError("overlap: colocated engines share the learner's weights, which change while they would "
                                 "generate; set ray.colocate: false or overlap: false")
        return self

    @property
    def aggregation(self) -> str:
        """The loss aggregation after resolving `auto`."""
        if self.loss_aggregation != "auto":
            return self.loss_aggregation
        return recipe(self.estimator).aggregation

    @property
    def recipe(self):  # -> estimators.Recipe
        """The estimator's parts (advantage, policy loss, critic, greedy baseline)."""
        return recipe(self.estimator)

    @property
    def learner_ranks(self) -> int:
        """Learner processes: one per GPU given to the learner, or one on CPU."""
        return max(1, self.ray.nodes * self.ray.gpus_per_node)
