"""The recipe task families (arithmetic, counting, geometry): deterministic, right answers checked against the
drawing itself, text-only tasks through the oracle teacher and the rollout loop."""

from __future__ import annotations

import hashlib
import math
import re

import numpy as np
import pytest
from PIL import Image
from scipy import ndimage

from loupe.config import ProtocolParams
from loupe.data.families import DataParams, generate_family
from loupe.data.recipe_tasks import (
    ArithmeticConfig,
    CountingConfig,
    GeometryConfig,
    draw_counting_task,
    draw_geometry_task,
    make_arithmetic_task,
)
from loupe.data.synthetic_draw import PALETTE
from loupe.data.tasks import read_tasks
from loupe.protocol import get_protocol
from loupe.rewards import RewardConfig, score_trajectory
from loupe.rollout import run_rollouts
from stages.synth.oracle import OracleEngine
from stages.synth.params import OracleParams

_STORY = {
    "add": re.compile(r"has (\d+) \w+ and gets (\d+) more"),
    "sub": re.compile(r"has (\d+) \w+ and gives away (\d+)"),
    "mul": re.compile(r"buys (\d+) bags with (\d+) "),
}


def test_arithmetic_answers_are_right_and_never_negative():
    cfg = ArithmeticConfig(operations=("add", "sub", "mul"), operands=(0, 20), word_problems=0.5)
    stories = 0
    for index in range(300):
        task = make_arithmetic_task(cfg, "train", index)
        assert task.images == [] and task.category in ("add", "sub", "mul")
        bare = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", task.problem)
        if bare:
            a, op, b = int(bare.group(1)), bare.group(2), int(bare.group(3))
        else:
            stories += 1
            a, b = (int(v) for v in _STORY[task.category].search(task.problem).groups())
            op = {"add": "+", "sub": "-", "mul": "*"}[task.category]
        assert int(task.solution) == {"+": a + b, "-": a - b, "*": a * b}[op] >= 0
        assert task.model_extra["rationale"] == f"{a} {op} {b} = {task.solution}."
    assert 100 < stories < 200


def _blobs(image: Image.Image, colour: tuple[int, int, int]) -> int:
    pixels = np.asarray(image).astype(int)
    mask = (np.abs(pixels - np.array(colour)).sum(-1) < 30)
    labels, count = ndimage.label(mask)
    return sum(1 for k in range(1, count + 1) if (labels == k).sum() > 40)


def test_counting_answers_match_the_objects_drawn():
    cfg = CountingConfig(colours=("red", "green", "blue", "yellow"))
    kinds = set()
    for index in range(40):
        task, image = draw_counting_task(cfg, "train", index)
        kinds.add(task.category)
        colour = re.search(r"How many (\w+) objects", task.problem)
        if colour:
            assert _blobs(image, PALETTE[colour.group(1)]) == int(task.solution), task.doc_id
        else:
            assert sum(_blobs(image, PALETTE[c]) for c in cfg.colours) == int(task.solution), task.doc_id
    assert kinds == {"colour", "all"}


def test_geometry_answers_follow_from_the_givens():
    cfg = GeometryConfig()
    for index in range(30):
        task, image = draw_geometry_task(cfg, "train", index)
        assert image.size == (cfg.side, cfg.side)
        numbers = [int(v) for v in re.findall(r"\d+", task.problem)]
        if task.category == "triangle_angle":
            a, b = numbers
            assert int(task.solution) == 180 - a - b > 0 and a % cfg.angle_step == 0
        elif task.category == "rectangle_area":
            assert int(task.solution) == math.prod(numbers)
        else:
            assert int(task.solution) == 2 * sum(numbers)
        assert np.asarray(image).min() < 50, "the figure is drawn"


