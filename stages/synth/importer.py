"""The import teacher: Mini-o3's cold-start set (parquet) from a local copy, read without `eval()`.

Mini-o3-Coldstart-Dataset rows hold `conversations` (a list of {"from": system|human|gpt, "value": text}
stored as a *string*: the printed Python list, which Mini-o3's own preprocessing script turns back into data
with `eval()`), `images` (Hugging Face image structs {"bytes", "path"}), `image_names`, `data_source`,
`sample_index` and `rollout_index`. Here the string is read as JSON when it is JSON, else with
`ast.literal_eval`, which accepts literals only: a row holding code fails with its row and field named
instead of running it.

Each row becomes a `Trajectory` (human turns are user turns, observations included; gpt turns are assistant
turns, parsed by the protocol like a model's), so imported rows pass the same rejection checks and reach the
dataset through the same writer as the other teachers. Images keep their original bytes and names (no
re-encoding); rows whose images are unreadable or over `protocol.max_decode_pixels` are rejected as
`bad_image`. The set holds no solutions, so answers are not re-scored: Mini-o3 kept only correct ones.
"""

from __future__ import annotations

import ast
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from PIL import Image

from loupe.images import image_cell
from loupe.protocol import IMAGE_PLACEHOLDER, Protocol
from loupe.trajectory import Trajectory, Turn

REQUIRED_COLUMNS = ("conversations", "images")
ROLES = {"human": "user", "gpt": "assistant"}
DATA_SOURCE = "mini_o3_coldstart"


class ImportFormatError(ValueError):
    """A parquet file or row that is not in the cold-start format; names the file, row and field."""


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


def parquet_files(path: str | Path) -> list[Path]:
    """The parquet files of the train split: a file itself, or a folder's `train-*.parquet` files when it has any
    (Mini-o3's scripts/preprocess_coldstart.py reads `load_dataset(path, split="train")`), else all of them."""
    path = Path(path)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(path.rglob("*.parquet"))
        # Hugging Face names a split's files train-*.parquet, or puts them in a train/ folder.
        train = [f for f in files if f.name.startswith("train") or "train" in f.relative_to(path).parts[:-1]]
        if files:
            return train or files
        raise FileNotFoundError(f"{path}: no *.parquet file in this folder")
    raise FileNotFoundError(f"{path}: parquet file or folder not found")


Row = tuple[Path, int, dict[str, Any]]
"""A parquet row with where it came from: (file, row number in the file, column values)."""


def iter_rows(path: str | Path, batch_rows: int, limit: int | None = None) -> Iterator[list[Row]]:
    """Batches of rows from every parquet file under `path`, `batch_rows` at a time, the first `limit` only."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    seen = 0
    batch: list[Row] = []
    for file in parquet_files(path):
        try:
            reader = pq.ParquetFile(file)
        except (OSError, pa.ArrowException) as err:
            raise ImportFormatError(f"{file}: not a readable parquet file ({err})") from None
        missing = [c for c in REQUIRED_COLUMNS if c not in reader.schema_arrow.names]
        if missing:
            raise ImportFormatError(f"{file}: column(s) {missing} missing; found {reader.schema_arrow.names}")
        row_in_file = 0
        for record_batch in reader.iter_batches(batch_size=batch_rows):
            for row in record_batch.to_pylist():
                if limit is not None and seen >= limit:
                    if batch:
                        yield batch
                    return
                batch.append((file, row_in_file, row))
                row_in_file += 1
                seen += 1
                if len(batch) == batch_rows:
                    yield batch
                    batch = []
    if batch:
        yield batch


def parse_conversations(value: Any, where: str) -> list[dict[str, str]]:
    """The row's conversation as a list of {"from", "value"}: JSON, a Python literal, or already a list."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            try:
                value = ast.literal_eval(value.strip())
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                raise ImportFormatError(
                    f"{where}: field 'conversations': neither JSON nor a Python literal (never evaluated as code)"
                ) from None
    if not isinstance(value, list) or not value:
        raise ImportFormatError(f"{where}: field 'conversations': expected a non-empty list of messages")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("value"), str):
            raise ImportFormatError(f"{where}: field 'conversations.{i}': expected {{'from': ..., 'value': text}}")
        if message.get("from") not in ("system", "human", "gpt"):
            raise ImportFormatError(
                f"{where}: field 'conversations.{i}.from': {message.get('from')!r} is not system, human or gpt"
            )
        messages.append({"from": message["from"], "value": message["value"]})
    return messages


def _safe_name(name: str, fallback: str) -> str:
    base = Path(str(name)).name
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", base)[:100]
    return cleaned if cleaned.strip("._") else fallback


def image_bytes(value: Any, where: str, base_dir: Path) -> bytes:
    """The encoded bytes of one `images` entry: a {"bytes", "path"} struct, raw bytes, or a path beside the file."""
    value = image_cell(value)
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        path = (base_dir / value).resolve()
        if not path.is_relative_to(base_dir.resolve()) or not path.is_file():
            raise ImportFormatError(f"{where}: field 'images': {value!r} is neither embedded nor a file beside the parquet")
        return path.read_bytes()
    raise ImportFormatError(f"{where}: field 'images': an entry holds no image bytes or path")


def row_to_trajectory(
    source_row: Row, number: int, protocol: Protocol, keep_system: bool, max_decode_pixels: int
) -> tuple[Trajectory, dict[str, bytes]]:
    """Row `number` (counted over all files) as a finished trajectory, plus the image files to write beside it
    (relative path -> bytes)."""
    file, row_in_file, row = source_row
    where = f"{file}: row {row_in_file}"
    messages = parse_conversations(row.get("conversations"), where)
    images = row.get("images")
    if not isinstance(images, list):
        raise ImportFormatError(f"{where}: field 'images': expected a list")
    names = row.get("image_names") if isinstance(row.get("image_names"), list) else []
    base_dir = file.parent
    folder = f"images/row-{number:07d}"
    files: dict[str, bytes] = {}
    paths: list[str] = []
    reject = None
    for i, value in enumerate(images):
        data = image_bytes(value, where, base_dir)
        name = _safe_name(names[i] if i < len(names) and names[i] else "", f"{i}.png")
        relative = f"{folder}/{i:02d}-{name}"
        files[relative] = data
        paths.append(relative)
        reject = reject or _image_problem(data, max_decode_pixels)

    system = protocol.system_prompt()
    if messages[0]["from"] == "system":
        own = messages.pop(0)["value"]
        system = own if keep_system else system
    source = str(row.get("data_source") or DATA_SOURCE)
    doc_id = f"{source}/{row.get('sample_index', number)}"
    trajectory = Trajectory(
        traj_id=f"import-{number:07d}",
        task={"doc_id": doc_id, "images": paths[:1], "problem": "", "solution": "", "data_source": source},
        protocol=protocol.name,
        system=system,
        images=paths,
        sample_index=_whole_number(row.get("rollout_index"), where, "rollout_index"),
        meta={"teacher": "import", "imported": True, "source": where,
              "sample_index": row.get("sample_index"), "rollout_index": row.get("rollout_index")},
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
