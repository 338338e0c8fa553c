"""The task-record reader: good records load, and every bad one fails naming its file, line and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loupe.data.tasks import OPTION_LETTERS, TaskRecord, TaskRecordError, parse_task, read_tasks, write_tasks

GOOD = {
    "doc_id": "t-1",
    "images": ["img/a.png"],
    "problem": "What colour is the star?",
    "solution": "B",
    "data_source": "synthetic",
    "options": ["red", "green", "blue"],
    "category": "colour/hard",
    "bbox": [0.1, 0.2, 0.3, 0.4],
}


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def record(**changes) -> str:
    data = {**GOOD, **changes}
    return json.dumps({k: v for k, v in data.items() if v is not ...})


def read_error(path: Path, **kwargs) -> str:
    with pytest.raises(TaskRecordError) as err:
        read_tasks(path, **kwargs)
    return str(err.value)


def test_reads_good_records_and_skips_blank_lines(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [record(), "", record(doc_id="t-2", options=..., solution="green")])
    first, second = read_tasks(path)
    assert first.is_choice and first.option_letters == "ABC" and first.answer_text() == "green"
    assert first.bbox == [0.1, 0.2, 0.3, 0.4]
    assert not second.is_choice and second.answer_text() == "green"


def test_bad_json_names_file_and_line(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [record(), '{"doc_id": "x",'])
    message = read_error(path)
    assert f"{path}:2:" in message and "not valid JSON" in message


def test_a_line_that_is_not_an_object_fails(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", ["[1, 2]"])
    message = read_error(path)
    assert f"{path}:1:" in message and "JSON object" in message


def test_missing_field_is_named(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [record(), record(doc_id="t-2", problem=...)])
    message = read_error(path)
    assert f"{path}:2:" in message and "field 'problem'" in message and "required" in message.lower()


@pytest.mark.parametrize(
    ("field", "value"),
    [("images", "a.png"), ("problem", 5), ("options", "red"), ("bbox", "0 0 1 1"), ("images", [])],
)
def test_wrong_type_is_named(tmp_path, field, value):
    path = write_lines(tmp_path / "t.jsonl", [record(**{field: value})])
    message = read_error(path)
    assert f"{path}:1:" in message and f"field '{field}" in message


@pytest.mark.parametrize(
    "box", [[0.1, 0.2, 1.5, 0.4], [-0.1, 0.2, 0.3, 0.4], [0.3, 0.2, 0.1, 0.4], [0.1, 0.4, 0.3, 0.4], [0.1, 0.2, 0.3]]
)
def test_bbox_out_of_range_is_named(tmp_path, box):
    path = write_lines(tmp_path / "t.jsonl", [record(bbox=box)])
    message = read_error(path)
    assert f"{path}:1:" in message and "field 'bbox'" in message


def test_nan_in_bbox_is_refused(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(record().replace("[0.1, 0.2, 0.3, 0.4]", "[NaN, 0.2, 0.3, 0.4]") + "\n", encoding="utf-8")
    assert "field 'bbox'" in read_error(path)


@pytest.mark.parametrize("solution", ["D", "a", "green"])
def test_solution_must_be_an_option_letter(tmp_path, solution):
    path = write_lines(tmp_path / "t.jsonl", [record(solution=solution)])
    message = read_error(path)
    assert f"{path}:1:" in message and "solution" in message and "ABC" in message


def test_a_single_option_is_refused(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [record(options=["red"], solution="A")])
    assert "options" in read_error(path)


def test_duplicate_doc_id_names_both_lines(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [record(), record(doc_id="t-2"), record()])
    message = read_error(path)
    assert f"{path}:3:" in message and "field 'doc_id'" in message and "line 1" in message


def test_missing_image_is_named_when_checked(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(b"png")
    path = write_lines(tmp_path / "t.jsonl", [record(), record(doc_id="t-2", images=["img/a.png", "img/b.png"])])
    assert len(read_tasks(path)) == 2  # not checked: missing files do not matter
    message = read_error(path, check_images=True)
    assert f"{path}:2:" in message and "field 'images.1'" in message and "b.png" in message


def test_images_resolve_against_base_dir(tmp_path):
    (tmp_path / "data" / "img").mkdir(parents=True)
    (tmp_path / "data" / "img" / "a.png").write_bytes(b"png")
    path = write_lines(tmp_path / "t.jsonl", [record()])
    assert "images.0" in read_error(path, check_images=True)
    assert len(read_tasks(path, check_images=True, base_dir=tmp_path / "data")) == 1


def test_missing_file_is_named(tmp_path):
    assert str(tmp_path / "absent.jsonl") in read_error(tmp_path / "absent.jsonl")


def test_parse_task_keeps_extra_fields():
    task = parse_task({**GOOD, "width": 2048}, "here:1")
    assert task.model_dump()["width"] == 2048


def test_write_then_read_round_trips_without_nulls(tmp_path):
    records = [TaskRecord.model_validate(GOOD), TaskRecord(doc_id="t-2", images=["b.png"], problem="Q?", solution="7")]
    path = tmp_path / "out" / "t.jsonl"
    write_tasks(records, path)
    assert read_tasks(path) == records
    assert "null" not in path.read_text(encoding="utf-8")
    assert not [p for p in path.parent.iterdir() if p.name != "t.jsonl"]  # no temporary file left behind


texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=20)


@st.composite
def task_records(draw) -> TaskRecord:
    options = draw(st.none() | st.lists(texts, min_size=2, max_size=5))
    solution = draw(st.sampled_from(OPTION_LETTERS[: len(options)])) if options else draw(texts)
    x0, x1 = sorted(draw(st.lists(st.floats(0, 1), min_size=2, max_size=2, unique=True)))
    y0, y1 = sorted(draw(st.lists(st.floats(0, 1), min_size=2, max_size=2, unique=True)))
    return TaskRecord(doc_id=draw(texts), images=draw(st.lists(texts, min_size=1, max_size=3)), problem=draw(texts),
                      solution=solution, options=options, bbox=draw(st.none() | st.just([x0, y0, x1, y1])))


@settings(max_examples=40, deadline=None)
@given(st.lists(task_records(), max_size=4, unique_by=lambda r: r.doc_id))
def test_any_valid_records_round_trip(tmp_path_factory, records):
    # Texts include newlines, quotes and non-ASCII: JSONL must keep one record per line regardless.
    path = tmp_path_factory.mktemp("rt") / "t.jsonl"
    write_tasks(records, path)
    assert read_tasks(path) == records
