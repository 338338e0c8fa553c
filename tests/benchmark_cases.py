"""What the benchmark reader tests share (tests/test_benchmarks.py, tests/test_benchmark_layouts.py): small
images, TSV tables, HR-Bench rows and V* Bench folders written as their publishers lay them out."""

from __future__ import annotations

import base64
import csv
import io
import json
from pathlib import Path

from PIL import Image

TABLE_COLUMNS = ["index", "question", "A", "B", "C", "D", "answer", "category", "cycle_category", "image"]


def image_bytes(colour: str, size: tuple[int, int] = (40, 30), kind: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format=kind)
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def write_tsv(path: Path, columns: list[str], rows: list[dict]) -> Path:
    with path.open("w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, delimiter="\t")
        writer.writeheader()
        writer.writerows(rows)
    return path


def hrbench_rows() -> list[dict]:
    return [
        {"index": 0, "question": "What is the colour of the sign?", "A": "red", "B": "blue", "C": "green",
         "D": "white", "answer": "C", "category": "single", "cycle_category": "cycle_0",
         "image": b64(image_bytes("red", kind="JPEG"))},
        {"index": 1, "question": "Which side is the car on?\nLook closely.", "A": "left", "B": "right",
         "C": "top", "D": "bottom", "answer": "B", "category": "cross", "cycle_category": "cycle_1",
         "image": b64(image_bytes("blue", size=(50, 20)))},
    ]


VSTAR_INSTRUCTION = "Answer with the option's letter from the given choices directly."


def write_vstar(folder: Path, rows: list[dict]) -> None:
    for row in rows:
        image = folder / row["image"]
        image.parent.mkdir(parents=True, exist_ok=True)
        image.write_bytes(image_bytes("white", kind="JPEG"))
    (folder / "test_questions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def vstar_rows() -> list[dict]:
    return [
        {"image": "direct_attributes/sa_123.jpg", "category": "direct_attributes", "question_id": 0, "label": "A",
         "text": "What color is the woman's bag?\n(A) black\n(B) white\n(C) red\n(D) blue\n" + VSTAR_INSTRUCTION},
        {"image": "relative_position/sa_9.jpg", "category": "relative_position", "question_id": 1, "label": "B",
         "text": f"Is the cup on the left or right of the plate?\n(A) left\n(B) right\n{VSTAR_INSTRUCTION}"},
    ]
