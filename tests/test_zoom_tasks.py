"""The zoom task family (loupe.data.zoom_tasks): answers legible only after zooming, at a place the
downscaled view shows. Issue 13's candidate for the embedded default; not yet wired into the data stage."""

from __future__ import annotations

import numpy as np
import pytest

from loupe.data.tasks import TaskRecord, read_tasks
from loupe.data.zoom_tasks import ZoomTaskConfig, chance_rate, generate_zoom_tasks, make_zoom_task
from loupe.tools import PixelBudget, smart_resize

SMALL = {"train": 3, "val": 2, "test": 2, "canvas_side": (1024, 1024)}


def test_a_config_always_gives_the_same_task(tmp_path):
    cfg = ZoomTaskConfig(**SMALL)
    first, image = make_zoom_task(cfg, "train", 1)
    again, image_again = make_zoom_task(cfg, "train", 1)
    assert first == again and np.array_equal(np.asarray(image), np.asarray(image_again))
    other, _ = make_zoom_task(ZoomTaskConfig(**{**SMALL, "seed": 1}), "train", 1)
    assert other.problem != first.problem or other.solution != first.solution or other.bbox != first.bbox


def test_the_files_are_ordinary_task_records(tmp_path):
    paths = generate_zoom_tasks(tmp_path / "zoom", ZoomTaskConfig(**SMALL))
    records = read_tasks(tmp_path / "zoom" / "train.jsonl", check_images=True)
    assert len(records) == 3 and all(isinstance(r, TaskRecord) for r in records)
    assert set(paths) == {"train", "val", "test"}
    assert all(r.bbox is not None and len(r.bbox) == 4 for r in records)  # the oracle teacher zooms there


def test_the_answer_patch_is_a_few_pixels_at_the_first_view_and_many_in_a_crop_of_its_frame():
    cfg = ZoomTaskConfig(**SMALL)
    record, image = make_zoom_task(cfg, "test", 0)
    width, height = image.size
    # The model first sees the canvas resized into the protocol's pixel budget (params.yaml's embedded default:
    # 50,176 pixels at most). The patch side is 1-1.4 % of the canvas side.
    shown_h, shown_w = smart_resize(height, width, PixelBudget(min_pixels=3136, max_pixels=50_176))
    side = cfg.patch_size[1] * min(width, height)
    assert side * shown_w / width < 8  # under 8 px on the first view
    x0, y0, x1, y1 = record.bbox
    box_w = (x1 - x0) * width if x1 <= 1 else (x1 - x0)
    assert side / box_w > 0.05  # in a crop of the frame the patch spans a real share of the crop


@pytest.mark.parametrize("answer_format", ["free", "choice"])
def test_the_chance_rate_is_the_best_constant_guess(answer_format):
    cfg = ZoomTaskConfig(**{**SMALL, "answer_format": answer_format})
    records = [make_zoom_task(cfg, "test", i)[0] for i in range(6)]
    rate = chance_rate(records)
    if answer_format == "choice":
        assert rate == pytest.approx(1 / cfg.option_count)
    else:
        commonest = max(sum(r.solution == s for r in records) for r in records for s in [r.solution])
        assert rate == pytest.approx(commonest / len(records))
