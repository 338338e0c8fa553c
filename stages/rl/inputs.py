"""What an rl run reads, validated before any model loads: the params sections, the model and the task splits.

`read_inputs` checks every combination the stage cannot run (an engine without token ids, colocated modes
it does not support, sampling at temperature 0) and names the params file and field; the trainer gets an
`Inputs` with absolute paths, because Ray actors run in their node's working directory, not this one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loupe.config import ProtocolParams, RolloutParams, load_section, load_seed
from loupe.data.tasks import TaskRecord, read_tasks
from loupe.models.family import read_family
from stages.rl.cluster import absolute_params, absolute_path
from stages.rl.params import RLParams
from stages.rl.ttrl import unlabeled


@dataclass
class Inputs:
    """Everything a run reads, validated before any model loads."""

    seed: int
    params: RLParams
    protocol: ProtocolParams
    rollout: RolloutParams
    model_path: Path
    tasks_dir: Path
    train: list[TaskRecord]
    val: list[TaskRecord]
    vision_markers: frozenset[int] = frozenset()
    """Token ids of image/video markers: a trajectory whose model wrote one cannot be replayed (see _trainable)."""
    end_of_turn_id: int | None = None
    """The chat template's end-of-turn token (<|im_end|>), read when rl.cut_turn is `masked`: a last turn that does
    not end with it is untrained."""
    withheld_labels: dict[str, str] = field(default_factory=dict)
    """Test-time RL: each question's solution by doc_id, read by nothing but the pseudo-labels' accuracy figure
    (`ttrl/pseudo_label_accuracy`); the trainer's questions carry `UNLABELED`."""

    @property
    def max_turns(self) -> int:
        return self.params.max_turns or self.protocol.max_turns

    @property
    def generation_budget(self) -> int:
        """Most tokens one trajectory can generate (the token_sum normaliser's per-sequence constant)."""
        return self.rollout.max_new_tokens * self.max_turns


def read_inputs(params_path: Path, model_path: Path, tasks_dir: Path, section: str = "rl") -> Inputs:
    """`section`: the params section of RL settings (`rl`; a pipeline's earlier RL stage reads its own)."""
    seed = load_seed(params_path)
    params = absolute_params(load_section(RLParams, section, params_path))
    # Actors run in their node's working directory, not this one: they get absolute paths only.
    model_path, tasks_dir = absolute_path(model_path), absolute_path(tasks_dir)
    protocol = load_section(ProtocolParams, "protocol", params_path)
    rollout = load_section(RolloutParams, "rollout", params_path)
    updates: dict[str, Any] = {}
    if params.temperature is not None:
        updates["temperature"] = params.temperature
    if params.max_new_tokens is not None:
        updates["max_new_tokens"] = params.max_new_tokens
    rollout = rollout.model_copy(update=updates)
    if rollout.temperature <= 0:
        raise ValueError(f"{params_path}: rl.temperature: RL needs sampling (temperature > 0), got rollout.temperature 0")
    if rollout.engine == "openai":
        raise ValueError(f"{params_path}: rollout.engine: the openai engine keeps no token ids to train on; use transformers or vllm")
    if rollout.later_turn_temperature is not None and params.logprob_source != "recompute":
        raise ValueError(f"{params_path}: rollout.later_turn_temperature: later turns sample at another temperature than "
                         "the learner scores at, so the sampler's log-probs are not the old policy's; set "
                         f"{section}.logprob_source: recompute")
    if params.ray.colocate and rollout.engine == "transformers" and (params.ray.num_workers != 1 or params.learner_ranks != 1):
        raise ValueError(
            f"{params_path}: rl.ray.colocate: colocated mode runs one transformers engine on the learner's own module "
            f"(rl.ray.num_workers: 1, one learner rank); got {params.ray.num_workers} workers, "
            f"{params.learner_ranks} learner ranks"
        )
    if params.ray.colocate and rollout.engine == "vllm" and not (params.ray.enabled and params.learner_ranks == 1):
        raise ValueError(
            f"{params_path}: rl.ray.colocate: vLLM colocated with the learner runs as a Ray actor on a share of the "
            f"learner's GPU (rl.ray.enabled: true, gpus_per_worker below 1) beside one learner rank; got "
            f"{params.learner_ranks} learner ranks"
        )
    if not (Path(model_path) / "config.json").is_file():
        raise FileNotFoundError(f"{model_path}: not a Hugging Face model directory (no config.json)")
    train_file = Path(tasks_dir) / f"{params.train_split}.jsonl"
    train = read_tasks(train_file, check_images=True)
    if not train:
        raise ValueError(f"{train_file}: holds no task records; rl needs at least one training prompt")
    withheld: dict[str, str] = {}
    if params.ttrl.enabled:
        withheld = {task.doc_id: task.solution for task in train}
        train = unlabeled(train)  # test-time RL never trains on a label
    end_of_turn = None
    if params.cut_turn == "masked" or params.max_prompt_tokens is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
        end_of_turn = end_of_turn if isinstance(end_of_turn, int) and end_of_turn != tokenizer.unk_token_id else None
        if params.max_prompt_tokens is not None:
            train = prompts_within(train, tokenizer, protocol, params.max_prompt_tokens, train_file)
    if params.epochs is not None:
        per_pass = len(train) // params.prompts_per_step
        if per_pass == 0:
            raise ValueError(f"{params_path}: {section}.epochs: {train_file} holds {len(train)} prompts, fewer than one "
                             f"batch of prompts_per_step {params.prompts_per_step}")
        params = params.model_copy(update={"steps": params.epochs * per_pass})
    val: list[TaskRecord] = []
    if params.val_every:
        val_file = Path(tasks_dir) / f"{params.val_split}.jsonl"
        val = read_tasks(val_file, check_images=True)
        if not val:
            raise ValueError(f"{val_file}: holds no task records; set rl.val_every: 0 to train without validation")
        val = val[: params.val_prompts] if params.val_prompts else val
    markers = frozenset(read_family(model_path).marker_ids.values())  # stops here for a model Loupe cannot run
    return Inputs(seed, params, protocol, rollout, Path(model_path), Path(tasks_dir), train, val,
                  vision_markers=markers, withheld_labels=withheld, end_of_turn_id=end_of_turn)


def prompts_within(tasks: list[TaskRecord], tokenizer: Any, protocol_params: ProtocolParams, limit: int,
                   where: Path) -> list[TaskRecord]:
    """The tasks whose prompt (system and question turns through the chat template, each image one `<image>`, as
    verl counts them before its processor expands images) holds at most `limit` tokens; says how many went."""
    from loupe.protocol import make_protocol

    protocol = make_protocol(protocol_params)
    kept = []
    for task in tasks:
        messages = [{"role": "system", "content": protocol.task_system_prompt(task)},
                    {"role": "user", "content": protocol.question_text(task)}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # transformers 5 returns a BatchEncoding
        if len(ids) <= limit:
            kept.append(task)
    if len(kept) < len(tasks):
        print(f"rl: {len(tasks) - len(kept)} of {len(tasks)} train prompts in {where} are longer than "
              f"rl.max_prompt_tokens {limit} and are left out")
    if not kept:
        raise ValueError(f"{where}: every prompt is longer than rl.max_prompt_tokens {limit}")
    return kept
