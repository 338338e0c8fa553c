"""The visual operations (loupe/visual_ops.py) on drawn images whose right results are known, run here or inside a
stage image, reporting what they imported: how the tests show that each image that runs rollouts can run them.

    python tests/visual_ops_cases.py [BLOCKED.json]     # here or in an image, the repository as working directory

runs every operation once through `loupe.tools.run_tool`, as the rollout loop calls them (`segment_at` then
`get_properties` on a red square, `read_text` on a sign reading EXIT 7 and on an empty corner, `rotate`,
`select_frames` and `track_object` on a square moving right), and prints one JSON line: each operation's outcome
(`results`, to compare with `EXPECTED`), what any raised or refused (`errors`), and the distributions owning the
third-party modules imported (`distributions`, canonical names; `a|b` when several own one name). BLOCKED.json
lists top-level import names made unimportable first, as in an environment without their distributions: the fast
test (tests/test_containers.py) blocks everything the images that run rollouts do not lock; the slow one
(tests/test_containers_slow.py) runs this file inside those images, blocking nothing. Standard library, Pillow,
numpy and loupe only, so it runs in any of them.
"""

from __future__ import annotations

import json
import re
import sys
import traceback
from pathlib import Path
from typing import Any

SIGN = "EXIT 7"
EXPECTED: dict[str, Any] = {
    "segment_at": {"area": 6400, "box_px": [50, 60, 130, 140]},
    "get_properties": {"colour": "red", "shape": "square"},
    "read_text": [SIGN],
    "read_text (empty corner)": [],
    "rotate": [300, 400],
    "select_frames": 2,
    "track_object": "moved right by 0.41 of the width",
}
"""The outcome of each call: the square's area and pixel box, its colour and shape, the sign's one line of text
(none in the corner), the size of the scene turned by 90 degrees, two frames picked, and the square's movement."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # as containers/locks.py names distributions


def scene():
    """A 400x300 grey ground with a red 80x80 square at (50, 60) and a white sign at the bottom right reading EXIT 7
    (Pillow's own font, 36 px: no font file needed, as in tests/test_visual_ops.py)."""
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", (400, 300), (200, 200, 200))
    draw = ImageDraw.Draw(image)
    draw.rectangle((50, 60, 129, 139), fill=(220, 30, 30))
    draw.rectangle((210, 210, 390, 270), fill=(255, 255, 255))
    draw.text((222, 218), SIGN, fill=(0, 0, 0), font=ImageFont.load_default(size=36))
    return image


def moving_square(count: int = 12, step: int = 6) -> list:
    from PIL import Image, ImageDraw

    frames = []
    for i in range(count):
        frame = Image.new("RGB", (160, 120), (200, 200, 200))
        ImageDraw.Draw(frame).rectangle((10 + i * step, 40, 34 + i * step, 64), fill=(220, 30, 30))
        frames.append(frame)
    return frames


def run_operations() -> tuple[dict[str, Any], dict[str, str]]:
    """Each call's outcome by `EXPECTED`'s names, and for a call that raised or was refused, why."""
    from loupe import visual_ops  # noqa: F401 (registers the operations, as loupe.rollout.loop does)
    from loupe.config import ProtocolParams
    from loupe.protocol import ToolCall
    from loupe.tools import ImageSession, ToolResult, run_tool

    budget = ProtocolParams().budget
    still, frames = ImageSession(original=scene()), moving_square()
    video = ImageSession(original=frames[0], frames=frames)
    calls = {
        "segment_at": (still, "segment_at", {"point": [0.2, 0.33]},
                       lambda r: {"area": r.record["area"], "box_px": [round(v * s) for v, s in
                                                                       zip(r.record["box"], (400, 300, 400, 300))]}),
        "get_properties": (still, "get_properties", {"mask": "mask_1"},
                           lambda r: {"colour": r.record["colour"], "shape": r.record["shape"]}),
        "read_text": (still, "read_text", {"bbox_2d": [0.5, 0.66, 1.0, 0.95]},
                      lambda r: [line["text"] for line in r.record["lines"]]),
        "read_text (empty corner)": (still, "read_text", {"bbox_2d": [0.0, 0.0, 0.1, 0.1]},
                                     lambda r: [line["text"] for line in r.record["lines"]]),
        "rotate": (still, "rotate", {"angle": 90}, lambda r: list(r.images[0].full.size)),
        "select_frames": (video, "select_frames", {"target_frames": [1, 12]}, lambda r: len(r.images)),
        "track_object": (video, "track_object", {"bbox_2d": [10 / 160, 40 / 120, 35 / 160, 65 / 120],
                                                 "start_frame": 1}, lambda r: r.record["movement"]),
    }
    results, errors = {}, {}
    for name, (session, tool, arguments, outcome) in calls.items():
        try:
            result = run_tool(ToolCall(tool, arguments), session, budget)
        except Exception as error:  # noqa: BLE001 - reported, not raised: the other calls still run
            errors[name] = "".join(traceback.format_exception_only(error)).strip()
            continue
        if isinstance(result, ToolResult):
            results[name] = outcome(result)
        else:
            errors[name] = f"refused: {result}"
    return results, errors


def distributions(modules: list[str]) -> list[str]:
    """The distributions owning the third-party top-level modules among `modules` (the standard library and this
    repository's code left out)."""
    from importlib.metadata import packages_distributions

    owners = packages_distributions()
    found = set()
    for name in {m.split(".")[0] for m in modules}:
        if name in sys.stdlib_module_names or name in ("__main__", "loupe", "stages", "pipelines") or name not in owners:
            continue
        found.add("|".join(sorted({canonical(d) for d in owners[name]})))
    return sorted(found)


def main(argv: list[str]) -> int:
    blocked = json.loads(Path(argv[0]).read_text()) if argv else []
    for name in blocked:
        if name not in sys.modules:
            sys.modules[name] = None  # `import name` now raises ImportError, as where it is not installed
    results, errors = run_operations()
    imported = [m for m, module in sys.modules.items() if module is not None]
    print(json.dumps({"results": results, "errors": errors, "distributions": distributions(imported)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
