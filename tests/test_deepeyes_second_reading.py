"""Issue 54's second reading of the DeepEyes preset against Visual-Agent/DeepEyes@6c5e796: each test writes
upstream's rule as its code runs it (a transcription in the test, with file and line) and puts Loupe's preset beside
it on an input where the two used to differ. docs/recipes.md's DeepEyes table has a row for each.

`tb2` = verl/workers/agent/envs/mm_process_engine/visual_toolbox_v2.py, `trainer` = verl/trainer/ppo/ray_trainer.py,
`rl_dataset` = verl/utils/dataset/rl_dataset.py.
"""

from __future__ import annotations

import json
from math import ceil, floor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image
from test_mini_o3_second_reading import _RecordingLearner, _sequence
from test_rollout_loop import ScriptedEngine

from loupe.config import ProtocolParams
from loupe.data.tasks import TaskRecord
from loupe.protocol import make_protocol
from loupe.rewards.deepeyes import decoded_response, deepeyes_crops
from loupe.rollout.loop import run_rollouts
from loupe.tools import ImageSession, crop, fit_to_budget
from loupe.trajectory import Trajectory
from pipelines.workspace import read_recipe
from stages.rl.params import RLParams
from stages.rl.trainer import Trainer

REPO = Path(__file__).resolve().parent.parent
PRESET = read_recipe(REPO, REPO / "params" / "deepeyes.yaml")
PROTOCOL = ProtocolParams.model_validate(PRESET["protocol"])
ANSWER = "<think>seen</think>\n<answer>red</answer>"


def _call(arguments: dict, name: str = "image_zoom_in_tool", **extra) -> str:
    return "<think>look</think>\n<tool_call>" + json.dumps({"name": name, "arguments": arguments, **extra}) + "</tool_call>"


# --- the call: tb2:26-100 -----------------------------------------------------------------------------------------


def test_keys_the_tool_does_not_read_are_ignored():
    """tb2:75-81: `tool_call["name"]`, `args["bbox_2d"]`; anything else in the JSON is never looked at (the
    README's own example call carries `image_path`)."""
    protocol = make_protocol(PROTOCOL)
    for turn in (_call({"bbox_2d": [10, 20, 300, 400], "image_path": "a.jpg"}),
                 _call({"bbox_2d": [10, 20, 300, 400], "label": "the sign"}, id=3)):
        action = protocol.parse(turn)
        assert action.call is not None and action.call.arguments["bbox_2d"] == [10, 20, 300, 400], action.error
    strict = make_protocol(PROTOCOL.model_copy(update={"turn_reading": "first_call"}))
    assert strict.parse(_call({"bbox_2d": [10, 20, 300, 400], "image_path": "a.jpg"})).error is not None


def _rollout(tmp_path: Path, turns: list[str], size: tuple[int, int] = (1000, 800), **protocol) -> Trajectory:
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(tmp_path / "scene.png")
    params = PROTOCOL.model_copy(update={"max_turns": 3, **protocol})
    task = TaskRecord(doc_id="t", images=["scene.png"], problem="What colour?", solution="red")
    [trajectory] = run_rollouts([task], ScriptedEngine([turns]), params, tmp_path, max_turns=3)
    return trajectory


def test_an_empty_last_call_ends_the_episode(tmp_path):
    """tb2:43-44,63-65: the last `<tool_call>(.*?)</tool_call>` is "" and `if not action:` ends it, scored as it
    stands; a blank one (a space) is not empty, fails json.loads and gets an error turn (tb2:66-72)."""
    empty = _rollout(tmp_path, ["<think>hm</think>\n<tool_call></tool_call>", ANSWER])
    assert empty.end_reason == "format_error" and empty.num_turns == 1
    blank = _rollout(tmp_path, ["<think>hm</think>\n<tool_call> </tool_call>", ANSWER])
    assert blank.end_reason == "answered" and blank.num_format_errors == 1


def upstream_box(box: list[float], width: int, height: int) -> list[int] | None:
    """tb2:129-164 (`maybe_resize_bbox`, `validate_bbox`) then tb2:87 (`Image.crop`, which rounds each coordinate
    half to even): the pixel box cut from the original, or None for "ZOOM IN ARGUMENTS ARE INVALID"."""
    def valid(left, top, right, bottom):
        if not (left < right and bottom > top):
            return False
        h, w = bottom - top, right - left
        return max(h, w) / min(h, w) <= 100 and min(h, w) > 30

    left, top, right, bottom = max(0, box[0]), max(0, box[1]), min(width, box[2]), min(height, box[3])
    if not valid(left, top, right, bottom):
        return None
    if bottom - top < 28 or right - left < 28:  # unreachable past the > 30 check; kept as written
        cx, cy = (left + right) / 2, (top + bottom) / 2
        ratio = 28 / min(bottom - top, right - left)
        hh, hw = ceil((bottom - top) * ratio * 0.5), ceil((right - left) * ratio * 0.5)
        left, right, top, bottom = floor(cx - hw), ceil(cx + hw), floor(cy - hh), ceil(cy + hh)
    return [round(v) for v in (left, top, right, bottom)]


