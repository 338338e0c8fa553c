"""Readers of the recipes' published data sets (loupe.data.recipe_formats) on fixtures in the publishers' layouts:
R1-V's hub parquet and its eval JSONL, EasyR1's geometry3k parquet, LMM-R1's stringified-message JSONL."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from PIL import Image

from loupe.data.recipe_formats import RecipeFormatError, import_tasks
from loupe.data.tasks import read_tasks
from loupe.rewards.math_grading import math_equal

FIXTURES = Path(__file__).parent / "fixtures" / "recipes"


def _png(colour: tuple[int, int, int], size: tuple[int, int] = (48, 32)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, "PNG")
    return out.getvalue()


def _hub_parquet(path: Path, columns: dict, features: dict) -> Path:
    """A parquet file as the hub serves it: written by `datasets` with its Image feature (a bytes/path struct)."""
    import datasets

    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_dict(columns, features=datasets.Features(features)).to_parquet(str(path))
    return path


def test_r1v_hub_parquet(tmp_path):
    import datasets

    source = _hub_parquet(
        tmp_path / "clevr_cogen_a_train" / "data" / "train-00000-of-00001.parquet",
        {"image": [_png((200, 0, 0)), _png((0, 200, 0))],
         "problem": ["How many items are there in the image?", "How many cubes are there?"],
         "solution": ["<answer> 3 </answer>", "<answer> 5 </answer>"]},
        {"image": datasets.Image(), "problem": datasets.Value("string"), "solution": datasets.Value("string")},
    )
    import pyarrow.parquet as pq

    assert str(pq.read_schema(source).field("image").type) == "struct<bytes: binary, path: string>"
    out = import_tasks("r1v", {"train": source}, tmp_path / "tasks")
    tasks = read_tasks(out["train"])
    assert [t.solution for t in tasks] == ["<answer> 3 </answer>", "<answer> 5 </answer>"]
    assert math_equal("3", tasks[0].solution) and not math_equal("4", tasks[0].solution)
    image = Image.open(tmp_path / "tasks" / tasks[1].images[0])
    assert image.getpixel((0, 0)) == (0, 200, 0)


def test_r1v_text_only_parquet_has_no_image_column(tmp_path):
    import datasets

    source = _hub_parquet(tmp_path / "text.parquet", {"problem": ["What is 2 + 2?"], "solution": ["<answer> 4 </answer>"]},
                          {"problem": datasets.Value("string"), "solution": datasets.Value("string")})
    [task] = read_tasks(import_tasks("r1v", {"train": source}, tmp_path / "tasks")["train"])
    assert task.images == [] and task.problem == "What is 2 + 2?"


def test_r1v_eval_prompts_as_published(tmp_path):
    out = import_tasks("r1v_eval", {"test": FIXTURES / "r1v_eval" / "prompts" / "superclevr_test200_counting_problems.jsonl"},
                       tmp_path / "superclevr", data_source="superclevr")
    tasks = read_tasks(out["test"])
    assert [t.solution for t in tasks] == ["4", "9", "10"]  # published as ints
    assert tasks[0].problem == "How many different items are there in the image?"
    assert all(t.data_source == "superclevr" and len(t.images) == 1 for t in tasks)
    geo = read_tasks(import_tasks("r1v_eval", {"test": FIXTURES / "r1v_eval" / "prompts" / "geoqa_test_prompts.jsonl"},
                                  tmp_path / "geoqa")["test"])
    assert geo[0].solution == "140°" and math_equal("140", geo[0].solution)
    assert (tmp_path / "geoqa" / geo[2].images[0]).is_file()


def test_easyr1_geometry3k_parquet(tmp_path):
    import datasets

    source = _hub_parquet(
        tmp_path / "geometry3k" / "data" / "test-00000-of-00001.parquet",
        {"images": [[_png((10, 10, 10))], [_png((20, 20, 20))]],
         "problem": ["<image>Find x. Round to the nearest tenth.", "<image>Find the area of the figure."],
         "answer": ["48", "\\frac{3}{2}"]},
        {"images": datasets.Sequence(datasets.Image()), "problem": datasets.Value("string"),
         "answer": datasets.Value("string")},
    )
    tasks = read_tasks(import_tasks("easyr1", {"test": source}, tmp_path / "tasks")["test"])
    assert tasks[0].solution == "48" and tasks[0].problem.startswith("<image>")
    assert math_equal("1.5", tasks[1].solution)


def test_lmm_r1_stringified_messages(tmp_path):
    source = FIXTURES / "lmm_r1" / "test_message.jsonl"
    assert isinstance(json.loads(source.read_text().splitlines()[0])["message"], str)  # as published
    tasks = read_tasks(import_tasks("lmm_r1", {"train": source}, tmp_path / "tasks")["train"])
    assert [t.solution for t in tasks] == ["$\\boxed{60}$", "$\\boxed{A}$"]
    assert tasks[0].problem.startswith("Which number should be written in place of the question mark?")
    assert tasks[0].problem.count("<image>") == 1
    assert "boxed" in tasks[0].system  # the data's system message, shown as the dialogue's (protocol.record_prompts)
    assert Image.open(tmp_path / "tasks" / tasks[1].images[0]).format == "JPEG"
    assert math_equal("60", tasks[0].solution) and math_equal("\\boxed{60}", tasks[0].solution)


def test_lmm_r1_text_only_rows(tmp_path):
    source = tmp_path / "fre.jsonl"
    message = [{"role": "user", "content": [{"type": "text", "text": "Compute $3 \\times 4$."}]}]
    source.write_text(json.dumps({"message": json.dumps(message), "answer": "$12$"}) + "\n")
    [task] = read_tasks(import_tasks("lmm_r1", {"train": source}, tmp_path / "tasks")["train"])
    assert task.images == [] and math_equal("12", task.solution)


@pytest.mark.parametrize(
    ("row", "message"),
    [({"answer": "1"}, "field 'message' is missing"),
     ({"message": "[{not json", "answer": "1"}, "not a JSON message list"),
     ({"message": json.dumps([{"role": "user", "content": [{"type": "image", "image": "/nowhere/x.png"}]}]),
       "answer": "1"}, "image '/nowhere/x.png' not found")],
)
def test_bad_rows_name_file_row_and_field(tmp_path, row, message):
    source = tmp_path / "bad.jsonl"
    good = json.dumps([{"role": "user", "content": "What is 0 + 0?"}])
    source.write_text(json.dumps({"message": good, "answer": "0"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(RecipeFormatError, match=message) as err:
        import_tasks("lmm_r1", {"train": source}, tmp_path / "tasks")
    assert str(err.value).startswith(f"{source}:2: ")
    assert not (tmp_path / "tasks").exists(), "nothing half-written"


def test_loupe_data_import_command(tmp_path, capsys):
    from pipelines.cli import main

    assert main(["data", "import", "lmm_r1", "--train", str(FIXTURES / "lmm_r1" / "test_message.jsonl"),
                 "--out", str(tmp_path / "tasks"), "--limit", "1", "--val-size", "0"]) == 0
    assert len(read_tasks(tmp_path / "tasks" / "train.jsonl")) == 1
    assert main(["data", "import", "r1v", "--out", str(tmp_path / "none")]) == 2
    assert "at least one of --train" in capsys.readouterr().err


def _text_rows(path: Path, count: int) -> Path:
    rows = []
    for i in range(count):
        message = [{"role": "user", "content": [{"type": "text", "text": f"Compute {i} + 1."}]}]
        rows.append(json.dumps({"message": json.dumps(message), "answer": f"${i + 1}$"}))
    path.write_text("\n".join(rows) + "\n")
    return path


def test_an_import_without_val_holds_out_a_seeded_validation_split(tmp_path, capsys):
    """The presets validate, so `loupe data import` writes val.jsonl: 5% of --train by default (at least one
    row), drawn by --seed, disjoint from train; --val-size takes a count too; a given --val is used as is."""
    from pipelines.cli import main

    source = _text_rows(tmp_path / "fre.jsonl", 40)
    assert main(["data", "import", "lmm_r1", "--train", str(source), "--out", str(tmp_path / "a")]) == 0
    train, val = read_tasks(tmp_path / "a" / "train.jsonl"), read_tasks(tmp_path / "a" / "val.jsonl")
    assert len(val) == 2 and len(train) == 38
    assert not {t.doc_id for t in train} & {t.doc_id for t in val}
    assert main(["data", "import", "lmm_r1", "--train", str(source), "--out", str(tmp_path / "b")]) == 0
    assert [t.doc_id for t in read_tasks(tmp_path / "b" / "val.jsonl")] == [t.doc_id for t in val]  # seeded
    assert main(["data", "import", "lmm_r1", "--train", str(source), "--out", str(tmp_path / "c"),
                 "--val-size", "5", "--seed", "1"]) == 0
    other = read_tasks(tmp_path / "c" / "val.jsonl")
    assert len(other) == 5 and {t.doc_id for t in other} != {t.doc_id for t in val}
    given = _text_rows(tmp_path / "val.jsonl", 3)
    assert main(["data", "import", "lmm_r1", "--train", str(source), "--val", str(given), "--out", str(tmp_path / "d")]) == 0
    assert len(read_tasks(tmp_path / "d" / "train.jsonl")) == 40 and len(read_tasks(tmp_path / "d" / "val.jsonl")) == 3
    assert main(["data", "import", "lmm_r1", "--train", str(source), "--val", str(given), "--val-size", "3",
                 "--out", str(tmp_path / "e")]) == 2
    assert "give one" in capsys.readouterr().err
    with pytest.raises(ValueError, match="leaves no training rows"):
        import_tasks("lmm_r1", {"train": _text_rows(tmp_path / "one.jsonl", 1)}, tmp_path / "f", val_size=0.05)
