"""Benchmark readers: each published format loads from a small local file, and bad rows are named (the
publishers' own layouts and paths one level off: tests/test_benchmark_layouts.py)."""

from __future__ import annotations

import csv
import io
import json
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from published_benchmarks import (
    MME_COLUMNS,
    build_visualprobe,
    build_vstar,
)

from loupe.data import benchmark_tables
from loupe.data.benchmarks import (
    BENCHMARKS,
    BenchmarkFormatError,
    BenchmarkNotFoundError,
    UnknownBenchmarkError,
    load_benchmark,
)
from loupe.data.tasks import TaskRecord, write_tasks
from tests.benchmark_cases import (
    TABLE_COLUMNS,
    b64,
    hrbench_rows,
    image_bytes,
    vstar_rows,
    write_tsv,
    write_vstar,
)

# ---------------------------------------------------------------------------------------------------------------
# Registry and paths


def test_unknown_name_lists_the_known_ones(tmp_path):
    with pytest.raises(UnknownBenchmarkError) as err:
        load_benchmark("vstar_plus", tmp_path, tmp_path / "cache")
    for name in ("vstar", "hrbench4k", "hrbench8k", "mme_realworld_lite", "visualprobe_hard", "synthetic"):
        assert name in str(err.value)
        assert name in BENCHMARKS


def test_missing_path_names_the_benchmark_and_path(tmp_path):
    missing = tmp_path / "no_such_copy"
    with pytest.raises(BenchmarkNotFoundError) as err:
        load_benchmark("vstar", missing, tmp_path / "cache")
    assert "'vstar'" in str(err.value) and str(missing) in str(err.value)


def test_folder_without_the_expected_file_is_not_found(tmp_path):
    (tmp_path / "vstar").mkdir()
    with pytest.raises(BenchmarkNotFoundError, match="test_questions.jsonl"):
        load_benchmark("vstar", tmp_path / "vstar", tmp_path / "cache")


def test_empty_benchmark_is_an_error(tmp_path):
    (tmp_path / "test_questions.jsonl").write_text("\n")
    with pytest.raises(BenchmarkFormatError, match="holds no questions"):
        load_benchmark("vstar", tmp_path, tmp_path / "cache")


# ---------------------------------------------------------------------------------------------------------------
# synthetic


def test_synthetic_reads_a_folder_or_a_file(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "0.png").write_bytes(image_bytes("green"))
    record = TaskRecord(doc_id="synth-test-000000", images=["images/0.png"], problem="Colour?", solution="B",
                        options=["red", "green"], data_source="generator", bbox=[0.1, 0.1, 0.2, 0.2])
    write_tasks([record], tmp_path / "test.jsonl")
    for path in (tmp_path, tmp_path / "test.jsonl"):
        bench = load_benchmark("synthetic", path, tmp_path / "cache")
        assert bench.image_root == tmp_path
        (task,) = bench.tasks
        assert task.doc_id == "synth-test-000000" and task.data_source == "synthetic"
        assert task.bbox == [0.1, 0.1, 0.2, 0.2] and task.answer_text() == "green"
        assert bench.image_paths(task)[0].is_file()


def test_synthetic_missing_image_is_named(tmp_path):
    record = TaskRecord(doc_id="s-1", images=["images/gone.png"], problem="Colour?", solution="red")
    write_tasks([record], tmp_path / "test.jsonl")
    with pytest.raises(BenchmarkFormatError, match=r"test\.jsonl:1: field 'images\.0'"):
        load_benchmark("synthetic", tmp_path, tmp_path / "cache")


# ---------------------------------------------------------------------------------------------------------------
# V* Bench


