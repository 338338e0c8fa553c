"""The synthetic visual-search generator: valid, deterministic, well-placed tasks, and a config that says
what is wrong with it."""

from __future__ import annotations

import hashlib
import io
import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from pydantic import ValidationError

from loupe.data import synthetic
from loupe.data.splits import SPLITS
from loupe.data.synthetic import DIFFICULTIES, QUESTION_KINDS, SyntheticConfig, generate_tasks, make_task
from loupe.data.synthetic_draw import BACKGROUND_LEVELS, DIGITS, LETTERS, PALETTE, SHAPES
from loupe.data.tasks import TaskRecord, read_tasks
from loupe.png import encode_png

SMALL = dict(canvas_side=(1024, 1280), clutter_count=(20, 40))
SINGLE_TARGET_KINDS = {"colour", "shape", "glyph"}


def tree_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def load(folder: Path) -> dict[str, list[TaskRecord]]:
    return {split: read_tasks(folder / f"{split}.jsonl", check_images=True) for split in SPLITS}


def pixels(folder: Path, record: TaskRecord) -> np.ndarray:
    return np.asarray(Image.open(folder / record.images[0]).convert("RGB"))


def box_px(record: TaskRecord, image: np.ndarray) -> tuple[int, int, int, int]:
    h, w = image.shape[:2]
    x0, y0, x1, y1 = record.bbox
    return math.floor(x0 * w), math.floor(y0 * h), math.ceil(x1 * w), math.ceil(y1 * h)


def kind_of(record: TaskRecord) -> str:
    return record.category.split("/")[0]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> Path:
    """Every kind and difficulty, half choice questions."""
    out = tmp_path_factory.mktemp("mixed") / "synth"
    generate_tasks(out, SyntheticConfig(seed=3, train=14, val=4, test=4, **SMALL))
    return out


@pytest.fixture(scope="module")
def single_targets(tmp_path_factory) -> Path:
    """Many one-target questions (colour, shape, glyph) across difficulties, for the size and pixel checks."""
    out = tmp_path_factory.mktemp("single") / "synth"
    cfg = SyntheticConfig(seed=11, train=30, val=0, test=0, kind_mix={"colour": 2, "shape": 1, "glyph": 1}, **SMALL)
    generate_tasks(out, cfg)
    return out


def test_writes_valid_records_for_every_split(mixed):
    records = load(mixed)
    assert [len(records[s]) for s in SPLITS] == [14, 4, 4]
    for split, tasks in records.items():
        for index, task in enumerate(tasks):
            assert task.doc_id == f"synth-{split}-{index:06d}"
            assert task.images == [f"images/{split}/{index:06d}.png"]
            assert task.data_source == "synthetic"
            kind, difficulty = task.category.split("/")
            assert kind in QUESTION_KINDS and difficulty in DIFFICULTIES
            assert task.bbox is not None and task.problem.endswith(("?", ".")) and task.problem[0].isupper()
            width, height = Image.open(mixed / task.images[0]).size
            assert 1024 <= width <= 1280 and 1024 <= height <= 1280


def test_returns_the_split_paths(tmp_path):
    paths = generate_tasks(tmp_path / "out", SyntheticConfig(train=1, val=1, test=0, **SMALL))
    assert paths == {s: tmp_path / "out" / f"{s}.jsonl" for s in ("train", "val", "test")}
    assert [len(read_tasks(p)) for p in paths.values()] == [1, 1, 0]


def test_same_config_gives_identical_bytes_and_another_seed_differs(tmp_path, mixed):
    again = tmp_path / "again"
    generate_tasks(again, SyntheticConfig(seed=3, train=14, val=4, test=4, **SMALL))
    assert tree_bytes(again) == tree_bytes(mixed)

    other = tmp_path / "other"
    generate_tasks(other, SyntheticConfig(seed=4, train=14, val=4, test=4, **SMALL))
    first, second = tree_bytes(mixed), tree_bytes(other)
    assert first.keys() == second.keys()
    assert first["train.jsonl"] != second["train.jsonl"]
    assert all(first[name] != second[name] for name in first if name.endswith(".png"))


