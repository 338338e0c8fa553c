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
    [("images", "a.png"), ("problem", 5), ("options", "red"), ("bbox", "0 0 1 1"), ("images", [5])],
)
def test_wrong_type_is_named(tmp_path, field, value):
    path = write_lines(tmp_path / "t.jsonl", [record(**{field: value})])
    message = read_error(path)
    assert f"{path}:1:" in message and f"field '{field}" in message


def test_a_text_only_record_reads_and_a_box_needs_an_image(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [json.dumps({"doc_id": "m-1", "problem": "What is 3 + 4?",
                                                          "solution": "7", "images": []}),
                                              json.dumps({"doc_id": "m-2", "problem": "What is 2 + 2?",
                                                          "solution": "4"})])
    tasks = read_tasks(path)
    assert [t.images for t in tasks] == [[], []]
    path = write_lines(tmp_path / "b.jsonl", [json.dumps({"doc_id": "m-1", "problem": "Where?", "solution": "7",
                                                          "bbox": [0.1, 0.1, 0.2, 0.2]})])
    message = read_error(path)
    assert f"{path}:1:" in message and "bbox" in message and "text-only" in message
    path = write_lines(tmp_path / "p.jsonl", [json.dumps({"doc_id": "m-1", "problem": "<image> What?", "solution": "7"})])
    assert "placeholders for 0 images" in read_error(path)


@pytest.mark.parametrize(
    "box", [[0.1, 0.2, 1.5, 0.4], [-0.1, 0.2, 0.3, 0.4], [0.3, 0.2, 0.1, 0.4], [0.1, 0.4, 0.3, 0.4], [0.1, 0.2, 0.3]]
)
def test_bbox_out_of_range_is_named(tmp_path, box):
    path = write_lines(tmp_path / "t.jsonl", [record(bbox=box)])
    message = read_error(path)
    assert f"{path}:1:" in message and "field 'bbox'" in message


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e400", "-1e400"])
def test_nan_and_infinite_numbers_are_refused_naming_the_field(tmp_path, number):
    path = tmp_path / "t.jsonl"
    path.write_text(record(doc_id="t-0") + "\n" + record().replace("[0.1, 0.2, 0.3, 0.4]", f"[0.1, {number}, 0.3, 0.4]")
                    + "\n", encoding="utf-8")
    message = read_error(path)
    assert message.startswith(f"{path}:2: field 'bbox.1':")


@pytest.mark.parametrize("solution", ["D", "a", "green"])
def test_solution_must_be_an_option_letter(tmp_path, solution):
    path = write_lines(tmp_path / "t.jsonl", [record(solution=solution)])
    message = read_error(path)
    assert f"{path}:1:" in message and "solution" in message and "ABC" in message


def test_a_problem_holding_one_placeholder_per_image_is_read_as_it_is(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [record(problem="<image>\nWhat colour is the star?"),
                                               record(doc_id="t-2", images=["a.png", "b.png"], problem="<image> or <image>?")])
    assert [t.problem for t in read_tasks(path)] == ["<image>\nWhat colour is the star?", "<image> or <image>?"]


@pytest.mark.parametrize(
    "changes, field",
    [({"problem": "<image><image> Which colour?"}, "problem"), ({"images": ["a.png", "b.png"], "problem": "<image> Which?"}, "problem"),
     ({"options": ["red", "<image>", "blue"]}, "options")],
)
def test_placeholders_that_do_not_match_the_images_are_named(tmp_path, changes, field):
    path = write_lines(tmp_path / "t.jsonl", [record(), record(doc_id="t-2", **changes)])
    assert f"{path}:2: field '{field}':" in read_error(path)


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


texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=20).filter(
    lambda text: "<image>" not in text)  # placeholders have their own rule and tests
# Relative image paths inside the root (the reader checks every path): folders and names of any letters.
path_parts = st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="/\\."),
                     min_size=1, max_size=8)
image_names = st.builds(lambda parts, suffix: "/".join(parts) + suffix, st.lists(path_parts, min_size=1, max_size=3),
                        st.sampled_from([".png", ".jpg", ".JPEG", ".webp"]))


