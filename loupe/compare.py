"""The eval stage's comparison of models as a text table, for the stage's own output and the flow's summary.

The eval stage (stages/eval) writes the comparison as its top-level `metrics.json`; the pipeline's closing
summary (pipelines/summary.py) prints the same table from that file. Both import this module, since stages and
pipelines never import each other. The shape it reads (numbers nested in plain objects, so `dvc metrics show`
flattens them to `synthetic.rl.accuracy`; lists, which DVC leaves out, hold only the order):

    {"models": ["base", "sft", "rl"],                  the models, in the order they ran
     "benchmarks": ["synthetic"],                     the benchmarks, each a key of its own below
     "turn_limits": [1, 2, 4, 8],
     "bootstrap": {"confidence": 0.95, "resamples": 2000, "seed": 0},
     "synthetic": {"questions": 200, "samples_per_question": 4, "chance_rate": 0.25,
                   "base": {"accuracy": 0.0, "accuracy_ci_low": 0.0, "accuracy_ci_high": 0.0, "pass@4": 0.0,
                            "maj@4": 0.0, "valid_turn_rate": 0.0, "mean_turns": 1.0, "invalid": 0,
                            "turn_scaling": {"1": 0.0, "2": 0.0, "4": 0.0, "8": 0.0}},
                   "sft": {...}, "rl": {...}},
     "seconds": 12.3}
"""

from __future__ import annotations

from typing import Any


def is_comparison(metrics: Any) -> bool:
    """Whether `metrics` has the comparison's shape (and not, say, one model's metrics.json)."""
    return (isinstance(metrics, dict) and isinstance(metrics.get("models"), list)
            and isinstance(metrics.get("benchmarks"), list)
            and all(isinstance(metrics.get(b), dict) for b in metrics["benchmarks"]))


def _number(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _interval(entry: dict[str, Any]) -> str:
    low, high = entry.get("accuracy_ci_low"), entry.get("accuracy_ci_high")
    interval = f" [{_number(low)}, {_number(high)}]" if low is not None and high is not None else ""
    return _number(entry.get("accuracy")) + interval


def _columns(lines: list[tuple[str, ...]]) -> list[str]:
    """Left-aligned columns two spaces apart, trailing spaces cut."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines]


def benchmark_table(metrics: dict[str, Any], benchmark: str) -> str:
    """One benchmark's block: a title line (questions, samples, chance rate), a header and a row per model."""
    entry = metrics[benchmark]
    k = entry.get("samples_per_question")
    confidence = round(100 * float(metrics.get("bootstrap", {}).get("confidence", 0.95)))
    limits = [str(limit) for limit in metrics.get("turn_limits", [])]
    title = (f"{benchmark} ({entry.get('questions')} questions x {k} samples; "
             f"chance rate {_number(entry.get('chance_rate'))})")
    lines = [("model", f"accuracy [{confidence}% CI]", f"pass@{k}", "valid", "turns", *(f"acc@{x}" for x in limits))]
    for model in metrics["models"]:
        m = entry.get(model, {})
        scaling = m.get("turn_scaling", {})
        lines.append((model, _interval(m), _number(m.get(f"pass@{k}")), _number(m.get("valid_turn_rate"), 2),
                      _number(m.get("mean_turns"), 2), *(_number(scaling.get(x)) for x in limits)))
    return "\n".join([title, *_columns(lines)])


def verdict(metrics: dict[str, Any], benchmark: str) -> str:
    """One line that says what the table shows, so no reader has to compare intervals: each model against
    chance and against the model before it, where "better" and "worse" need the intervals apart."""
    entry = metrics[benchmark]
    chance = entry.get("chance_rate")
    parts, previous = [], None
    for model in metrics["models"]:
        m = entry.get(model, {})
        accuracy, low, high = m.get("accuracy"), m.get("accuracy_ci_low"), m.get("accuracy_ci_high")
        if accuracy is None or low is None or high is None:
            continue
        claims = []
        if chance is not None:
            claims.append("above chance" if low > chance else "below chance" if high < chance else "at chance")
        if previous is None and m.get("valid_turn_rate") == 0:
            claims.append("no valid turn: it never learned the dialogue's format")
        if previous is not None:
            name, p_low, p_high = previous
            if low > p_high:
                claims.append(f"better than {name} (intervals apart)")
            elif high < p_low:
                claims.append(f"worse than {name} (intervals apart)")
            else:
                claims.append(f"not clearly different from {name} (intervals overlap)")
        parts.append(f"{model} {accuracy:.3f}, {', '.join(claims)}")
        previous = (model, low, high)
    return f"verdict ({benchmark}): " + "; ".join(parts) if parts else f"verdict ({benchmark}): no model was scored"


NOTES = ("accuracy: the share of right answers over every sample (Avg@K), with its bootstrap interval; "
         "pass@K: questions answered right at least once; valid: turns the protocol could read; "
         "acc@N: accuracy when a dialogue may take at most N turns (acc@1: answering before any tool call).")
"""What the table's columns mean, printed once under it."""


def comparison_table(metrics: dict[str, Any], with_verdict: bool = True) -> str:
    """Every benchmark's block, a blank line apart: accuracy (Avg@K) with its bootstrap interval, pass@K,
    valid-turn rate, mean turns and accuracy at each turn limit, one row per model; then its verdict line, and
    the columns' meaning once at the end."""
    if not is_comparison(metrics):
        raise ValueError("not the eval stage's comparison (no models, benchmarks and per-benchmark entries)")
    blocks = [benchmark_table(metrics, b) + (f"\n{verdict(metrics, b)}" if with_verdict else "")
              for b in metrics["benchmarks"]]
    return "\n\n".join(blocks) + "\n" + NOTES
