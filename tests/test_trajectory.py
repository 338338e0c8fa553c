"""Trajectory records: JSONL round trips, crops saved beside the file, atomic writes, and readable errors."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
from PIL import Image

import loupe.io
from loupe.protocol import ORIGINAL_IMAGE, ToolCall, get_protocol, to_sharegpt
from loupe.trajectory import Trajectory, Turn, read_trajectories, write_trajectories

MINI = get_protocol("mini_o3")


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    return Image.frombytes("RGB", (width, height), random.Random(seed).randbytes(width * height * 3))


def make_trajectory(task_image: Path, traj_id: str = "doc-1#0", seed: int = 0) -> Trajectory:
    """Question, zoom, observation, zoom on the observation, observation, answer: two crops still in memory."""
    trajectory = Trajectory(
        traj_id=traj_id,
        task={"doc_id": traj_id.split("#")[0], "images": [task_image.name], "problem": "Which letter?", "solution": "B",
              "options": ["A", "B"]},
        protocol="mini_o3",
        system=MINI.system_prompt(),
        sample_index=int(traj_id.rsplit("#", 1)[-1]),
    )
    first = trajectory.add_image(task_image)
    trajectory.turns.append(Turn("user", "<image>\nWhich letter?", images=[first], num_tokens=40))
    for step, source in enumerate((ORIGINAL_IMAGE, "observation_1"), start=1):
        call = ToolCall("crop", {"bbox_2d": [0.1, 0.2, 0.6, 0.7], "source": source, "frame": "relative"})
        trajectory.turns.append(Turn("assistant", MINI.render_call(f"step {step}", call), action="call",
                                     call={"tool": call.tool, "arguments": call.arguments}, num_tokens=30))
        crop_index = trajectory.add_image(noise_image(56, 84, seed=seed * 10 + step))
        trajectory.turns.append(Turn("user", MINI.observation_text(step), images=[crop_index], num_tokens=70,
                                     crop={"source": source, "source_image": crop_index - 1,
                                           "box_px": [5, 10, 30, 35], "size": [56, 84]}))
    trajectory.turns.append(Turn("assistant", MINI.render_answer("it is B", "B"), action="answer", num_tokens=12))
    trajectory.end_reason, trajectory.answer = "answered", "B"
    trajectory.rewards = {"accuracy": 1.0, "format": 1.0, "tool": 0.5, "total": 2.5, "valid": True}
    trajectory.num_tool_calls, trajectory.prompt_tokens, trajectory.generated_tokens = 2, 400, 72
    trajectory.meta = {"teacher": "scripted", "seconds": 0.25}
    return trajectory


@pytest.fixture
def task_image(tmp_path) -> Path:
    path = tmp_path / "data" / "task.png"
    path.parent.mkdir()
    noise_image(64, 48, seed=99).save(path)
    return path


def test_write_then_read_gives_back_the_same_trajectories(tmp_path, task_image):
    originals = [make_trajectory(task_image, f"doc-{i}#{i % 2}", seed=i) for i in range(3)]
    crops = [dict(t.pending) for t in originals]
    out = write_trajectories(originals, tmp_path / "out" / "traj.jsonl")
    assert out == tmp_path / "out" / "traj.jsonl"
    loaded = read_trajectories(out)
    assert loaded == originals  # every serialised field: turns, images, rewards, crops, meta
    for trajectory, original_crops in zip(loaded, crops, strict=True):
        assert trajectory.base_dir == out.parent
        assert trajectory.rewards["valid"] is True and trajectory.rewards["total"] == 2.5
        assert trajectory.turns[2].crop == {"source": ORIGINAL_IMAGE, "source_image": 0, "box_px": [5, 10, 30, 35],
                                            "size": [56, 84]}
        assert trajectory.turns[3].call["arguments"]["source"] == "observation_1"
        assert trajectory.num_turns == 3
        for index, image in original_crops.items():
            assert trajectory.load_image(index).tobytes() == image.tobytes()  # PNG is lossless
        assert trajectory.load_image(0).tobytes() == Image.open(task_image).convert("RGB").tobytes()


def test_pending_crops_become_png_files_beside_the_jsonl_with_relative_paths(tmp_path, task_image):
    trajectory = make_trajectory(task_image, "doc-7#3")
    out = write_trajectories([trajectory], tmp_path / "out" / "traj.jsonl")
    assert trajectory.pending == {}
    assert trajectory.images[0] == str(task_image)
    folder = Path(trajectory.images[1]).parent
    assert folder.parent == Path("images") and folder.name.startswith("doc-7_3-")
    assert trajectory.images[1:] == [str(folder / "1.png"), str(folder / "2.png")]
    for relative in trajectory.images[1:]:
        assert not Path(relative).is_absolute()
        data = (out.parent / relative).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n")
    record = json.loads(out.read_text(encoding="utf-8"))
    assert record["images"] == trajectory.images
    assert not {"pending", "trace", "base_dir"} & set(record)


def test_unsafe_trajectory_ids_stay_inside_the_images_folder(tmp_path, task_image):
    trajectory = make_trajectory(task_image, "../../etc/doc 1#0")
    out = write_trajectories([trajectory], tmp_path / "out" / "traj.jsonl")
    for relative in trajectory.images[1:]:
        saved = (out.parent / relative).resolve()
        assert saved.is_file()
        assert saved.is_relative_to((out.parent / "images").resolve())


def test_write_leaves_no_temporary_files_and_replaces_the_old_file(tmp_path, task_image):
    path = tmp_path / "out" / "traj.jsonl"
    write_trajectories([make_trajectory(task_image, "doc-1#0")], path)
    write_trajectories([make_trajectory(task_image, "doc-2#0"), make_trajectory(task_image, "doc-3#1")], path)
    assert [t.traj_id for t in read_trajectories(path)] == ["doc-2#0", "doc-3#1"]
    leftovers = [p for p in (tmp_path / "out").rglob("*") if p.name.startswith(".") or p.suffix == ".tmp"]
    assert leftovers == []
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["images", "traj.jsonl"]


def test_a_write_that_fails_leaves_the_previous_file_whole(tmp_path, task_image, monkeypatch):
    path = tmp_path / "out" / "traj.jsonl"
    write_trajectories([make_trajectory(task_image, "doc-1#0")], path)
    before = path.read_bytes()
    changed = read_trajectories(path)[0]  # its crops are saved: only the JSONL itself is written again
    changed.answer = "A"

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(loupe.io.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        write_trajectories([changed], path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert [p for p in path.parent.rglob("*") if p.name.startswith(".") or p.suffix == ".tmp"] == []


def test_an_unserialisable_trajectory_leaves_the_previous_file_whole(tmp_path, task_image):
    path = tmp_path / "out" / "traj.jsonl"
    write_trajectories([make_trajectory(task_image, "doc-1#0")], path)
    before = path.read_bytes()
    bad = make_trajectory(task_image, "doc-2#0")
    bad.meta["engine"] = object()
    with pytest.raises(TypeError):
        write_trajectories([make_trajectory(task_image, "doc-3#0"), bad], path)
    assert path.read_bytes() == before


def test_writing_a_read_trajectory_elsewhere_keeps_its_images_reachable(tmp_path, task_image):
    first = write_trajectories([make_trajectory(task_image, "doc-1#0")], tmp_path / "rollouts" / "traj.jsonl")
    moved = write_trajectories(read_trajectories(first), tmp_path / "sft" / "nested" / "accepted.jsonl")
    trajectory = read_trajectories(moved)[0]
    for index in range(len(trajectory.images)):
        assert trajectory.image_path(index).is_file(), trajectory.images[index]
    assert trajectory.load_image(1).size == (56, 84)
    record = to_sharegpt(trajectory)
    assert all(Path(p).is_file() for p in record["images"])


def test_blank_lines_are_skipped(tmp_path, task_image):
    path = write_trajectories([make_trajectory(task_image, "doc-1#0")], tmp_path / "traj.jsonl")
    path.write_text("\n" + path.read_text(encoding="utf-8") + "\n  \n", encoding="utf-8")
    assert [t.traj_id for t in read_trajectories(path)] == ["doc-1#0"]


def test_an_empty_list_writes_an_empty_file(tmp_path):
    path = write_trajectories([], tmp_path / "none.jsonl")
    assert path.read_text(encoding="utf-8") == ""
    assert read_trajectories(path) == []


@pytest.mark.parametrize(
    "bad_line, words",
    [
        ("{not json", "not a trajectory record"),
        ("[1, 2, 3]", "not a trajectory record"),
        ("42", "not a trajectory record"),
        ("null", "not a trajectory record"),
        ('{"task": {}, "protocol": "mini_o3", "system": "s"}', "traj_id"),
        ('{"traj_id": "x", "task": {}, "protocol": "mini_o3", "system": "s", "score": 1}', "score"),
        ('{"traj_id": "x", "task": {}, "protocol": "mini_o3", "system": "s", "turns": [{"role": "user"}]}', "text"),
        ('{"traj_id": "x", "task": {}, "protocol": "mini_o3", "system": "s", '
         '"turns": [{"role": "user", "text": "t", "mood": "happy"}]}', "mood"),
        ('{"traj_id": "x", "task": {}, "protocol": "mini_o3", "system": "s", "turns": ["hello"]}',
         "not a trajectory record"),
    ],
)
def test_a_bad_line_names_the_file_and_line(tmp_path, task_image, bad_line, words):
    path = write_trajectories([make_trajectory(task_image, "doc-1#0")], tmp_path / "traj.jsonl")
    path.write_text(path.read_text(encoding="utf-8") + bad_line + "\n", encoding="utf-8")
    with pytest.raises(ValueError) as info:
        read_trajectories(path)
    message = str(info.value)
    assert f"{path}:2:" in message
    assert words in message


def test_an_unknown_field_is_refused_by_from_json(task_image):
    data = make_trajectory(task_image).to_json()
    data["surprise"] = True
    with pytest.raises(ValueError, match="surprise"):
        Trajectory.from_json(data)


def test_reading_a_missing_file_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="absent.jsonl"):
        read_trajectories(tmp_path / "absent.jsonl")


def test_an_unsaved_crop_has_no_path_until_written(tmp_path, task_image):
    trajectory = make_trajectory(task_image)
    assert trajectory.images[1] == "" and 1 in trajectory.pending
    with pytest.raises(ValueError, match="unsaved crop"):
        trajectory.image_path(1)
    assert trajectory.load_image(1) is trajectory.pending[1]
    write_trajectories([trajectory], tmp_path / "traj.jsonl")
    saved = trajectory.image_path(1)
    assert saved.is_file() and saved.parent.parent == tmp_path / "images" and saved.parent.name.startswith("doc-1_0-")


def test_ids_that_sanitise_alike_get_distinct_crop_folders(tmp_path, task_image):
    first, second = make_trajectory(task_image), make_trajectory(task_image)
    first.traj_id, second.traj_id = "a#0", "a_0"
    write_trajectories([first, second], tmp_path / "traj.jsonl")
    assert first.image_path(1) != second.image_path(1)
    assert first.image_path(1).is_file() and second.image_path(1).is_file()


def test_to_json_is_plain_json_without_in_memory_fields(task_image):
    trajectory = make_trajectory(task_image)
    trajectory.trace = object()
    data = trajectory.to_json()
    assert not {"pending", "trace", "base_dir"} & set(data)
    assert data["turns"][1]["action"] == "call"
    json.dumps(data)  # raises if anything in it is not plain JSON


def test_add_image_indexes_images_in_order(task_image):
    trajectory = Trajectory(traj_id="t#0", task={}, protocol="mini_o3", system="s")
    assert trajectory.add_image(task_image) == 0
    assert trajectory.add_image(Image.new("RGB", (28, 28))) == 1
    assert trajectory.add_image(str(task_image)) == 2
    assert trajectory.images == [str(task_image), "", str(task_image)]
    assert list(trajectory.pending) == [1]
    assert os.fspath(trajectory.image_path(2)) == str(task_image)
