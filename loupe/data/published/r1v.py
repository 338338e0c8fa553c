"""R1-V's published sets (Deep-Agent/R1-V @ bbbbe3d).

- `r1v`: the training sets on the hub (`leonardPKU/clevr_cogen_a_train`, `leonardPKU/GEOQA_R1V_Train_8K`):
  parquet with an `image` column (the `datasets` Image feature: a struct of `bytes` and `path`), `problem`, and
  `solution` written `<answer> 3 </answer>`; `src/r1-v/src/open_r1/grpo.py` branches on whether `image` is a
  column (text-only sets have none) and its `accuracy_reward` strips the tags from the solution.
- `r1v_eval`: the test prompts (`src/eval/prompts/superclevr_test200_counting_problems.jsonl`,
  `geoqa_test_prompts.jsonl`): JSONL of `image_path`, `question`, `ground_truth` (an int for counting, text like
  `140°` for GeoQA). The test scripts (`src/eval/test_qwen2vl_counting_superclevr.py:13,42`) run from `src/eval`
  and open `./images/...` from there, the prompts folder's parent, where the README unzips the images
  (README, "SuperCLEVR" and "GEOQA"): paths are looked for beside the file and one folder above it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from loupe.data.published.rows import ImageFinder, RawTask, answer_text, get, image_value, rows


def read_r1v(path: Path, image_dir: Path | None = None) -> Iterator[RawTask]:
    finder = ImageFinder(path, image_dir)
    for number, row in rows(path):
        problem = get(path, number, row, "problem")
        solution = answer_text(path, number, row, "solution")
        image = row.get("image")
        images = [image_value(finder, number, "image", image)] if image is not None else []
        yield RawTask(problem, solution, images, image_field="image")


def read_r1v_eval(path: Path, image_dir: Path | None = None) -> Iterator[RawTask]:
    finder = ImageFinder(path, image_dir, parent_too=True)
    for number, row in rows(path):
        question = get(path, number, row, "question")
        truth = answer_text(path, number, row, "ground_truth")
        image = finder.find(number, "image_path", get(path, number, row, "image_path"))
        yield RawTask(question, truth, [image], image_field="image_path")