def test_a_task_does_not_depend_on_the_others():
    # Task 5 of a 6-task run is task 5 of a 40-task run: each draws from its own stream.
    cfg_small, cfg_large = SyntheticConfig(seed=8, train=6, **SMALL), SyntheticConfig(seed=8, train=40, **SMALL)
    record_small, image_small = make_task(cfg_small, "train", 5)
    record_large, image_large = make_task(cfg_large, "train", 5)
    assert record_small == record_large
    assert np.array_equal(np.asarray(image_small), np.asarray(image_large))


def test_workers_do_not_change_the_output(tmp_path):
    cfg = SyntheticConfig(seed=5, train=5, val=2, test=1, **SMALL)
    generate_tasks(tmp_path / "serial", cfg)
    generate_tasks(tmp_path / "parallel", cfg, workers=2)
    assert tree_bytes(tmp_path / "serial") == tree_bytes(tmp_path / "parallel")


def test_splits_share_no_image_and_no_doc_id(mixed):
    records = load(mixed)
    seen_ids: set[str] = set()
    seen_images: set[str] = set()
    for tasks in records.values():
        ids = {t.doc_id for t in tasks}
        digests = {hashlib.sha256((mixed / t.images[0]).read_bytes()).hexdigest() for t in tasks}
        assert len(digests) == len(tasks)
        assert not ids & seen_ids and not digests & seen_images
        seen_ids |= ids
        seen_images |= digests


def test_choice_and_free_form_answers_are_well_formed(mixed):
    tasks = [t for tasks in load(mixed).values() for t in tasks]
    choice = [t for t in tasks if t.is_choice]
    free = [t for t in tasks if not t.is_choice]
    assert choice and free  # choice_fraction 0.5 over 22 tasks
    spaces = {"colour": set(PALETTE), "shape": set(SHAPES), "glyph": set(LETTERS + DIGITS),
              "count": {str(v) for v in range(0, 14)}, "position": {"left", "right", "above", "below"}}
    for task in choice:
        assert 2 <= len(task.options) <= 5
        assert len(set(task.options)) == len(task.options)
        assert task.solution in task.option_letters
        assert set(task.options) <= spaces[kind_of(task)]
    for task in free:
        assert re.fullmatch(r"[a-z]+|[A-Z]|[0-9]", task.solution), task.solution
        assert task.solution in spaces[kind_of(task)]
        assert task.solution not in task.problem.split("?")[0].split()  # the question does not give it away


def test_choice_fraction_and_option_count_are_obeyed():
    cfg = SyntheticConfig(train=12, choice_fraction=1.0, option_count=(3, 3), **SMALL)
    records = [make_task(cfg, "train", i)[0] for i in range(12)]
    assert all(r.is_choice and len(r.options) == 3 for r in records)
    cfg = SyntheticConfig(train=6, choice_fraction=0.0, **SMALL)
    assert not any(make_task(cfg, "train", i)[0].is_choice for i in range(6))


def test_the_right_option_moves_around():
    cfg = SyntheticConfig(seed=2, choice_fraction=1.0, option_count=(4, 4), **SMALL)
    letters = {make_task(cfg, "train", i)[0].solution for i in range(16)}
    assert len(letters) >= 3


def test_a_glyph_answer_is_never_an_option_letter():
    # Otherwise "B" could mean option B or the letter B written on the target.
    cfg = SyntheticConfig(seed=4, kind_mix={"glyph": 1}, choice_fraction=1.0, option_count=(5, 5), **SMALL)
    records = [make_task(cfg, "train", i)[0] for i in range(10)]
    assert all(r.is_choice and not set(r.options) & set("ABCDE") for r in records)
    assert any(r.answer_text() in LETTERS for r in records)  # letters are still asked, just not A-E


def test_mixes_are_obeyed():
    cfg = SyntheticConfig(difficulty_mix={"hard": 1.0}, kind_mix={"count": 1.0, "position": 1.0}, **SMALL)
    categories = [make_task(cfg, "test", i)[0].category for i in range(8)]
    assert all(c.endswith("/hard") for c in categories)
    assert {c.split("/")[0] for c in categories} <= {"count", "position"}
    assert len({c.split("/")[0] for c in categories}) == 2


