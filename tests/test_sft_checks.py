"""The sft stage's pre-flight checks: every bad input found before training, named with its sample and fix.

Datasets here are built the way the synth stage builds them: hand-made `Trajectory` objects (real crops
through the real crop tool's PIL images) converted by `loupe.protocol.to_sharegpt`, with images relative to
the dataset folder and LLaMA-Factory's `dataset_info.json`. Other sft tests import `build_dataset`.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
from PIL import Image

from loupe.protocol import ToolCall, get_protocol, to_sharegpt
from loupe.trajectory import Trajectory, Turn, write_trajectories
from stages.sft import checks

DATASET_INFO = {
    "loupe_synth": {
        "file_name": "loupe_synth.json",
        "formatting": "sharegpt",
        "columns": {"messages": "conversations", "images": "images"},
        "tags": {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                 "system_tag": "system"},
    }
}
COLOURS = ["red", "green", "blue", "yellow"]


def make_trajectory(index: int, source: Path, rng: random.Random, zooms: int) -> Trajectory:
    """A finished mini_o3 search: `zooms` crops of the source image, then the answer."""
    protocol = get_protocol("mini_o3")
    colour = COLOURS[index % len(COLOURS)]
    canvas = Image.new("RGB", (rng.randint(300, 900), rng.randint(300, 900)), (30, 30, 30))
    canvas.paste(Image.new("RGB", (60, 60), colour), (rng.randint(0, canvas.width - 60), rng.randint(0, canvas.height - 60)))
    canvas.save(source)
    t = Trajectory(traj_id=f"demo-{index:03d}#0", task={"doc_id": f"demo-{index:03d}"}, protocol="mini_o3",
                   system=protocol.system_prompt(), end_reason="answered")
    t.turns.append(Turn("user", "<image>\nWhat colour is the small square?", images=[t.add_image(source)]))
    image = canvas
    for zoom in range(zooms):
        x0, y0 = round(rng.uniform(0, 0.4), 3), round(rng.uniform(0, 0.4), 3)
        box = [x0, y0, round(x0 + 0.5, 3), round(y0 + 0.5, 3)]
        source_name = "original_image" if zoom == 0 else f"observation_{zoom}"
        call = ToolCall("crop", {"bbox_2d": box, "source": source_name})
        t.turns.append(Turn("assistant", protocol.render_call(f"Zoom {zoom + 1}: look closer.", call), action="call"))
        w, h = image.size
        image = image.crop((int(box[0] * w), int(box[1] * h), int(box[2] * w), int(box[3] * h)))
        t.turns.append(Turn("user", protocol.observation_text(zoom + 1), images=[t.add_image(image)]))
    t.turns.append(Turn("assistant", protocol.render_answer(f"The square is {colour}.", colour), action="answer"))
    t.answer = colour
    return t


def build_dataset(folder: Path, samples: int = 8, seed: int = 0, max_zooms: int = 2) -> Path:
    """A LLaMA-Factory dataset folder of `samples` searches (the synth stage's layout); returns the folder."""
    rng = random.Random(seed)
    (folder / "images" / "sources").mkdir(parents=True, exist_ok=True)
    trajectories = [
        make_trajectory(i, folder / "images" / "sources" / f"{i:03d}.png", rng, zooms=i % (max_zooms + 1))
        for i in range(samples)
    ]
    write_trajectories(trajectories, folder / "images" / "trajectories.jsonl")  # saves the crops beside it
    records = []
    for t in trajectories:
        record = to_sharegpt(t)
        record["images"] = [os.path.relpath(Path(p).resolve(), folder.resolve()) for p in record["images"]]
        records.append(record)
    (folder / "loupe_synth.json").write_text(json.dumps(records, indent=1))
    (folder / "dataset_info.json").write_text(json.dumps(DATASET_INFO, indent=1))
    return folder


def edit_records(folder: Path, change) -> None:
    records = json.loads((folder / "loupe_synth.json").read_text())
    change(records)
    (folder / "loupe_synth.json").write_text(json.dumps(records))


@pytest.fixture()
def dataset(tmp_path) -> Path:
    return build_dataset(tmp_path / "dataset", samples=6)


def run_preflight(model: Path, dataset: Path, cutoff: int = 4096, max_pixels: int = 50176):
    return checks.preflight(model, dataset, "loupe_synth", cutoff, 3136, max_pixels)


def test_a_good_dataset_passes_and_is_measured(tiny_model_dir, dataset):
    report = run_preflight(tiny_model_dir, dataset)
    assert report.samples == 6 and report.images == 2 * (1 + 2 + 3)  # the question plus 0, 1, 2 zooms, twice
    assert report.assistant_turns == report.images  # each image is followed by one model turn
    assert 0 < report.mean_image_tokens < report.mean_tokens <= report.max_tokens < 4096


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda r: r[3]["conversations"].__setitem__(2, {"from": "human", "value": "again"}),
         ["sample 3", "conversations[2]", "'human'", "merge"]),
        (lambda r: r[1]["conversations"].pop(), ["sample 1", "must end on a 'gpt' turn"]),
        (lambda r: r[2]["conversations"][1].__setitem__("from", "user"), ["sample 2", "'user'", "'human' was expected", "not a role of this dataset"]),
        (lambda r: r[4]["images"].pop(), ["sample 4", "2 <image> placeholders but 1 images"]),
        (lambda r: r[5]["conversations"][1].__setitem__("value", "no picture here"), ["sample 5", "2 <image> placeholders but 3 images"]),
        (lambda r: r[0]["images"].__setitem__(0, "images/nowhere.png"), ["sample 0", "nowhere.png not found"]),
        (lambda r: r[0]["conversations"][2].__setitem__("value", 7), ["sample 0", "string `value`"]),
    ],
    ids=["two-human-turns", "ends-on-human", "unknown-role", "fewer-images", "more-images", "missing-image", "not-text"],
)
def test_each_bad_sample_is_named_with_its_fix(tiny_model_dir, dataset, change, expected):
    edit_records(dataset, change)
    with pytest.raises(checks.InputError) as err:
        run_preflight(tiny_model_dir, dataset)
    message = str(err.value)
    assert "loupe_synth.json" in message
    for part in expected:
        assert part in message


