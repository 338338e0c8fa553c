"""The import teacher: a publisher's cold-start SFT set from a local copy, as trajectories.

`synth.import.format` names the set (stages/synth/import_formats.py reads each: Mini-o3-Coldstart-Dataset,
PixelReasoner-SFT-Data, R1-V's chain-of-thought set). Each row becomes a `Trajectory` (human turns are user
turns, observations included; gpt turns are assistant turns, parsed by the protocol like a model's), so imported
rows pass the same rejection checks and reach the dataset through the same writer as the other teachers. Images
keep their original bytes and names (no re-encoding); rows whose images are unreadable or over
`protocol.max_decode_pixels` are rejected as `bad_image`. The sets hold no separate solutions, so answers are
not re-scored: their publishers kept only correct ones.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from PIL import Image

from loupe.data.published.rows import DATA_SUFFIXES, ImageFinder, RecipeFormatError, rows, split_files
from loupe.protocol import IMAGE_PLACEHOLDER, Protocol
from loupe.trajectory import Trajectory, Turn
from stages.synth.import_formats import READERS, REQUIRED_COLUMNS, SUFFIXES, Dialogue, ImportFormatError

ROLES = {"human": "user", "gpt": "assistant"}

__all__ = ["ImportFormatError", "data_files", "iter_rows", "row_to_trajectory"]


def _whole_number(value: Any, where: str, field: str) -> int:
    """A non-negative integer cell (None or empty is 0), else an ImportFormatError naming the field."""
    if value is None or value == "":
        return 0
    try:
        number = float(str(value).strip())  # parquet may store it as 3 or 3.0
    except ValueError:
        number = -1.0
    if isinstance(value, bool) or number < 0 or not number.is_integer():
        raise ImportFormatError(f"{where}: field '{field}': {str(value)[:40]!r} is not a whole number")
    return int(number)


def data_files(path: str | Path, format: str = "mini_o3") -> list[Path]:
    """The files of the train split at `path`: a file itself, or a folder's files of the format's kinds, those
    named for the train split when some are (Mini-o3's scripts/preprocess_coldstart.py reads
    `load_dataset(path, split="train")`)."""
    if format not in READERS:
        raise ValueError(f"synth.import.format: unknown format {format!r}; known: {', '.join(READERS)}")
    return split_files(Path(path), "train", SUFFIXES.get(format, DATA_SUFFIXES))


Row = tuple[Path, int, dict[str, Any]]
"""A row with where it came from: (file, row number in the file from 1, column values)."""


def iter_rows(path: str | Path, batch_rows: int, limit: int | None = None,
              format: str = "mini_o3") -> Iterator[list[Row]]:
    """Batches of rows from every file of the set at `path`, `batch_rows` at a time, the first `limit` only."""
    seen = 0
    batch: list[Row] = []
    for file in data_files(path, format):
        _check_columns(file, format)
        try:
            for number, row in rows(file):
                if limit is not None and seen >= limit:
                    if batch:
                        yield batch
                    return
                batch.append((file, number, row))
                seen += 1
                if len(batch) == batch_rows:
                    yield batch
                    batch = []
        except RecipeFormatError as err:
            raise ImportFormatError(str(err)) from None
    if batch:
        yield batch


def _check_columns(file: Path, format: str) -> None:
    """A parquet file without the format's columns is named at once, with the columns it has."""
    if file.suffix.lower() != ".parquet":
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(file).names
    except (OSError, pa.ArrowException) as err:
        raise ImportFormatError(f"{file}: not a readable parquet file ({err})") from None
    missing = [c for c in REQUIRED_COLUMNS[format] if c not in names]
    if missing:
        raise ImportFormatError(f"{file}: column(s) {missing} missing; found {names}")


def _safe_name(name: str, fallback: str) -> str:
    base = Path(str(name)).name
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", base)[:100]
    return cleaned if cleaned.strip("._") else fallback


