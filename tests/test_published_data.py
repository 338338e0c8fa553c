"""`loupe data import` on the seeds' data sets as each publisher ships them (tests/published_data.py writes them
from the publishers' loader code): Mini-o3's JSON lists under BASE_IMAGE_DIR, DeepEyes' verl parquet files,
Pixel-Reasoner's parquet and images.zip, EasyR1's keys, shards and videos, R1-V's evaluation layout, benchmarks
as validation splits, and hostile rows that must fail naming file, row and field with nothing written."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
from PIL import Image

from loupe.data.published import RecipeFormatError
from loupe.data.recipe_formats import import_tasks
from loupe.data.tasks import read_tasks
from pipelines.cli import main
from tests.published_data import (
    DEEPEYES_SYSTEM,
    DEEPEYES_USER_SUFFIX,
    deepeyes_row,
    png,
    questions,
    write_deepeyes,
    write_mini_o3,
    write_pixel_reasoner,
)

FIXTURES = Path(__file__).parent / "fixtures" / "recipes"


def _colour(folder: Path, image: str) -> tuple[int, int, int]:
    return Image.open(folder / image).convert("RGB").getpixel((0, 0))


# --- Mini-o3 ------------------------------------------------------------------------------------------------


def _mini_o3_base(tmp_path: Path) -> Path:
    base = tmp_path / "datasets"  # BASE_IMAGE_DIR
    write_mini_o3(base, "VisualProbe_train", "train", questions(3), "visual_probe_train")
    write_mini_o3(base, "DeepEyes_train_4K", "train", questions(2, offset=3), "deepeyes_train", first_id=100)
    write_mini_o3(base, "VisualProbe_Hard", "val", questions(2, offset=5), "visual_probe_hard")
    return base


def test_mini_o3_rl_sets_concatenate_as_upstream_with_every_row_s_source(tmp_path):
    base = _mini_o3_base(tmp_path)
    assert main(["data", "import", "mini_o3", "--train", str(base / "VisualProbe_train" / "train.json"),
                 str(base / "DeepEyes_train_4K" / "train.json"), "--val", str(base / "VisualProbe_Hard" / "val.json"),
                 "--image-dir", str(base), "--out", str(tmp_path / "tasks")]) == 0
    train = read_tasks(tmp_path / "tasks" / "train.jsonl", check_images=True)
    assert [t.data_source for t in train] == ["visual_probe_train"] * 3 + ["deepeyes_train"] * 2
    assert [t.source_id for t in train] == ["0", "1", "2", "100", "101"]
    assert train[0].problem.startswith("<image>\nWhat colour") and train[3].solution == "yellow"
    assert _colour(tmp_path / "tasks", train[1].images[0]) == (30, 170, 40)
    val = read_tasks(tmp_path / "tasks" / "val.jsonl")
    assert [t.data_source for t in val] == ["visual_probe_hard"] * 2


def test_mini_o3_images_default_to_the_folder_above_the_file(tmp_path):
    base = _mini_o3_base(tmp_path)
    out = import_tasks("mini_o3", {"train": [base / "VisualProbe_train"]}, tmp_path / "tasks")
    assert len(read_tasks(out["train"], check_images=True)) == 3  # a folder gives its train.json


def test_a_benchmark_becomes_the_validation_split(tmp_path):
    """Mini-o3 validates on VisualProbe; `--val-benchmark` reads it with the eval stage's reader."""
    base = _mini_o3_base(tmp_path)
    assert main(["data", "import", "mini_o3", "--train", str(base / "VisualProbe_train"),
                 "--val-benchmark", "visualprobe_hard", str(base / "VisualProbe_Hard"),
                 "--val-benchmark", "superclevr", str(FIXTURES / "r1v_eval" / "prompts"),
                 "--out", str(tmp_path / "tasks")]) == 0
    val = read_tasks(tmp_path / "tasks" / "val.jsonl", check_images=True)
    assert [t.data_source for t in val] == ["visualprobe_hard"] * 2 + ["superclevr"] * 3
    assert val[0].doc_id.startswith("visualprobe_hard-") and val[2].solution == "4"
    assert _colour(tmp_path / "tasks", val[0].images[0]) == (30, 170, 40)  # question 5: green
    assert len(read_tasks(tmp_path / "tasks" / "train.jsonl")) == 3  # nothing held out of train


# --- DeepEyes -----------------------------------------------------------------------------------------------