def test_a_corrupt_image_is_named(tiny_model_dir, dataset):
    record = json.loads((dataset / "loupe_synth.json").read_text())[2]
    (dataset / record["images"][-1]).write_bytes(b"\x89PNG\r\n\x1a\n not really")
    with pytest.raises(checks.InputError, match=r"sample 2: image .* cannot be read"):
        run_preflight(tiny_model_dir, dataset)


def test_dataset_info_problems_are_named(tiny_model_dir, dataset):
    info = dataset / "dataset_info.json"
    info.unlink()
    with pytest.raises(checks.InputError, match=r"dataset_info.json: missing.*loupe_synth"):
        run_preflight(tiny_model_dir, dataset)
    info.write_text(json.dumps({"other": DATASET_INFO["loupe_synth"]}))
    with pytest.raises(checks.InputError, match=r"declares no dataset 'loupe_synth' \(declared: other\)"):
        run_preflight(tiny_model_dir, dataset)
    info.write_text(json.dumps({"loupe_synth": {**DATASET_INFO["loupe_synth"], "formatting": "alpaca"}}))
    with pytest.raises(checks.InputError, match=r"loupe_synth.formatting: must be sharegpt"):
        run_preflight(tiny_model_dir, dataset)
    info.write_text(json.dumps({"loupe_synth": {**DATASET_INFO["loupe_synth"], "file_name": "gone.json"}}))
    with pytest.raises(checks.InputError, match=r"gone.json not found"):
        run_preflight(tiny_model_dir, dataset)
    info.write_text("{not json")
    with pytest.raises(checks.InputError, match=r"not valid JSON"):
        run_preflight(tiny_model_dir, dataset)


def test_an_empty_dataset_is_refused(tiny_model_dir, dataset):
    (dataset / "loupe_synth.json").write_text("[]")
    with pytest.raises(checks.InputError, match="no samples"):
        run_preflight(tiny_model_dir, dataset)


