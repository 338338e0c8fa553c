"""Small benchmark copies in the layouts their publishers ship, every question with a known right answer.

Each builder writes what the publisher's own loader reads: folder and file names, column order, cell encodings
and value types, with small generated images of one colour each. It returns a `PublishedCopy`: the path a user
gives `eval.benchmarks` and the questions with their right answers, for tests to check Loupe's readers and the
eval stage against. Where each layout was confirmed upstream: docs/benchmarks.md.
"""

from __future__ import annotations

import base64
import io
import json
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from loupe.data.tasks import OPTION_LETTERS, TaskRecord, write_tasks

IMAGE_SIZE = (96, 80)
"""Small, yet above every minimum side a vision processor asks for (Qwen2.5-VL: 28 px)."""

VSTAR_INSTRUCTION = "Answer with the option's letter from the given choices directly."
"""The line that ends every `text` of V*'s test_questions.jsonl."""


@dataclass(frozen=True)
class Question:
    """One fixture question and what a reader must make of it."""

    problem: str
    """The question as Loupe should show it: no image placeholder, no option list, no instruction."""
    answer: str
    """The right answer: the right option's text for a choice question, else the free-form answer."""
    options: tuple[str, ...] | None
    """Option texts in the publisher's order; None for a free-form question."""
    letter: str | None
    """The letter the publisher gives the right option; None where it gives none (V*'s per-question files)."""
    category: str | None
    colour: tuple[int, int, int]
    """The colour of the question's image, so a test can tell the right image was attached."""

    @property
    def is_choice(self) -> bool:
        return self.options is not None

    def wrong_answer(self, options: list[str] | None = None) -> str:
        """A wrong answer: a letter naming a wrong option in `options` (as read), else words that are not it."""
        if options is None:
            return "a purple giraffe"
        return next(OPTION_LETTERS[i] for i, text in enumerate(options) if text != self.answer)


@dataclass(frozen=True)
class PublishedCopy:
    benchmark: str
    """The name `eval.benchmarks` gives the reader."""
    path: Path
    """The path a user gives: the folder as downloaded."""
    questions: tuple[Question, ...]


PALETTE = [(200, 30, 30), (30, 160, 40), (30, 60, 200), (220, 200, 20), (150, 40, 170), (20, 180, 190),
           (240, 120, 20), (90, 90, 90), (250, 250, 250), (120, 60, 20), (0, 0, 0), (255, 150, 200)]


def image_bytes(colour: tuple[int, int, int], kind: str = "JPEG") -> bytes:
    buffer = io.BytesIO()
    # Quality 100 keeps a flat colour within a few levels of itself after JPEG coding.
    Image.new("RGB", IMAGE_SIZE, colour).save(buffer, format=kind, **({"quality": 100} if kind == "JPEG" else {}))
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


# ---------------------------------------------------------------------------------------------------------------
# V* Bench (craigwu/vstar_bench)

_VSTAR = [  # (category, image stem, question, options with the right one first, as V*'s annotations hold them)
    ("direct_attributes", "sa_4690", "What is the material of the glove?", ("rubber", "cotton", "kevlar", "leather")),
    ("direct_attributes", "sa_10051", "What is the color of the woman's umbrella?", ("blue", "red", "white", "black")),
    ("relative_position", "sa_24971", "Is the cup on the left or right side of the laptop?", ("right", "left")),
    ("relative_position", "sa_3077", "Is the dog on the left or right side of the bicycle?", ("left", "right")),
]


