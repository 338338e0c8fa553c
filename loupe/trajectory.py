"""The trajectory record: one multi-turn attempt at one task, and its JSONL I/O.

A trajectory is the dialogue after the system prompt: the user's question, then alternating assistant turns
(reasoning plus a tool call or an answer) and user turns (an observation image, or an error message). Every
image in the dialogue, in the order the `<image>` placeholders appear, is listed once in `images`: the task's
images first, then each crop. Turns refer to images by their index there, so a crop's box can be drawn on
its source and a dataset writer can copy each file once.

Crops produced during a rollout live in memory (`pending`) until `write_trajectories` saves them as PNG files
beside the JSONL (`images/<traj_id>/<index>.png`) and records their paths relative to the JSONL's folder.
Token ids, the generated-token mask and sampling log-probs (what RL trains on) stay in memory on `trace`;
they are not written to JSONL. `JsonlWriter` writes a file a piece at a time (eval streams its trajectories
chunk by chunk) and puts it in place whole, with one rename, only when the last piece is in.
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from PIL import Image

from loupe.images import open_image
from loupe.io import FILE_MODE, atomic_write_bytes, atomic_write_text
from loupe.png import encode_png

END_REASONS = ("answered", "over_turn", "format_error", "length")
"""Why a trajectory stopped: it answered; it was still calling tools at the turn, image or context limit;
its last turn broke the format with no retries left; or it ran out of new-token budget mid-turn."""


@dataclass
class Turn:
    """One message of the dialogue after the system prompt."""

    role: str
    """'user' (question, observation, error message) or 'assistant' (the model's turn)."""
    text: str
    """The message text verbatim; user turns hold one `<image>` placeholder per image."""
    images: list[int] = field(default_factory=list)
    """Indices into `Trajectory.images` of this turn's images, in placeholder order."""
    action: str | None = None
    """Assistant turns: 'call', 'answer' or 'error' (see loupe.protocol.Action.kind)."""
    call: dict[str, Any] | None = None
    """Assistant turns that call a tool: {'tool': name, 'arguments': {...}}."""
    error: str | None = None
    """Why the turn failed: a format error on an assistant turn, a tool error on the user turn after it."""
    crop: dict[str, Any] | None = None
    """Observation turns: {'source': name, 'source_image': index, 'box_px': [x0, y0, x1, y1] on the source,
    'region_px': [x0, y0, x1, y1] on its base (the pixels cut: the original, or observation `base` when
    that is an image of its own, such as a rotated view), 'size': [w, h], 'observation': N, 'base': 0 or N}."""
    tool: dict[str, Any] | None = None
    """Observation turns of a visual operation other than the crop (`loupe.visual_ops`): {'tool': name,
    'observations': [N, ...] (the observations its images became), 'text': what it said, ...its record}."""
    num_tokens: int = 0
    """Tokens this turn occupies in the model's context (generated tokens for assistant turns)."""


@dataclass
class Trajectory:
    """One attempt at one task: the dialogue, why it ended, and how it scored."""

    traj_id: str
    """Unique id: '<doc_id>#<sample_index>' by convention."""
    task: dict[str, Any]
    """The task record (loupe.data.tasks.TaskRecord as a dict)."""
    protocol: str
    """Name of the protocol variant that produced the dialogue."""
    system: str
    """The system prompt."""
    turns: list[Turn] = field(default_factory=list)
    images: list[str] = field(default_factory=list)
    """Every image of the dialogue in placeholder order; paths absolute or relative to the JSONL's folder."""
    sample_index: int = 0
    """Which of the K samples of this task this is."""
    end_reason: str | None = None
    """One of END_REASONS once finished."""
    answer: str | None = None
    """The extracted final answer, when it answered."""
    rewards: dict[str, Any] = field(default_factory=dict)
    """Reward parts (accuracy, format, tool, total, valid, ...) from loupe.rewards."""
    num_tool_calls: int = 0
    num_format_errors: int = 0
    prompt_tokens: int = 0
    """Tokens of the system prompt and the question, images included."""
    generated_tokens: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    """Free-form extras: teacher name, engine, timings."""

    # In memory only: never serialised.
    pending: dict[int, Image.Image] = field(default_factory=dict, repr=False, compare=False)
    """Crops not yet saved, by image index."""
    trace: Any = field(default=None, repr=False, compare=False)
    """The rollout's token-level record (ids, generated mask, log-probs), for RL."""
    base_dir: Path | None = field(default=None, repr=False, compare=False)
    """Folder that relative image paths resolve against (set when read from or written to a file)."""

    @property
    def num_turns(self) -> int:
        """Assistant turns taken."""
        return sum(1 for t in self.turns if t.role == "assistant")

    def add_image(self, path_or_image: str | Path | Image.Image) -> int:
        """Register an image of the dialogue; returns its index."""
        index = len(self.images)
        if isinstance(path_or_image, Image.Image):
            self.images.append("")
            self.pending[index] = path_or_image
        else:
            self.images.append(str(path_or_image))
        return index

    def image_path(self, index: int) -> Path:
        """The file of image `index`; crops must have been saved (write_trajectories) first."""
        if index in self.pending:
            raise ValueError(f"trajectory {self.traj_id}: image {index} is an unsaved crop; write the trajectory first")
        path = Path(self.images[index])
        if not path.is_absolute() and self.base_dir is not None:
            path = self.base_dir / path
        return path

    def load_image(self, index: int) -> Image.Image:
        """Image `index` as a PIL image, from memory or from its file.

        Files are decoded by `open_image`, the rule the model was shown them by (EXIF orientation applied,
        transparency on white), so boxes drawn on an original land where the model pointed.
        """
        if index in self.pending:
            return self.pending[index]
        return open_image(self.image_path(index))

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("pending", "trace", "base_dir")}
        data["turns"] = [asdict(t) for t in self.turns]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any], base_dir: Path | None = None) -> Trajectory:
        known = {f.name for f in fields(cls)} - {"pending", "trace", "base_dir"}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown trajectory fields {sorted(unknown)}")
        data = dict(data)
        data["turns"] = [Turn(**t) for t in data.get("turns", [])]
        return cls(**data, base_dir=base_dir)