BOXES = [
    [10.5, 10.5, 40.5, 40.5],      # 30.0 x 30.0: not above 30 (Loupe cut 31 x 31 before)
    [10.4, 10.4, 40.6, 40.6],      # 30.2: above 30, cut as PIL rounds: 10 .. 41
    [10.5, 20.5, 50.5, 60.5],      # halves round to even: 10, 20, 50, 60
    [-5, -7, 60.2, 45.7],          # clamped first
    [0, 0, 3200, 31.5],            # aspect 101.6: above 100 (Loupe allowed 200 before)
    [0, 0, 3100, 31.5],            # aspect 98.4
    [990, 790, 1200, 900],         # clamped to a 10 x 10 box: too small
]


@pytest.mark.parametrize("box", BOXES)
def test_a_box_is_checked_in_floats_and_cut_as_pil_rounds_it(box):
    rng = np.random.default_rng(1)
    original = Image.fromarray(rng.integers(0, 256, (800, 4000, 3), dtype=np.uint8))
    session = ImageSession(original=original, shown_original=original)
    result = crop(session, {"bbox_2d": box, "source": "original_image", "frame": "absolute"}, PROTOCOL.budget)
    expected = upstream_box(box, *original.size)
    if expected is None:
        assert not hasattr(result, "image"), (box, result)
        return
    assert list(result.region_px) == expected, (box, result)
    assert result.image.tobytes() == fit_to_budget(original.crop(expected), PROTOCOL.budget.for_crops()).tobytes()


def test_the_rotate_tool_turns_the_original_and_its_image_earns_the_tool_bonus(tmp_path):
    """tb2:90-95: `image_rotate_tool` gives the original turned by PIL's `Image.rotate(angle)` (same size, NEAREST,
    black corners) as the next observation, which vl_agent.py:260-261 counts as a vision block: the 1.2 bonus is
    within reach for a right answer after it. Loupe had no rotate tool in this grammar before issue 54."""
    trajectory = _rollout(tmp_path, [_call({"angle": 90}, name="image_rotate_tool"), ANSWER], size=(400, 300))
    assert trajectory.end_reason == "answered" and trajectory.num_format_errors == 0
    [shown] = [turn for turn in trajectory.turns if turn.tool is not None]
    original = Image.open(tmp_path / "scene.png").convert("RGB")
    expected = fit_to_budget(original.rotate(90), PROTOCOL.budget.for_crops())
    assert trajectory.pending[shown.images[0]].tobytes() == expected.tobytes()
    response = decoded_response([(t.role, t.text, True) for t in trajectory.turns[1:]])
    assert deepeyes_crops(response) == 1


def test_a_rotate_call_the_protocol_can_make_renders_as_the_tool_it_reads_back():
    """`can_call("rotate")` under DeepEyes' reading: the call the teacher's oracle would write is image_rotate_tool's
    JSON, and it parses back to the same rotation."""
    protocol = make_protocol(PROTOCOL)
    assert protocol.can_call("rotate")
    action = protocol.parse("<think>turn</think><tool_call>" + json.dumps(
        {"name": "image_rotate_tool", "arguments": {"angle": 450}}) + "</tool_call>")
    text = protocol.render_call("turn", action.call)
    assert '"name": "image_rotate_tool"' in text and protocol.parse(text).call == action.call


# --- training: trainer:1023-1030, dp_actor.py:302-306,381, rl_dataset.py:110-147 -----------------------------------


class _FlakyReward:
    """A reward service whose first call fails one trajectory's judge; every call scores the whole batch anew."""

    def __init__(self):
        self.calls = 0

    def score(self, trajectories):
        self.calls += 1
        return [{"total": 1.0, "valid": not (self.calls == 1 and k == 0)} for k, _ in enumerate(trajectories)]


