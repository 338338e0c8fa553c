"""Property tests of the task-record reader: on any input it returns records or raises TaskRecordError, nothing else."""

from __future__ import annotations

import json
import re
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loupe.data.tasks import TaskRecord, TaskRecordError, parse_json, parse_task, read_tasks
from loupe.images import IMAGE_SUFFIXES

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

GOOD = {"doc_id": "t-1", "images": ["img/a.png"], "problem": "What colour is the star?", "solution": "B",
        "options": ["red", "green", "blue"], "bbox": [0.1, 0.2, 0.3, 0.4]}

# JSON values of every kind, with the hostile numbers and texts the reader must refuse by name.
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-(10**120), 10**120), st.floats(),
    st.text(max_size=12), st.sampled_from(["/etc/passwd", "../x.png", "img/a.png", "a.PNG", "", "\x00.png", "x.txt"]),
)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)


@st.composite
def records(draw) -> dict:
    """A good record with some fields replaced, removed or added, by any JSON values."""
    data = dict(GOOD)
    for field in draw(st.lists(st.sampled_from([*GOOD, "data_source", "category", "extra"]), max_size=3)):
        if draw(st.booleans()):
            data[field] = draw(json_values)
        else:
            data.pop(field, None)
    return data


SLOT = "@@slot@@"
"""A string records() may place as any value; json_lines() swaps it for a value json.dumps never writes."""
hostile_values = st.sampled_from([
    "NaN", "Infinity", "-Infinity", "1e999", "-1e400", "9" * 5000, "-" + "9" * 101, "9" * 100, "[" * 64 + "]" * 64,
    "[" * 65 + "]" * 65, "[" * 3000 + "]" * 3000, '{"k": 1, "k": 2}', '[{"a": {"b": 0, "b": 0}}]', '"\\ud800"',
    '"\\udfff\\ud800"', '"\\ud83d\\ude00"', '"a\u2028b"', '"img/../../x.png"',
])
# Any text spliced in anywhere: mostly breaks the syntax, which must be reported as such.
hostile_tokens = st.sampled_from(["\ufeff", "\r", "\u2028", '"', "\\", "{", "}", ",", ":", "\x00", "\x85"])


@st.composite
def json_lines(draw) -> str:
    data = draw(records())
    for field in draw(st.lists(st.sampled_from([*GOOD, "extra"]), max_size=2)):
        data[field] = SLOT if draw(st.booleans()) else [SLOT, 0.5]
    text = json.dumps(data, ensure_ascii=draw(st.booleans()))
    while f'"{SLOT}"' in text:
        text = text.replace(f'"{SLOT}"', draw(hostile_values), 1)
    for _ in range(draw(st.integers(0, 2)) if draw(st.integers(0, 3)) == 0 else 0):
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(hostile_tokens | st.text(max_size=3)) + text[at:]
    return text


@st.composite
def files(draw) -> bytes:
    one_line = st.integers(0, 4).flatmap(lambda k: st.text(max_size=30) if k == 0 else json_lines())
    lines = draw(st.lists(one_line, max_size=4))
    data = draw(st.sampled_from(["\n", "\r\n"])).join(lines).encode("utf-8", "surrogatepass")
    if draw(st.booleans()):
        data = b"\xef\xbb\xbf" + data
    if data and draw(st.integers(0, 4)) == 0:  # a flipped byte: often no longer UTF-8
        at = draw(st.integers(0, len(data) - 1))
        data = data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1:]
    return data


def read_or_refuse(
    tmp_path_factory, data: bytes, check_images: bool
) -> tuple[Path, list[TaskRecord] | TaskRecordError]:
    folder = tmp_path_factory.mktemp("fuzz")
    (folder / "img").mkdir()
    (folder / "img" / "a.png").write_bytes(b"png")
    path = folder / "t.jsonl"
    path.write_bytes(data)
    try:
        return folder, read_tasks(path, check_images=check_images)
    except TaskRecordError as err:
        assert re.match(r":\d+: ", str(err).removeprefix(str(path))), err  # names the file, then the line
        return folder, err


@FUZZ
@given(data=st.binary(max_size=300), check_images=st.booleans())
def test_any_bytes_give_records_or_a_task_record_error(tmp_path_factory, data, check_images):
    read_or_refuse(tmp_path_factory, data, check_images)


@FUZZ
@given(data=files(), check_images=st.booleans())
def test_any_json_lines_give_records_or_a_task_record_error(tmp_path_factory, data, check_images):
    folder, result = read_or_refuse(tmp_path_factory, data, check_images)
    if isinstance(result, TaskRecordError):
        return
    for task in result:  # whatever was accepted obeys the path rule
        for image in task.images:
            assert not Path(image).is_absolute() and Path(image).suffix.lower() in IMAGE_SUFFIXES
            assert (folder / image).resolve().is_relative_to(folder.resolve())


@FUZZ
@given(text=st.text(max_size=60) | json_lines())
def test_parse_json_decodes_or_raises_a_task_record_error(text):
    try:
        parse_json(text, "here:7")
    except TaskRecordError as err:
        assert str(err).startswith("here:7: ")


@FUZZ
@given(data=records() | json_values)
def test_parse_task_validates_or_raises_a_task_record_error(data):
    try:
        task = parse_task(data, "here:3")
    except TaskRecordError as err:
        assert str(err).startswith("here:3: ")
    else:
        # A record may hold no image (text-only tasks, the recipes' arithmetic); every image it holds is a path.
        assert isinstance(task, TaskRecord) and isinstance(task.images, list)
        assert all(isinstance(i, str) and i for i in task.images)
