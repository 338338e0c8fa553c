"""EasyR1's data sets (hiyouga/EasyR1 @ b44b311, `verl/utils/dataset.py`, `RLHFDataset`).

Rows (parquet or JSON(L), one file, a folder of shards, or the hub's `path@split` read by `load_dataset`) hold a
prompt (`prompt_key`; `examples/config.yaml` sets `problem`), an answer (`answer_key`, `answer`) and either
images (`image_key`, `images`: the `datasets` Image struct, or paths joined to `data.image_dir`) or videos
(`video_key`, `videos`: paths joined to `image_dir`, read by qwen-vl-utils' `fetch_video`); `_build_messages`
splits the prompt on `<image>` / `<video>`, one placeholder per image or video. A text-only row has an empty
list. A video row becomes a Loupe video task (one clip a task: its `<video>` placeholder is dropped, the frames
are placed by the protocol); a row with two videos is refused, as is every video row with `videos="refuse"`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from loupe.data.published.rows import ImageFinder, RawTask, RecipeFormatError, answer_text, get, image_value, rows

VIDEO_PLACEHOLDER = "<video>"


def read_easyr1(path: Path, image_dir: Path | None = None, prompt_key: str = "problem", answer_key: str = "answer",
                image_key: str = "images", video_key: str = "videos",
                videos: Literal["keep", "refuse"] = "keep") -> Iterator[RawTask]:
    finder = ImageFinder(path, image_dir)
    for number, row in rows(path):
        problem = get(path, number, row, prompt_key)
        answer = answer_text(path, number, row, answer_key)
        cells = row.get(image_key) or []
        if not isinstance(cells, list):
            cells = [cells]
        images = [image_value(finder, number, f"{image_key}.{k}", cell) for k, cell in enumerate(cells)]
        clips = row.get(video_key) or []
        if not isinstance(clips, list):
            clips = [clips]
        if not clips:
            yield RawTask(problem, answer, images, image_field=image_key)
            continue
        where = f"{path}:{number}: field {video_key!r}"
        if videos == "refuse":
            raise RecipeFormatError(f"{where}: a video row, and --videos refuse was given (keep imports it as a "
                                    "video task)")
        if images or len(clips) != 1:
            raise RecipeFormatError(f"{where}: {len(clips)} video(s) and {len(images)} image(s) in one row; a Loupe "
                                    "task holds one clip and no images beside it")
        if not isinstance(clips[0], str):
            raise RecipeFormatError(f"{where}.0: a video is a path, got {type(clips[0]).__name__}")
        clip = _video_file(finder, number, f"{video_key}.0", clips[0])
        text = problem.replace(VIDEO_PLACEHOLDER, "").strip()
        if not text:
            raise RecipeFormatError(f"{path}:{number}: field {prompt_key!r} holds no question besides {VIDEO_PLACEHOLDER}")
        yield RawTask(text, answer, [], video=clip, image_field=video_key)


def _video_file(finder: ImageFinder, number: int, name: str, text: str) -> Path:
    """The video file a row names, looked for like an image (a video is not an image name, so by hand)."""
    where = f"{finder.data_file}:{number}: field {name!r}"
    written = Path(text.removeprefix("file://"))
    if ".." in written.parts:
        raise RecipeFormatError(f"{where}: {text!r} leaves the folder it is read from")
    candidates = [written] if written.is_absolute() else [root / written for root in finder.roots]
    for candidate in candidates:
        if candidate.is_file() or candidate.is_dir():
            return candidate
    raise RecipeFormatError(f"{where}: video {text!r} not found (looked under "
                            f"{', '.join(str(r) for r in finder.roots)})")
