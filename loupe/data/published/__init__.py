"""The seeds' published data sets, one reader per publisher, each following the publisher's own loader.

| format | reader | the publisher's files |
|---|---|---|
| `r1v`, `r1v_eval` | `r1v.py` | R1-V's hub parquet; its test prompts (JSONL) |
| `easyr1` | `easyr1.py` | EasyR1's parquet or JSON(L) (geometry3k; your own with its keys) |
| `lmm_r1` | `lmm_r1.py` | LMM-R1's JSONL of stringified message lists |
| `mini_o3` | `mini_o3.py` | Mini-o3's RL and validation JSON lists under BASE_IMAGE_DIR |
| `deepeyes` | `deepeyes.py` | DeepEyes' verl parquet files (47k) |
| `pixel_reasoner` | `pixel_reasoner.py` | Pixel-Reasoner's parquet + images.zip (RL set and evaluation collection) |

`loupe.data.recipe_formats.import_tasks` writes a task folder from any of them (`loupe data import`); the SFT
sets (Mini-o3's, Pixel-Reasoner's, R1-V's chain-of-thought) are read by the synth stage's import teacher.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from loupe.data.published.deepeyes import read_deepeyes
from loupe.data.published.easyr1 import read_easyr1
from loupe.data.published.lmm_r1 import read_lmm_r1
from loupe.data.published.mini_o3 import read_mini_o3
from loupe.data.published.pixel_reasoner import read_pixel_reasoner
from loupe.data.published.r1v import read_r1v, read_r1v_eval
from loupe.data.published.rows import RawTask, RecipeFormatError

READERS: dict[str, Callable[..., Iterator[RawTask]]] = {
    "r1v": read_r1v,
    "r1v_eval": read_r1v_eval,
    "easyr1": read_easyr1,
    "lmm_r1": read_lmm_r1,
    "mini_o3": read_mini_o3,
    "deepeyes": read_deepeyes,
    "pixel_reasoner": read_pixel_reasoner,
}
"""Format name -> reader(path, image_dir=None, **options) yielding one RawTask a row."""
FORMATS: tuple[str, ...] = tuple(READERS)

__all__ = ["FORMATS", "READERS", "RawTask", "RecipeFormatError"]