@pytest.mark.parametrize("family", ["arithmetic", "counting", "geometry"])
def test_families_write_byte_identical_folders(tmp_path, family):
    params = DataParams(family=family, **{family: {"train": 6, "val": 2, "test": 2}})
    digests = []
    for run in ("a", "b"):
        out = generate_family(tmp_path / run, params)
        digests.append(sorted(hashlib.sha256(p.read_bytes()).hexdigest() for p in (tmp_path / run).rglob("*") if p.is_file()))
        assert [len(read_tasks(out[s])) for s in ("train", "val", "test")] == [6, 2, 2]
    assert digests[0] == digests[1]
    train = read_tasks(tmp_path / "a" / "train.jsonl")
    assert all(bool(t.images) == (family != "arithmetic") for t in train)
    assert read_tasks(tmp_path / "a" / "test.jsonl")[0].doc_id != train[0].doc_id


def test_the_oracle_answers_text_only_tasks_with_their_rationale(tmp_path):
    tasks = [make_arithmetic_task(ArithmeticConfig(), "train", k) for k in range(6)]
    protocol = get_protocol("single_turn")
    engine = OracleEngine(OracleParams(), protocol, seed=0, max_turns=1)
    engine.prepare(tasks, 2)
    trajectories = run_rollouts(tasks, engine, ProtocolParams(name="single_turn"), tmp_path, samples_per_task=2,
                                max_turns=1, max_new_tokens=96)
    cfg = RewardConfig(free_form_match="math", format_rule="r1v", format_weight=1.0)
    for trajectory in trajectories:
        parts = score_trajectory(trajectory, cfg)
        assert (trajectory.end_reason, parts.accuracy, parts.format) == ("answered", 1.0, 1.0), trajectory.traj_id
        assert trajectory.images == [] and trajectory.num_tool_calls == 0
        assert trajectory.task["rationale"] in trajectory.turns[-1].text
    assert set(engine.patterns.values()) == {"reason"}


def test_a_text_only_task_asks_for_a_crop_in_vain(tmp_path):
    """A multi-turn protocol on a task with no image: the crop call comes back as the tool's error."""
    from loupe.protocol import ToolCall
    from loupe.rollout.engine import Engine, Generation

    protocol = get_protocol("mini_o3")

    class Cropper(Engine):
        name = "cropper"

        def begin(self, system, question, images):
            assert images == []
            return {"turns": 0}

        def add_user_turn(self, state, text, images):
            state["last"] = text

        def context_length(self, state):
            return 10

        def generate(self, states, max_new_tokens):
            out = []
            for state in states:
                state["turns"] += 1
                if state["turns"] == 1:
                    text = protocol.render_call("look", ToolCall("crop", {"bbox_2d": [0, 0, 0.5, 0.5],
                                                                          "source": "original_image"}))
                    out.append(Generation(text=text, finish="stop", num_tokens=5))
                else:
                    out.append(Generation(text=protocol.render_answer("none", "7"), finish="eos", num_tokens=5))
            return out

    task = make_arithmetic_task(ArithmeticConfig(), "train", 0)
    [trajectory] = run_rollouts([task], Cropper(), ProtocolParams(), tmp_path, max_turns=3, max_new_tokens=32)
    assert trajectory.end_reason == "answered" and trajectory.images == []
    assert trajectory.turns[2].role == "user" and trajectory.turns[2].images == []
    assert "original_image" in trajectory.turns[2].text or trajectory.turns[2].error


def test_a_mixed_set_holds_each_family_with_its_images(tmp_path):
    params = DataParams(family="mixed", mixed=["arithmetic", "counting"], arithmetic={"train": 3, "val": 1, "test": 1},
                        counting={"train": 2, "val": 1, "test": 1})
    out = generate_family(tmp_path / "tasks", params)
    train = read_tasks(out["train"], check_images=True)  # every image path resolves inside the folder
    assert [t.data_source for t in train] == ["arithmetic", "counting", "arithmetic", "counting", "arithmetic"]
    assert train[1].images == ["images/counting/train/000000.png"]
    alone = read_tasks(generate_family(tmp_path / "counting", DataParams(family="counting", counting={
        "train": 2, "val": 1, "test": 1}))["train"])
    assert train[1].problem == alone[0].problem and train[1].solution == alone[0].solution
