"""Video as input: a task's clip read as a few frames, sampled under a frame budget.

A clip is either a video file, decoded with PyAV (FFmpeg's bindings; a well-kept library, where a hand-written
reader would have to know every container and codec), or a folder of frame images read in name order. Frames are
picked evenly across the clip (the first and the last included), the way Qwen2.5-VL's own sampler spreads
`nframes` over a clip (`smart_nframes` / `torchvision.io.read_video` path in qwen-vl-utils' `vision_process.py`)
and the way Pixel-Reasoner feeds a video to its model: as a list of frame images, one `<image>` each, from which
its `select_frames` tool picks some to look at again.

Frames are images to the rest of Loupe: the rollout shows them in the question turn (each resized into the
pixel budget like any image), the learner encodes them as images, the viewer draws them, and the SFT dataset
lists them under `images`. So a video task trains through the same code path as an image task, on a model that
was never given Qwen's video tokens (the tiny default has none) and on one that has them.

A missing or undecodable clip raises `ImageError` naming the file: that is the data's fault, not the model's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from loupe.images import DEFAULT_MAX_DECODE_PIXELS, ImageError, open_image

FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
DEFAULT_MAX_FRAMES = 8


def evenly_spaced(count: int, wanted: int) -> list[int]:
    """`wanted` frame indices spread evenly over `count` frames, first and last included (all when fewer)."""
    if count <= 0:
        return []
    if wanted >= count:
        return list(range(count))
    if wanted == 1:
        return [0]
    return sorted({int(round(i)) for i in np.linspace(0, count - 1, wanted)})


def read_clip(path: str | Path, root: str | Path | None = None, max_frames: int = DEFAULT_MAX_FRAMES,
              max_decode_pixels: int = DEFAULT_MAX_DECODE_PIXELS) -> list[Image.Image]:
    """The clip's frames, at most `max_frames` of them spread evenly over it, as RGB images.

    `path` is a video file or a folder of frames, relative to `root` when given (the same rule as task images:
    `loupe.images.resolve_image_path`).
    """
    if max_frames < 1:
        raise ValueError(f"max_frames must be at least 1, got {max_frames}")
    resolved = _resolve(root, path)
    if resolved.is_dir():
        files = sorted(p for p in resolved.iterdir() if p.suffix.lower() in FRAME_SUFFIXES)
        if not files:
            raise ImageError(f"{resolved}: a frame folder with no frame images ({', '.join(FRAME_SUFFIXES)})")
        return [open_image(files[i], None, max_decode_pixels) for i in evenly_spaced(len(files), max_frames)]
    if not resolved.is_file():
        raise ImageError(f"{resolved}: no such video file or frame folder")
    return _decode(resolved, max_frames)


def _resolve(root: str | Path | None, path: str | Path) -> Path:
    """`path` under `root`, which it may not escape (the rule `loupe.images.resolve_image_path` applies to
    images, without its suffix check: a clip is a folder or a video file)."""
    text = str(path)
    if not text or "\x00" in text:
        raise ImageError(f"{text!r}: not a file path")
    if root is None:
        return Path(path)
    root_resolved = Path(root).resolve()
    try:
        resolved = (root_resolved / path).resolve()
    except (OSError, RuntimeError) as err:
        raise ImageError(f"{text}: cannot resolve the path under the image root {root} ({err})") from None
    if not resolved.is_relative_to(root_resolved):
        raise ImageError(f"{text}: the clip's path escapes the image root {root_resolved} (it resolves to {resolved})")
    return resolved


def _decode(path: Path, max_frames: int) -> list[Image.Image]:
    import av  # PyAV: a heavy import, needed only by video tasks

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise ImageError(f"{path}: the file has no video stream")
            count = sum(1 for _ in container.decode(video=0))
        if count == 0:
            raise ImageError(f"{path}: the video stream has no frames")
        wanted = set(evenly_spaced(count, max_frames))
        frames: list[Image.Image] = []
        with av.open(str(path)) as container:  # a second pass keeps only the wanted frames in memory
            for index, frame in enumerate(container.decode(video=0)):
                if index in wanted:
                    frames.append(frame.to_image().convert("RGB"))
        return frames
    except (av.error.FFmpegError, OSError) as error:
        raise ImageError(f"{path}: not a readable video ({type(error).__name__}: {error})") from error


def write_clip(frames: list[Image.Image], path: str | Path, fps: int = 4) -> Path:
    """Encode frames as an MPEG-4 Part 2 file at high quality (PyAV, atomically); synthetic video tasks use it."""
    import av

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    width, height = frames[0].size
    width, height = width - width % 2, height - height % 2  # yuv420p needs even sides
    tmp = path.with_name(f".{path.name}.tmp{path.suffix}")
    with av.open(str(tmp), mode="w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"qscale": "2"}
        for image in frames:
            frame = av.VideoFrame.from_image(image.convert("RGB").crop((0, 0, width, height)))
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    tmp.replace(path)
    return path
