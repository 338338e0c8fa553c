"""Video as input (loupe/video.py): clips read from a file (PyAV) or a frame folder, sampled under a frame budget."""

from __future__ import annotations

import pytest
from PIL import Image, ImageDraw

from loupe.config import ProtocolParams
from loupe.data.tasks import TaskRecord
from loupe.images import ImageError
from loupe.video import evenly_spaced, read_clip, write_clip


def numbered_frames(count: int) -> list[Image.Image]:
    """Frame i has a red bar whose width is 4 * (i + 1) px: the frame's number can be read off its pixels."""
    frames = []
    for i in range(count):
        frame = Image.new("RGB", (128, 64), (200, 200, 200))
        ImageDraw.Draw(frame).rectangle((0, 16, 4 * (i + 1) - 1, 47), fill=(220, 30, 30))
        frames.append(frame)
    return frames


def bar_width(frame: Image.Image) -> int:
    return sum(1 for x in range(frame.width) if frame.getpixel((x, 32))[0] > 180 and frame.getpixel((x, 32))[1] < 90)


@pytest.mark.parametrize("count, wanted, expected", [
    (20, 5, [0, 5, 10, 14, 19]), (3, 8, [0, 1, 2]), (10, 1, [0]), (0, 4, []), (16, 16, list(range(16))),
])
def test_frames_are_spread_evenly_first_and_last_included(count, wanted, expected):
    assert evenly_spaced(count, wanted) == expected


def test_a_video_file_is_decoded_and_sampled(tmp_path):
    path = write_clip(numbered_frames(20), tmp_path / "clip.mp4")
    frames = read_clip(path, max_frames=5)
    assert [f.size for f in frames] == [(128, 64)] * 5
    assert [round(bar_width(f) / 4) for f in frames] == [1, 6, 11, 15, 20]  # frames 0, 5, 10, 14, 19


def test_a_frame_folder_is_read_in_name_order(tmp_path):
    folder = tmp_path / "frames"
    folder.mkdir()
    for i, frame in enumerate(numbered_frames(6)):
        frame.save(folder / f"{i:03d}.png")
    (folder / "notes.txt").write_text("not a frame")
    frames = read_clip("frames", root=tmp_path, max_frames=3)
    assert [bar_width(f) // 4 for f in frames] == [1, 3, 6]  # 0, 2.5 (rounds to even: 2), 5


def test_a_missing_or_broken_clip_names_the_file(tmp_path):
    with pytest.raises(ImageError, match="missing.mp4"):
        read_clip(tmp_path / "missing.mp4")
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"not a video at all")
    with pytest.raises(ImageError, match="broken.mp4: not a readable video"):
        read_clip(broken)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ImageError, match="empty: a frame folder with no frame images"):
        read_clip(tmp_path / "empty")


def test_a_video_task_lists_no_images_and_no_placeholders():
    task = TaskRecord(doc_id="v1", video="clips/a.mp4", problem="Where does the square go?", solution="right")
    assert task.video == "clips/a.mp4" and task.images == []
    with pytest.raises(ValueError, match="list no 'images'"):
        TaskRecord(doc_id="v2", video="a.mp4", images=["a.png"], problem="q", solution="a")
    with pytest.raises(ValueError, match="give no <image> placeholder"):
        TaskRecord(doc_id="v3", video="a.mp4", problem="<image> q", solution="a")


def test_frames_share_the_video_pixel_budget():
    params = ProtocolParams(min_pixels=3136, max_pixels=50176, video_max_pixels=100352)
    assert params.frame_budget(8).max_pixels == 12544  # 100,352 shared by 8
    assert params.frame_budget(1).max_pixels == 50176  # never above an image's budget
    assert params.frame_budget(100).max_pixels == 3136  # never below min_pixels
    assert ProtocolParams().frame_budget(8).max_pixels == ProtocolParams().max_pixels


def test_a_clip_may_not_escape_the_image_root(tmp_path):
    with pytest.raises(ImageError, match="escapes the image root"):
        read_clip("../elsewhere.mp4", root=tmp_path)