def _deepeyes_folder(tmp_path: Path) -> Path:
    """The hub folder DeepEyes-Datasets-47k: three parquet files at its root."""
    folder = tmp_path / "DeepEyes-Datasets-47k"
    items = questions(4)
    write_deepeyes(folder / "data_0.1.2_visual_toolbox_v2.parquet",
                   [deepeyes_row(items[0], 0, "vstar"), deepeyes_row(items[1], 1, "chart")])
    write_deepeyes(folder / "data_v0.8_visual_toolbox_v2.parquet", [deepeyes_row(items[2], 2, "vl_agent")])
    text_only = questions(1, offset=9)[0]
    text_only.image = None
    write_deepeyes(folder / "data_thinklite_reasoning_acc.parquet",
                   [deepeyes_row(items[3], 3, "thinklite_eureka", env_name=""),
                    deepeyes_row(text_only, 4, "thinklite_eureka", env_name=None)])
    return folder


def test_deepeyes_parquet_keeps_what_upstream_trains_and_scores_on(tmp_path):
    folder = _deepeyes_folder(tmp_path)
    out = import_tasks("deepeyes", {"train": [folder]}, tmp_path / "tasks", val_size=0)
    tasks = read_tasks(out["train"], check_images=True)
    # The folder's three files in name order, each row's own data_source (verl's reward dispatch key).
    assert [t.data_source for t in tasks] == ["vstar", "chart", "thinklite_eureka", "thinklite_eureka", "vl_agent"]
    assert [t.tools for t in tasks] == [True, True, False, False, True]  # env_name empty or null: no tool
    first = tasks[0]
    assert first.problem == "What colour is the picture? (0)"  # extra_info.question: what the judge reads
    assert first.system == DEEPEYES_SYSTEM
    assert first.prompt == "<image>\nWhat colour is the picture? (0)" + DEEPEYES_USER_SUFFIX
    assert first.solution == "red" and first.source_id == "0"
    assert first.model_extra["extra_info"] == {"answer": "red", "index": 0, "question": "What colour is the picture? (0)"}
    assert tasks[3].images == [] and "<image>" not in tasks[3].prompt
    assert _colour(tmp_path / "tasks", first.images[0]) == (200, 30, 30)


def test_a_deepeyes_row_without_a_tool_is_single_turn_and_its_source_picks_its_judge(tmp_path):
    from loupe.config import ProtocolParams
    from loupe.protocol import make_protocol
    from loupe.rewards.config import RewardConfig
    from loupe.rollout.loop import run_rollouts
    from tests.test_rollout_loop import ScriptedEngine, call

    folder = _deepeyes_folder(tmp_path)
    tasks = read_tasks(import_tasks("deepeyes", {"train": [folder]}, tmp_path / "tasks")["train"])
    params = ProtocolParams(name="deepeyes", system_prompt="the preset's own system prompt")
    zoom = '<think>look</think><tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [0, 0, 20, 20]}}</tool_call>'
    engine = ScriptedEngine([[zoom, "<answer>red</answer>"]])
    done = run_rollouts([tasks[0], tasks[2]], engine, params, tmp_path / "tasks", max_new_tokens=64)
    assert done[0].num_tool_calls == 1 and len([t for t in done[0].turns if t.role == "assistant"]) == 2
    assert len([t for t in done[1].turns if t.role == "assistant"]) == 1  # env_name empty: one turn, no call run
    assert done[0].system == DEEPEYES_SYSTEM and done[0].turns[0].text == tasks[0].prompt  # the row's own words
    own = ProtocolParams(name="deepeyes", system_prompt="the preset's own", record_prompts=False)
    assert make_protocol(own).question_text(tasks[0]) == "<image>\n" + tasks[0].problem
    assert make_protocol(own).task_system_prompt(tasks[0]) == "the preset's own"
    # The preset's by_data_source: a thinklite_eureka row is scored by DeepEyes' math rule and its judge.
    import yaml

    reward = yaml.safe_load(Path("params/deepeyes.yaml").read_text())["rl"]["reward"]
    config = RewardConfig.model_validate(reward)
    assert config.for_source(tasks[2].data_source).free_form_match == "deepeyes_math"
    assert config.for_source(tasks[0].data_source).free_form_match == "deepeyes"
    # A verl compute_score gets the row's own extra_info, as DeepEyes' reward manager passes it (naive.py:76).
    from loupe.rewards.custom import load_custom_reward

    reward_file = tmp_path / "reward.py"
    reward_file.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                           "    return float(extra_info['question'].endswith('(0)') and data_source == 'vstar')\n")
    verl = load_custom_reward(f"{reward_file}:compute_score")
    assert verl(task=tasks[0], response="<answer>red</answer>").total == 1.0


# --- Pixel-Reasoner ------------------------------------------------------------------------------------------