def build_vstar(root: Path, with_question_file: bool = True) -> PublishedCopy:
    """`root/vstar_bench` as on Hugging Face: per category folder, `<stem>.jpg` beside `<stem>.json`
    ({target_object, bbox, question, options}, the right option first: V*'s README and vstar_bench_eval.py), and,
    unless `with_question_file` is off (the copy before May 2024), `test_questions.jsonl` ({image, text,
    category, question_id, label}: the question, "(A) ..." lines and the instruction in `text`)."""
    home = root / "vstar_bench"
    lines, questions = [], []
    for question_id, (category, stem, question, options) in enumerate(_VSTAR):
        colour = PALETTE[question_id]
        (home / category).mkdir(parents=True, exist_ok=True)
        (home / category / f"{stem}.jpg").write_bytes(image_bytes(colour))
        annotation = {"target_object": ["object"], "bbox": [[10, 12, 20, 18]], "question": question,
                      "options": list(options)}
        (home / category / f"{stem}.json").write_text(json.dumps(annotation))
        # The question file lists the options in its own order: rotate them so the right letter varies.
        shown = options[question_id % len(options):] + options[: question_id % len(options)]
        letter = OPTION_LETTERS[shown.index(options[0])]
        text = "\n".join([question, *(f"({L}) {o}" for L, o in zip(OPTION_LETTERS, shown)), VSTAR_INSTRUCTION])
        lines.append({"image": f"{category}/{stem}.jpg", "text": text, "category": category,
                      "question_id": question_id, "label": letter})
        questions.append(Question(question, options[0], shown if with_question_file else options,
                                  letter if with_question_file else None, category, colour))
    if with_question_file:
        (home / "test_questions.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return PublishedCopy("vstar", home, tuple(questions))


# ---------------------------------------------------------------------------------------------------------------
# HR-Bench (DreamMr/HR-Bench)

HRBENCH_COLUMNS = ["index", "question", "answer", "category", "A", "B", "C", "D", "cycle_category", "image"]
"""The columns of hr_bench_4k/8k, in the order their Hugging Face dataset card lists them."""

_HRBENCH = [  # (question, options with the right one first, category)
    ("What is the number on the bus?", ("27", "72", "17", "21"), "FSP"),
    ("Which is closer to the camera, the red car or the\nbicycle?", ("the red car", "the bicycle", "same", "neither"),
     "FCP"),
]


def build_hrbench(root: Path, resolution: str = "4k", file_format: str = "tsv") -> PublishedCopy:
    """`root/HR-Bench/hr_bench_<resolution>.<tsv|parquet>`: one row per question and option cycle (HR-Bench asks
    each question once per rotation of its options, named by `cycle_category`), `index` an integer, options in
    columns A-D, `answer` a letter, `image` the base64 of the image file. The TSV is written as VLMEvalKit writes
    and reads TSVs (pandas, tab-separated, header, no index column)."""
    import pandas as pd

    rows, questions = [], []
    index = 0
    for number, (question, options, category) in enumerate(_HRBENCH):
        for cycle in range(2):
            shown = options[cycle:] + options[:cycle]
            letter = OPTION_LETTERS[shown.index(options[0])]
            colour = PALETTE[index]
            rows.append({"index": index, "question": question, "answer": letter, "category": category,
                         **dict(zip("ABCD", shown)), "cycle_category": f"cycle_{cycle}",
                         "image": b64(image_bytes(colour))})
            questions.append(Question(question, options[0], shown, letter, category, colour))
            index += 1
    home = root / "HR-Bench"
    home.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(rows, columns=HRBENCH_COLUMNS)
    file = home / f"hr_bench_{resolution}.{file_format}"
    if file_format == "tsv":
        frame.to_csv(file, sep="\t", index=False)
    else:
        frame.to_parquet(file, index=False)
    return PublishedCopy(f"hrbench{resolution}", home, tuple(questions))


# ---------------------------------------------------------------------------------------------------------------
# MME-RealWorld-Lite (yifanzhang114/MME-RealWorld-Base64, read by VLMEvalKit's MMERealWorld)

MME_COLUMNS = ["index", "image", "question", "multi-choice options", "answer", "category", "l2-category"]
"""The fields of an MME-RealWorld record, in the order VLMEvalKit's MMERealWorld.load_data (generate_tsv) lists
them, without the A-E columns VLMEvalKit derives after loading."""

_MME = [  # (question, option texts A-E, right letter, category, l2-category)
    ("How many cars are parked on the left side of the road?", ("2", "3", "4", "5", "The image does not feature the cars."),
     "C", "Perception/Autonomous_Driving", "object_counting"),
    ("What color is the truck's trailer?", ("white", "red", "the driver's side is blue", "green",
                                            "The image does not feature the truck."),
     "C", "Perception/Monitoring", "attribute/color"),
    ("What is written on the shop sign?", ("OPEN", "CLOSED", "SALE", "EXIT", "The image does not feature the sign."),
     "E", "Reasoning/OCR with Complex Context", "text_recognition"),
]


def build_mme_realworld_lite(root: Path, file_name: str = "mme_realworld_lite.tsv") -> PublishedCopy:
    """`root/MME-RealWorld-Base64/<file_name>`: `multi-choice options` holds the Python list of "(A) text" strings
    as pandas prints a list cell (so an option holding an apostrophe comes out in double quotes), `answer` A-E,
    `category` Task/Subtask, `image` the base64 of the image file. VLMEvalKit downloads the file as
    mme_realworld_lite.tsv and keeps it as MME-RealWorld-Lite.tsv."""
    import pandas as pd

    rows, questions = [], []
    for index, (question, options, letter, category, l2) in enumerate(_MME):
        colour = PALETTE[index + 4]
        rows.append({"index": index, "image": b64(image_bytes(colour)), "question": question,
                     "multi-choice options": [f"({L}) {o}" for L, o in zip(OPTION_LETTERS, options)],
                     "answer": letter, "category": category, "l2-category": l2})
        questions.append(Question(question, options[OPTION_LETTERS.index(letter)], options, letter, category, colour))
    home = root / "MME-RealWorld-Base64"
    home.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows, columns=MME_COLUMNS).to_csv(home / file_name, sep="\t", index=False)
    return PublishedCopy("mme_realworld_lite", home, tuple(questions))


