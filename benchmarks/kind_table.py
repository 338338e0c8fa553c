"""Per-kind held-out accuracy of eval runs, with bootstrap intervals: the table docs/learning.md gives for the
Pixelis operations twin (SFT, RL, TTRL and the reward-term ablation).

Reads each `<model>/results.jsonl` an eval stage wrote. It groups the samples by their question's category:
`zoom/*` is one kind, `operations/sign`, `operations/shape` and `operations/motion` are one kind each. It
prints, per model and kind, the mean of per-question accuracies with the eval stage's own percentile bootstrap
over questions (stages/eval/comparison.py, `bootstrap_interval`), and the number of questions.

    python benchmarks/kind_table.py NAME=work/runs/pixelis-operations-cpu/work/eval/sft ...
    python benchmarks/kind_table.py --json out.json NAME=DIR ...

A DIR is one model's eval folder, the one that holds `results.jsonl`.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from statistics import mean

from stages.eval.comparison import bootstrap_interval

KINDS = ("all", "zoom", "sign", "shape", "motion")


def kind_of(category: str | None) -> str:
    """The table's column for a question category."""
    category = category or "unknown"
    if category.startswith("zoom/"):
        return "zoom"
    return category.split("/", 1)[-1]


def kind_accuracies(results: Path, seed: int = 0) -> dict[str, dict[str, float | int | None]]:
    """Per kind: accuracy (the mean over questions of their samples' mean), its 95 % interval, questions."""
    per_question: dict[str, list[float]] = defaultdict(list)
    kind_of_question: dict[str, str] = {}
    for line in results.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if not row.get("valid", True):
            continue
        per_question[row["doc_id"]].append(float(row["accuracy"]))
        kind_of_question[row["doc_id"]] = kind_of(row.get("category"))
    out: dict[str, dict[str, float | int | None]] = {}
    for kind in KINDS:
        values = [mean(v) for q, v in per_question.items() if kind == "all" or kind_of_question[q] == kind]
        if not values:
            continue
        low, high = bootstrap_interval(values, seed)
        out[kind] = {"accuracy": mean(values), "low": low, "high": high, "questions": len(values)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="NAME=DIR, DIR holding results.jsonl")
    parser.add_argument("--json", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    table = {}
    for item in args.models:
        name, _, folder = item.partition("=")
        table[name] = kind_accuracies(Path(folder) / "results.jsonl")
    print("| model | " + " | ".join(KINDS) + " |")
    print("|---" * (len(KINDS) + 1) + "|")
    for name, kinds in table.items():
        cells = []
        for kind in KINDS:
            k = kinds.get(kind)
            cells.append("-" if k is None else f"{k['accuracy']:.3f} [{k['low']:.3f}, {k['high']:.3f}]")
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps(table, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
