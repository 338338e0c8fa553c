"""DeepEyes' RL set (Visual-Agent/DeepEyes @ 6c5e796; ChenShawn/DeepEyes-Datasets-47k: three verl parquet files,
`data_0.1.2_visual_toolbox_v2.parquet`, `data_v0.8_visual_toolbox_v2.parquet`, `data_thinklite_reasoning_acc.parquet`,
which `examples/agent/final_merged_v1v8_thinklite.sh:10-14,20` trains on together).

What upstream reads of a row, and where it lands in the task record:
- `prompt`, a chat list: `verl/utils/dataset/rl_dataset.py` (`RLHFDataset._build_messages`, lines 134-147) splits
  each message's text on `<image>` and the processor's chat template renders the list, system message
  included. Kept verbatim as the record's `system` and `prompt` (the user message), which the protocol shows
  as they are (`protocol.record_prompts`).
- `images`, a list of `{"bytes": ...}` (`rl_dataset.py:158-163`, `vision_utils.process_raw_image`): written out.
- `data_source`: the reward manager's dispatch key (`verl/workers/reward_manager/naive.py:74-78`,
  `verl/utils/reward_score/__init__.py:64-77`): kept per row, so `rl.reward.by_data_source` picks the judge.
- `reward_model.ground_truth`: the reference (`naive.py:72`): the record's `solution`.
- `extra_info`: handed to the scorer (`naive.py:76`); its `question` is what the judge is asked
  (`vl_agent.py:219,306,411`): the record's `problem` (what Loupe's judge reads), and `extra_info` is kept whole
  for a custom verl reward. `extra_info.index` is the row's id (`rl_dataset.py:247`): the record's `source_id`.
- `env_name` (`actor_rollout_ref.rollout.agent.tool_name_key`, sh:54): the tool the row may call; empty or
  null for a row without tools (`parallel_env.py:474-495`): the record's `tools` flag. Loupe's `deepeyes`
  protocol is `visual_toolbox_v2`'s zoom; a row naming another of DeepEyes' environments is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from loupe.data.published.rows import ImageFinder, RawTask, RecipeFormatError, answer_text, get, image_value, rows
from loupe.data.tasks import IMAGE_PLACEHOLDER

ZOOM_ENVIRONMENTS = ("visual_toolbox_v2",)
"""`env_name` values whose tool Loupe's `deepeyes` protocol is (visual_toolbox_v2.py:14)."""


def read_deepeyes(path: Path, image_dir: Path | None = None) -> Iterator[RawTask]:
    finder = ImageFinder(path, image_dir)
    for number, row in rows(path):
        messages = get(path, number, row, "prompt", (list,))
        system, user = _messages(path, number, messages)
        cells = row.get("images") or []
        if not isinstance(cells, list):
            raise RecipeFormatError(f"{path}:{number}: field 'images' is {type(cells).__name__}, expected a list")
        images = [image_value(finder, number, f"images.{k}", cell) for k, cell in enumerate(cells)]
        if user.count(IMAGE_PLACEHOLDER) != len(images):
            raise RecipeFormatError(f"{path}:{number}: field 'prompt': the user message holds "
                                    f"{user.count(IMAGE_PLACEHOLDER)} {IMAGE_PLACEHOLDER} for {len(images)} images")
        extra_info = get(path, number, row, "extra_info", (dict,))
        question = get(path, number, row, "extra_info.question").strip()
        if not question:
            raise RecipeFormatError(f"{path}:{number}: field 'extra_info.question' is empty")
        env_name = get(path, number, row, "env_name", required=False) or ""
        if env_name and env_name not in ZOOM_ENVIRONMENTS:
            raise RecipeFormatError(f"{path}:{number}: field 'env_name': {env_name!r} is a DeepEyes environment "
                                    f"Loupe does not have (its deepeyes protocol is {', '.join(ZOOM_ENVIRONMENTS)}; "
                                    "empty: no tool)")
        index = extra_info.get("index")
        extra = {"prompt": user, "tools": bool(env_name), "extra_info": extra_info}
        if system is not None:
            extra["system"] = system
        yield RawTask(question.replace(IMAGE_PLACEHOLDER, "").strip() or question,
                      answer_text(path, number, row, "reward_model.ground_truth"), images,
                      data_source=get(path, number, row, "data_source"),
                      source_id=None if index is None else str(index), extra=extra)


def _messages(path: Path, number: int, messages: list) -> tuple[str | None, str]:
    """(system text or None, the user message's text) of a row's `prompt`."""
    system, user = None, None
    for k, message in enumerate(messages):
        where = f"{path}:{number}: field 'prompt.{k}'"
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise RecipeFormatError(f"{where}: expected {{'role': ..., 'content': text}}")
        role = message.get("role")
        if role == "system" and system is None and user is None:
            system = message["content"]
        elif role == "user" and user is None:
            user = message["content"]
        else:
            raise RecipeFormatError(f"{where}: role {role!r}: a DeepEyes prompt is an optional system message, "
                                    "then one user message")
    if user is None or not user.strip():
        raise RecipeFormatError(f"{path}:{number}: field 'prompt' holds no user message")
    return system, user
