"""The zoom-task generator: deterministic, valid records, a known chance rate, and an answer that is legible
only after zooming (a few pixels at the downscaled view, many in the crop the oracle teacher takes)."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from loupe.config import ProtocolParams
from loupe.data.synthetic_draw import PALETTE
from loupe.data.splits import SPLITS
from loupe.data.tasks import TaskRecord, chance_rate, read_tasks
from loupe.data.zoom_tasks import CELL_NAMES, ZoomTaskConfig, draw_zoom_task, generate_zoom_tasks, inner_box
from loupe.protocol import get_protocol
from loupe.rewards import RewardConfig, score_trajectory
from loupe.rollout import run_rollouts
from loupe.tools import PixelBudget, smart_resize
from stages.synth.oracle import OracleEngine
from stages.synth.params import OracleParams

PROTOCOL = ProtocolParams()
TINY_MODEL = Path(__file__).resolve().parents[1] / "assets" / "tiny-model"
SMALL = dict(train=6, val=2, test=4, canvas_side=(1024, 1152))


def tree_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("zoom") / "tasks"
    generate_zoom_tasks(out, ZoomTaskConfig(seed=5, **SMALL))
    return out


def test_same_seed_same_bytes_other_seed_other_canvases(generated, tmp_path):
    again = tmp_path / "again"
    generate_zoom_tasks(again, ZoomTaskConfig(seed=5, **SMALL))
    assert tree_bytes(again) == tree_bytes(generated)
    other = tmp_path / "other"
    generate_zoom_tasks(other, ZoomTaskConfig(seed=6, **SMALL))
    assert tree_bytes(other)["images/train/000000.png"] != tree_bytes(generated)["images/train/000000.png"]


def test_workers_do_not_change_the_output(generated, tmp_path):
    parallel = tmp_path / "parallel"  # the data stage draws with one process per core
    generate_zoom_tasks(parallel, ZoomTaskConfig(seed=5, **SMALL), workers=2)
    assert tree_bytes(parallel) == tree_bytes(generated)


def test_records_validate_and_point_at_their_images(generated):
    seen = set()
    for split in SPLITS:
        records = read_tasks(generated / f"{split}.jsonl", check_images=True)
        assert len(records) == ZoomTaskConfig(**SMALL).split_size(split)
        for record in records:
            assert isinstance(record, TaskRecord) and record.doc_id not in seen
            seen.add(record.doc_id)
            assert record.solution in ZoomTaskConfig().colours and not record.is_choice
            assert record.bbox is not None and record.category in ("zoom/single", "zoom/multi")


def test_choice_questions_offer_the_answer_among_distinct_colours():
    cfg = ZoomTaskConfig(answer_format="choice", colours=("red", "green", "blue", "yellow", "pink"), option_count=3,
                         marker_colours=("black", "white", "purple", "orange"))
    for index in range(20):
        record, _, layout = draw_zoom_task(cfg, "train", index)
        assert len(record.options) == 3 == len(set(record.options))
        assert record.answer_text() == layout["answer"]
    records = [draw_zoom_task(cfg, "test", i)[0] for i in range(10)]
    assert chance_rate(records) == pytest.approx(1 / 3)


def test_balanced_answers_give_a_chance_rate_of_one_over_the_colours():
    cfg = ZoomTaskConfig()
    records = [draw_zoom_task(cfg, "test", i)[0] for i in range(40)]
    assert Counter(r.solution for r in records) == {c: 10 for c in cfg.colours}
    assert chance_rate(records) == pytest.approx(0.25)
    unbalanced = [draw_zoom_task(cfg.model_copy(update={"balanced_answers": False}), "test", i)[0] for i in range(40)]
    assert chance_rate(unbalanced) == max(Counter(r.solution for r in unbalanced).values()) / 40


def test_the_question_names_the_cell_and_the_view_box_holds_the_frame_there():
    cfg = ZoomTaskConfig()
    boxes: dict[str, set[tuple[float, ...]]] = {}
    for index in range(40):
        record, image, layout = draw_zoom_task(cfg, "train", index)
        cell = next(name for name in CELL_NAMES[cfg.grid_shape] if f" the {name} of the image" in record.problem)
        boxes.setdefault(cell, set()).add(tuple(record.bbox))
        x0, y0, x1, y1 = record.bbox
        fx0, fy0, fx1, fy1 = layout["frames"][0]
        assert x0 * image.width <= fx0 and fx1 <= x1 * image.width and y0 * image.height <= fy0 and fy1 <= y1 * image.height
        assert x1 - x0 == pytest.approx(cfg.view_side) and y1 - y0 == pytest.approx(cfg.view_side)
    assert all(len(b) == 1 for b in boxes.values())  # one box per cell: where to zoom follows from the words
    assert len(boxes) == cfg.grid_shape[0] * cfg.grid_shape[1]


def test_without_the_hint_the_question_does_not_say_where():
    cfg = ZoomTaskConfig(location_hint=False, bbox_target="marker")
    record, _, _ = draw_zoom_task(cfg, "train", 0)
    assert not any(name in record.problem for names in CELL_NAMES.values() for name in names)


def test_the_patch_is_drawn_in_its_colour_inside_the_named_frame():
    cfg = ZoomTaskConfig(markers=(2, 4), grid=2, grid_rows=None)
    for index in range(12):
        record, image, layout = draw_zoom_task(cfg, "train", index)
        pixels = np.asarray(image)
        x0, y0, x1, y1 = layout["patches"][0]
        assert (pixels[y0:y1, x0:x1] == PALETTE[layout["answer"]]).all()
        fx0, fy0, fx1, fy1 = layout["frames"][0]
        assert fx0 < x0 and x1 < fx1 and fy0 < y0 and y1 < fy1
        assert f"inside the {layout['frame_colours'][0]} frame" in record.problem
        assert len(set(layout["frame_colours"])) == len(layout["frames"])  # the named frame is the only one


BUDGET = PixelBudget(min_pixels=3136, max_pixels=12544)  # params.yaml's protocol budget for the tiny model


def test_the_answer_is_a_few_pixels_at_the_first_view_and_large_in_the_oracles_zoom():
    cfg = ZoomTaskConfig()
    for index in range(30):
        record, image, layout = draw_zoom_task(cfg, "test", index)
        height, width = smart_resize(image.height, image.width, BUDGET)
        x0, _, x1, _ = layout["patches"][0]
        at_view = (x1 - x0) * width / image.width
        assert at_view < 5  # a fifth of a 28 px vision token: unreadable at the first view (docs/learning.md)
        bx0, by0, bx1, by1 = record.bbox  # the oracle's direct zoom with close_margin 0 crops exactly this
        crop_w, crop_h = (bx1 - bx0) * image.width, (by1 - by0) * image.height
        _, shown_w = smart_resize(round(crop_h), round(crop_w), BUDGET)
        in_crop = (x1 - x0) * shown_w / crop_w
        assert in_crop >= 28 and in_crop >= 6 * at_view, (index, in_crop, at_view)


def test_decoys_hold_answer_colours_and_stay_clear_of_the_frames():
    cfg = ZoomTaskConfig(decoys=(10, 10), markers=(2, 2))
    for index in range(6):
        _, image, layout = draw_zoom_task(cfg, "val", index)
        pixels = np.asarray(image)
        assert len(layout["decoys"]) >= 5
        for x0, y0, x1, y1 in layout["decoys"]:
            colour = tuple(int(v) for v in pixels[(y0 + y1) // 2, (x0 + x1) // 2])
            assert colour in {PALETTE[c] for c in cfg.colours}
            for fx0, fy0, fx1, fy1 in layout["frames"]:
                assert x1 <= fx0 or fx1 <= x0 or y1 <= fy0 or fy1 <= y0


def test_the_oracle_teacher_answers_right_through_the_loop(generated):
    tasks = read_tasks(generated / "train.jsonl", check_images=True)
    engine = OracleEngine(OracleParams(), get_protocol("mini_o3"), seed=0, max_turns=6)
    engine.prepare(tasks, 2)
    trajectories = run_rollouts(tasks, engine, PROTOCOL, generated, samples_per_task=2, max_new_tokens=96)
    assert len(trajectories) == 2 * len(tasks)
    for trajectory in trajectories:
        assert trajectory.end_reason == "answered" and trajectory.num_tool_calls >= 1
        assert score_trajectory(trajectory, RewardConfig()).accuracy == 1.0


@pytest.mark.parametrize("bad, field", [
    (dict(colours=("red",)), "colours"),
    (dict(colours=("red", "black")), "marker_colours"),
    (dict(colours=("red", "red", "blue")), "colours"),
    (dict(patch_size=(0.01, 0.08)), "patch_size"),
    (dict(markers=(3, 2)), "markers"),
    (dict(grid=2, grid_rows=None, markers=(5, 5)), "grid"),
    (dict(grid=3, markers=(4, 4)), "grid"),
    (dict(colour_count=4), "colour_count"),
    (dict(grid=4, markers=(1, 1)), "location_hint"),
    (dict(view_side=0.05), "view_side"),
    (dict(grid=None, location_hint=False), "bbox_target"),
    (dict(pointers=True, grid=2, grid_rows=2, markers=(1, 1)), "pointers"),
    (dict(pointers=True, pointer_colours=("purple", "orange", "red")), "pointer_colours"),
    (dict(pointers=True, marker_colours=("black", "purple", "orange", "pink")), "marker_colours"),
    (dict(depth=2, markers=(1, 2)), "depth"),
    (dict(depth=2, bbox_target="marker"), "depth"),
    (dict(depth=2, view_side=0.16, inner_view_side=0.05), "inner_view_side"),
    (dict(depth=2, inner_patch_size=(0.007, 0.006)), "inner_patch_size"),
])
def test_bad_configs_are_refused_by_name(bad, field):
    with pytest.raises(ValidationError, match=field):
        ZoomTaskConfig(**bad)


def test_a_folder_of_other_files_is_not_replaced(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        generate_zoom_tasks(tmp_path, ZoomTaskConfig(**SMALL))
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_layout_geometry_is_consistent_for_free_placement():
    cfg = ZoomTaskConfig(grid=None, markers=(3, 3), location_hint=False, bbox_target="marker")
    for index in range(8):
        record, image, layout = draw_zoom_task(cfg, "train", index)
        boxes = layout["frames"]
        for i, a in enumerate(boxes):
            assert 0 <= a[0] and a[2] <= image.width and 0 <= a[1] and a[3] <= image.height
            for b in boxes[i + 1:]:
                assert a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1]
        x0, y0, x1, y1 = record.bbox
        px = layout["patches"][0] if cfg.bbox_target == "patch" else layout["frames"][0]
        assert math.floor(x0 * image.width) <= px[0] and math.ceil(x1 * image.width) >= px[2]


def _inside(box_px, box_rel, image) -> bool:
    x0, y0, x1, y1 = box_px
    bx0, by0, bx1, by1 = box_rel
    return (bx0 * image.width <= x0 and x1 <= bx1 * image.width and by0 * image.height <= y0
            and y1 <= by1 * image.height)


def test_a_pointer_task_points_from_the_named_frame_to_the_answer():
    cfg = ZoomTaskConfig(pointers=True)
    targets = Counter()
    for index in range(24):
        record, image, layout = draw_zoom_task(cfg, "train", index)
        pixels = np.asarray(image)
        named, target = layout["named"], layout["target"]
        other = ({0, 1, 2} - {named, target}).pop()
        colour = lambda cell: tuple(int(v) for v in pixels[(layout["patches"][cell][1] + layout["patches"][cell][3]) // 2,
                                                            (layout["patches"][cell][0] + layout["patches"][cell][2]) // 2])  # noqa: E731
        assert colour(named) == PALETTE[cfg.pointer_colours[target]]  # the pointer's colour names the target's cell
        assert colour(target) == PALETTE[record.solution]
        assert colour(other) in {PALETTE[c] for c in cfg.colours} and colour(other) != PALETTE[record.solution]
        assert f" {CELL_NAMES[(1, 3)][named]} of the image points to" in record.problem
        assert _inside(layout["frames"][named], record.waypoints[0].bbox, image)  # the first look: the pointer
        assert _inside(layout["frames"][target], record.bbox, image)  # the second: the answer
        assert cfg.pointer_colours[target] in record.waypoints[0].seen
        assert not set(layout["frame_colours"]) & set(cfg.pointer_colours)
        targets[target - named] += 1
    assert set(targets) == {-2, -1, 1, 2}  # every direction occurs


def test_the_oracle_follows_the_pointer_in_three_turns(tmp_path):
    out = tmp_path / "tasks"
    generate_zoom_tasks(out, ZoomTaskConfig(pointers=True, train=6, val=0, test=0))
    tasks = read_tasks(out / "train.jsonl")
    engine = OracleEngine(OracleParams(patterns={"direct": 1.0}), get_protocol("mini_o3"), seed=0, max_turns=4)
    engine.prepare(tasks, 1)
    for trajectory in run_rollouts(tasks, engine, PROTOCOL, out, samples_per_task=1, max_new_tokens=96):
        assert trajectory.end_reason == "answered" and trajectory.num_tool_calls == 2
        assert score_trajectory(trajectory, RewardConfig()).accuracy == 1.0
        calls = [t.call["arguments"]["bbox_2d"] for t in trajectory.turns if t.call]
        assert calls == [trajectory.task["waypoints"][0]["bbox"], trajectory.task["bbox"]]
        assert "pointer: the answer is" in trajectory.turns[3].text


DEPTH_2 = dict(depth=2, view_side=0.16)


def _shown_side(box_px, region_rel, image) -> float:
    """Pixels of a box's width when `region_rel` of the image is cropped and resized into the model's budget."""
    crop_w, crop_h = (region_rel[2] - region_rel[0]) * image.width, (region_rel[3] - region_rel[1]) * image.height
    _, shown_w = smart_resize(round(crop_h), round(crop_w), BUDGET)
    return (box_px[2] - box_px[0]) * shown_w / crop_w


def test_at_depth_2_the_answer_is_legible_only_in_a_zoom_into_the_first_zoom():
    cfg = ZoomTaskConfig(**DEPTH_2)
    for index in range(30):
        record, image, layout = draw_zoom_task(cfg, "train", index)
        patch, frame = layout["patches"][0], layout["frames"][0]
        first = record.waypoints[0].bbox
        assert _inside(frame, first, image) and _inside(patch, record.bbox, image)
        assert all(a <= b for a, b in zip(first[:2], record.bbox[:2])) and all(
            a >= b for a, b in zip(first[2:], record.bbox[2:]))  # the second look lies inside the first
        assert _shown_side(patch, first, image) < 5  # a few pixels in the first zoom, as the depth-1 patch at the view
        assert _shown_side(patch, record.bbox, image) >= 14  # a quarter of the second zoom or more
        assert tuple(int(v) for v in np.asarray(image)[(patch[1] + patch[3]) // 2, (patch[0] + patch[2]) // 2]) == \
            PALETTE[record.solution]
        decoy = layout["decoys"][0]
        assert decoy[2] - decoy[0] > 3 * (patch[2] - patch[0])  # decoys keep their size: the overview's colours say nothing
        assert record.category == "zoom/nested"


def test_depth_1_canvases_do_not_change_with_the_depth_knobs():
    for index in range(3):
        _, plain, _ = draw_zoom_task(ZoomTaskConfig(), "test", index)
        _, same, _ = draw_zoom_task(ZoomTaskConfig(inner_patch_size=(0.001, 0.002), inner_view_side=0.5), "test", index)
        assert plain.tobytes() == same.tobytes()


def depth_2_oracle_trajectories(tmp_path, **oracle):
    """The oracle's `direct` trajectories, plain wording, on six depth-2 training tasks."""
    out = tmp_path / "tasks"
    generate_zoom_tasks(out, ZoomTaskConfig(**DEPTH_2, train=6, val=0, test=0))
    tasks = read_tasks(out / "train.jsonl")
    engine = OracleEngine(OracleParams(patterns={"direct": 1.0}, plain_wording=True, **oracle),
                          get_protocol("mini_o3"), seed=0, max_turns=4)
    engine.prepare(tasks, 1)
    return run_rollouts(tasks, engine, PROTOCOL, out, samples_per_task=1, max_new_tokens=96)


