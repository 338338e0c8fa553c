"""Mini-o3's RL and validation sets (Mini-o3/Mini-o3 @ 8654dbf).

`VisualProbe_train/train.json`, `DeepEyes_train_4K/train.json` and the validation files (`Vstar_Bench/val.json`,
`VisualProbe_{Easy,Medium,Hard}/val.json`) are JSON lists of `{doc_id, problem, images, solution, data_source}`
(README, "Stage 2"). `verl/utils/dataset/multimodal_dataset.py` reads each with `json.load`, concatenates a
split's files (`MultiModalDataset._read_files_and_tokenize`), joins every image path to `BASE_IMAGE_DIR`
(`make_conversation_multimodal`, lines 34-48: the README puts every set's folder inside it), renders `problem`
(which starts with `<image>\n`) as the user turn, and hands `solution` to the reward as `ground_truth`
(lines 295-296) with the row's `data_source`, which `verl/utils/reward_score/__init__.py` dispatches on
(`visual_probe_train`, `deepeyes_train`, `vstar_bench`, `visual_probe_{easy,medium,hard}`).

`image_dir` is `BASE_IMAGE_DIR`; without it, the folder above the file's folder, where the README's layout puts
it. `doc_id` is kept as the record's `source_id`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from loupe.data.published.rows import ImageFinder, RawTask, answer_text, get, rows


def read_mini_o3(path: Path, image_dir: Path | None = None) -> Iterator[RawTask]:
    finder = ImageFinder(path, image_dir if image_dir is not None else Path(path).parent.parent)
    for number, row in rows(path):
        source_id = str(get(path, number, row, "doc_id", (str, int)))
        problem = get(path, number, row, "problem")
        solution = answer_text(path, number, row, "solution")
        data_source = get(path, number, row, "data_source")
        names = get(path, number, row, "images", (list, str))
        names = [names] if isinstance(names, str) else names
        images = [finder.find(number, f"images.{k}", name) for k, name in enumerate(names)]
        yield RawTask(problem, solution, images, data_source=data_source, source_id=source_id)
