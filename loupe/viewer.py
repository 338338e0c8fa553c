"""`loupe view`: render trajectories as one self-contained HTML page to look at in a browser.

The page has a summary table (count, accuracy, end reasons, mean turns), a filter bar (end reason,
correct/incorrect, text search; a few lines of inline JavaScript) and one collapsible card per trajectory that
walks through it turn by turn: the model's text HTML-escaped with its tags (`<think>`, `<grounding>`, ...)
shown and coloured, tool-call arguments, errors in red, and every image inline.

Images are downscaled JPEG thumbnails embedded as base64, each distinct image once per page (an original
shared by K samples of a task is encoded once): each is defined once as an SVG `<image>` in a hidden sprite
and shown wherever needed through `<use href="#id">`. Every figure is an SVG whose viewBox is the thumbnail's
size, so boxes are drawn as `<rect>`s in thumbnail coordinates (source pixels times the thumbnail's scale):
- on an observation's source image, the crop's `box_px` (orange); a visual operation's turn (`Turn.tool`: a mask,
  found text, a track) shows what it returned beside its images;
- on the original, every box the model looked at, mapped back through chains of crops (blue, numbered);
- the task's ground-truth `bbox` (green) on the original, and on crops wherever it is in view.
Nothing is fetched from outside the file, so it works offline from file://.
"""

from __future__ import annotations

import base64
import html
import io
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from loupe.io import atomic_write_text
from loupe.trajectory import Trajectory, Turn, read_trajectories

JPEG_QUALITY = 80
OPTION_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
Box = tuple[float, float, float, float]

