"""Benchmark readers: each published format loads from a small local file, and bad rows are named."""

from __future__ import annotations

import base64
import csv
import io
import json
import sys
from pathlib import Path

import pytest
from PIL import Image

from loupe.data import benchmarks
from loupe.data.benchmarks import (
    BENCHMARKS,
    BenchmarkFormatError,
    BenchmarkNotFoundError,
    UnknownBenchmarkError,
    load_benchmark,
)
from loupe.data.tasks import TaskRecord, write_tasks

TABLE_COLUMNS = ["index", "question", "A", "B", "C", "D", "answer", "category", "cycle_category", "image"]


def image_bytes(colour: str, size: tuple[int, int] = (40, 30), kind: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format=kind)
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def write_tsv(path: Path, columns: list[str], rows: list[dict]) -> Path:
    with path.open("w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, delimiter="\t")
        writer.writeheader()
        writer.writerows(rows)
    return path


def hrbench_rows() -> list[dict]:
    return [
        {"index": 0, "question": "What is the colour of the sign?", "A": "red", "B": "blue", "C": "green",
         "D": "white", "answer": "C", "category": "single", "cycle_category": "cycle_0",
         "image": b64(image_bytes("red", kind="JPEG"))},
        {"index": 1, "question": "Which side is the car on?\nLook closely.", "A": "left", "B": "right",
         "C": "top", "D": "bottom", "answer": "B", "category": "cross", "cycle_category": "cycle_1",
         "image": b64(image_bytes("blue", size=(50, 20)))},
    ]


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

VSTAR_INSTRUCTION = "Answer with the option's letter from the given choices directly."


def write_vstar(folder: Path, rows: list[dict]) -> None:
    for row in rows:
        image = folder / row["image"]
        image.parent.mkdir(parents=True, exist_ok=True)
        image.write_bytes(image_bytes("white", kind="JPEG"))
    (folder / "test_questions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def vstar_rows() -> list[dict]:
    return [
        {"image": "direct_attributes/sa_123.jpg", "category": "direct_attributes", "question_id": 0, "label": "A",
         "text": "What color is the woman's bag?\n(A) black\n(B) white\n(C) red\n(D) blue\n" + VSTAR_INSTRUCTION},
        {"image": "relative_position/sa_9.jpg", "category": "relative_position", "question_id": 1, "label": "B",
         "text": f"Is the cup on the left or right of the plate?\n(A) left\n(B) right\n{VSTAR_INSTRUCTION}"},
    ]


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
    real_write = benchmarks.atomic_write_bytes
    monkeypatch.setattr(benchmarks, "atomic_write_bytes", lambda p, d: (writes.append(p), real_write(p, d)))

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
    assert benchmarks._image_cell(b64(png), "w") == png  # base64 text (TSV, HR-Bench parquet)
    assert benchmarks._image_cell(png, "w") == png  # raw bytes (a binary parquet column)
    assert benchmarks._image_cell({"bytes": png, "path": None}, "w") == png  # a Hugging Face Image feature
    assert benchmarks._image_cell(" 17 ", "w") == "17"  # another row's index


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    (tmp_path / "hr_bench_4k.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match="pip install pyarrow"):
        load_benchmark("hrbench4k", tmp_path, tmp_path / "cache")


# ---------------------------------------------------------------------------------------------------------------
# VisualProbe


def visualprobe_records() -> list[dict]:
    return [
        {"doc_id": 0, "images": ["images/0.jpg"], "problem": "What is the number on the bus?", "solution": 42,
         "data_source": "visual_probe_hard"},
        {"doc_id": 1, "images": "images/1.jpg", "problem": "What brand is the cup?", "solution": "Starbucks",
         "data_source": "visual_probe_hard"},
    ]


def write_visualprobe_images(folder: Path) -> None:
    (folder / "images").mkdir()
    for i in range(2):
        (folder / "images" / f"{i}.jpg").write_bytes(image_bytes("white", kind="JPEG"))


@pytest.mark.parametrize("file_name", ["val.json", "val.jsonl"])
def test_visualprobe_reads_free_form_records(tmp_path, file_name):
    write_visualprobe_images(tmp_path)
    records = visualprobe_records()
    text = json.dumps(records) if file_name == "val.json" else "".join(json.dumps(r) + "\n" for r in records)
    (tmp_path / file_name).write_text(text)
    bench = load_benchmark("visualprobe_hard", tmp_path, tmp_path / "cache")
    first, second = bench.tasks
    assert [first.doc_id, second.doc_id] == ["visualprobe_hard-0", "visualprobe_hard-1"]
    assert first.solution == "42" and not first.is_choice and second.images == ["images/1.jpg"]
    assert {t.data_source for t in bench.tasks} == {"visualprobe_hard"}
    assert all(bench.image_paths(t)[0].is_file() for t in bench.tasks)


@pytest.mark.parametrize(
    "change, field",
    [({"problem": ""}, "problem"), ({"doc_id": None}, "doc_id"), ({"doc_id": 0}, "doc_id"),
     ({"images": ["images/7.jpg"]}, "images.0")],
)
def test_visualprobe_bad_record_is_named(tmp_path, change, field):
    write_visualprobe_images(tmp_path)
    records = visualprobe_records()
    records[1].update(change)
    (tmp_path / "val.json").write_text(json.dumps(records))
    with pytest.raises(BenchmarkFormatError, match=rf"val\.json: record 2: field '{field}'"):
        load_benchmark("visualprobe_easy", tmp_path, tmp_path / "cache")
