"""Benchmark readers on the publishers' own layouts: each fixture is what its publisher's loader reads, and Loupe
reads it the same way, including image placeholders and paths one level off."""

from __future__ import annotations

import ast
import base64
import io
import json
import os
import string

import pytest
from PIL import Image
from published_benchmarks import (
    HRBENCH_COLUMNS,
    MME_COLUMNS,
    build_hrbench,
    build_mme_realworld_lite,
    build_synthetic,
    build_visualprobe,
    build_vstar,
)

from loupe.data import benchmark_rows
from loupe.data.benchmarks import (
    BenchmarkFormatError,
    BenchmarkNotFoundError,
    load_benchmark,
)
from loupe.data.tasks import TaskRecord, write_tasks
from loupe.protocol import IMAGE_PLACEHOLDER
from tests.benchmark_cases import (
    TABLE_COLUMNS,
    hrbench_rows,
    image_bytes,
    vstar_rows,
    write_tsv,
    write_vstar,
)

# ---------------------------------------------------------------------------------------------------------------
# The published layouts: each fixture is what its publisher's loader reads, and Loupe reads it the same way


def test_vstar_fixture_is_what_the_v_star_eval_script_reads(tmp_path):
    copy = build_vstar(tmp_path)
    # vstar_bench_eval.py (eval_model): per category folder, every non-.json file is an image and the file of the
    # same stem with .json its annotation, whose first option is the right one.
    right = {}
    for test_type in ["direct_attributes", "relative_position"]:
        folder = os.path.join(copy.path, test_type)
        for image_file in [f for f in os.listdir(folder) if ".json" not in f]:
            image_path = os.path.join(folder, image_file)
            with open(os.path.splitext(image_path)[0] + ".json") as f:  # V* splits off the suffix by hand
                annotation = json.load(f)
            Image.open(image_path).convert("RGB")
            right[annotation["question"]] = annotation["options"][0]
    assert right == {q.problem: q.answer for q in copy.questions}
    # test_questions.jsonl as letter-based evaluators read it: image joined to the benchmark folder, label a letter.
    for line in (copy.path / "test_questions.jsonl").read_text().splitlines():
        example = json.loads(line)
        assert os.path.exists(os.path.join(copy.path, example["image"]))
        option = next(row for row in example["text"].splitlines() if row.startswith(f"({example['label']}) "))
        assert option[4:] == right[example["text"].splitlines()[0]]


@pytest.mark.parametrize("with_question_file", [True, False])
def test_vstar_reads_both_published_layouts(tmp_path, with_question_file):
    copy = build_vstar(tmp_path, with_question_file)
    check_loaded(copy, load_benchmark("vstar", copy.path, tmp_path / "cache"))


def test_vstar_folders_read_only_image_files_beside_their_annotations(tmp_path):
    copy = build_vstar(tmp_path, with_question_file=False)
    (copy.path / "direct_attributes" / "notes.txt").write_text("not an image")
    (copy.path / "direct_attributes" / "notes.json").write_text('{"question": "?", "options": ["a", "b"]}')
    check_loaded(copy, load_benchmark("vstar", copy.path, tmp_path / "cache"))  # the same questions as without them


