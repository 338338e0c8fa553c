"""Operation tasks (loupe.data.operation_tasks): each is answered by the operation its record names, not by a
glance; the oracle teacher writes Pixelis-dialogue trajectories with those operations; a mixed task set moves
video folders with their records."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from loupe.config import ProtocolParams
from loupe.data.families import DataParams, generate_family
from loupe.data.operation_tasks import OperationTaskConfig, generate_operation_tasks, make_operation_task
from loupe.data.tasks import chance_rate, read_tasks
from loupe.protocol import ToolCall, get_protocol
from loupe.rewards import RewardConfig, score_trajectory
from loupe.rollout import run_rollouts
from loupe.tools import ImageSession, PixelBudget, run_tool
from loupe.video import read_clip
from stages.synth.oracle import OracleEngine, OracleError
from stages.synth.params import OracleParams

BUDGET = PixelBudget(min_pixels=3136, max_pixels=12544)
"""The tiny model's view (112 x 112)."""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("operations") / "tasks"
    generate_operation_tasks(out, OperationTaskConfig(train=18, val=0, test=6))
    return out


def _answer_by_operation(record, root: Path) -> tuple[str | None, str]:
    """What the named operation gives for the record's box: (the answer it reads, its result text)."""
    if record.video is not None:
        session = ImageSession(frames=read_clip(record.video, root))
        result = run_tool(ToolCall("track_object", {"bbox_2d": record.bbox}), session, BUDGET)
        return result.record["movement"].split()[1], result.text
    session = ImageSession(original=Image.open(root / record.images[0]).convert("RGB"))
    if record.operation == "read_text":
        result = run_tool(ToolCall("read_text", {"bbox_2d": record.bbox}), session, BUDGET)
        return (result.record["lines"][0]["text"] if len(result.record["lines"]) == 1 else None), result.text
    x0, y0, x1, y1 = record.bbox
    run_tool(ToolCall("segment_at", {"point": [(x0 + x1) / 2, (y0 + y1) / 2]}), session, BUDGET)
    result = run_tool(ToolCall("get_properties", {"mask": "mask_1"}), session, BUDGET)
    return result.record["shape"], result.text


def test_every_task_is_answered_by_the_operation_it_names(task_dir):
    records = read_tasks(task_dir / "train.jsonl") + read_tasks(task_dir / "test.jsonl")
    assert Counter(r.operation for r in records) == {"read_text": 8, "segment_at": 8, "track_object": 8}
    for record in records:
        answer, text = _answer_by_operation(record, task_dir)
        assert answer == record.solution, (record.doc_id, record.problem, text)


def test_the_decoys_give_other_answers_so_the_named_cell_matters(task_dir):
    for record in read_tasks(task_dir / "train.jsonl"):
        if record.operation != "read_text":
            continue
        session = ImageSession(original=Image.open(task_dir / record.images[0]).convert("RGB"))
        words = []
        for cell in range(3):  # each cell's box holds one sign
            box = [cell / 3 + 1 / 6 - 0.1, 0.4, cell / 3 + 1 / 6 + 0.1, 0.6]
            lines = run_tool(ToolCall("read_text", {"bbox_2d": box}), session, BUDGET).record["lines"]
            words += [line["text"] for line in lines]
        assert len(words) == 3 and len(set(words)) == 3 and record.solution in words, words


def test_a_sign_is_illegible_and_a_shape_tiny_at_the_models_view():
    cfg = OperationTaskConfig()
    for index in (0, 1):  # a sign task, a shape task
        record, canvas = make_operation_task(cfg, "train", index)
        scale = (BUDGET.max_pixels / (canvas.width * canvas.height)) ** 0.5
        side = (record.bbox[3] - record.bbox[1]) * canvas.height * scale
        if record.operation == "read_text":
            assert cfg.text_height[1] * min(canvas.size) * scale < 2.5  # letters about two pixels high
        else:
            assert side < 6  # the shape: a few pixels across