def test_pixel_reasoner_parquet_reads_images_from_the_zip_and_videos_as_frame_folders(tmp_path):
    items = questions(3)
    frames = [png((10 * k, 0, 0), (32, 32)) for k in range(4)]
    source = write_pixel_reasoner(tmp_path / "PixelReasoner-RL-Data", "release", items, videos={2: frames})
    out = import_tasks("pixel_reasoner", {"train": [source]}, tmp_path / "tasks")
    tasks = read_tasks(out["train"], check_images=True)
    assert [t.source_id for t in tasks] == ["q0", "q1", "q2"] and tasks[1].solution == "green"
    assert tasks[0].problem == items[0].text and _colour(tmp_path / "tasks", tasks[0].images[0]) == (200, 30, 30)
    clip = tmp_path / "tasks" / tasks[2].video
    assert tasks[2].images == [] and sorted(p.name for p in clip.iterdir()) == [f"{k:05d}.png" for k in range(4)]
    from loupe.video import read_clip

    assert [f.getpixel((0, 0)) for f in read_clip(tasks[2].video, tmp_path / "tasks")] == [(0, 0, 0), (10, 0, 0),
                                                                                          (20, 0, 0), (30, 0, 0)]


def test_pixel_reasoner_reads_the_unpacked_folder_and_prepare_sh_s_renamed_paths(tmp_path):
    import pyarrow.parquet as pq

    source = write_pixel_reasoner(tmp_path / "VStar-EvalData-PixelReasoner", "vstar", questions(2), zipped=False)
    assert len(read_tasks(import_tasks("pixel_reasoner", {"test": [source]}, tmp_path / "a")["test"])) == 2
    # prepare.sh moves images/ to data/<name>_images and rename_imagepath.py prefixes every path with it, on
    # the authors' machine: the paths are found again by their trailing parts.
    data = tmp_path / "curiosity_driven_rl" / "data"
    data.mkdir(parents=True)
    (source.parent / "images").rename(data / "vstar_images")
    table = pq.read_table(source).to_pylist()
    for row in table:
        row["image"] = [f"/home/ma-user/work/curiosity_driven_rl/data/vstar_{p}" for p in row["image"]]
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(table), data / "vstar.parquet")
    tasks = read_tasks(import_tasks("pixel_reasoner", {"test": [data / "vstar.parquet"]}, tmp_path / "b")["test"],
                       check_images=True)
    assert _colour(tmp_path / "b", tasks[1].images[0]) == (30, 170, 40)


# --- EasyR1, R1-V, LMM-R1 ------------------------------------------------------------------------------------


def test_easyr1_keys_image_dir_shards_and_videos(tmp_path):
    import datasets

    images = tmp_path / "imgs"
    images.mkdir()
    (images / "a.png").write_bytes(png((1, 2, 3)))
    (images / "clip.mp4").write_bytes(b"not decoded at import")
    shards = tmp_path / "hub" / "data"
    for k in range(2):  # the hub's sharded layout: data/train-0000k-of-00002.parquet, and a test file beside
        datasets.Dataset.from_dict({"question": [f"Q{k}?"], "label": [str(k)], "pics": [["a.png"]],
                                    "clips": [[]]}).to_parquet(str(shards / f"train-0000{k}-of-00002.parquet"))
    datasets.Dataset.from_dict({"question": ["<video>Which way does it move?"], "label": ["left"], "pics": [[]],
                                "clips": [["clip.mp4"]]}).to_parquet(str(shards / "test-00000-of-00001.parquet"))
    keys = ["--prompt-key", "question", "--answer-key", "label", "--image-key", "pics", "--video-key", "clips"]
    assert main(["data", "import", "easyr1", "--train", str(tmp_path / "hub"), "--test", str(tmp_path / "hub"),
                 "--image-dir", str(images), "--val-size", "0", "--out", str(tmp_path / "tasks"), *keys]) == 0
    train = read_tasks(tmp_path / "tasks" / "train.jsonl", check_images=True)
    assert [(t.problem, t.solution) for t in train] == [("Q0?", "0"), ("Q1?", "1")]
    [video] = read_tasks(tmp_path / "tasks" / "test.jsonl")
    assert video.problem == "Which way does it move?" and (tmp_path / "tasks" / video.video).read_bytes().startswith(b"not")
    assert main(["data", "import", "easyr1", "--test", str(tmp_path / "hub"), "--image-dir", str(images),
                 "--videos", "refuse", "--out", str(tmp_path / "refused"), *keys]) == 2
    assert not (tmp_path / "refused").exists()
    assert main(["data", "import", "mini_o3", "--train", str(tmp_path / "hub"), "--prompt-key", "q",
                 "--out", str(tmp_path / "x")]) == 2  # EasyR1's keys belong to its reader alone


