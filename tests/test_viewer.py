"""The HTML trajectory viewer: self-contained, escaped, images embedded once, boxes where they belong."""

from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

from loupe.trajectory import Trajectory, Turn, read_trajectories, write_trajectories
from loupe.viewer import render_html, view_file

ORIGINAL_SIZE = (1600, 1200)
TARGET_PX = (700, 525, 900, 675)
"""The red target on the original; the ground-truth bbox is this, relative."""
TARGET_RGB = (220, 30, 30)
CROP1_BOX = [600, 450, 1000, 750]
"""Observation 1 cuts this out of the original, resized to 800x600 (2x)."""
CROP2_BOX = [200, 150, 600, 450]
"""Observation 2 cuts this out of observation 1: exactly the target, back in original pixels."""
JPEG_PREFIX = "data:image/jpeg;base64,"


def _original(path: Path) -> Image.Image:
    image = Image.new("RGB", ORIGINAL_SIZE, (235, 235, 230))
    draw = ImageDraw.Draw(image)
    draw.rectangle(TARGET_PX, fill=TARGET_RGB)
    draw.ellipse((100, 100, 300, 300), fill=(30, 60, 200))
    image.save(path)
    return image


def _task(doc_id: str, image: str) -> dict:
    w, h = ORIGINAL_SIZE
    x0, y0, x1, y1 = TARGET_PX
    return {
        "doc_id": doc_id, "images": [image], "problem": f"What colour is the square? ({doc_id})", "solution": "A",
        "data_source": "synthetic", "options": ["red", "green", "blue"], "category": "colour",
        "bbox": [x0 / w, y0 / h, x1 / w, y1 / h],
    }


def _trajectories(tmp_path: Path) -> list[Trajectory]:
    """Three trajectories: two samples sharing one original on disk (one zooming twice, one error turn), one missing its image."""
    original = _original(tmp_path / "orig.png")
    crop1 = original.crop(CROP1_BOX).resize((800, 600))
    crop2 = crop1.crop(CROP2_BOX)

    deep = Trajectory("synth-1#0", _task("synth-1", "orig.png"), "mini_o3", "System <b>prompt</b>", sample_index=0)
    deep.add_image(tmp_path / "orig.png")
    deep.add_image(crop1)
    deep.add_image(crop2)
    call1 = {"tool": "crop", "arguments": {"bbox_2d": [0.375, 0.375, 0.625, 0.625], "source": "original_image", "frame": "relative"}}
    call2 = {"tool": "crop", "arguments": {"bbox_2d": [0.25, 0.25, 0.75, 0.75], "source": "observation_1", "frame": "relative"}}
    deep.turns = [
        Turn("user", "<image>\nWhat colour is the square?", images=[0], num_tokens=400),
        Turn("assistant", '<think>Too small.</think>\n<grounding>{"bbox_2d": [0.375, 0.375, 0.625, 0.625], "source": "original_image"}</grounding>',
             action="call", call=call1, num_tokens=40),
        Turn("user", "Observation 1: <image>", images=[1],
             crop={"source": "original_image", "source_image": 0, "box_px": CROP1_BOX, "size": [800, 600], "observation": 1}),
        Turn("assistant", '<think>Closer.</think><grounding>{"bbox_2d": [0.25, 0.25, 0.75, 0.75], "source": "observation_1"}</grounding>',
             action="call", call=call2, num_tokens=30),
        Turn("user", "Observation 2: <image>", images=[2],
             crop={"source": "observation_1", "source_image": 1, "box_px": CROP2_BOX, "size": [400, 300], "observation": 2}),
        Turn("assistant", "<think>Red.</think><answer>A", action="error", error="unclosed_tag: <answer> is never closed", num_tokens=9),
        Turn("user", "Your last turn could not be carried out.", error="unclosed_tag: <answer> is never closed"),
        Turn("assistant", "<think>It is red & <b>bold</b>.</think><answer>A</answer>", action="answer", num_tokens=12),
    ]
    deep.end_reason, deep.answer, deep.num_tool_calls, deep.num_format_errors = "answered", "A", 2, 1
    deep.rewards = {"accuracy": 1.0, "format": 0.5, "tool": 0.0, "total": 1.5, "extracted": "A"}

    wide = Trajectory("synth-1#1", _task("synth-1", "orig.png"), "mini_o3", "System <b>prompt</b>", sample_index=1)
    wide.add_image(tmp_path / "orig.png")
    wide.add_image(original.crop((0, 0, 800, 600)))
    wide.turns = [
        Turn("user", "<image>\nWhat colour is the square?", images=[0]),
        Turn("assistant", '<grounding>{"bbox_2d": [0, 0, 0.5, 0.5], "source": "original_image"}</grounding>', action="call",
             call={"tool": "crop", "arguments": {"bbox_2d": [0, 0, 0.5, 0.5]}}),
        Turn("user", "Observation 1: <image>", images=[1],
             crop={"source": "original_image", "source_image": 0, "box_px": [0, 0, 800, 600], "size": [800, 600], "observation": 1}),
    ]
    wide.end_reason, wide.num_tool_calls, wide.rewards = "over_turn", 1, {"accuracy": 0.0, "total": 0.0}

    lost = Trajectory("synth-2#0", _task("synth-2", "nope.png"), "mini_o3", "System <b>prompt</b>")
    lost.add_image(tmp_path / "nope.png")
    lost.turns = [Turn("user", "<image>\nWhat colour is the square?", images=[0]),
                  Turn("assistant", "no idea", action="error", error="no_action: the turn holds neither")]
    lost.end_reason = "format_error"
    return [deep, wide, lost]