# ---------------------------------------------------------------------------------------------------------------
# VisualProbe (Mini-o3/VisualProbe_Easy, _Medium, _Hard)

_VISUALPROBE = [  # (question, free-form solution)
    ("What is the number on the bus in the distance?", "42"),
    ("What brand is written on the coffee cup?", "Starbucks."),
    ("What color is the kite above the trees?", "orange"),
]


def build_visualprobe(root: Path, difficulty: str = "hard") -> PublishedCopy:
    """`root/VisualProbe_<Difficulty>/val.json` and its `data/` images, as on Hugging Face: val.json is a JSON list
    of records {images, doc_id, problem, solution, data_source} (Mini-o3's docs/mini_o3_demo.md), all strings but
    `images` (a list); image paths start with the data set's folder name, because Mini-o3 joins them to
    BASE_IMAGE_DIR, the folder above (multimodal_dataset.make_conversation_multimodal); `problem` starts with
    "<image>\\n"; answers are free-form. `root` plays BASE_IMAGE_DIR."""
    folder = f"VisualProbe_{difficulty.capitalize()}"
    home = root / folder
    (home / "data").mkdir(parents=True, exist_ok=True)
    records, questions = [], []
    for n, (question, solution) in enumerate(_VISUALPROBE):
        colour = PALETTE[n + 7]
        image = f"{difficulty}_{n:04d}.jpg"
        (home / "data" / image).write_bytes(image_bytes(colour))
        records.append({"images": [f"{folder}/data/{image}"], "doc_id": f"{difficulty}_{n:04d}",
                        "problem": f"<image>\n{question}", "solution": solution,
                        "data_source": f"visual_probe_{difficulty}"})
        questions.append(Question(question, solution, None, None, None, colour))
    (home / "val.json").write_text(json.dumps(records, indent=4))
    return PublishedCopy(f"visualprobe_{difficulty}", home, tuple(questions))


# ---------------------------------------------------------------------------------------------------------------
# synthetic (Loupe's own generator output)


def build_synthetic(root: Path) -> PublishedCopy:
    """`root/tasks/test.jsonl` and `images/test/`: task records as Loupe's generator writes them (write_tasks),
    image paths relative to the file's folder; one choice and one free-form question."""
    home = root / "tasks"
    (home / "images" / "test").mkdir(parents=True, exist_ok=True)
    specs = [("What colour is the small square?", "B", ["red", "green", "blue"]),
             ("What shape is drawn in the corner?", "triangle", None)]
    records, questions = [], []
    for n, (question, solution, options) in enumerate(specs):
        colour = PALETTE[n + 10]
        (home / "images" / "test" / f"{n:06d}.png").write_bytes(image_bytes(colour, "PNG"))
        records.append(TaskRecord(doc_id=f"synth-test-{n:06d}", images=[f"images/test/{n:06d}.png"], problem=question,
                                  solution=solution, options=options, data_source="synthetic", category="colour",
                                  bbox=[0.1, 0.1, 0.3, 0.3]))
        answer = options[OPTION_LETTERS.index(solution)] if options else solution
        questions.append(Question(question, answer, tuple(options) if options else None,
                                  solution if options else None, "colour", colour))
    write_tasks(records, home / "test.jsonl")
    return PublishedCopy("synthetic", home, tuple(questions))


def build_all(root: Path, variant: int = 0) -> list[PublishedCopy]:
    """One copy of every benchmark. Variant 0: the layouts as downloaded; variant 1: the other published shapes
    (V* without its question file, HR-Bench parquet for 4K and TSV for 8K, MME-RealWorld-Lite under the name
    VLMEvalKit stores it)."""
    if variant == 0:
        copies = [build_vstar(root), build_hrbench(root, "4k", "tsv"), build_hrbench(root, "8k", "parquet"),
                  build_mme_realworld_lite(root)]
    else:
        copies = [build_vstar(root, with_question_file=False), build_hrbench(root, "4k", "parquet"),
                  build_hrbench(root, "8k", "tsv"), build_mme_realworld_lite(root, "MME-RealWorld-Lite.tsv")]
    visualprobe = root / "visualprobe"  # the folder that plays Mini-o3's BASE_IMAGE_DIR
    copies += [build_visualprobe(visualprobe, d) for d in ("easy", "medium", "hard")]
    return copies + [build_synthetic(root)]