def test_boxes_are_inside_the_image_and_sized_by_difficulty(single_targets):
    tasks = load(single_targets)["train"]
    sizes: dict[str, list[float]] = {d: [] for d in DIFFICULTIES}
    for task in tasks:
        image = pixels(single_targets, task)
        x0, y0, x1, y1 = box_px(task, image)
        assert 0 <= x0 < x1 <= image.shape[1] and 0 <= y0 < y1 <= image.shape[0]
        side = min(image.shape[:2])
        difficulty = task.category.split("/")[1]
        low, high = SyntheticConfig().target_size[difficulty]
        relative = max(x1 - x0, y1 - y0) / side
        # Rounding adds a pixel; glyph-bearing targets are at least 20 px wide.
        assert relative <= high + 2 / side, (task.doc_id, relative)
        assert relative >= min(low * 0.85, 20 / side), (task.doc_id, relative)
        sizes[difficulty].append(relative)
    assert all(sizes.values()), sizes  # every difficulty drawn
    mean = {d: sum(v) / len(v) for d, v in sizes.items()}
    assert mean["hard"] < mean["medium"] < mean["easy"]


def _ink(image: np.ndarray) -> np.ndarray:
    """Pixels the background can never produce: a channel outside BACKGROUND_LEVELS."""
    lo, hi = BACKGROUND_LEVELS
    return ((image < lo) | (image > hi)).any(axis=-1)


def test_the_target_is_where_its_box_says(single_targets):
    tasks = load(single_targets)["train"]
    colour_tasks = [t for t in tasks if kind_of(t) == "colour"]
    assert len(colour_tasks) >= 8
    for task in tasks:
        image = pixels(single_targets, task)
        x0, y0, x1, y1 = box_px(task, image)
        crop = image[y0:y1, x0:x1]
        if kind_of(task) == "colour":
            # The answer colour fills a good part of the box (a star fills the least, about a third).
            share = (crop == PALETTE[task.answer_text()]).all(axis=-1).mean()
            assert share > 0.2, (task.doc_id, task.answer_text(), share)
        # The box is tight: ink touches (within a pixel) each of its four sides.
        rows, cols = np.nonzero(_ink(crop))
        assert rows.size, task.doc_id
        assert rows.min() <= 1 and cols.min() <= 1, task.doc_id
        assert rows.max() >= crop.shape[0] - 2 and cols.max() >= crop.shape[1] - 2, task.doc_id


def test_a_wrong_box_would_be_caught(single_targets):
    # The pixel check above has teeth: the same box moved by its own size misses the target colour.
    task = next(t for t in load(single_targets)["train"] if kind_of(t) == "colour")
    image = pixels(single_targets, task)
    x0, y0, x1, y1 = box_px(task, image)
    dx = x1 - x0 if x1 + (x1 - x0) <= image.shape[1] else -(x1 - x0)
    moved = image[y0:y1, x0 + dx:x1 + dx]
    assert (moved == PALETTE[task.answer_text()]).all(axis=-1).mean() < 0.2


def _one(items, **attributes):
    found = [i for i in items if all(getattr(i, k) == v for k, v in attributes.items())]
    assert len(found) == 1, (attributes, found)
    return found[0]


def _nearest_matching(items, anchor, matches):
    """The item nearest the anchor among those the description fits; the next is at least twice as far."""
    candidates = sorted((math.dist(i.centre, anchor.centre), i) for i in items if i is not anchor and matches(i))
    assert len(candidates) >= 1
    if len(candidates) > 1:
        assert candidates[1][0] >= 2 * candidates[0][0], candidates[:2]
    return candidates[0][1]