class _Figures(HTMLParser):
    """Collects each figure's image index, thumbnail size (from the viewBox) and boxes."""

    def __init__(self):
        super().__init__()
        self.figures: list[dict] = []
        self.missing: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "figure":
            self.figures.append({"image": int(a["data-image"]), "rects": []})
        elif tag == "svg" and "viewbox" in a and self.figures and "size" not in self.figures[-1]:
            self.figures[-1]["size"] = tuple(float(v) for v in a["viewbox"].split()[2:])
        elif tag == "rect" and self.figures:
            kind = a["class"].split()[1]
            self.figures[-1]["rects"].append((kind, *(float(a[k]) for k in ("x", "y", "width", "height"))))
        elif tag == "div" and "missing" in a.get("class", ""):
            self.missing.append(a["data-image"])


def _parse(page: str) -> _Figures:
    parser = _Figures()
    parser.feed(page)
    return parser


def _expected_rect(box_px, image_size, thumb_size):
    sx, sy = thumb_size[0] / image_size[0], thumb_size[1] / image_size[1]
    x0, y0, x1, y1 = box_px
    return (x0 * sx, y0 * sy, (x1 - x0) * sx, (y1 - y0) * sy)


def _has_rect(figure: dict, kind: str, expected) -> bool:
    return any(r[0] == kind and all(abs(a - b) <= 1.0 for a, b in zip(r[1:], expected)) for r in figure["rects"])


def _render(tmp_path: Path, **kw) -> str:
    out = render_html(_trajectories(tmp_path), tmp_path / "page.html", **kw)
    return out.read_text(encoding="utf-8")


def test_page_is_self_contained_and_embeds_each_image_once(tmp_path):
    page = _render(tmp_path)
    assert page.startswith("<!DOCTYPE html>")
    for external in ('src="http', "src='http", "<link", "<script src", 'href="http', "url(http", "@import"):
        assert external not in page
    # original (shared by two samples) + two crops + one crop; the missing image embeds nothing.
    assert page.count(JPEG_PREFIX) == 4
    defined = re.findall(r'<image id="(im\d+)"', page)
    assert len(defined) == len(set(defined)) == 4
    used = set(re.findall(r'<use href="#(im\d+)"', page))
    assert used == set(defined)
    assert page.count('<details class="traj"') == 3 and page.count('<details class="traj" open') == 1


def test_model_text_is_escaped_and_tags_stay_visible(tmp_path):
    page = _render(tmp_path)
    assert "&lt;grounding&gt;" in page and "&lt;/think&gt;" in page
    assert '<span class="tag think">&lt;think&gt;</span>' in page
    assert "<grounding>" not in page and "<think>" not in page
    assert '<span class="tag b">&lt;b&gt;</span>bold<span class="tag b">&lt;/b&gt;</span>' in page
    assert "<b>bold</b>" not in page
    assert "red &amp; " in page
    assert "System <span class=\"tag b\">&lt;b&gt;</span>prompt" in page and "<b>prompt</b>" not in page
    assert "unclosed_tag: &lt;answer&gt; is never closed" in page
    assert page.count('class="err"') == 3  # synth-1#0's bad turn and the reply to it, synth-2#0's bad turn
    assert '"source": "observation_1"' in page.replace("&quot;", '"')


def test_crop_boxes_land_on_the_thumbnail(tmp_path):
    figures = _parse(_render(tmp_path)).figures
    original = next(f for f in figures if f["image"] == 0 and any(r[0] == "crop" for r in f["rects"]))
    assert original["size"] == (640.0, 480.0)
    assert _has_rect(original, "crop", _expected_rect(CROP1_BOX, ORIGINAL_SIZE, original["size"]))
    assert _has_rect(original, "gt", _expected_rect(TARGET_PX, ORIGINAL_SIZE, original["size"]))
    # A crop of a crop: its box is drawn on observation 1, in observation 1's pixels.
    observation1 = next(f for f in figures if f["image"] == 1 and any(r[0] == "crop" for r in f["rects"]))
    assert observation1["size"] == (640.0, 480.0)
    assert _has_rect(observation1, "crop", _expected_rect(CROP2_BOX, (800, 600), observation1["size"]))
    # The ground truth follows the crop chain: on observation 1 it sits exactly where observation 2 was cut.
    assert _has_rect(observation1, "gt", _expected_rect(CROP2_BOX, (800, 600), observation1["size"]))
    assert not _has_rect(observation1, "crop", _expected_rect(CROP1_BOX, (800, 600), observation1["size"]))