def test_answers_are_balanced_per_kind_and_the_chance_rate_is_per_kind():
    cfg = OperationTaskConfig(train=36, val=0, test=0)
    records = [make_operation_task(cfg, "train", i)[0] for i in range(cfg.train)]
    by_kind = Counter((r.category, r.solution) for r in records)
    assert by_kind[("operations/sign", "EXIT")] == 3 and by_kind[("operations/shape", "circle")] == 4
    assert by_kind[("operations/motion", "up")] == 3
    # Best guess per kind: 3 of 12 signs, 4 of 12 shapes, 3 of 12 motions.
    assert chance_rate(records) == pytest.approx((3 + 4 + 3) / 36)


def test_the_same_config_draws_the_same_task_and_another_seed_another():
    cfg = OperationTaskConfig()
    a, image_a = make_operation_task(cfg, "val", 4)
    b, image_b = make_operation_task(cfg, "val", 4)
    c, image_c = make_operation_task(cfg.model_copy(update={"seed": 3}), "val", 4)
    assert a == b and image_a.tobytes() == image_b.tobytes()
    assert image_a.tobytes() != image_c.tobytes()


@pytest.mark.parametrize("update, field", [
    ({"words": ("EXIT", "EXIT", "STOP")}, "words"),
    ({"shapes": ("circle", "square")}, "shapes"),
    ({"words": ("EMERGENCY", "OPEN", "STOP")}, "words"),
    ({"view_side": 0.05}, "view_side"),
    ({"text_height": (0.03, 0.02)}, "text_height"),
])
def test_a_bad_knob_is_named(update, field):
    with pytest.raises(ValueError, match=field):
        OperationTaskConfig(**update)


def _oracle(records, root, protocol_name="pixelis"):
    protocol = get_protocol(protocol_name)
    engine = OracleEngine(OracleParams(plain_wording=True), protocol, seed=0, max_turns=4)
    engine.prepare(records, 1, root)
    return engine, run_rollouts(records, engine, ProtocolParams(name=protocol_name, max_pixels=12544, min_crop_side=1),
                                root, samples_per_task=1, max_new_tokens=96)


def test_the_oracle_answers_each_kind_with_its_operations_in_pixelis_dialogue(task_dir):
    records = read_tasks(task_dir / "test.jsonl")
    engine, trajectories = _oracle(records, task_dir)
    calls = {}
    for trajectory in trajectories:
        assert trajectory.end_reason == "answered" and trajectory.num_format_errors == 0, trajectory.traj_id
        assert score_trajectory(trajectory, RewardConfig()).accuracy == 1.0, trajectory.traj_id
        assert engine.patterns[(trajectory.task["doc_id"], 0)] == "operate"
        names = [turn.tool["tool"] for turn in trajectory.turns if turn.tool]
        calls[trajectory.task["category"]] = names
        assistant = [turn.text for turn in trajectory.turns if turn.role == "assistant"]
        assert all(len(text) < 96 * 2.5 for text in assistant)
    assert calls == {"operations/sign": ["read_text"], "operations/shape": ["segment_at", "get_properties"],
                     "operations/motion": ["track_object"]}
    motion = next(t for t in trajectories if t.task["category"] == "operations/motion")
    assert "TRACK_OBJECT(" in motion.turns[1].text and "overall: moved" in motion.turns[2].text


def test_the_oracle_refuses_operation_tasks_in_a_grammar_without_those_calls(task_dir):
    records = read_tasks(task_dir / "test.jsonl")
    with pytest.raises(OracleError, match="mini_o3 protocol has no grammar"):
        OracleEngine(OracleParams(), get_protocol("mini_o3"), seed=0, max_turns=4).prepare(records, 1, task_dir)


def test_a_mixed_set_moves_each_video_folder_with_its_record(tmp_path):
    params = DataParams(family="mixed", mixed=["zoom", "operations"],
                        zoom={"train": 2, "val": 0, "test": 0},
                        operations={"train": 3, "val": 0, "test": 0})
    generate_family(tmp_path / "tasks", params)
    records = read_tasks(tmp_path / "tasks" / "train.jsonl")
    assert [r.data_source for r in records] == ["zoom", "operations", "zoom", "operations", "operations"]
    video = next(r for r in records if r.video)
    assert video.video.startswith("images/operations/")
    assert len(read_clip(video.video, tmp_path / "tasks")) == 8