def row_to_trajectory(
    source_row: Row, number: int, protocol: Protocol, keep_system: bool, max_decode_pixels: int,
    format: str = "mini_o3", image_dir: Path | None = None,
) -> tuple[Trajectory, dict[str, bytes]]:
    """Row `number` (counted over all files) as a finished trajectory, plus the image files to write beside it
    (relative path -> bytes)."""
    file, row_in_file, row = source_row
    where = f"{file}: row {row_in_file}"
    if not isinstance(row, dict):
        raise ImportFormatError(f"{where}: a row must be an object, not {type(row).__name__}")
    archive = file.parent / "images.zip"
    finder = ImageFinder(file, image_dir, archive=archive if archive.is_file() else None)
    dialogue: Dialogue = READERS[format](file, row_in_file, row, finder)
    messages = list(dialogue.messages)
    folder = f"images/row-{number:07d}"
    files: dict[str, bytes] = {}
    paths: list[str] = []
    reject = None
    for i, data in enumerate(dialogue.images):
        names = dialogue.names
        name = _safe_name(names[i] if i < len(names) and names[i] else "", f"{i}.png")
        relative = f"{folder}/{i:02d}-{name}"
        files[relative] = data
        paths.append(relative)
        reject = reject or _image_problem(data, max_decode_pixels)

    system = protocol.system_prompt()
    if messages[0]["from"] == "system":
        own = messages.pop(0)["value"]
        system = own if keep_system else system
    source = dialogue.data_source
    sample_index = number if dialogue.sample_index is None else dialogue.sample_index
    trajectory = Trajectory(
        traj_id=f"import-{number:07d}",
        task={"doc_id": f"{source}/{sample_index}", "images": paths[:1], "problem": "", "solution": "",
              "data_source": source},
        protocol=protocol.name,
        system=system,
        images=paths,
        sample_index=_whole_number(dialogue.rollout_index, where, "rollout_index"),
        meta={"teacher": "import", "imported": True, "source": where,
              "sample_index": dialogue.sample_index, "rollout_index": dialogue.rollout_index},
    )
    _fill_turns(trajectory, messages, protocol)
    if reject:
        trajectory.meta["reject"] = reject
    return trajectory, files


def _image_problem(data: bytes, max_decode_pixels: int) -> str | None:
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
    except (OSError, SyntaxError, ValueError):
        return "bad_image"
    return "bad_image" if width * height > max_decode_pixels else None


def _fill_turns(trajectory: Trajectory, messages: list[dict[str, str]], protocol: Protocol) -> None:
    """Turns, tool-call counts, answer and end reason, read the way the rollout loop records a model's."""
    next_image, observations = 0, 0
    for i, message in enumerate(messages):
        role = ROLES.get(message["from"])
        if role is None:  # a system message past the first: not a dialogue LLaMA-Factory can train on
            trajectory.meta["reject"] = "protocol"
            role = "user"
        text = message["value"]
        count = text.count(IMAGE_PLACEHOLDER)
        indices = list(range(next_image, min(next_image + count, len(trajectory.images))))
        next_image += count
        turn = Turn(role, text, images=indices)
        if role == "user":
            if not trajectory.turns:
                trajectory.task["problem"] = text.replace(IMAGE_PLACEHOLDER, "").strip() or "(image question)"
            elif indices:
                observations += len(indices)
        else:
            action = protocol.parse(text, observations)
            turn.action = action.kind
            if action.call is not None:
                trajectory.num_tool_calls += 1
                turn.call = {"tool": action.call.tool, "arguments": action.call.arguments}
            elif action.error is not None:
                trajectory.num_format_errors += 1
                turn.error = f"{action.error.kind.value}: {action.error.detail}"
            else:
                trajectory.answer = action.answer
        trajectory.turns.append(turn)
    if next_image != len(trajectory.images):
        trajectory.meta["reject"] = "protocol"
    last = trajectory.turns[-1]
    expected_roles = ["user" if i % 2 == 0 else "assistant" for i in range(len(trajectory.turns))]
    if [t.role for t in trajectory.turns] != expected_roles:
        trajectory.meta["reject"] = "protocol"
    if last.role == "assistant" and last.action == "answer":
        trajectory.end_reason = "answered"
        trajectory.task["solution"] = trajectory.answer or ""
    else:
        trajectory.end_reason = "format_error"