def test_a_missing_or_incomplete_base_model_is_named(tmp_path, tiny_model_dir, dataset):
    with pytest.raises(checks.InputError, match=r"base model not found.*loupe model tiny --out"):
        run_preflight(tmp_path / "no-model", dataset)
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    with pytest.raises(checks.InputError, match="no weights"):
        run_preflight(partial, dataset)


def test_a_token_budget_the_images_do_not_fit_names_sample_and_fixes(tiny_model_dir, dataset):
    report = run_preflight(tiny_model_dir, dataset)
    cutoff = report.max_tokens - 1
    with pytest.raises(checks.InputError) as err:
        run_preflight(tiny_model_dir, dataset, cutoff=cutoff)
    message = str(err.value)
    assert f"needs {report.max_tokens} tokens" in message and f"sft.cutoff_len is {cutoff}" in message
    assert f"raise sft.cutoff_len to at least {report.max_tokens}" in message
    assert "Image features and image tokens do not match" in message
    # The suggested pixel budget really makes the sample fit.
    suggested = int(message.split("lower protocol.max_pixels to ")[1].split(" ")[0])
    assert run_preflight(tiny_model_dir, dataset, cutoff=cutoff, max_pixels=suggested).max_tokens <= cutoff


def test_image_token_count_follows_the_budget():
    budget = checks.ImageBudget(3136, 50176, checks.PixelBudget(3136, 12845056), factor=28)
    assert budget.tokens(224, 224) == 64  # 8 x 8 merged patches
    assert budget.tokens(4000, 3000) <= 50176 // 784  # scaled into image_max_pixels first
    assert budget.tokens(10, 10) == 4  # scaled up to image_min_pixels (56 x 56)


def test_token_counts_match_llamafactorys_own_encoding(tiny_model_dir, tmp_path):
    """Text and image tokens per sample, as LLaMA-Factory's qwen2_vl template and Qwen2-VL plugin count them."""
    from llamafactory.data import get_template_and_fix_tokenizer
    from llamafactory.hparams import DataArguments, ModelArguments
    from llamafactory.model import load_tokenizer

    folder = build_dataset(tmp_path / "ds", samples=4)
    odd = folder / "images" / "odd"
    odd.mkdir()
    sizes = [(1000, 37), (3000, 2000), (20, 500), (4000, 27), (333, 777)]  # thin, huge, tiny, extreme, plain
    for i, size in enumerate(sizes):
        Image.new("RGB", size, (i * 40, 90, 200)).save(odd / f"{i}.png")
    records = json.loads((folder / "loupe_synth.json").read_text())
    records.append({
        "conversations": [{"from": "human", "value": "<image><image> two at once"}, {"from": "gpt", "value": "ok"},
                          {"from": "human", "value": "and <image> then <image><image>"}, {"from": "gpt", "value": "done"}],
        "images": [f"images/odd/{i}.png" for i in range(5)],
    })
    (folder / "loupe_synth.json").write_text(json.dumps(records))

    for image_max_pixels in (50176, 12544):
        model_args = ModelArguments(model_name_or_path=str(tiny_model_dir), image_max_pixels=image_max_pixels,
                                    image_min_pixels=3136)
        module = load_tokenizer(model_args)
        tokenizer, processor = module["tokenizer"], module["processor"]
        template = get_template_and_fix_tokenizer(tokenizer, DataArguments(template="qwen2_vl"))
        spec = checks.read_dataset_spec(folder, "loupe_synth")
        budget = checks.image_budget(processor, 3136, image_max_pixels)
        for index, record in enumerate(checks.read_records(spec)):
            system, turns = checks.check_conversation(spec, index, record)
            paths = [folder / p for p in record["images"]]
            ours = checks.count_tokens(tokenizer, [(system, turns, [Image.open(p).size for p in paths])], budget)[0]
            messages = [{"role": t["role"], "content": t["content"]} for t in turns]
            expanded = template.mm_plugin.process_messages(messages, [str(p) for p in paths], [], [], processor)
            pairs = template.encode_multiturn(tokenizer, expanded, system)
            theirs = sum(len(source) + len(target) for source, target in pairs)
            image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
            theirs_images = sum(ids.count(image_pad) for pair in pairs for ids in pair)
            assert (ours.total, sum(ours.images)) == (theirs, theirs_images), (index, image_max_pixels)