@st.composite
def task_records(draw) -> TaskRecord:
    options = draw(st.none() | st.lists(texts, min_size=2, max_size=5))
    solution = draw(st.sampled_from(OPTION_LETTERS[: len(options)])) if options else draw(texts)
    x0, x1 = sorted(draw(st.lists(st.floats(0, 1), min_size=2, max_size=2, unique=True)))
    y0, y1 = sorted(draw(st.lists(st.floats(0, 1), min_size=2, max_size=2, unique=True)))
    return TaskRecord(doc_id=draw(texts), images=draw(st.lists(image_names, min_size=1, max_size=3)),
                      problem=draw(texts),
                      solution=solution, options=options, bbox=draw(st.none() | st.just([x0, y0, x1, y1])))


@settings(max_examples=40, deadline=None)
@given(st.lists(task_records(), max_size=4, unique_by=lambda r: r.doc_id))
def test_any_valid_records_round_trip(tmp_path_factory, records):
    # Texts include newlines, quotes and non-ASCII: JSONL must keep one record per line regardless.
    path = tmp_path_factory.mktemp("rt") / "t.jsonl"
    write_tasks(records, path)
    assert read_tasks(path) == records


# --- hostile records: every refusal names the file, the line and the field -------------------------------------


@pytest.fixture
def image_root(tmp_path) -> Path:
    """`tmp/root` holding the task file's images, and `tmp/outside.png` and `tmp/elsewhere/` beyond it."""
    root = tmp_path / "root"
    (root / "img").mkdir(parents=True)
    (root / "img" / "a.png").write_bytes(b"png")
    (tmp_path / "outside.png").write_bytes(b"png")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "b.png").write_bytes(b"png")
    return root


def image_error(root: Path, image: str, check_images: bool = False) -> str:
    """The reader's message for a file whose second record names `image`; it must name line 2 and images.0."""
    path = write_lines(root / "t.jsonl", [record(doc_id="t-0"), record(images=[image])])
    message = read_error(path, check_images=check_images)
    assert message.startswith(f"{path}:2: field 'images.0':"), message
    return message


@pytest.mark.parametrize("check_images", [False, True])
def test_an_absolute_image_path_is_refused_whether_or_not_images_are_checked(image_root, check_images):
    assert "absolute path" in image_error(image_root, "/etc/passwd", check_images)
    # Even one that lies inside the root: a record's paths are relative to it.
    assert "absolute path" in image_error(image_root, str(image_root / "img" / "a.png"), check_images)


@pytest.mark.parametrize("image", ["../outside.png", "img/../../outside.png", "../root/../outside.png"])
def test_a_dot_dot_path_leaving_the_root_is_refused(image_root, image):
    assert "escapes the image root" in image_error(image_root, image)


def test_a_dot_dot_path_that_stays_inside_the_root_is_accepted(image_root):
    path = write_lines(image_root / "t.jsonl", [record(images=["img/../img/a.png"])])
    assert read_tasks(path, check_images=True)[0].images == ["img/../img/a.png"]


def test_a_symlink_to_a_file_outside_the_root_is_refused(image_root):
    (image_root / "img" / "sneaky.png").symlink_to(image_root.parent / "outside.png")
    message = image_error(image_root, "img/sneaky.png")
    assert "escapes the image root" in message and str(image_root.parent / "outside.png") in message


def test_a_symlink_to_a_folder_outside_the_root_is_refused(image_root):
    (image_root / "linked").symlink_to(image_root.parent / "elsewhere", target_is_directory=True)
    message = image_error(image_root, "linked/b.png")
    assert "escapes the image root" in message and "elsewhere" in message


def test_symlinks_that_stay_inside_the_root_are_accepted(image_root):
    (image_root / "alias.png").symlink_to(image_root / "img" / "a.png")
    (image_root / "pictures").symlink_to(image_root / "img", target_is_directory=True)
    path = write_lines(image_root / "t.jsonl", [record(images=["alias.png", "pictures/a.png"])])
    assert read_tasks(path, check_images=True)[0].images == ["alias.png", "pictures/a.png"]