def test_overview_maps_every_zoom_onto_the_original(tmp_path):
    figures = _parse(_render(tmp_path, thumb_side=320)).figures
    overview = next(f for f in figures if f["image"] == 0 and any(r[0] == "looked" for r in f["rects"]))
    assert overview["size"] == (320.0, 240.0)
    looked = [r for r in overview["rects"] if r[0] == "looked"]
    assert len(looked) == 2
    assert _has_rect(overview, "looked", _expected_rect(CROP1_BOX, ORIGINAL_SIZE, overview["size"]))
    # Observation 2 (CROP2_BOX on the 2x-resized observation 1) is the target itself on the original.
    assert _has_rect(overview, "looked", _expected_rect(TARGET_PX, ORIGINAL_SIZE, overview["size"]))
    assert _has_rect(overview, "gt", _expected_rect(TARGET_PX, ORIGINAL_SIZE, overview["size"]))


def test_summary_filters_and_missing_image(tmp_path):
    page = _render(tmp_path)
    assert "50.0% of 2 scored" in page
    assert "answered 1 (33%)" in page and "over_turn 1 (33%)" in page and "format_error 1 (33%)" in page
    assert 'data-end="answered" data-ok="1"' in page and 'data-end="over_turn" data-ok="0"' in page
    assert 'data-end="format_error" data-ok=""' in page
    assert 'id="f-end"' in page and 'id="f-ok"' in page and 'id="f-q"' in page and "function applyFilter" in page
    assert "A (red)" in page  # ground truth with its option text
    parsed = _parse(page)
    assert parsed.missing == ["0"]
    assert f"missing image: {tmp_path / 'nope.png'}" in page
    assert "Showing the first" not in page


def test_rendering_leaves_the_callers_images_alone(tmp_path):
    trajectories = _trajectories(tmp_path)
    render_html(trajectories, tmp_path / "page.html", thumb_side=100)
    assert trajectories[0].pending[1].size == (800, 600)


def test_max_trajectories_truncates_and_says_so(tmp_path):
    page = _render(tmp_path, max_trajectories=2)
    assert "Showing the first 2 of 3 trajectories" in page
    assert page.count('<details class="traj"') == 2
    assert "synth-2#0" not in page and "missing image" not in page
    assert page.count(JPEG_PREFIX) == 4
    assert "format_error 1 (33%)" in page  # the summary still counts everything


def test_round_trip_through_jsonl_and_view_file(tmp_path):
    jsonl = write_trajectories(_trajectories(tmp_path), tmp_path / "run" / "trajectories.jsonl")
    assert all(not t.pending for t in read_trajectories(jsonl))
    out = view_file(jsonl, tmp_path / "view" / "page.html")
    page = out.read_text(encoding="utf-8")
    assert "trajectories.jsonl" in page.split("</title>")[0]
    assert page.count(JPEG_PREFIX) == 4  # saved crops are files now, still each embedded once
    figures = _parse(page).figures
    observation1 = next(f for f in figures if f["image"] == 1 and any(r[0] == "crop" for r in f["rects"]))
    assert _has_rect(observation1, "crop", _expected_rect(CROP2_BOX, (800, 600), observation1["size"]))
    assert len(page.encode()) < 300_000
    assert not list(out.parent.glob(".*.tmp"))  # written atomically, nothing left behind


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian chromium is not installed")
def test_page_renders_in_headless_chromium(tmp_path):
    """The embedded images really show (the red target's pixels appear) when a browser draws the page."""
    page_path = render_html(_trajectories(tmp_path), tmp_path / "page.html")
    shot = tmp_path / "shot.png"
    subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
         "--window-size=1280,2000", page_path.as_uri()],
        check=True, capture_output=True, timeout=120,
    )
    with Image.open(shot) as image:
        pixels = image.convert("RGB").getdata()
        red = sum(1 for r, g, b in pixels if r > 180 and g < 80 and b < 80)
    assert red > 500


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian chromium is not installed")
def test_filters_hide_cards_in_headless_chromium(tmp_path):
    """The inline filter script runs: filtering on an end reason plus a search leaves one card shown."""
    page = _render(tmp_path)
    drive = ("<script>document.getElementById('f-end').value='over_turn';"
             "document.getElementById('f-q').value='SYNTH-1';applyFilter();</script></body>")
    driven = tmp_path / "driven.html"
    driven.write_text(page.replace("</body>", drive), encoding="utf-8")
    dom = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", driven.as_uri()],
        check=True, capture_output=True, text=True, timeout=120,
    ).stdout
    cards = re.findall(r"<details [^>]*>", dom)
    assert len(cards) == 3
    visible = [c for c in cards if " hidden" not in c]
    assert len(visible) == 1 and 'data-end="over_turn"' in visible[0]
    assert '<b id="f-count">1</b>' in dom
