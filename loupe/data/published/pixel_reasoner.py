"""Pixel-Reasoner's RL set and evaluation collection (TIGER-AI-Lab/Pixel-Reasoner @ a3a6c3a).

`TIGER-Lab/PixelReasoner-RL-Data`, and each set of the evaluation collection (`VStar-EvalData-PixelReasoner`,
...), is one `<name>.parquet` beside `images.zip` (`onestep_evaluation/prepare.sh`: it unzips the archive into
`images/`, moves it to `data/<name>_images`, and `rename_imagepath.py` prefixes every path with that folder).
A row holds:
- `question`: the text of the user turn (`openrlhf/datasets/prompts_dataset.py:143-161`: the images, then the
  question and the system prompt's guidelines; Loupe's `pixel_reasoner` protocol and its `vcot` template build
  the same turn from `problem`);
- `image`: a list of paths (`images/...` as downloaded; prefixed after prepare.sh), empty for a text-only row;
  with `is_video` true the list is a clip's frames (`prompts_dataset.py:149-151`), which become a video task's
  frame folder;
- `qid` and `answer`: `experience_maker.py:1405-1436` (`RemoteExperienceMaker.__init__`) maps each qid to its
  ground truth, `answer` in parquet files (`gt_answer` in JSON ones).

Images are read from the archive when it is there (never unpacked), else from the unpacked folder beside the
parquet, `image_dir`, or prepare.sh's `<name>_images` folder (found by the paths' trailing parts).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from loupe.data.published.rows import ImageFinder, RawTask, RecipeFormatError, answer_text, get, rows


def read_pixel_reasoner(path: Path, image_dir: Path | None = None) -> Iterator[RawTask]:
    archive = path.parent / "images.zip"
    finder = ImageFinder(path, image_dir, archive=archive if archive.is_file() else None)
    answer_key = "answer" if path.suffix.lower() == ".parquet" else "gt_answer"
    for number, row in rows(path):
        question = get(path, number, row, "question")
        answer = answer_text(path, number, row, answer_key)
        qid = get(path, number, row, "qid", (str, int))
        names = row.get("image")
        names = [] if names is None or names == "" else names if isinstance(names, list) else [names]
        refs = [finder.find(number, f"image.{k}", name) for k, name in enumerate(names) if name]
        is_video = get(path, number, row, "is_video", (bool,), required=False)
        if is_video:
            if not refs:
                raise RecipeFormatError(f"{path}:{number}: field 'image': a video row (is_video) lists no frames")
            yield RawTask(question, answer, [], video=refs, source_id=str(qid), image_field="image")
        else:
            yield RawTask(question, answer, refs, source_id=str(qid), image_field="image")