def test_vstar_splits_question_and_options_and_drops_the_instruction(tmp_path):
    write_vstar(tmp_path, vstar_rows())
    bench = load_benchmark("vstar", tmp_path, tmp_path / "cache")
    first, second = bench.tasks
    assert first.problem == "What color is the woman's bag?"
    assert first.options == ["black", "white", "red", "blue"] and first.solution == "A"
    assert second.options == ["left", "right"] and second.answer_text() == "right"
    assert [t.category for t in bench.tasks] == ["direct_attributes", "relative_position"]
    assert [t.doc_id for t in bench.tasks] == ["vstar-0", "vstar-1"]
    assert all(t.data_source == "vstar" and "Answer with" not in t.problem for t in bench.tasks)
    assert bench.image_root == tmp_path and all(bench.image_paths(t)[0].is_file() for t in bench.tasks)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"text": "What is the color of the bag?\nAnswer with the option's letter."}, "text"),
        ({"text": "What colour?\n(A) red\n(C) blue"}, "text"),
        ({"label": "C"}, "label"),
        ({"question_id": 0}, "question_id"),
        ({"image": "relative_position/missing.jpg"}, "image"),
    ],
)
def test_vstar_bad_row_names_line_and_field(tmp_path, change, field):
    rows = vstar_rows()
    write_vstar(tmp_path, rows)
    rows[1].update(change)  # written after the images, so a changed image path points at nothing
    (tmp_path / "test_questions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(BenchmarkFormatError, match=rf"test_questions\.jsonl:2: field '{field}'"):
        load_benchmark("vstar", tmp_path, tmp_path / "cache")


def test_vstar_line_that_is_not_json_is_named(tmp_path):
    write_vstar(tmp_path, vstar_rows())
    with (tmp_path / "test_questions.jsonl").open("a") as f:
        f.write('{"image": "direct_attributes/sa_123.jpg", "text": \n')
    with pytest.raises(BenchmarkFormatError, match=r"test_questions\.jsonl:3: not valid JSON"):
        load_benchmark("vstar", tmp_path, tmp_path / "cache")


# ---------------------------------------------------------------------------------------------------------------
# HR-Bench and MME-RealWorld-Lite


def test_hrbench_tsv_decodes_images_and_reads_options(tmp_path):
    tsv = write_tsv(tmp_path / "hr_bench_4k.tsv", TABLE_COLUMNS, hrbench_rows())
    bench = load_benchmark("hrbench4k", tsv, tmp_path / "cache")
    assert bench.image_root == tmp_path / "cache" / "hrbench4k"
    first, second = bench.tasks
    assert first.doc_id == "hrbench4k-0" and first.images == ["0.jpg"] and second.images == ["1.png"]
    assert first.options == ["red", "blue", "green", "white"] and first.answer_text() == "green"
    assert second.problem == "Which side is the car on?\nLook closely." and second.solution == "B"
    assert (first.category, second.category) == ("single", "cross")
    assert second.model_dump()["cycle_category"] == "cycle_1"
    with Image.open(bench.image_paths(second)[0]) as image:
        assert image.size == (50, 20) and image.getpixel((0, 0)) == (0, 0, 255)


def test_hrbench_folder_finds_its_file(tmp_path):
    write_tsv(tmp_path / "hr_bench_8k.tsv", TABLE_COLUMNS, hrbench_rows())
    write_tsv(tmp_path / "hr_bench_4k.tsv", TABLE_COLUMNS, hrbench_rows()[:1])
    assert len(load_benchmark("HRBench8K", tmp_path, tmp_path / "cache").tasks) == 2
    assert len(load_benchmark("hrbench4k", tmp_path, tmp_path / "cache").tasks) == 1


def test_hrbench_decoding_is_cached(tmp_path, monkeypatch):
    tsv = write_tsv(tmp_path / "hr.tsv", TABLE_COLUMNS, hrbench_rows())
    writes: list[Path] = []
    real_write = benchmark_tables.atomic_write_bytes
    monkeypatch.setattr(benchmark_tables, "atomic_write_bytes", lambda p, d: (writes.append(p), real_write(p, d)))

    bench = load_benchmark("hrbench4k", tsv, tmp_path / "cache")
    assert len(writes) == 2
    files = sorted(bench.image_root.iterdir())
    stamps = {p: (p.stat().st_mtime_ns, p.stat().st_ino) for p in files}

    writes.clear()
    load_benchmark("hrbench4k", tsv, tmp_path / "cache")
    assert writes == []
    assert sorted(bench.image_root.iterdir()) == files  # no stray temporary files either
    assert {p: (p.stat().st_mtime_ns, p.stat().st_ino) for p in files} == stamps

    rows = hrbench_rows()
    rows[0]["image"] = b64(image_bytes("yellow", kind="JPEG"))  # same index, new content: rewritten
    write_tsv(tsv, TABLE_COLUMNS, rows)
    load_benchmark("hrbench4k", tsv, tmp_path / "cache")
    assert writes == [bench.image_root / "0.jpg"]
    with Image.open(bench.image_root / "0.jpg") as image:
        assert image.getpixel((5, 5))[1] > 150  # yellow, not the red it was


def test_tsv_cells_beyond_the_csv_default_limit(tmp_path):
    import numpy as np

    noise = np.random.default_rng(0).integers(0, 256, size=(300, 300, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(noise).save(buffer, format="PNG")
    rows = hrbench_rows()
    rows[1]["image"] = b64(buffer.getvalue())
    assert len(rows[1]["image"]) > 2 * csv.field_size_limit()  # the real files' cells are far larger still
    limit_before = csv.field_size_limit()
    bench = load_benchmark("hrbench4k", write_tsv(tmp_path / "hr.tsv", TABLE_COLUMNS, rows), tmp_path / "cache")
    assert bench.image_paths(bench.tasks[1])[0].read_bytes() == buffer.getvalue()
    assert csv.field_size_limit() == limit_before  # the process-wide limit is put back


def test_rows_can_share_an_image_by_index(tmp_path):
    rows = hrbench_rows()
    rows[0]["image"] = "1"  # VLMEvalKit stores a repeated image once and refers to it by the owner's index
    bench = load_benchmark("hrbench8k", write_tsv(tmp_path / "hr.tsv", TABLE_COLUMNS, rows), tmp_path / "cache")
    assert bench.tasks[0].images == bench.tasks[1].images == ["1.png"]
    assert sorted(p.name for p in bench.image_root.iterdir()) == ["1.png"]


@pytest.mark.parametrize(
    "change, field",
    [
        ({"image": "%%%not base64%%%" * 10}, "image"),
        ({"image": b64(b"plain text, not an image" * 5)}, "image"),
        ({"image": b64(image_bytes("red")[:60] + b"\0" * 200)}, "image"),
        ({"image": "7"}, "image"),
        ({"answer": "E"}, "answer"),
        ({"answer": ""}, "answer"),
        ({"question": ""}, "question"),
        ({"B": ""}, "B"),
        ({"index": 0}, "index"),
        ({"index": "../x"}, "index"),
    ],
)
def test_bad_table_row_names_row_and_field(tmp_path, change, field):
    rows = hrbench_rows()
    rows[1].update(change)
    tsv = write_tsv(tmp_path / "hr.tsv", TABLE_COLUMNS, rows)
    with pytest.raises(BenchmarkFormatError, match=rf"hr\.tsv: row 2 .*field '{field}'"):
        load_benchmark("hrbench4k", tsv, tmp_path / "cache")


def test_missing_column_is_named(tmp_path):
    columns = [c for c in TABLE_COLUMNS if c != "answer"]
    rows = [{k: v for k, v in r.items() if k != "answer"} for r in hrbench_rows()]
    with pytest.raises(BenchmarkFormatError, match=r"hr\.tsv: column\(s\) 'answer' missing"):
        load_benchmark("hrbench4k", write_tsv(tmp_path / "hr.tsv", columns, rows), tmp_path / "cache")


def test_mme_realworld_lite_reads_up_to_five_options(tmp_path):
    columns = ["index", "question", "A", "B", "C", "D", "E", "answer", "category", "l2-category", "image"]
    rows = [
        {"index": 11, "question": "What is written on the sign?", "A": "stop", "B": "go", "C": "yield", "D": "exit",
         "E": "The image does not feature the sign.", "answer": "E", "category": "Perception/OCR",
         "l2-category": "text", "image": b64(image_bytes("gray"))},
        {"index": 12, "question": "How many cars?", "A": "1", "B": "2", "C": "3", "D": "4", "E": "",
         "answer": "D", "category": "Perception/Counting", "l2-category": "count", "image": b64(image_bytes("red"))},
    ]
    path = write_tsv(tmp_path / "MME-RealWorld-Lite.tsv", columns, rows)
    bench = load_benchmark("MME-RealWorld-Lite", tmp_path, tmp_path / "cache")
    assert bench.name == "mme_realworld_lite" and path.is_file()
    five, four = bench.tasks
    assert len(five.options) == 5 and five.answer_text() == "The image does not feature the sign."
    assert four.options == ["1", "2", "3", "4"] and four.solution == "D"
    assert five.category == "Perception/OCR" and five.model_dump()["l2_category"] == "text"
    assert all(p.is_file() for t in bench.tasks for p in bench.image_paths(t))


def test_options_from_the_multi_choice_column(tmp_path):
    columns = ["index", "question", "multi-choice options", "answer", "category", "image"]
    rows = [{"index": 1, "question": "Which colour?", "answer": "B", "category": "c", "image": b64(image_bytes("red")),
             "multi-choice options": "The choices are listed below:\n(A) red\n(B) blue\n(C) green"}]
    bench = load_benchmark("mme_realworld_lite", write_tsv(tmp_path / "m.tsv", columns, rows), tmp_path / "c")
    assert bench.tasks[0].options == ["red", "blue", "green"] and bench.tasks[0].answer_text() == "blue"


def test_hrbench_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(hrbench_rows()), tmp_path / "hr_bench_4k.parquet")
    bench = load_benchmark("hrbench4k", tmp_path, tmp_path / "cache")
    assert [t.images for t in bench.tasks] == [["0.jpg"], ["1.png"]]
    assert bench.tasks[0].options == ["red", "blue", "green", "white"] and bench.tasks[1].solution == "B"
    assert all(bench.image_paths(t)[0].is_file() for t in bench.tasks)


def test_image_cells_in_every_published_shape():
    png = image_bytes("red")
    assert benchmark_tables._image_cell(b64(png), "w") == png  # base64 text (TSV, HR-Bench parquet)
    assert benchmark_tables._image_cell(png, "w") == png  # raw bytes (a binary parquet column)
    assert benchmark_tables._image_cell({"bytes": png, "path": None}, "w") == png  # a Hugging Face Image feature
    assert benchmark_tables._image_cell(" 17 ", "w") == "17"  # another row's index


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    (tmp_path / "hr_bench_4k.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match="pip install pyarrow"):
        load_benchmark("hrbench4k", tmp_path, tmp_path / "cache")


# ---------------------------------------------------------------------------------------------------------------
# VisualProbe (Mini-o3's val.json: image paths relative to the folder above the data set's folder)


def test_visualprobe_reads_mini_o3_val_json(tmp_path):
    copy = build_visualprobe(tmp_path, "hard")
    for path in (copy.path, copy.path / "val.json"):
        bench = load_benchmark("visualprobe_hard", path, tmp_path / "cache")
        assert bench.image_root == tmp_path  # Mini-o3's BASE_IMAGE_DIR: the folder above VisualProbe_Hard
        first = bench.tasks[0]
        assert first.doc_id == "visualprobe_hard-hard_0000" and first.images == ["VisualProbe_Hard/data/hard_0000.jpg"]
        assert first.problem == "What is the number on the bus in the distance?"  # "<image>\n" removed
        assert first.solution == "42" and not first.is_choice and first.data_source == "visualprobe_hard"
        assert bench.tasks[1].solution == "Starbucks."


def visualprobe_records(copy) -> list[dict]:
    return json.loads((copy.path / "val.json").read_text())


@pytest.mark.parametrize(
    "change, field",
    [({"problem": ""}, "problem"), ({"problem": "<image>\n"}, "problem"), ({"doc_id": None}, "doc_id"),
     ({"doc_id": "hard_0000"}, "doc_id"), ({"doc_id": 1.5}, "doc_id"), ({"solution": 4.5}, "solution"),
     ({"images": ["VisualProbe_Hard/data/gone.jpg"]}, "images.0"), ({"images": ["/etc/hostname"]}, "images.0"),
     ({"images": ["../outside.jpg"]}, "images.0"), ({"data_source": "visual_probe_easy"}, "data_source")],
)
def test_visualprobe_bad_record_is_named(tmp_path, change, field):
    copy = build_visualprobe(tmp_path, "hard")
    (tmp_path.parent / "outside.jpg").write_bytes(b"not even an image")
    records = visualprobe_records(copy)
    records[1].update(change)
    (copy.path / "val.json").write_text(json.dumps(records))
    with pytest.raises(BenchmarkFormatError, match=rf"val\.json: record 2: field '{field}'"):
        load_benchmark("visualprobe_hard", copy.path, tmp_path / "cache")


def test_visualprobe_image_relative_to_its_own_folder_says_where_mini_o3_looks(tmp_path):
    copy = build_visualprobe(tmp_path, "easy")
    records = visualprobe_records(copy)
    records[0]["images"] = ["data/easy_0000.jpg"]  # resolves inside the folder, not against the one above
    (copy.path / "val.json").write_text(json.dumps(records))
    with pytest.raises(BenchmarkFormatError, match=r"record 1: field 'images\.0': .* folder above the data set's folder"):
        load_benchmark("visualprobe_easy", copy.path, tmp_path / "cache")


def test_visualprobe_val_json_must_be_a_list(tmp_path):
    copy = build_visualprobe(tmp_path, "medium")
    records = visualprobe_records(copy)
    (copy.path / "val.json").write_text("".join(json.dumps(r) + "\n" for r in records))  # JSONL is not what it reads
    with pytest.raises(BenchmarkFormatError, match=r"val\.json: not valid JSON"):
        load_benchmark("visualprobe_medium", copy.path, tmp_path / "cache")
    (copy.path / "val.json").write_text(json.dumps({"records": records}))
    with pytest.raises(BenchmarkFormatError, match=r"val\.json: expected a JSON list"):
        load_benchmark("visualprobe_medium", copy.path, tmp_path / "cache")


# ---------------------------------------------------------------------------------------------------------------
# Hostile bytes: every failure is a named BenchmarkFormatError


@pytest.mark.parametrize(
    "line, message",
    [(b'{"image": "a.jpg", "text": "\xff\xfe"}', "not UTF-8"), (b'{"question_id": NaN}', "NaN"),
     (b'{"question_id": ' + b"9" * 5000 + b"}", "field 'question_id': an integer of 5000 digits"),
     (b"[" * 100000 + b"]" * 100000, "nested deeper than 64 levels"),
     (b'["a list"]', "must be a JSON object")],
)
def test_vstar_hostile_line_is_named(tmp_path, line, message):
    write_vstar(tmp_path, vstar_rows())
    with (tmp_path / "test_questions.jsonl").open("ab") as f:
        f.write(line + b"\n")
    with pytest.raises(BenchmarkFormatError, match=rf"test_questions\.jsonl:3: .*({message})"):
        load_benchmark("vstar", tmp_path, tmp_path / "cache")


def test_tsv_that_is_not_utf8_is_named(tmp_path):
    tsv = write_tsv(tmp_path / "hr.tsv", TABLE_COLUMNS, hrbench_rows())
    tsv.write_bytes(tsv.read_bytes() + b"2\tq\xff\tx\n")
    # header, row 1, row 2 over two lines (its question holds a line break), then the bad line
    with pytest.raises(BenchmarkFormatError, match=r"hr\.tsv: line 5: not UTF-8 text \(bad byte at column 4\)"):
        load_benchmark("hrbench4k", tsv, tmp_path / "cache")


def test_vstar_annotation_errors_are_named(tmp_path):
    copy = build_vstar(tmp_path, with_question_file=False)
    annotation = copy.path / "relative_position" / "sa_3077.json"
    annotation.write_text(json.dumps({"question": "Left or right?", "options": ["left"]}))
    with pytest.raises(BenchmarkFormatError, match=r"sa_3077\.json: field 'options'"):
        load_benchmark("vstar", copy.path, tmp_path / "cache")
    annotation.unlink()
    with pytest.raises(BenchmarkFormatError, match=r"sa_3077\.jpg: no annotation sa_3077\.json"):
        load_benchmark("vstar", copy.path, tmp_path / "cache")


# ---------------------------------------------------------------------------------------------------------------
# Property: whatever the bytes or values, a reader loads or fails with a named benchmark error, nothing else

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
IMAGE_PATHS = st.sampled_from(["VisualProbe_Hard/data/hard_0000.jpg", "data/hard_0000.jpg", "/etc/hostname",
                               "../x.jpg", "", "VisualProbe_Hard"])


def load_or_named_error(name: str, path: Path, cache: Path) -> None:
    try:
        load_benchmark(name, path, cache)
    except (BenchmarkFormatError, BenchmarkNotFoundError) as err:
        assert str(path.name) in str(err) or "benchmark" in str(err)


@settings(max_examples=150, deadline=None)
@given(records=st.lists(st.fixed_dictionaries({}, optional={
    "images": JSON_VALUES | st.lists(IMAGE_PATHS, max_size=2), "doc_id": JSON_VALUES, "problem": JSON_VALUES,
    "solution": JSON_VALUES, "data_source": JSON_VALUES | st.sampled_from(["visual_probe_easy", "visual_probe_hard"]),
}), max_size=3), raw=st.binary(max_size=60))
def test_visualprobe_reader_never_lets_a_raw_exception_out(records, raw):
    with tempfile.TemporaryDirectory() as tmp:
        copy = build_visualprobe(Path(tmp), "hard")
        for text in (json.dumps(records).encode(), raw):
            (copy.path / "val.json").write_bytes(text)
            load_or_named_error("visualprobe_hard", copy.path, Path(tmp) / "cache")


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(st.fixed_dictionaries({}, optional={
    "image": JSON_VALUES | st.just("direct_attributes/sa_4690.jpg"), "text": JSON_VALUES | st.text(
        alphabet="(AB) x\n<image>", max_size=30), "question_id": JSON_VALUES, "label": JSON_VALUES,
    "category": JSON_VALUES}), max_size=3), raw=st.binary(max_size=60))
def test_vstar_reader_never_lets_a_raw_exception_out(rows, raw):
    with tempfile.TemporaryDirectory() as tmp:
        copy = build_vstar(Path(tmp))
        for text in ("".join(json.dumps(r) + "\n" for r in rows).encode(), raw):
            (copy.path / "test_questions.jsonl").write_bytes(text)
            load_or_named_error("vstar", copy.path, Path(tmp) / "cache")


CELLS = st.text(alphabet="AB()[]'\"E0<>image \n\t,", max_size=24) | st.sampled_from(["", "A", "0", "nan"])


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(st.fixed_dictionaries({c: CELLS for c in MME_COLUMNS}), max_size=3), raw=st.binary(max_size=80))
def test_table_reader_never_lets_a_raw_exception_out(rows, raw):
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "mme_realworld_lite.tsv"
        for rows_or_bytes in (rows, raw):
            if isinstance(rows_or_bytes, bytes):
                file.write_bytes(rows_or_bytes)
            else:
                write_tsv(file, MME_COLUMNS, rows_or_bytes)
            load_or_named_error("mme_realworld_lite", file, Path(tmp) / "cache")


def test_a_folder_with_several_tables_lists_them(tmp_path):
    write_tsv(tmp_path / "a.tsv", TABLE_COLUMNS, hrbench_rows())
    write_tsv(tmp_path / "b.tsv", TABLE_COLUMNS, hrbench_rows())
    with pytest.raises(BenchmarkNotFoundError, match=r"holds no hr_bench_4k\.parquet .*\(found a\.tsv, b\.tsv\)"):
        load_benchmark("hrbench4k", tmp_path, tmp_path / "cache")