def save_pending_images(trajectory: Trajectory, out_dir: Path) -> None:
    """Write the trajectory's in-memory crops under `out_dir/images/<traj_id>/` and record relative paths."""
    if not trajectory.pending:
        return
    folder = Path("images") / _safe_name(trajectory.traj_id)
    for index, image in sorted(trajectory.pending.items()):
        relative = folder / f"{index}.png"
        if image.mode == "RGB":
            data = encode_png(image)
        else:
            buffer = io.BytesIO()
            image.save(buffer, format="PNG", compress_level=1)
            data = buffer.getvalue()
        atomic_write_bytes(out_dir / relative, data)
        trajectory.images[index] = str(relative)
    trajectory.pending.clear()
    trajectory.base_dir = out_dir


def _safe_name(traj_id: str) -> str:
    """A folder name for a trajectory's crops: readable, and distinct for distinct ids (a short hash)."""
    readable = "".join(c if c.isalnum() or c in "-_" else "_" for c in traj_id)[:80]
    return f"{readable}-{hashlib.sha1(traj_id.encode('utf-8')).hexdigest()[:8]}"


def _rebase_images(trajectory: Trajectory, out_dir: Path) -> None:
    """Make relative image paths relative to `out_dir`, for a trajectory read from or written to another folder."""
    base = trajectory.base_dir
    if base is None or Path(base).resolve() == Path(out_dir).resolve():
        return
    for index, image in enumerate(trajectory.images):
        if index in trajectory.pending or not image or Path(image).is_absolute():
            continue
        trajectory.images[index] = os.path.relpath(Path(base).resolve() / image, Path(out_dir).resolve())
    trajectory.base_dir = out_dir


def write_trajectories(trajectories: Iterable[Trajectory], path: str | Path) -> Path:
    """Save crops beside `path`, then write all trajectories as JSONL atomically."""
    path = Path(path)
    lines = []
    for trajectory in trajectories:
        _rebase_images(trajectory, path.parent)
        save_pending_images(trajectory, path.parent)
        lines.append(json.dumps(trajectory.to_json(), ensure_ascii=False))
    atomic_write_text(path, "".join(line + "\n" for line in lines))
    return path


class JsonlWriter:
    """A JSONL file written a piece at a time into a hidden temporary file beside `path`, renamed to `path` on
    `commit`.

    Eval writes its trajectories and results a chunk at a time, so memory holds one chunk, not the benchmark;
    the rename at the end keeps the all-or-nothing promise of `atomic_write_text`: a run that dies before
    `commit` leaves `path` as it was (absent, or the previous run's whole file), never half a file. As a context
    manager it commits on a normal exit and discards the temporary file on an exception. The leftovers of a
    run killed outright (`.<name>.*.partial`) are removed by the next writer of the same path.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for stale in self.path.parent.glob(f".{glob.escape(self.path.name)}.*.partial"):
            stale.unlink(missing_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".partial")
        self.tmp_path = Path(tmp)  # where the lines go until `commit`
        self._file = os.fdopen(fd, "w", encoding="utf-8")
        self.lines = 0  # lines written so far

    def write_rows(self, rows: Iterable[dict[str, Any]], ensure_ascii: bool = True) -> None:
        """Append one JSON line per row. Every row is serialised before any is written, so a row that cannot be
        written leaves the file as it was."""
        self._write([json.dumps(row, ensure_ascii=ensure_ascii) for row in rows])

    def write_trajectories(self, trajectories: Iterable[Trajectory]) -> None:
        """Append trajectories as `write_trajectories` writes them: crops saved beside `path` first (which
        clears them from memory), relative image paths made relative to its folder."""
        lines = []
        for trajectory in trajectories:
            _rebase_images(trajectory, self.path.parent)
            save_pending_images(trajectory, self.path.parent)
            lines.append(json.dumps(trajectory.to_json(), ensure_ascii=False))
        self._write(lines)

    def _write(self, lines: list[str]) -> None:
        if self._file.closed:
            raise ValueError(f"{self.path}: writer already committed or discarded")
        self._file.write("".join(line + "\n" for line in lines))
        self._file.flush()  # a piece is on disk before the next one is computed (and visible to a watcher)
        self.lines += len(lines)

    def commit(self) -> Path:
        """Put the file in place under `path` in one rename; returns `path`."""
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.chmod(self.tmp_path, FILE_MODE)
            os.replace(self.tmp_path, self.path)
        except BaseException:
            self.abort()
            raise
        return self.path

    def abort(self) -> None:
        """Drop what was written; `path` stays as it was."""
        if not self._file.closed:
            self._file.close()
        self.tmp_path.unlink(missing_ok=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if kind is None:
            self.commit()
        else:
            self.abort()


def read_trajectories(path: str | Path) -> list[Trajectory]:
    """Read a trajectory JSONL; errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: trajectory file not found")
    out = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                out.append(Trajectory.from_json(json.loads(line), base_dir=path.parent))
            except (ValueError, TypeError) as err:
                raise ValueError(f"{path}:{line_no}: not a trajectory record ({err})") from None
    return out