def test_a_judge_failure_scores_the_whole_batch_again_once():
    """trainer:1023-1030: `reward_fn(batch)` raising is caught and `reward_fn(batch)` called again on the whole
    batch; here the second call succeeds, so every trajectory trains on its second score."""
    trainer = Trainer.__new__(Trainer)
    trainer.params = RLParams(rescore_invalid=True, ray={"enabled": False})
    trainer.ttrl, trainer.pixelis, trainer.reward = None, None, _FlakyReward()
    trajectories = [Trajectory(traj_id=str(k), task={}, protocol="deepeyes", system="") for k in range(4)]
    timing = {"rollout": 0.0, "generated_tokens": 0.0, "reward": 0.0}
    trainer._scored(trajectories, 0, 0.0, timing, 2)
    assert trainer.reward.calls == 2 and timing["rescored_batches"] == 1
    assert all(t.rewards["valid"] for t in trajectories)
    trainer.params, trainer.reward = RLParams(ray={"enabled": False}), _FlakyReward()
    trainer._scored(trajectories, 0, 0.0, timing, 2)
    assert trainer.reward.calls == 1 and not trajectories[0].rewards["valid"]


def test_the_token_mean_runs_per_micro_batch_as_verls_actor_runs_it(tiny_model_dir):
    """sh:33 and dp_actor.py:302-306,381: micro-batches of 4 sequences, each its own token mean divided by the
    accumulation count. Ten rows of 3 tokens: micro-batches of 4, 4 and 2 rows, each divided by its tokens x 3."""
    rows = [_sequence([7, 8], 151645) for _ in range(10)]
    micro = _RecordingLearner(tiny_model_dir, micro_batch_size=4, loss_aggregation="micro_token_mean")
    micro.learner.update(rows)
    assert micro.calls == [(4, 12.0 * 3), (4, 12.0 * 3), (2, 6.0 * 3)]
    whole = _RecordingLearner(tiny_model_dir, micro_batch_size=4, loss_aggregation="token_mean")
    whole.learner.update(rows)
    assert whole.calls == [(4, 30.0), (4, 30.0), (2, 30.0)]
    assert PRESET["rl"]["loss_aggregation"] == "micro_token_mean" and PRESET["rl"]["micro_batch_size"] == 4


def test_an_imported_row_is_prompted_as_verls_dataset_prompts_it(tiny_model_dir, tmp_path):
    """rl_dataset.py:134-147,157-177: the row's `prompt` messages through the processor's chat template, each
    `<image>` an image part, then the processor expands the image; Loupe's engine builds the same token ids from the
    imported record (`protocol.record_prompts`)."""
    from published_data import deepeyes_row, questions, write_deepeyes
    from transformers import AutoProcessor

    from loupe.config import RolloutParams
    from loupe.data.recipe_formats import import_tasks
    from loupe.data.tasks import read_tasks
    from loupe.rollout import make_engine

    [question] = questions(1)
    row = deepeyes_row(question, 0)
    parquet = write_deepeyes(tmp_path / "data" / "data_v0.8_visual_toolbox_v2.parquet", [row])
    import_tasks("deepeyes", {"train": [parquet]}, tmp_path / "tasks")
    [task] = read_tasks(tmp_path / "tasks" / "train.jsonl")
    image = Image.open(tmp_path / "tasks" / task.images[0]).convert("RGB")
    params = PROTOCOL.model_copy(update={"min_pixels": 3136, "max_pixels": 50176})  # the tiny model's processor's
    shown = fit_to_budget(image, params.budget)

    processor = AutoProcessor.from_pretrained(str(tiny_model_dir))
    messages = [{"role": m["role"], "content": [{"type": "image"} if part == "<image>" else {"type": "text", "text": part}
                                                for part in _split_images(m["content"])]} for m in row["prompt"]]
    raw_prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    upstream_ids = processor(text=[raw_prompt], images=[shown], return_tensors="pt")["input_ids"][0].tolist()

    engine = make_engine(RolloutParams(device="cpu"), params, str(tiny_model_dir))
    protocol = make_protocol(params)
    state = engine.begin(protocol.task_system_prompt(task), protocol.question_text(task), [shown])
    assert engine.trace(state).input_ids == upstream_ids


def _split_images(text: str) -> list[str]:
    """rl_dataset.py:140-147: the content split on `<image>`, the placeholders kept, empty pieces dropped."""
    import re

    return [part for part in re.split("(<image>)", text) if part]


def test_a_turn_is_capped_where_vllms_context_ends():
    """vllm_rollout_spmd.py:146: `max_model_len=32768`, so a late turn stops there within its 10,240 tokens."""
    assert PRESET["protocol"]["model_len"] == 32768
    rollout = SimpleNamespace(protocol_params=PROTOCOL, max_new_tokens=10240,
                              engine=SimpleNamespace(context_length=lambda state: 30000))
    from loupe.rollout.loop import Rollout

    assert Rollout.turn_tokens(rollout, SimpleNamespace(state=None)) == 2768
