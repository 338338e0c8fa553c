"""Small data sets written in each seed publisher's own layout, from the publisher's loader code (never from
Loupe's records): the fixtures of tests/test_published_data.py and of the presets' runs from an import.

- Mini-o3 (Mini-o3/Mini-o3 @ 8654dbf, README "Stage 2", verl/utils/dataset/multimodal_dataset.py:34-48,
  190-195): `BASE/<set>/train.json` and `BASE/<set>/val.json`, JSON lists of
  `{doc_id, problem ("<image>\\n..."), images (relative to BASE), solution, data_source}`.
- DeepEyes (Visual-Agent/DeepEyes @ 6c5e796, verl/utils/dataset/rl_dataset.py, reward_manager/naive.py,
  agent/parallel_env.py; the hub's DeepEyes-Datasets-47k holds three parquet files at its root): verl rows
  `{data_source, prompt: [{role, content}], images: [Image], ability, env_name, reward_model: {style,
  ground_truth}, extra_info: {index, question, answer}}`, written with `datasets` (its Image feature is the
  bytes/path struct verl's `process_raw_image` opens).
- Pixel-Reasoner (TIGER-AI-Lab/Pixel-Reasoner @ a3a6c3a, onestep_evaluation/prepare.sh, rename_imagepath.py,
  openrlhf/datasets/prompts_dataset.py:143-161, experience_maker.py:1405-1436): `<name>.parquet` of
  `{qid, question, image: ["images/..."], answer, is_video}` beside `images.zip` holding `images/...`.
"""

from __future__ import annotations

import io
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

DEEPEYES_SYSTEM = ("You are a helpful assistant.\n\n# Tools\nYou may call one or more functions to assist with the "
                   "user query.")
"""The start of DeepEyes' SYSTEM_PROMPT_V2 (verl/workers/agent/envs/mm_process_engine/prompt.py:40)."""
DEEPEYES_USER_SUFFIX = ("\nThink first, call **image_zoom_in_tool** if needed, then answer. Format strictly as:  "
                        "<think>...</think>  <tool_call>...</tool_call> (if tools needed)  <answer>...</answer> ")
"""USER_PROMPT_V2 (prompt.py:60), which follows the question in DeepEyes' rows."""


@dataclass
class Question:
    """One question of a fixture: its text (no placeholder), its answer, and its image's encoded bytes."""

    text: str
    answer: str
    image: bytes | None


def png(colour: tuple[int, int, int], size: tuple[int, int] = (64, 48)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, "PNG")
    return out.getvalue()


def questions(count: int, offset: int = 0) -> list[Question]:
    """`count` questions about plain colour images (the answer is the colour's name)."""
    colours = {"red": (200, 30, 30), "green": (30, 170, 40), "blue": (40, 60, 200), "yellow": (220, 210, 40)}
    names = list(colours)
    return [Question(f"What colour is the picture? ({offset + i})", names[(offset + i) % 4],
                     png(colours[names[(offset + i) % 4]], (64 + i, 48))) for i in range(count)]


def write_mini_o3(base: Path, folder: str, split: str, items: list[Question], data_source: str,
                  first_id: int = 0) -> Path:
    """`base/folder/<split>.json` and its images under `base/folder/images/`, paths relative to `base`."""
    (base / folder / "images").mkdir(parents=True, exist_ok=True)
    records = []
    for n, item in enumerate(items):
        name = f"{folder}/images/{first_id + n}.png"
        (base / name).write_bytes(item.image or b"")
        records.append({"doc_id": first_id + n, "problem": "<image>\n" + item.text, "images": [name],
                        "solution": item.answer, "data_source": data_source})
    path = base / folder / f"{split}.json"
    path.write_text(json.dumps(records, indent=2, ensure_ascii=False))
    return path


def deepeyes_row(item: Question, index: int, data_source: str = "vstar",
                 env_name: str | None = "visual_toolbox_v2") -> dict:
    """One verl row as DeepEyes' training parquet holds it."""
    images = [] if item.image is None else [{"bytes": item.image, "path": None}]
    user = ("<image>\n" if images else "") + item.text + DEEPEYES_USER_SUFFIX
    return {"data_source": data_source, "prompt": [{"role": "system", "content": DEEPEYES_SYSTEM},
                                                   {"role": "user", "content": user}],
            "images": images, "ability": "vqa", "env_name": env_name,
            "reward_model": {"style": "model", "ground_truth": item.answer},
            "extra_info": {"index": index, "question": item.text, "answer": item.answer}}


def write_deepeyes(path: Path, rows: list[dict]) -> Path:
    """A verl parquet file of `rows`, written with `datasets` (images as its Image feature)."""
    import datasets

    features = datasets.Features({
        "data_source": datasets.Value("string"),
        "prompt": [{"content": datasets.Value("string"), "role": datasets.Value("string")}],
        "images": datasets.Sequence(datasets.Image()),
        "ability": datasets.Value("string"),
        "env_name": datasets.Value("string"),
        "reward_model": {"ground_truth": datasets.Value("string"), "style": datasets.Value("string")},
        "extra_info": {"answer": datasets.Value("string"), "index": datasets.Value("int64"),
                       "question": datasets.Value("string")},
    })
    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(rows, features=features).to_parquet(str(path))
    return path


def write_pixel_reasoner(folder: Path, name: str, items: list[Question], videos: dict[int, list[bytes]] | None = None,
                         zipped: bool = True, first_qid: int = 0) -> Path:
    """`folder/<name>.parquet` and its images, zipped as `folder/images.zip` (as downloaded) or unpacked into
    `folder/images/` (after `unzip`); `videos` maps a row number to its frames (an `is_video` row)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    files: dict[str, bytes] = {}
    rows = []
    for n, item in enumerate(items):
        frames = (videos or {}).get(n)
        if frames is not None:
            paths = [f"images/clip{first_qid + n}/{k:03d}.png" for k in range(len(frames))]
            files.update(zip(paths, frames))
        else:
            paths = [f"images/{first_qid + n}.png"] if item.image is not None else []
            files.update({p: item.image for p in paths})
        rows.append({"qid": f"q{first_qid + n}", "question": item.text, "image": paths, "answer": item.answer,
                     "is_video": frames is not None})
    pq.write_table(pa.Table.from_pylist(rows), folder / f"{name}.parquet")
    if zipped:
        with zipfile.ZipFile(folder / "images.zip", "w") as archive:
            for path, data in files.items():
                archive.writestr(path, data)
    else:
        for path, data in files.items():
            (folder / path).parent.mkdir(parents=True, exist_ok=True)
            (folder / path).write_bytes(data)
    return folder / f"{name}.parquet"