def test_the_oracle_zooms_into_its_own_observation_at_depth_2(tmp_path):
    cfg = ZoomTaskConfig(**DEPTH_2)
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    for trajectory in depth_2_oracle_trajectories(tmp_path):
        assert trajectory.end_reason == "answered" and trajectory.num_tool_calls == 2
        assert score_trajectory(trajectory, RewardConfig()).accuracy == 1.0
        longest = max(len(tokenizer(t.text)["input_ids"]) for t in trajectory.turns if t.role == "assistant")
        assert longest <= 64  # every turn fits rl.max_new_tokens in the tiny model's tokens
        calls = [(t.call["arguments"]["bbox_2d"], t.call["arguments"]["source"]) for t in trajectory.turns if t.call]
        assert calls == [(trajectory.task["waypoints"][0]["bbox"], "original_image"),
                         (inner_box(cfg.inner_view_side), "observation_1")]
        assert "tiny square. Zooming into the centre." in trajectory.turns[3].text


@pytest.mark.parametrize("name_first_look", [True, False])
def test_the_first_turn_names_its_place_only_when_asked(tmp_path, name_first_look):
    """params.yaml's `name_first_look: false`: the side word is in the question only, never in the turn the
    model writes (docs/learning.md, "The side word SFT writes"); the box is the same either way."""
    for trajectory in depth_2_oracle_trajectories(tmp_path, name_first_look=name_first_look):
        first = trajectory.turns[1]
        assert first.role == "assistant" and first.call["arguments"]["bbox_2d"] == trajectory.task["waypoints"][0]["bbox"]
        think = first.text.split("</think>")[0]
        named = [side for side in ("left", "right", "centre") if side in think]
        if name_first_look:
            assert len(named) == 1, think
        else:
            assert named == [] and "Checking the frame." in think, think