def _referent(problem: str, kind: str, items) -> object:
    """The one object the question's words pick out, found from the words alone."""
    if kind == "colour" and (m := re.search(r"the (\w+) with the (?:letter|digit) (\w) on it", problem)):
        return _one(items, shape=m[1], glyph=m[2])
    if kind == "colour" and (m := re.search(r"the (\w+) next to the (?:letter|digit) (\w)", problem)):
        anchor = _one(items, glyph=m[2], shape=None)
        return _nearest_matching(items, anchor, lambda i: i.shape == m[1])
    if kind == "shape" and (m := re.search(r"the (\w+) object next to the (?:letter|digit) (\w)", problem)):
        anchor = _one(items, glyph=m[2], shape=None)
        return _nearest_matching(items, anchor, lambda i: i.colour == m[1])
    if kind == "glyph" and (m := re.search(r"the (\w+) (\w+)(?: carry)?\?", problem)):
        return _one(items, colour=m[1], shape=m[2])
    raise AssertionError(f"no description found in {problem!r}")


@pytest.mark.parametrize("kind", QUESTION_KINDS)
def test_the_words_pick_out_exactly_the_target(kind):
    cfg = SyntheticConfig(seed=21, kind_mix={kind: 1}, **SMALL)
    plurals = {s + ("es" if s == "cross" else "s"): s for s in SHAPES}
    for index in range(10):
        record, image, items = synthetic._draw_task(cfg, "train", index)
        glyphs = [i.glyph for i in items if i.glyph]
        assert len(glyphs) == len(set(glyphs))  # "the letter K" is always unique
        box = box_px(record, np.asarray(image))
        inside = [i for i in items
                  if box[0] <= i.box[0] and box[1] <= i.box[1] and i.box[2] <= box[2] and i.box[3] <= box[3]]
        problem = record.problem
        if kind == "count":
            m = re.search(r"(?:many|Count the) (\w+) (\w+) .*?(\w+)(?:-bordered| border)", problem)
            counted = [i for i in inside if i.colour == m[1] and i.shape == plurals[m[2]]]
            assert str(len(counted)) == record.answer_text(), problem
        elif kind == "position":
            m = re.search(r"Where is the (\w+) (\w+) (?:located )?relative to the (letter|digit|\w+) (\w+)\?", problem)
            target = _one(items, colour=m[1], shape=m[2])
            if m[3] in ("letter", "digit"):
                reference = _one(items, glyph=m[4], shape=None)
            else:
                reference = _one(items, colour=m[3], shape=m[4])
            dx, dy = (t - r for t, r in zip(target.centre, reference.centre))
            expected = ("left" if dx < 0 else "right") if abs(dx) > abs(dy) else ("above" if dy < 0 else "below")
            assert max(abs(dx), abs(dy)) >= 2 * min(abs(dx), abs(dy))  # never borderline
            assert expected == record.answer_text(), problem
            assert target in inside and reference in inside
        else:
            target = _referent(problem, kind, items)
            assert target in inside
            assert max(abs(a - b) for a, b in zip(target.box, box)) <= 1  # the box is this object's, tightly
            answer = {"colour": target.colour, "shape": target.shape, "glyph": target.glyph}[kind]
            assert answer == record.answer_text(), problem


def test_background_never_takes_a_palette_colour():
    rng = np.random.default_rng(0)
    from loupe.data.synthetic_draw import textured_background

    background = np.asarray(textured_background(rng, 1024, 1100))
    assert not _ink(background).any()
    lo, hi = BACKGROUND_LEVELS
    for name, rgb in PALETTE.items():
        assert any(c < lo or c > hi for c in rgb), name


def test_png_encoder_round_trips_exactly():
    rng = np.random.default_rng(1)
    array = rng.integers(0, 256, size=(37, 53, 3), dtype=np.uint8)
    decoded = np.asarray(Image.open(io.BytesIO(encode_png(Image.fromarray(array)))).convert("RGB"))
    assert np.array_equal(decoded, array)


