"""benchmarks/ttrl_shift.py's parts that run without a model: the shifted set it writes, the stage log it reads
and the report it prints (the scenario itself runs in tests/test_recipes_slow.py, marked slow)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

from benchmarks.ttrl_shift import SHIFT, report, ttrl_log, write_shifted_set
from loupe.data.synthetic_draw import PALETTE
from loupe.data.tasks import read_tasks


def test_the_shifted_set_holds_only_shapes_and_motion_in_new_colours(tmp_path: Path):
    params = {"data": {"operations": {"train": 256, "val": 16, "test": 80}}}
    tasks = write_shifted_set(params, tmp_path / "shift")
    records = read_tasks(tasks / "test.jsonl", check_images=True)
    assert len(records) == SHIFT["test"]
    assert {r.category for r in records} == {"operations/shape", "operations/motion"}
    assert [r.category for r in records[:4]] == ["operations/shape", "operations/motion"] * 2
    fills = set()
    for record in records[:8:2]:  # shape canvases: the three shapes' fills are exact palette colours
        pixels = np.asarray(Image.open(tasks / record.images[0]).convert("RGB")).reshape(-1, 3)
        fills |= {name for name, rgb in PALETTE.items() if (pixels == rgb).all(axis=1).any()}
    assert fills & {"orange", "purple"} and not fills & {"green", "yellow"}, fills
    # A second call reuses the files rather than drawing them again.
    before = (tasks / "test.jsonl").stat().st_mtime_ns
    write_shifted_set(params, tmp_path / "shift")
    assert (tasks / "test.jsonl").stat().st_mtime_ns == before


def test_the_stage_log_and_the_report_carry_the_vote_the_gate_and_the_buffer(tmp_path: Path):
    rows = [{"step": 1, "ttrl/pseudo_label_accuracy": 0.75, "ttrl/kept_label_accuracy": 1.0,
             "ttrl/groups_kept": 0.25, "ttrl/buffer_hits": 1.5, "update/lr": 1.2e-5, "reward/mean": 0.9},
            {"val/accuracy": 0.5},  # a validation row: no step figures
            {"step": 2, "ttrl/pseudo_label_accuracy": 0.5, "ttrl/groups_kept": 0.0, "ttrl/buffer_hits": 3.0}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    log = ttrl_log(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in log] == [1, 2] and "reward/mean" not in log[0]
    kinds = {"all": {"accuracy": 0.6, "low": 0.5, "high": 0.7}, "shape": {"accuracy": 0.5, "low": 0.4, "high": 0.6},
             "motion": {"accuracy": 0.7, "low": 0.6, "high": 0.8}}
    model = {"kinds": kinds, "pass@4": 0.9, "maj@4": 0.61}
    text = report({"rl": model, "ttrl": model, "ttrl_log": log})
    assert "| rl | 0.600 [0.500, 0.700] | 0.500 [0.400, 0.600] | 0.700 [0.600, 0.800] | 0.900 | 0.610 |" in text
    assert "| 1 | 0.75 | 1 | 0.25 | 1.5 | 1.2e-05 |" in text
    assert "| 2 | 0.5 | - | 0 | 3 | - |" in text  # a step whose gate kept no group has no kept-label figure
    assert "right in 0.62 of the groups" in text