@pytest.mark.parametrize("image", ["img/a.txt", "img/a", "img/a.png.json", "img/", ".png", "img/a.svg", "img/a.eps"])
def test_a_path_without_an_image_suffix_is_refused(image_root, image):
    assert "not an image file name" in image_error(image_root, image)


@pytest.mark.parametrize("image", ["img/a.PNG", "img/a.Jpeg", "img/a.TIF", "img/a.webp", "img/a.gif", "img/a.bmp"])
def test_image_suffixes_are_matched_case_insensitively(image_root, image):
    path = write_lines(image_root / "t.jsonl", [record(images=[image])])
    assert read_tasks(path)[0].images == [image]


@pytest.mark.parametrize("image", ["img/a\u0000.png", ""])
def test_an_empty_path_or_a_nul_byte_in_one_is_refused(image_root, image):
    assert "not a file path" in image_error(image_root, image)


def test_an_over_long_image_name_is_refused_when_checked(image_root):
    assert "cannot be checked" in image_error(image_root, "x" * 5000 + ".png", check_images=True)


def test_non_utf8_bytes_name_the_line_and_column(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(record(doc_id="t-0").encode() + b"\n" + b'{"doc_id": "caf\xe9"}\n')
    assert read_error(path) == f"{path}:2: not UTF-8 (byte 0xe9 at column 16)"


def test_non_utf8_bytes_after_a_bom_are_placed_on_the_right_column(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\xef\xbb\xbf\xff" + record().encode() + b"\n")
    assert read_error(path) == f"{path}:1: not UTF-8 (byte 0xff at column 4)"


def test_a_bom_and_crlf_line_ends_are_accepted(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (record(doc_id="t-0") + "\r\n" + "\r\n" + record() + "\r\n").encode())
    first, second = read_tasks(path)
    assert (first.doc_id, second.doc_id) == ("t-0", "t-1") and first.images == ["img/a.png"]


def test_unicode_line_separators_inside_a_string_stay_text(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [record(problem="one\u2028two\u0085three?")])
    assert read_tasks(path)[0].problem == "one\u2028two\u0085three?"


def test_a_bom_in_the_middle_of_the_file_is_not_valid_json(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes((record(doc_id="t-0") + "\n\ufeff" + record() + "\n").encode())
    message = read_error(path)
    assert message.startswith(f"{path}:2: not valid JSON")


@pytest.mark.parametrize("depth", [65, 200, 5000])
def test_deep_nesting_is_refused(tmp_path, depth):
    path = tmp_path / "t.jsonl"
    path.write_text(record()[:-1] + ', "extra": ' + "[" * depth + "]" * depth + "}\n", encoding="utf-8")
    message = read_error(path)
    assert message.startswith(f"{path}:1:") and "nested deeper than 64 levels" in message
    if depth < 1000:  # decoded, then found by the walk: the field is named
        assert message.startswith(f"{path}:1: field 'extra.0.0.")


def test_nesting_up_to_the_limit_is_accepted(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(record()[:-1] + ', "extra": ' + "[" * 63 + "]" * 63 + "}\n", encoding="utf-8")
    assert read_tasks(path)[0].model_dump()["extra"] == eval("[" * 63 + "]" * 63)


def test_a_huge_integer_is_refused_naming_the_field(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(record()[:-1] + ', "width": ' + "9" * 5000 + "}\n", encoding="utf-8")
    assert read_error(path) == f"{path}:1: field 'width': an integer of 5000 digits (at most 100 are accepted)"


def test_integers_up_to_the_digit_limit_are_kept_exactly(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(record()[:-1] + ', "width": -' + "9" * 100 + "}\n", encoding="utf-8")
    assert read_tasks(path)[0].model_dump()["width"] == -int("9" * 100)


@pytest.mark.parametrize(
    ("field", "value"),
    [("bbox", [10**99, 0.2, 0.3, 0.4]), ("bbox", [0.1, 0.2, -(10**99), 0.4]), ("doc_id", 10**99), ("problem", 1.5),
     ("solution", 2), ("images", [10**50]), ("options", [1, 2]), ("category", ["x"]), ("data_source", None)],
)
def test_a_number_where_text_is_expected_or_a_huge_number_in_a_box_names_the_field(tmp_path, field, value):
    path = write_lines(tmp_path / "t.jsonl", [record(**{field: value})])
    assert read_error(path).startswith(f"{path}:1: field '{field}")


def test_a_repeated_key_is_refused_naming_it(tmp_path):
    path = tmp_path / "t.jsonl"
    repeated = '{"doc_id": "a", "doc_id": "b", ' + record()[1:]
    path.write_text(record(doc_id="t-0") + "\n" + repeated + "\n", encoding="utf-8")
    assert read_error(path) == f"{path}:2: field 'doc_id': the key appears more than once in one JSON object"


def test_a_repeated_key_in_a_nested_object_is_named_by_its_path(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(record()[:-1] + ', "meta": {"notes": [{"k": 1, "k": 2}]}}\n', encoding="utf-8")
    assert read_error(path) == f"{path}:1: field 'meta.notes.0.k': the key appears more than once in one JSON object"


def test_a_lone_surrogate_is_refused_naming_the_field(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(record(problem="PLACEHOLDER").replace("PLACEHOLDER", "a\\ud800b") + "\n", encoding="utf-8")
    assert read_error(path).startswith(f"{path}:1: field 'problem': text holds a lone UTF-16 surrogate")


def test_an_escaped_surrogate_pair_is_valid_text(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(record(problem="PLACEHOLDER").replace("PLACEHOLDER", "\\ud83d\\ude00?") + "\n", encoding="utf-8")
    assert read_tasks(path)[0].problem == "\U0001f600?"


@pytest.mark.parametrize("content", [b"", b"\n\n  \r\n", b"\xef\xbb\xbf", b"\xef\xbb\xbf\r\n"])
def test_a_file_with_no_records_reads_as_an_empty_list(tmp_path, content):
    # The policy: what write_tasks writes for an empty split reads back as one; stages needing records say so.
    path = tmp_path / "t.jsonl"
    path.write_bytes(content)
    assert read_tasks(path) == []
    write_tasks([], tmp_path / "empty.jsonl")
    assert read_tasks(tmp_path / "empty.jsonl") == []


def test_a_folder_is_not_a_task_file(tmp_path):
    (tmp_path / "t.jsonl").mkdir()
    assert read_error(tmp_path / "t.jsonl") == f"{tmp_path / 't.jsonl'}: task file not found"


def test_a_task_file_in_a_hugging_face_hub_cache_snapshot_is_read(tmp_path):
    # huggingface_hub's cache: <repo>/snapshots/<revision>/<file> are symlinks to <repo>/blobs/<hash>.
    repo = tmp_path / "hub" / "datasets--org--bench"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "blobs" / "1a2b1a2b1a2b1a2b1a2b1a2b1a2b1a2b1a2b1a2b").write_bytes(b"png")
    snapshot = repo / "snapshots" / "c0ffeec0ffeec0ffeec0ffeec0ffeec0ffeec0ff"
    (snapshot / "img").mkdir(parents=True)
    (snapshot / "img" / "a.png").symlink_to(Path("../../../blobs/1a2b1a2b1a2b1a2b1a2b1a2b1a2b1a2b1a2b1a2b"))
    (repo / "blobs" / "3c4d3c4d3c4d3c4d3c4d3c4d3c4d3c4d3c4d3c4d3c4d3c4d3c4d3c4d3c4d3c4d").write_text(record() + "\n", encoding="utf-8")
    (snapshot / "t.jsonl").symlink_to(Path("../../blobs/3c4d3c4d3c4d3c4d3c4d3c4d3c4d3c4d3c4d3c4d3c4d3c4d3c4d3c4d3c4d3c4d"))
    assert read_tasks(snapshot / "t.jsonl", check_images=True)[0].images == ["img/a.png"]
