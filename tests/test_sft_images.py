"""Pre-scaled images: LLaMA-Factory sees exactly the pixels it would have made itself, from smaller files."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from stages.sft import checks, images

MAX_PIXELS, MIN_PIXELS = 50176, 3136


def noise(size: tuple[int, int], mode: str, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1, "CMYK": 4}
    if mode == "P":
        return noise(size, "RGB", seed).quantize(64)
    array = rng.integers(0, 256, (size[1], size[0], channels[mode]), dtype=np.uint8)
    return Image.fromarray(array.squeeze(-1) if channels[mode] == 1 else array, mode=mode)


CASES = [  # name, size, mode, format
    ("canvas.png", (1600, 1200), "RGB", "PNG"),
    ("photo.jpg", (1024, 2048), "RGB", "JPEG"),
    ("alpha.png", (700, 500), "RGBA", "PNG"),
    ("palette.png", (900, 400), "P", "PNG"),
    ("grey.png", (640, 480), "L", "PNG"),
    ("thin.png", (3000, 40), "RGB", "PNG"),  # scaled to under 28 px high: the plugin then pads it up
    ("cmyk.jpg", (800, 800), "CMYK", "JPEG"),  # PNG cannot hold CMYK: left where it is
    ("small.png", (200, 150), "RGB", "PNG"),  # within budget: left where it is
]


@pytest.fixture()
def dataset(tmp_path):
    folder = tmp_path / "dataset"
    (folder / "images").mkdir(parents=True)
    for seed, (name, size, mode, fmt) in enumerate(CASES):
        noise(size, mode, seed).save(folder / "images" / name, format=fmt)
    turns = [{"from": "human", "value": "<image>" * len(CASES) + " what?"}, {"from": "gpt", "value": "this"}]
    records = [{"conversations": turns, "images": [f"images/{name}" for name, *_ in CASES]}]
    (folder / "loupe_synth.json").write_text(json.dumps(records))
    info = {"loupe_synth": {"file_name": "loupe_synth.json", "formatting": "sharegpt",
                            "columns": {"messages": "conversations", "images": "images"}}}
    (folder / "dataset_info.json").write_text(json.dumps(info))
    return folder


def presize(folder, out):
    spec = checks.read_dataset_spec(folder, "loupe_synth")
    records = checks.read_records(spec)
    sizes = {folder / p: Image.open(folder / p).size for p in records[0]["images"]}
    return images.presize_dataset(spec, records, sizes, MAX_PIXELS, MIN_PIXELS, out, progress=False)


@pytest.mark.parametrize("processes", ["in the stage's process", "spawned processes"])
def test_llamafactory_sees_the_same_pixels_from_the_scaled_copy(dataset, tmp_path, monkeypatch, processes):
    from llamafactory.data.mm_plugin import get_mm_plugin

    if processes == "spawned processes":  # as for a real data set's hundreds of canvases
        monkeypatch.setattr(images, "POOL_FROM_IMAGES", 1)
    out, scaled = presize(dataset, tmp_path / "scaled")
    assert scaled == 6  # all but the CMYK photo and the small image
    plugin = get_mm_plugin("qwen2_vl", image_token="<|image_pad|>")
    original = [str(dataset / "images" / name) for name, *_ in CASES]
    copy = json.loads((out / "loupe_synth.json").read_text())[0]["images"]
    assert copy[-2] == str(dataset / "images" / "cmyk.jpg") and copy[-1] == str(dataset / "images" / "small.png")
    resolved = [p if p.startswith("/") else str(out / p) for p in copy]
    assert sum(Image.open(p).size != Image.open(q).size for p, q in zip(original, resolved)) == 6
    kwargs = {"image_max_pixels": MAX_PIXELS, "image_min_pixels": MIN_PIXELS}
    theirs = plugin._regularize_images(original, **kwargs)["images"]
    ours = plugin._regularize_images(resolved, **kwargs)["images"]
    for (name, *_), a, b in zip(CASES, theirs, ours):
        assert a.size == b.size and a.mode == b.mode, name
        assert np.array_equal(np.asarray(a), np.asarray(b)), name


def test_the_copy_is_a_dataset_the_checks_accept_and_is_reused(dataset, tmp_path, tiny_model_dir):
    out, _ = presize(dataset, tmp_path / "scaled")
    report = checks.preflight(tiny_model_dir, out, "loupe_synth", 4096, MIN_PIXELS, MAX_PIXELS)
    original = checks.preflight(tiny_model_dir, dataset, "loupe_synth", 4096, MIN_PIXELS, MAX_PIXELS)
    assert report.max_tokens == original.max_tokens  # same image tokens: the budget sees the same sizes
    stamp = (out / "images" / "0000000.png").stat().st_mtime_ns
    presize(dataset, tmp_path / "scaled")
    assert (out / "images" / "0000000.png").stat().st_mtime_ns == stamp  # nothing redone
    Image.new("RGB", (1000, 1000), "red").save(dataset / "images" / "canvas.png")  # a changed image size
    presize(dataset, tmp_path / "scaled")
    canvas = json.loads((out / "loupe_synth.json").read_text())[0]["images"][0]
    assert Image.open(out / canvas).getpixel((0, 0)) == (255, 0, 0)


def test_scaled_size_is_llamafactorys():
    assert images.scaled_size(224, 224, MAX_PIXELS, MIN_PIXELS) is None  # exactly at the budget
    assert images.scaled_size(1600, 1200, MAX_PIXELS, MIN_PIXELS) == (258, 193)
    assert images.scaled_size(100_000, 1, MAX_PIXELS, MIN_PIXELS) is None  # would need a second scaling
