"""The import teacher on a small Mini-o3-style cold-start parquet written here: no eval(), same writer, same checks."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from test_synth_support import write_params

from loupe.protocol import get_protocol
from stages.synth.__main__ import main
from stages.synth.dataset import DATASET_NAME
from stages.synth.import_formats import ImportFormatError, parse_conversations

MINI_O3 = get_protocol("mini_o3")
THEIR_SYSTEM = "You are a helpful assistant. Think, zoom with <grounding>, answer in <answer>."
OBSERVATION = MINI_O3.observation_text(1)


def encoded(colour: tuple[int, int, int], size: tuple[int, int], fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format=fmt)
    return buffer.getvalue()


ORIGINAL = encoded((200, 30, 30), (640, 480), "JPEG")
CROP = encoded((30, 200, 30), (224, 168), "PNG")
CALL = '<think>The sign is small; zoom in.</think>\n<grounding>{"bbox_2d": [0.1, 0.2, 0.4, 0.5], "source": "original_image"}</grounding>'


def row(conversations, images, names, sample):
    return {"conversations": conversations, "images": [{"bytes": b, "path": None} for b in images],
            "image_names": names, "data_source": "visual_probe", "sample_index": sample, "rollout_index": 0}


def good_dialogue(answer: str) -> list[dict[str, str]]:
    return [
        {"from": "system", "value": THEIR_SYSTEM},
        {"from": "human", "value": "<image>\nWhat colour is the sign?"},
        {"from": "gpt", "value": CALL},
        {"from": "human", "value": OBSERVATION},
        {"from": "gpt", "value": f"<think>Observation 1 shows it: {answer}.</think>\n<answer>{answer}</answer>"},
    ]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    schema = pa.schema([
        ("conversations", pa.string()),
        ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
        ("image_names", pa.list_(pa.string())),
        ("data_source", pa.string()),
        ("sample_index", pa.int64()),
        ("rollout_index", pa.int64()),
    ])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


@pytest.fixture()
def coldstart(tmp_path: Path) -> Path:
    names = ["original_image.jpg", "observation_1.png"]
    malformed = good_dialogue("red")
    malformed[2] = {"from": "gpt", "value": '<think>zoom</think>\n<grounding>{"bbox_2d": [0.1, 0.2}</grounding>'}
    rows = [
        row(repr(good_dialogue("red")), [ORIGINAL, CROP], names, 0),  # a printed Python list, single quotes
        row(json.dumps(good_dialogue("blue")), [ORIGINAL, CROP], names, 1),  # JSON works as well
        row(json.dumps([{"from": "human", "value": "<image>\nColour?"}, {"from": "gpt", "value": "<think>easy</think>\n<answer>red</answer>"}]),
            [ORIGINAL], names[:1], 2),  # answers without zooming: not a search
        row(repr(malformed), [ORIGINAL, CROP], names, 3),  # a malformed call: not a clean trajectory
        row(repr(good_dialogue("red")), [ORIGINAL, CROP], names, 0),  # the same as the first row
        row(repr(good_dialogue("red")), [b"not an image", CROP], names, 5),
    ]
    folder = tmp_path / "coldstart"
    folder.mkdir()
    write_parquet(folder / "part-0.parquet", rows[:4])
    write_parquet(folder / "part-1.parquet", rows[4:])
    return folder


def run_import(tmp_path: Path, path: Path, **settings) -> tuple[int, Path]:
    params = write_params(tmp_path / "params.yaml", {"teacher": "import", "import": {"path": str(path), "batch_rows": 4, **settings}})
    out = tmp_path / "out"
    return main(["--params", str(params), "--out", str(out), "--no-progress"]), out


def test_import_keeps_clean_searches_with_their_original_image_bytes(coldstart, tmp_path):
    code, out = run_import(tmp_path, coldstart)
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["teacher"] == "import" and metrics["trajectories"] == 6
    assert metrics["rejections"] == {"bad_image": 1, "format_errors": 1, "too_few_tool_calls": 1}
    assert metrics["accepted"] == 3 and metrics["duplicates"] == 1 and metrics["records"] == 2
    records = json.loads((out / "dataset" / f"{DATASET_NAME}.json").read_text())
    first = records[0]
    assert [m["from"] for m in first["conversations"]] == ["system", "human", "gpt", "human", "gpt"]
    assert first["conversations"][0]["value"] == MINI_O3.system_prompt()  # rl and eval prompt with this one
    assert [m["value"] for m in first["conversations"][1:]] == [m["value"] for m in good_dialogue("red")[1:]]
    images = [(out / "dataset" / p).read_bytes() for p in first["images"]]
    assert images == [ORIGINAL, CROP]  # not re-encoded
    assert first["images"][0].endswith(".jpg") and records[1]["images"][0] == first["images"][0]  # stored once
    assert (out / "viewer.html").is_file() and metrics["turns_histogram"]["2"] == 3


def test_import_can_keep_the_records_own_system_prompt_and_a_limit(coldstart, tmp_path):
    code, out = run_import(tmp_path, coldstart, system_prompt="keep", limit=2)
    assert code == 0
    records = json.loads((out / "dataset" / f"{DATASET_NAME}.json").read_text())
    assert len(records) == 2 and {r["conversations"][0]["value"] for r in records} == {THEIR_SYSTEM}


def test_code_in_a_row_is_refused_never_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    attack = "__import__('pathlib').Path('PWNED').touch() or [{'from': 'human', 'value': 'x'}]"
    path = write_parquet(tmp_path / "evil.parquet", [row(attack, [ORIGINAL], ["a.jpg"], 0)])
    code, _ = run_import(tmp_path, path)
    err = capsys.readouterr().err
    assert code == 2 and "evil.parquet: row 1: field 'conversations'" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "PWNED").exists()


def test_conversation_shapes_are_checked_by_name():
    assert parse_conversations('[{"from": "human", "value": "hi"}]', "f: row 1")[0]["value"] == "hi"
    assert parse_conversations([{"from": "gpt", "value": "x"}], "f: row 1")[0]["from"] == "gpt"
    with pytest.raises(ImportFormatError, match=r"f: row 1: field 'conversations.0.from'"):
        parse_conversations("[{'from': 'bot', 'value': 'x'}]", "f: row 1")
    with pytest.raises(ImportFormatError, match=r"field 'conversations.1'"):
        parse_conversations("[{'from': 'human', 'value': 'x'}, 'oops']", "f: row 1")
    with pytest.raises(ImportFormatError, match="non-empty list"):
        parse_conversations("{'from': 'human'}", "f: row 1")


def test_missing_columns_and_files_are_named(tmp_path, capsys):
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "other.parquet")
    code, _ = run_import(tmp_path, tmp_path / "other.parquet")
    assert code == 2 and "other.parquet: column(s) ['conversations', 'images'] missing" in capsys.readouterr().err
    code, _ = run_import(tmp_path, tmp_path / "absent")
    assert code == 2 and "absent is neither a file nor a folder" in capsys.readouterr().err


def test_a_folder_with_a_train_split_imports_only_its_train_files(tmp_path):
    from stages.synth.importer import data_files

    folder = tmp_path / "Mini-o3-Coldstart-Dataset" / "data"
    folder.mkdir(parents=True)
    for name in ("train-00000-of-00002.parquet", "train-00001-of-00002.parquet", "test-00000-of-00001.parquet"):
        write_parquet(folder / name, [row(json.dumps(good_dialogue("red")), [ORIGINAL, CROP], ["a.jpg", "b.png"], 0)])
    assert [f.name for f in data_files(folder.parent)] == ["train-00000-of-00002.parquet", "train-00001-of-00002.parquet"]


def test_a_rollout_index_that_is_not_a_number_is_named(tmp_path, capsys):
    names = ["original_image.jpg", "observation_1.png"]
    bad = {**row(json.dumps(good_dialogue("red")), [ORIGINAL, CROP], names, 0), "rollout_index": "first"}
    schema = pa.schema([("conversations", pa.string()),
                        ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
                        ("image_names", pa.list_(pa.string())), ("data_source", pa.string()),
                        ("sample_index", pa.int64()), ("rollout_index", pa.string())])
    pq.write_table(pa.Table.from_pylist([bad], schema=schema), tmp_path / "rows.parquet")
    code, _ = run_import(tmp_path, tmp_path / "rows.parquet")
    assert code == 2 and "field 'rollout_index': 'first' is not a whole number" in capsys.readouterr().err


def test_a_train_folder_is_the_train_split_too(tmp_path):
    from stages.synth.importer import data_files

    for split in ("train", "test"):
        (tmp_path / "data" / split).mkdir(parents=True)
        write_parquet(tmp_path / "data" / split / "0000.parquet",
                      [row(json.dumps(good_dialogue("red")), [ORIGINAL, CROP], ["a.jpg", "b.png"], 0)])
    assert data_files(tmp_path) == [tmp_path / "data" / "train" / "0000.parquet"]


PIXEL_CALL = ('<think>The label is small.</think>\n<tool_call>\n{"name": "crop_image_normalized", "arguments": '
              '{"bbox_2d": [0.1, 0.2, 0.5, 0.6], "target_image": 1}}\n</tool_call>')


def pixel_reasoner_row(answer: str, image: str, crop: str) -> dict:
    """One PixelReasoner-SFT-Data row (instruction_tuning/sft_tooltrainer.py:372-380 renders `message_list`)."""
    from loupe.protocol.pixel_reasoner import PIXEL_REASONER_OBSERVATION

    return {"message_list": [
        {"role": "system", "content": [{"type": "text", "text": "You are a helpful assistant."}]},
        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Which colour?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": PIXEL_CALL}]},
        {"role": "user", "content": [{"text": PIXEL_REASONER_OBSERVATION.format(width=224, height=168)},
                                     {"image": crop}]},
        {"role": "assistant", "content": f"<think>It is {answer}.</think>\n\\boxed{{{answer}}}"},
    ], "question_image_path": image, "qid": f"q-{answer}"}


def test_pixel_reasoner_sft_data_imports_its_message_lists_with_images_from_the_zip(tmp_path):
    import zipfile

    folder = tmp_path / "PixelReasoner-SFT-Data"
    folder.mkdir()
    with zipfile.ZipFile(folder / "images.zip", "w") as archive:
        archive.writestr("images/a.jpg", ORIGINAL)
        archive.writestr("images/a_crop.png", CROP)
    rows = [pixel_reasoner_row("red", "images/a.jpg", "images/a_crop.png"),
            pixel_reasoner_row("blue", "/home/ma-user/data/images/a.jpg", "images/a_crop.png")]
    (folder / "release.json").write_text(json.dumps(rows))
    params = write_params(tmp_path / "params.yaml", {"teacher": "import", "import": {"format": "pixel_reasoner",
                                                                                   "path": str(folder)}},
                          protocol={"name": "pixel_reasoner"})
    code = main(["--params", str(params), "--out", str(tmp_path / "out"), "--no-progress"])
    assert code == 0
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["trajectories"] == 2 and metrics["accepted"] == 2, metrics
    records = json.loads((tmp_path / "out" / "dataset" / f"{DATASET_NAME}.json").read_text())
    first = records[0]
    assert [m["from"] for m in first["conversations"]] == ["system", "human", "gpt", "human", "gpt"]
    assert first["conversations"][1]["value"] == "<image>Which colour?"
    assert first["conversations"][2]["value"] == PIXEL_CALL
    assert [(tmp_path / "out" / "dataset" / p).read_bytes() for p in first["images"]] == [ORIGINAL, CROP]


def test_r1v_cot_rows_become_one_turn_with_the_image_after_the_problem(tmp_path):
    import datasets

    source = tmp_path / "Clevr_CoGenT_TrainA_R1" / "data" / "train-00000-of-00001.parquet"
    source.parent.mkdir(parents=True)
    datasets.Dataset.from_dict(
        {"image": [ORIGINAL], "problem": ["How many objects are there?"],
         "thinking": ["<think>I count three cubes.</think>"], "solution": ["<answer> 3 </answer>"]},
        features=datasets.Features({"image": datasets.Image(), "problem": datasets.Value("string"),
                                    "thinking": datasets.Value("string"), "solution": datasets.Value("string")}),
    ).to_parquet(str(source))
    params = write_params(tmp_path / "params.yaml", {"teacher": "import", "min_tool_calls": 0,
                                                     "import": {"format": "r1v_cot", "path": str(source.parent.parent),
                                                                "system_prompt": "keep"}},
                          protocol={"name": "single_turn", "max_turns": 1})
    assert main(["--params", str(params), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    [record] = json.loads((tmp_path / "out" / "dataset" / f"{DATASET_NAME}.json").read_text())
    from stages.synth.import_formats import R1V_SYSTEM_PROMPT

    assert record["conversations"] == [
        {"from": "system", "value": R1V_SYSTEM_PROMPT},
        {"from": "human", "value": "How many objects are there?<image>"},
        {"from": "gpt", "value": "<think>I count three cubes.</think>\n\n<answer> 3 </answer>"}]
    assert (tmp_path / "out" / "dataset" / record["images"][0]).read_bytes() == ORIGINAL


def test_a_pixel_reasoner_row_with_a_missing_image_names_it(tmp_path, capsys):
    (tmp_path / "sft.json").write_text(json.dumps([pixel_reasoner_row("red", "images/none.jpg", "images/none.png")]))
    params = write_params(tmp_path / "params.yaml", {"teacher": "import", "import": {"format": "pixel_reasoner",
                                                                                   "path": str(tmp_path / "sft.json")}})
    assert main(["--params", str(params), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    assert "sft.json:1: field 'message_list.1.content.0.image': image 'images/none.jpg' not found" in capsys.readouterr().err