def test_a_jsonl_line_may_hold_a_unicode_line_separator_inside_a_string(tmp_path):
    write_vstar(tmp_path, vstar_rows())
    rows = [json.loads(line) for line in (tmp_path / "test_questions.jsonl").read_text().splitlines()]
    rows[0]["category"] = "direct\u2028attributes"
    (tmp_path / "test_questions.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    assert "\u2028" in (tmp_path / "test_questions.jsonl").read_text()
    benchmark = load_benchmark("vstar", tmp_path, tmp_path / "cache")
    assert benchmark.tasks[0].category == "direct\u2028attributes"


def test_vstar_option_order_of_the_per_question_files_is_fixed_and_spread(tmp_path):
    copy = build_vstar(tmp_path, with_question_file=False)
    first = load_benchmark("vstar", copy.path, tmp_path / "cache").tasks
    again = load_benchmark("vstar", copy.path, tmp_path / "cache").tasks
    assert [t.options for t in first] == [t.options for t in again]
    assert {t.solution for t in first} != {"A"}  # the right option is not always first, as the files hold it


def test_hrbench_fixture_is_what_vlmevalkit_reads(tmp_path):
    pd = pytest.importorskip("pandas")
    for resolution, file_format in (("4k", "tsv"), ("8k", "parquet")):
        copy = build_hrbench(tmp_path, resolution, file_format)
        file = copy.path / f"hr_bench_{resolution}.{file_format}"
        # VLMEvalKit's load() reads TSVs with pandas; HRBench's build_prompt takes A-Z columns that are not NaN.
        data = pd.read_csv(file, sep="\t") if file_format == "tsv" else pd.read_parquet(file)
        assert list(data.columns) == HRBENCH_COLUMNS
        for (_, line), question in zip(data.iterrows(), copy.questions, strict=True):
            options = {c: line[c] for c in string.ascii_uppercase if c in line and not pd.isna(line[c])}
            assert line["question"] == question.problem and options[line["answer"]] == question.answer
            with Image.open(io.BytesIO(base64.b64decode(line["image"]))) as image:
                assert close(image.convert("RGB").getpixel((5, 5)), question.colour)


@pytest.mark.parametrize("resolution, file_format", [("4k", "tsv"), ("4k", "parquet"), ("8k", "tsv"), ("8k", "parquet")])
def test_hrbench_reads_the_published_files(tmp_path, resolution, file_format):
    copy = build_hrbench(tmp_path, resolution, file_format)
    check_loaded(copy, load_benchmark(copy.benchmark, copy.path, tmp_path / "cache"))


def test_hrbench_never_reads_the_other_resolution(tmp_path):
    copy = build_hrbench(tmp_path, "4k", "tsv")
    with pytest.raises(BenchmarkNotFoundError, match="hr_bench_8k"):
        load_benchmark("hrbench8k", copy.path, tmp_path / "cache")


def test_mme_realworld_lite_fixture_is_what_vlmevalkit_reads(tmp_path):
    pd = pytest.importorskip("pandas")
    copy = build_mme_realworld_lite(tmp_path)
    # VLMEvalKit's MMERealWorld.load_data: pandas reads the TSV; each options cell is a Python-literal list whose
    # entries lose their "(X) " prefix (VLMEvalKit uses eval; literal_eval reads the same literals).
    data = pd.read_csv(copy.path / "mme_realworld_lite.tsv", sep="\t")
    assert list(data.columns) == MME_COLUMNS
    for (_, item), question in zip(data.iterrows(), copy.questions, strict=True):
        options = ast.literal_eval(item["multi-choice options"])
        assert [o[4:] for o in options] == list(question.options)
        assert options["ABCDE".index(item["answer"])][4:] == question.answer
    assert "\"(C) the driver's side is blue\"" in (copy.path / "mme_realworld_lite.tsv").read_text()


@pytest.mark.parametrize("file_name", ["mme_realworld_lite.tsv", "MME-RealWorld-Lite.tsv"])
def test_mme_realworld_lite_reads_the_published_file(tmp_path, file_name):
    copy = build_mme_realworld_lite(tmp_path, file_name)
    bench = load_benchmark("MME-RealWorld-Lite", copy.path, tmp_path / "cache")
    check_loaded(copy, bench)
    assert bench.tasks[1].options[2] == "the driver's side is blue"
    assert bench.tasks[0].model_dump()["l2_category"] == "object_counting"


@pytest.mark.parametrize(
    "cell, message",
    [("['(A) red', '(B) blue'", "not a Python list literal"), ("[__import__('os').getcwd()]", "not a Python list"),
     ("['(A) red', '(C) blue']", r"\(B\) <text> was due"), ("['(A) red', 'blue']", "every entry"),
     ("{'A': 'red'}", r"no '\(A\) \.\.\.' option lines"), ("[" * 5000 + "]" * 5000, "not a Python list")],
)
def test_mme_realworld_lite_bad_options_cell_is_named(tmp_path, cell, message):
    pd = pytest.importorskip("pandas")
    copy = build_mme_realworld_lite(tmp_path)
    file = copy.path / "mme_realworld_lite.tsv"
    data = pd.read_csv(file, sep="\t")
    data.loc[1, "multi-choice options"] = cell
    data.to_csv(file, sep="\t", index=False)
    with pytest.raises(BenchmarkFormatError, match=rf"row 2 .*field 'multi-choice options': .*{message}"):
        load_benchmark("mme_realworld_lite", copy.path, tmp_path / "cache")


def test_visualprobe_fixture_is_what_mini_o3_reads(tmp_path):
    pd = pytest.importorskip("pandas")
    for difficulty in ("easy", "medium", "hard"):
        copy = build_visualprobe(tmp_path, difficulty)
        assert copy.path.name == f"VisualProbe_{difficulty.capitalize()}"
        # MultiModalDataset._read_files_and_tokenize: json.load, a DataFrame; make_conversation_multimodal joins
        # each image path to BASE_IMAGE_DIR (here tmp_path) and sends `problem` as the user turn.
        with open(copy.path / "val.json") as f:
            json_data = json.load(f)
        frame = pd.DataFrame(json_data)
        assert list(frame.columns) == ["images", "doc_id", "problem", "solution", "data_source"]
        for row, question in zip(json_data, copy.questions, strict=True):
            assert all(os.path.exists(os.path.join(str(tmp_path), image)) for image in row["images"])
            assert row["problem"] == "<image>\n" + question.problem and row["solution"] == question.answer
            assert row["data_source"] == f"visual_probe_{difficulty}" and isinstance(row["doc_id"], str)
        check_loaded(copy, load_benchmark(copy.benchmark, copy.path, tmp_path / "cache"))


def test_synthetic_fixture_loads(tmp_path):
    copy = build_synthetic(tmp_path)
    check_loaded(copy, load_benchmark("synthetic", copy.path, tmp_path / "cache"))


def check_loaded(copy, bench) -> None:
    """Every fixture question came through with its text, options, right answer, category and image."""
    by_problem: dict[str, list] = {}
    for task in bench.tasks:
        by_problem.setdefault(task.problem, []).append(task)
    assert len(bench.tasks) == len(copy.questions)
    for question in copy.questions:
        task = by_problem[question.problem].pop(0)
        assert IMAGE_PLACEHOLDER not in task.problem and task.data_source == copy.benchmark
        assert task.answer_text() == question.answer
        assert (task.options is None) == (question.options is None)
        if question.options is not None:
            assert sorted(task.options) == sorted(question.options)
            if question.letter is not None:
                assert list(task.options) == list(question.options) and task.solution == question.letter
        assert task.category == question.category
        (path,) = bench.image_paths(task)
        with Image.open(path) as image:
            assert close(image.convert("RGB").getpixel((5, 5)), question.colour)


def close(pixel, colour, tolerance: int = 8) -> bool:
    return all(abs(a - b) <= tolerance for a, b in zip(pixel, colour, strict=True))


# ---------------------------------------------------------------------------------------------------------------
# Image placeholders and paths one level off


@pytest.mark.parametrize(
    "text, expected",
    [("<image>\nWhat is it?", "What is it?"), ("<image><image>\nWhat is it?", "What is it?"),
     ("What is it?\n<image>", "What is it?"), ("Look at <image> the sign.", "Look at the sign."),
     ("No placeholder here.", "No placeholder here.")],
)
def test_image_placeholders_leave_the_question(text, expected):
    assert benchmark_rows._without_placeholders(text) == expected


def test_a_placeholder_in_any_format_is_removed(tmp_path):
    rows = hrbench_rows()
    rows[0]["question"] = "<image>\nWhat is the colour of the sign?"
    bench = load_benchmark("hrbench4k", write_tsv(tmp_path / "hr.tsv", TABLE_COLUMNS, rows), tmp_path / "cache")
    assert bench.tasks[0].problem == "What is the colour of the sign?"
    record = TaskRecord(doc_id="s-1", images=["a.png"], problem="<image>\nColour?", solution="red")
    (tmp_path / "a.png").write_bytes(image_bytes("red"))
    write_tasks([record], tmp_path / "test.jsonl")
    assert load_benchmark("synthetic", tmp_path, tmp_path / "cache").tasks[0].problem == "Colour?"


@pytest.mark.parametrize(
    "benchmark, build, inner",
    [
        ("visualprobe_hard", lambda root: build_visualprobe(root, "hard"), "data"),
        ("vstar", build_vstar, "direct_attributes"),
        ("vstar", lambda root: build_vstar(root, with_question_file=False), "relative_position"),
        ("hrbench4k", lambda root: build_hrbench(root, "4k", "tsv"), None),
        ("mme_realworld_lite", build_mme_realworld_lite, None),
        ("synthetic", build_synthetic, "images"),
    ],
)
def test_a_path_one_level_off_says_which_to_give(tmp_path, benchmark, build, inner):
    copy = build(tmp_path / "downloads")
    with pytest.raises(BenchmarkNotFoundError) as err:
        load_benchmark(benchmark, copy.path.parent, tmp_path / "cache")
    assert f"{copy.path} does: give that path" in str(err.value)
    if inner is not None:
        with pytest.raises(BenchmarkNotFoundError) as err:
            load_benchmark(benchmark, copy.path / inner, tmp_path / "cache")
        assert f"give its parent {copy.path}" in str(err.value)


def test_the_parent_of_all_three_visualprobe_copies_names_the_right_one(tmp_path):
    for difficulty in ("easy", "medium", "hard"):
        build_visualprobe(tmp_path, difficulty)
    with pytest.raises(BenchmarkNotFoundError, match=r"VisualProbe_Medium does: give that path"):
        load_benchmark("visualprobe_medium", tmp_path, tmp_path / "cache")