def test_a_killed_run_keeps_the_previous_output(tmp_path, monkeypatch):
    out = tmp_path / "synth"
    generate_tasks(out, SyntheticConfig(seed=1, train=3, val=1, test=1, **SMALL))
    before = tree_bytes(out)
    real = synthetic.make_task

    def dies_midway(cfg, split, index):
        if split == "val":
            raise KeyboardInterrupt
        return real(cfg, split, index)

    monkeypatch.setattr(synthetic, "make_task", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        generate_tasks(out, SyntheticConfig(seed=2, train=3, val=1, test=1, **SMALL))
    assert tree_bytes(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["synth"]  # no partial folder left beside it


def test_a_rerun_replaces_stale_files(tmp_path):
    out = tmp_path / "synth"
    generate_tasks(out, SyntheticConfig(train=3, val=0, test=0, **SMALL))
    generate_tasks(out, SyntheticConfig(train=1, val=0, test=0, **SMALL))
    assert sorted(p.name for p in (out / "images" / "train").iterdir()) == ["000000.png"]


def test_refuses_to_replace_a_foreign_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="notes.txt"):
        generate_tasks(tmp_path, SyntheticConfig(train=1, val=0, test=0, **SMALL))
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_progress_bar_names_the_split(tmp_path, capsys):
    generate_tasks(tmp_path / "out", SyntheticConfig(train=2, val=0, test=0, **SMALL), progress=True)
    assert "synthetic train" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"canvas_side": (2000, 1500)}, "canvas_side"),
        ({"canvas_side": (512, 1024)}, "canvas_side"),
        ({"canvas_side": (1024, 8192)}, "canvas_side"),
        ({"option_count": (1, 3)}, "option_count"),
        ({"option_count": (4, 3)}, "option_count"),
        ({"clutter_count": (50, 10)}, "clutter_count"),
        ({"count_answers": (3, 12)}, "count_answers"),
        ({"difficulty_mix": {"easy": 0, "medium": 0, "hard": 0}}, "difficulty_mix"),
        ({"difficulty_mix": {"easy": -1, "hard": 2}}, "difficulty_mix"),
        ({"difficulty_mix": {"extreme": 1}}, "difficulty_mix"),
        ({"kind_mix": {"colour": 0}}, "kind_mix"),
        ({"kind_mix": {"size": 1}}, "kind_mix"),
        ({"target_size": {"hard": (0.03, 0.01)}}, "target_size"),
        ({"target_size": {"easy": (0.1, 0.5)}}, "target_size"),
        ({"choice_fraction": 1.5}, "choice_fraction"),
        ({"train": -1}, "train"),
        ({"seed": -3}, "seed"),
        ({"canvas": 1024}, "canvas"),
    ],
)
def test_config_errors_name_the_field(changes, field):
    with pytest.raises(ValidationError) as err:
        SyntheticConfig(**changes)
    assert field in str(err.value)


def test_config_fills_unnamed_target_sizes_and_documents_every_field():
    cfg = SyntheticConfig(target_size={"hard": (0.01, 0.02)})
    assert cfg.target_size == {"easy": (0.06, 0.10), "medium": (0.03, 0.05), "hard": (0.01, 0.02)}
    assert all(info.description for info in SyntheticConfig.model_fields.values())
    assert SyntheticConfig.model_validate(cfg.model_dump()) == cfg  # round-trips through params.yaml


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32), split=st.sampled_from(SPLITS), index=st.integers(0, 10**6),
       kind=st.sampled_from(QUESTION_KINDS), difficulty=st.sampled_from(DIFFICULTIES))
def test_any_seed_gives_a_valid_task(seed, split, index, kind, difficulty):
    cfg = SyntheticConfig(seed=seed, canvas_side=(1024, 1100), clutter_count=(5, 15), kind_mix={kind: 1},
                          difficulty_mix={difficulty: 1})
    record, image = make_task(cfg, split, index)
    assert TaskRecord.model_validate(record.model_dump()) == record
    assert record.category == f"{kind}/{difficulty}"
    assert record.doc_id == f"synth-{split}-{index:06d}"
    x0, y0, x1, y1 = box_px(record, np.asarray(image))
    assert 0 <= x0 < x1 <= image.width and 0 <= y0 < y1 <= image.height
    assert record.answer_text() not in record.problem.split("?")[0].split()  # the question does not give it away