_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:0 auto;max-width:1400px;padding:12px 20px;color:#222;background:#f6f6f4}
h1{font-size:20px;margin:4px 0 10px}table.summary{border-collapse:collapse;margin:6px 0}
.summary td,.summary th{border:1px solid #ccc;padding:3px 10px;text-align:left;background:#fff}
.bar{position:sticky;top:0;z-index:2;background:#f6f6f4;padding:8px 0;border-bottom:1px solid #ddd;display:flex;gap:10px;flex-wrap:wrap;align-items:center}
.bar input[type=search]{width:260px}.note{background:#fff3cd;border:1px solid #e0c060;padding:6px 10px;margin:8px 0}
.legend span{margin-right:14px}.sw{display:inline-block;width:14px;height:10px;border:2px solid;margin-right:4px;vertical-align:middle}
details.traj{background:#fff;border:1px solid #ccc;border-left:6px solid #999;border-radius:4px;margin:8px 0}
details.traj[data-ok="1"]{border-left-color:#2a9d3a}details.traj[data-ok="0"]{border-left-color:#d33}
details.traj>summary{cursor:pointer;padding:6px 10px;display:flex;gap:10px;flex-wrap:wrap;align-items:baseline}
.body{padding:4px 14px 12px}.id{font-weight:600;font-family:monospace}.q{color:#555;flex:1 1 300px;overflow:hidden;white-space:nowrap;text-overflow:ellipsis}
.pill{border-radius:9px;padding:0 7px;font-size:12px;background:#e8e8e8}.pill.answered{background:#d7ecff}
.pill.over_turn{background:#ffe3c2}.pill.format_error,.pill.length{background:#ffd0d0}.ok1{color:#2a9d3a;font-weight:700}.ok0{color:#d33;font-weight:700}
table.facts td{padding:2px 10px 2px 0;vertical-align:top}table.facts td:first-child{color:#666;white-space:nowrap}
ol.opts{margin:0;padding-left:22px}li.right{color:#2a9d3a;font-weight:600}li.chosen{text-decoration:underline wavy #d33}
.turn{border-top:1px dashed #ddd;padding:8px 0;display:flex;gap:10px}.role{width:88px;flex:none;font-size:12px;color:#666}
.turn.assistant .role{color:#0b5cad}.content{flex:1;min-width:0}
pre.text{white-space:pre-wrap;word-break:break-word;margin:0;font:13px/1.45 ui-monospace,monospace;background:#fafafa;padding:6px 8px;border-radius:3px}
.turn.assistant pre.text{background:#eef5ff}.tag{color:#888;background:#eee;border-radius:3px}.tag.think{color:#7a4ea8;background:#f1e8fb}
.tag.grounding,.tag.tool_call{color:#b35c00;background:#fff0dd}.tag.answer{color:#1f7a2e;background:#e3f6e6}.tag.image{color:#0b5cad;background:#e0ecfb}
.err{background:#ffe9e9;border:1px solid #e99;color:#a00;padding:4px 8px;margin:4px 0;border-radius:3px}.call{font-family:monospace;font-size:12px;margin:4px 0;color:#b35c00}
.shots{display:flex;gap:10px;flex-wrap:wrap;margin-top:6px}figure.shot{margin:0;flex:0 1 420px;cursor:zoom-in}
figure.shot.big{flex-basis:100%;cursor:zoom-out}figure.shot svg{width:100%;height:auto;display:block;background:#ddd}
figcaption{font-size:12px;color:#555}.missing{border:2px dashed #d33;color:#a00;padding:20px;background:#fff5f5;flex:0 1 420px}
.box{fill:none;stroke-width:2.5;vector-effect:non-scaling-stroke}.box.crop{stroke:#ff7a00}.box.gt{stroke:#00c040;stroke-dasharray:6 3}.box.looked{stroke:#1e90ff}
.lbl{paint-order:stroke;stroke:#000;stroke-width:3px;font-weight:700;font-family:sans-serif}.lbl.crop{fill:#ff7a00}.lbl.looked{fill:#1e90ff}.lbl.gt{fill:#00c040}
"""

_JS = """
function applyFilter(){
  const end=document.getElementById('f-end').value, ok=document.getElementById('f-ok').value;
  const q=document.getElementById('f-q').value.trim().toLowerCase();
  let shown=0;
  for(const card of document.querySelectorAll('details.traj')){
    const visible=(!end||card.dataset.end===end)&&(!ok||card.dataset.ok===ok)&&(!q||card.dataset.search.includes(q));
    card.hidden=!visible; if(visible) shown++;
  }
  document.getElementById('f-count').textContent=shown;
}
function openAll(open){for(const card of document.querySelectorAll('details.traj')) if(!card.hidden) card.open=open;}
document.addEventListener('click',e=>{const fig=e.target.closest('figure.shot'); if(fig) fig.classList.toggle('big');});
"""


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _highlighted(text: str) -> str:
    """The text HTML-escaped, with each tag-like `<name>`/`</name>` kept visible and coloured by its name."""

    def wrap(match: re.Match) -> str:
        return f'<span class="tag {_esc(match.group(2))}">{match.group(0)}</span>'

    return re.sub(r"&lt;(/?)([A-Za-z_][\w-]*)&gt;", wrap, html.escape(text or "", quote=False))


@dataclass(frozen=True)
class _Thumb:
    """An embedded thumbnail: its sprite id, the full image's size and the thumbnail's size."""

    dom_id: str
    width: int
    height: int
    thumb_width: int
    thumb_height: int


class _ImageSprite:
    """Distinct images of the page, each encoded once; later requests for the same image reuse its id."""

    def __init__(self, thumb_side: int):
        self.thumb_side = thumb_side
        self.by_key: dict[Any, _Thumb | str] = {}
        self.defs: list[str] = []

    def get(self, trajectory: Trajectory, index: int) -> _Thumb | str:
        """The thumbnail of image `index`, or a "missing image: ..." message when it cannot be loaded."""
        if not isinstance(index, int) or not 0 <= index < len(trajectory.images):
            return f"missing image: #{index} is not in the trajectory's {len(trajectory.images)} images"
        if index in trajectory.pending:
            # Keyed by the object itself: crops in memory have no path to share.
            key: Any = ("pending", id(trajectory.pending[index]))
        else:
            key = str(trajectory.image_path(index).resolve())
        if key not in self.by_key:
            self.by_key[key] = self._encode(trajectory, index)
        return self.by_key[key]

    def _encode(self, trajectory: Trajectory, index: int) -> _Thumb | str:
        try:
            image = trajectory.load_image(index)
        except (OSError, ValueError, Image.DecompressionBombError) as err:
            where = trajectory.images[index] or f"#{index}"
            return f"missing image: {where} ({type(err).__name__})"
        thumb = image.convert("RGB")  # a copy, so the caller's image is never resized in place
        thumb.thumbnail((self.thumb_side, self.thumb_side), Image.Resampling.LANCZOS)
        buffer = io.BytesIO()
        thumb.save(buffer, format="JPEG", quality=JPEG_QUALITY, optimize=True)
        dom_id = f"im{len(self.defs)}"
        data = base64.b64encode(buffer.getvalue()).decode("ascii")
        self.defs.append(
            f'<image id="{dom_id}" width="{thumb.width}" height="{thumb.height}" href="data:image/jpeg;base64,{data}"/>'
        )
        return _Thumb(dom_id, image.width, image.height, thumb.width, thumb.height)

    def svg_defs(self) -> str:
        # Zero-sized rather than display:none, which stops some browsers from rendering <use> references.
        return f'<svg width="0" height="0" style="position:absolute"><defs>{"".join(self.defs)}</defs></svg>'


def _to_original_maps(trajectory: Trajectory) -> dict[int, Box]:
    """Image index -> (offset_x, offset_y, scale_x, scale_y) with original pixel = offset + pixel * scale.

    Crops of crops chain: a crop's pixels map to its source's pixels through its box and stored size.
    """
    maps: dict[int, Box] = {0: (0.0, 0.0, 1.0, 1.0)}
    for turn in trajectory.turns:
        crop = turn.crop or {}
        parent = maps.get(crop.get("source_image", -1))
        box, size = crop.get("box_px"), crop.get("size")
        if parent is None or not turn.images or not box or not size or min(size) <= 0 or box[2] <= box[0] or box[3] <= box[1]:
            continue
        ox, oy, sx, sy = parent
        x0, y0, x1, y1 = box
        maps[turn.images[0]] = (ox + x0 * sx, oy + y0 * sy, sx * (x1 - x0) / size[0], sy * (y1 - y0) / size[1])
    return maps


def _map_box(box: Box, mapping: Box, inverse: bool = False) -> Box:
    ox, oy, sx, sy = mapping
    x0, y0, x1, y1 = box
    if inverse:
        return ((x0 - ox) / sx, (y0 - oy) / sy, (x1 - ox) / sx, (y1 - oy) / sy)
    return (ox + x0 * sx, oy + y0 * sy, ox + x1 * sx, oy + y1 * sy)


class _TrajectoryRenderer:
    """Renders one trajectory's card; knows its coordinate maps and ground-truth box."""

    def __init__(self, trajectory: Trajectory, sprite: _ImageSprite):
        self.trajectory, self.sprite = trajectory, sprite
        self.maps = _to_original_maps(trajectory)
        self.gt_px: Box | None = None
        bbox = trajectory.task.get("bbox")
        original = sprite.get(trajectory, 0) if trajectory.images else None
        if bbox and isinstance(original, _Thumb):
            self.gt_px = (bbox[0] * original.width, bbox[1] * original.height, bbox[2] * original.width, bbox[3] * original.height)

    def figure(self, index: int, caption: str, boxes: list[tuple[str, Box, str]] | None = None) -> str:
        """Image `index` with `boxes` ((kind, box in its pixels, label)) and the ground truth wherever in view."""
        thumb = self.sprite.get(self.trajectory, index)
        if isinstance(thumb, str):
            return f'<div class="missing" data-image="{index}">{_esc(thumb)}<br><small>{_esc(caption)}</small></div>'
        all_boxes = list(boxes or [])
        if self.gt_px is not None and index in self.maps:
            x0, y0, x1, y1 = _map_box(self.gt_px, self.maps[index], inverse=True)
            clipped = (max(0.0, x0), max(0.0, y0), min(float(thumb.width), x1), min(float(thumb.height), y1))
            if clipped[2] > clipped[0] and clipped[3] > clipped[1]:
                all_boxes.insert(0, ("gt", clipped, "GT"))
        scale_x, scale_y = thumb.thumb_width / thumb.width, thumb.thumb_height / thumb.height
        font = max(thumb.thumb_width, thumb.thumb_height) * 0.035
        shapes = []
        for kind, (x0, y0, x1, y1), label in all_boxes:
            x, y, w, h = x0 * scale_x, y0 * scale_y, (x1 - x0) * scale_x, (y1 - y0) * scale_y
            shapes.append(f'<rect class="box {kind}" x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}"/>')
            # Ground truth is labelled below its box, zooms above theirs, so a zoom onto the target stays readable.
            below = kind == "gt" or y <= font
            text_y = y + h + font if below and y + h + font <= thumb.thumb_height else (y - 3 if y > font else y + font)
            shapes.append(f'<text class="lbl {kind}" x="{x:.1f}" y="{text_y:.1f}" font-size="{font:.0f}">{_esc(label)}</text>')
        return (
            f'<figure class="shot" data-image="{index}"><svg viewBox="0 0 {thumb.thumb_width} {thumb.thumb_height}">'
            f'<use href="#{thumb.dom_id}"/>{"".join(shapes)}</svg>'
            f"<figcaption>{_esc(caption)} · {thumb.width}×{thumb.height}</figcaption></figure>"
        )

    def looked_boxes(self) -> list[tuple[str, Box, str]]:
        """Every crop's box mapped onto the original, labelled with its observation number."""
        out = []
        for turn in self.trajectory.turns:
            crop = turn.crop or {}
            mapping = self.maps.get(crop.get("source_image", -1))
            if mapping is not None and crop.get("box_px"):
                out.append(("looked", _map_box(tuple(crop["box_px"]), mapping), str(crop.get("observation", "?"))))
        return out

    def turn(self, number: int, turn: Turn) -> str:
        parts = [f'<pre class="text">{_highlighted(turn.text)}</pre>']
        if turn.call:
            parts.append(f'<div class="call">call {_esc(turn.call.get("tool"))}: {_esc(json.dumps(turn.call.get("arguments")))}</div>')
        if turn.error:
            parts.append(f'<div class="err">error: {_esc(turn.error)}</div>')
        figures = []
        if turn.crop:
            crop = turn.crop
            figures += [self.figure(i, f"observation {crop.get('observation', '?')} (image #{i})") for i in turn.images]
            box = crop.get("box_px")
            source_index = crop.get("source_image", -1)
            boxes = [("crop", tuple(box), str(crop.get("observation", "")))] if box else []
            figures.append(self.figure(source_index, f"source {crop.get('source')} (image #{source_index}), box_px {box}", boxes))
        elif turn.tool:
            tool = turn.tool
            shown = {k: v for k, v in tool.items() if k not in ("tool", "observations", "text")}
            parts.append(f'<div class="call">{_esc(tool.get("tool"))} returned: {_esc(_short(json.dumps(shown), 400))}</div>')
            figures += [self.figure(i, f"observation {n} (image #{i}) from {tool.get('tool')}")
                        for i, n in zip(turn.images, tool.get("observations", []))]
        else:
            for i in turn.images:
                # The original doubles as an overview: where the model looked, across all its zooms.
                boxes = self.looked_boxes() if i == 0 else []
                figures.append(self.figure(i, f"image #{i}" + (", every zoom mapped onto it" if boxes else ""), boxes))
        if figures:
            parts.append(f'<div class="shots">{"".join(figures)}</div>')
        label = turn.role + (f" · {turn.action}" if turn.action else "") + (" · observation" if turn.crop else "")
        label += f" · {turn.tool['tool']}" if turn.tool else ""
        error_class = " error" if turn.error else ""
        return (
            f'<div class="turn {_esc(turn.role)}{error_class}"><div class="role">#{number} {_esc(label)}'
            f"<br>{turn.num_tokens} tok</div><div class=\"content\">{''.join(parts)}</div></div>"
        )

    def card(self, open_card: bool = False) -> str:
        t, task = self.trajectory, self.trajectory.task
        ok = _correctness(t)
        options = task.get("options") or []
        solution = task.get("solution")
        chosen = t.rewards.get("extracted")
        truth = _esc(solution)
        if options and isinstance(solution, str) and solution in OPTION_LETTERS[: len(options)]:
            truth += f" ({_esc(options[OPTION_LETTERS.index(solution)])})"
        option_items = "".join(
            f'<li class="{"right" if letter == solution else ""} {"chosen" if letter == chosen and letter != solution else ""}">{_esc(text)}</li>'
            for letter, text in zip(OPTION_LETTERS, options)
        )
        rewards = ", ".join(f"{_esc(k)}={_esc(_short(v))}" for k, v in t.rewards.items()) or "—"
        counts = (
            f"{t.num_turns} turns · {t.num_tool_calls} tool calls · {t.num_format_errors} format errors · "
            f"{t.prompt_tokens} prompt + {t.generated_tokens} generated tokens"
        )
        facts = [
            ("doc_id / sample", f"{_esc(task.get('doc_id'))} / {t.sample_index}"),
            ("source", f"{_esc(task.get('data_source', '?'))} · category {_esc(task.get('category'))} · protocol {_esc(t.protocol)}"),
            ("question", _esc(task.get("problem", ""))),
            ("options", f'<ol class="opts" type="A">{option_items}</ol>' if options else "—"),
            ("ground truth", truth),
            ("model answer", _esc(t.answer) if t.answer is not None else "—"),
            ("end reason", _esc(t.end_reason)),
            ("rewards", rewards),
            ("turns / tokens", counts),
        ]
        if t.meta:
            facts.append(("meta", _esc(json.dumps(t.meta, ensure_ascii=False, default=str))))
        fact_rows = "".join(f"<tr><td>{name}</td><td>{value}</td></tr>" for name, value in facts)
        turns = "".join(self.turn(i, turn) for i, turn in enumerate(t.turns))
        mark = {"1": '<span class="ok1">✓</span>', "0": '<span class="ok0">✗</span>'}.get(ok, "·")
        search = " ".join(str(x) for x in (t.traj_id, task.get("doc_id", ""), task.get("problem", ""))).lower()
        return (
            f'<details class="traj"{" open" if open_card else ""} data-end="{_esc(t.end_reason)}" data-ok="{ok}" data-search="{_esc(search)}">'
            f'<summary>{mark}<span class="id">{_esc(t.traj_id)}</span><span class="pill {_esc(t.end_reason)}">'
            f"{_esc(t.end_reason)}</span><span>{t.num_turns} turns · {t.num_tool_calls} crops</span>"
            f"<span>answer {_esc(_short(t.answer if t.answer is not None else '—'))} / truth {_esc(solution)}</span>"
            f'<span class="q">{_esc(task.get("problem", ""))}</span></summary>'
            f'<div class="body"><table class="facts">{fact_rows}</table>{turns}</div></details>'
        )


def _short(value: Any, limit: int = 60) -> str:
    text = f"{value:.3g}" if isinstance(value, float) else str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _correctness(trajectory: Trajectory) -> str:
    """'1' correct, '0' incorrect, '' unscored. Judge scores may be fractional: half or more counts as right."""
    accuracy = trajectory.rewards.get("accuracy")
    if not isinstance(accuracy, (int, float)):
        return ""
    return "1" if accuracy >= 0.5 else "0"


def _summary(trajectories: list[Trajectory]) -> str:
    count = len(trajectories)
    accuracies = [t.rewards["accuracy"] for t in trajectories if isinstance(t.rewards.get("accuracy"), (int, float))]
    accuracy = f"{sum(accuracies) / len(accuracies):.1%} of {len(accuracies)} scored" if accuracies else "—"
    ends = Counter(str(t.end_reason) for t in trajectories)
    end_text = ", ".join(f"{_esc(reason)} {n} ({n / count:.0%})" for reason, n in ends.most_common()) or "—"

    def mean(values: list[float]) -> str:
        return f"{sum(values) / len(values):.2f}" if values else "—"

    rows = [
        ("trajectories", f"{count} ({len({t.task.get('doc_id') for t in trajectories})} tasks)"),
        ("accuracy", accuracy),
        ("end reasons", end_text),
        ("mean turns", mean([t.num_turns for t in trajectories])),
        ("mean tool calls", mean([t.num_tool_calls for t in trajectories])),
        ("mean format errors", mean([t.num_format_errors for t in trajectories])),
        ("mean generated tokens", mean([t.generated_tokens for t in trajectories])),
    ]
    return '<table class="summary">' + "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows) + "</table>"


def render_html(
    trajectories: list[Trajectory],
    out_path: str | Path,
    title: str = "Loupe trajectories",
    max_trajectories: int | None = None,
    thumb_side: int = 640,
) -> Path:
    """Write one self-contained HTML page showing `trajectories` (the first `max_trajectories` of them)."""
    if thumb_side < 1:
        raise ValueError(f"thumb_side must be a positive number of pixels, got {thumb_side}")
    out_path = Path(out_path)
    trajectories = list(trajectories)
    shown = trajectories if max_trajectories is None else trajectories[: max(0, max_trajectories)]
    sprite = _ImageSprite(thumb_side)
    # The first card starts open so the page shows a full trajectory at once.
    cards = "\n".join(_TrajectoryRenderer(t, sprite).card(open_card=i == 0) for i, t in enumerate(shown))
    note = ""
    if len(shown) < len(trajectories):
        note = (f'<div class="note truncated">Showing the first {len(shown)} of {len(trajectories)} trajectories '
                f"(max_trajectories={max_trajectories}); the summary counts all of them.</div>")
    end_options = "".join(f'<option value="{_esc(r)}">{_esc(r)}</option>' for r in sorted({str(t.end_reason) for t in shown}))
    prompts = {t.system for t in shown if t.system}
    prompt_blocks = "".join(f'<pre class="text">{_highlighted(p)}</pre>' for p in sorted(prompts))
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1">
<title>{_esc(title)}</title><style>{_CSS}</style></head>
<body>{sprite.svg_defs()}
<h1>{_esc(title)}</h1>
{_summary(trajectories)}{note}
<details><summary>System prompts ({len(prompts)})</summary>{prompt_blocks}</details>
<div class="bar">
<label>end reason <select id="f-end" onchange="applyFilter()"><option value="">all</option>{end_options}</select></label>
<label>result <select id="f-ok" onchange="applyFilter()"><option value="">all</option><option value="1">correct</option><option value="0">incorrect</option></select></label>
<input id="f-q" type="search" placeholder="search question / doc_id" oninput="applyFilter()">
<span><b id="f-count">{len(shown)}</b> shown</span>
<button onclick="openAll(true)">expand all</button><button onclick="openAll(false)">collapse all</button>
<span class="legend"><span><i class="sw" style="border-color:#00c040"></i>ground truth</span>
<span><i class="sw" style="border-color:#ff7a00"></i>crop box on its source</span>
<span><i class="sw" style="border-color:#1e90ff"></i>zooms mapped onto the original</span></span>
</div>
{cards}
<script>{_JS}</script>
</body></html>
"""
    atomic_write_text(out_path, page)
    return out_path


def view_file(trajectories_jsonl: str | Path, out_path: str | Path, **kw: Any) -> Path:
    """Read a trajectory JSONL and render it with `render_html` (keyword arguments pass through)."""
    trajectories_jsonl = Path(trajectories_jsonl)
    kw.setdefault("title", f"Loupe trajectories: {trajectories_jsonl.name}")
    return render_html(read_trajectories(trajectories_jsonl), out_path, **kw)