def test_r1v_eval_sets_in_upstream_s_readme_layout(tmp_path):
    """R1-V's scripts run in src/eval and open ./images/... beside prompts/ (README): import and benchmark alike."""
    prompts = FIXTURES / "r1v_eval" / "prompts"
    tasks = read_tasks(import_tasks("r1v_eval", {"test": [prompts / "superclevr_test200_counting_problems.jsonl"]},
                                    tmp_path / "superclevr")["test"], check_images=True)
    assert [t.solution for t in tasks] == ["4", "9", "10"]
    from loupe.data.benchmarks import load_benchmark

    geoqa = load_benchmark("geoqa", prompts / "geoqa_test_prompts.jsonl", tmp_path / "cache")
    assert geoqa.image_root == FIXTURES / "r1v_eval" and geoqa.tasks[0].images == ["Geo170K/images/test/0.png"]
    assert all(p.is_file() for t in geoqa.tasks for p in geoqa.image_paths(t))


def test_a_hub_name_is_named_as_one_never_fetched(tmp_path, capsys):
    assert main(["data", "import", "easyr1", "--train", "hiyouga/geometry3k", "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert "looks like a hub name" in err and "nothing is downloaded" in err


# --- hostile rows ---------------------------------------------------------------------------------------------


def _mini_o3_with(tmp_path: Path, change) -> tuple[Path, Path]:
    base = _mini_o3_base(tmp_path)
    path = base / "VisualProbe_train" / "train.json"
    records = json.loads(path.read_text())
    change(records[1], base)
    path.write_text(json.dumps(records))
    return base, path


@pytest.mark.parametrize(("change", "field", "message"), [
    (lambda r, b: r.pop("solution"), "solution", "is missing"),
    (lambda r, b: r.update(solution={"colour": "red"}), "solution", "is dict, expected str or int or float"),
    (lambda r, b: r.update(solution=["red"]), "solution", "is list"),
    (lambda r, b: r.update(images=["../../etc/secret.png"]), "images.0", "leaves the folder it is read from"),
    (lambda r, b: (b / r["images"][0]).write_bytes(b"\x89PNG\r\n\x1a\n broken"), "images.0", "not a readable image"),
    (lambda r, b: r.update(images=["VisualProbe_train/images/none.png"]), "images.0", "not found"),
])
def test_a_hostile_mini_o3_row_names_file_row_and_field_and_writes_nothing(tmp_path, change, field, message):
    base, path = _mini_o3_with(tmp_path, change)
    with pytest.raises(RecipeFormatError) as err:
        import_tasks("mini_o3", {"train": [path]}, tmp_path / "tasks", image_dir=base)
    assert str(err.value).startswith(f"{path}:2: "), err.value
    assert message in str(err.value) and (field is None or f"'{field}'" in str(err.value))
    assert not (tmp_path / "tasks").exists(), "nothing half-written"


def test_a_zip_entry_escaping_the_archive_is_refused(tmp_path):
    source = write_pixel_reasoner(tmp_path / "rl", "release", questions(2))
    with zipfile.ZipFile(source.parent / "images.zip", "a") as archive:
        archive.writestr("../outside.png", png((0, 0, 0)))
    with pytest.raises(RecipeFormatError, match=r"release.parquet:1: field 'image.0': .*images.zip: zip entry "
                                                r"'../outside.png' escapes the archive"):
        import_tasks("pixel_reasoner", {"train": [source]}, tmp_path / "tasks")
    assert not (tmp_path / "tasks").exists()


@pytest.mark.parametrize(("change", "message"), [
    (lambda row: row.pop("reward_model"), "field 'reward_model.ground_truth' is missing"),
    (lambda row: row["extra_info"].pop("question"), "field 'extra_info.question' is missing"),
    (lambda row: row.update(env_name="frozenlake"), "field 'env_name': 'frozenlake' is a DeepEyes environment"),
    (lambda row: row["prompt"][1].update(content="no image here"), "holds 0 <image> for 1 images"),
])
def test_a_hostile_deepeyes_row_names_file_row_and_field(tmp_path, change, message):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [deepeyes_row(q, n) for n, q in enumerate(questions(2))]
    change(rows[1])
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(RecipeFormatError) as err:
        import_tasks("deepeyes", {"train": [path]}, tmp_path / "tasks")
    assert str(err.value).startswith(f"{path}:2: ") and message in str(err.value), err.value
    assert not (tmp_path / "tasks").exists()
