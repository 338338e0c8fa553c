"""The verdict: several models scored on the same questions, side by side, with how sure each number is.

`compare` builds the top-level `metrics.json` of a multi-model eval (its shape is documented in loupe.compare,
which formats it as a table): per benchmark the split's chance rate and per model accuracy (Avg@K) with a 95%
bootstrap interval over questions, pass@K, maj@K, valid-turn rate, mean turns and the turn-scaling curve.
`turn_scaling_rows` is the DVC plot data (a column per model) and `comparison_plot` draws the PNG.

SciPy is imported here and not in metrics.py, which the rl stage imports too (its image holds no SciPy).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from statistics import mean
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from scipy import stats  # noqa: E402

from loupe.data.tasks import TaskRecord, chance_rate  # noqa: E402
from loupe.plots import save_figure  # noqa: E402
from loupe.sample_metrics import SampleRecord, correct_within  # noqa: E402

CONFIDENCE = 0.95
RESAMPLES = 2000


def question_accuracies(records: Iterable[SampleRecord], turn_limit: int) -> dict[str, float]:
    """Per question (doc_id), the mean accuracy of its scored samples within `turn_limit` turns; a question
    none of whose samples could be scored (a failed judge) is left out, as Avg@K leaves such samples out."""
    hits: dict[str, list[bool]] = defaultdict(list)
    for r in records:
        if r.valid:
            hits[r.doc_id].append(correct_within(r, turn_limit))
    return {doc_id: mean(values) for doc_id, values in hits.items()}


def bootstrap_interval(values: Sequence[float], seed: int, confidence: float = CONFIDENCE,
                       resamples: int = RESAMPLES) -> tuple[float, float] | tuple[None, None]:
    """Percentile bootstrap interval of the mean of `values`, one per question (its mean accuracy over its K
    samples); (None, None) when there are none.

    Why this way:
    - Questions are resampled, not samples: the K samples of a question share its image and wording, so they
      are not independent draws, and resampling them one by one would make the interval too narrow. What we
      want to generalise over is the population of questions, so a question is the unit, carrying its own mean.
    - The statistic is the mean of per-question means, which equals Avg@K when every question has the same
      number of scored samples (always, unless a judge failed).
    - The percentile method: accuracy is bounded in [0, 1], and the percentile interval stays inside the range
      the statistic can take; BCa needs a jackknife whose variance is zero on degenerate data (a model always
      right or always wrong, common here), where it fails. With as few as 200 questions its coverage is close
      to nominal for a mean.
    - 2000 resamples keep the Monte Carlo error of the 2.5% and 97.5% percentiles well under the interval's
      width; the generator is seeded from params.yaml's `seed`, so a rerun gives the same interval to the bit.
    Every value equal (one question, or a model right on all of them) leaves every resample's mean equal to it,
    so the interval is that point, given without resampling (SciPy refuses fewer than two observations).
    """
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        return None, None
    if np.all(data == data[0]):
        return float(data[0]), float(data[0])
    result = stats.bootstrap((data,), np.mean, n_resamples=resamples, confidence_level=confidence,
                             method="percentile", vectorized=True, rng=np.random.default_rng(seed))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def compare(
    models: dict[str, str],
    benchmarks: dict[str, list[TaskRecord]],
    summaries: dict[str, dict[str, dict[str, Any]]],
    records: dict[str, dict[str, list[SampleRecord]]],
    turn_limits: list[int],
    seed: int,
) -> dict[str, Any]:
    """The comparison metrics (loupe.compare documents the shape). `summaries[model][benchmark]` is the
    model's `summarize` output and `records[model][benchmark]` its scored samples; every model must have been
    asked exactly the same questions of each benchmark, or the comparison would not be one."""
    max_turns = max(turn_limits)
    out: dict[str, Any] = {"models": list(models), "benchmarks": list(benchmarks), "turn_limits": list(turn_limits),
                           "bootstrap": {"confidence": CONFIDENCE, "resamples": RESAMPLES, "seed": seed}}
    for benchmark, tasks in benchmarks.items():
        asked = {t.doc_id for t in tasks}
        first = next(iter(models))
        entry: dict[str, Any] = {"questions": len(tasks),
                                 "samples_per_question": summaries[first][benchmark]["samples_per_question"],
                                 "chance_rate": chance_rate(tasks)}
        for model in models:
            seen = {r.doc_id for r in records[model][benchmark]}
            if seen != asked:
                raise ValueError(f"{benchmark}: model {model} was scored on {len(seen)} questions, not the "
                                 f"{len(asked)} of the split; the comparison needs the same questions for every model")
            summary = summaries[model][benchmark]
            k = summary["samples_per_question"]
            low, high = bootstrap_interval(list(question_accuracies(records[model][benchmark], max_turns).values()), seed)
            entry[model] = {
                "accuracy": summary["accuracy"],
                "accuracy_ci_low": low,
                "accuracy_ci_high": high,
                f"pass@{k}": summary[f"pass@{k}"],
                f"maj@{k}": summary.get(f"maj@{k}"),
                "valid_turn_rate": summary["valid_turn_rate"],
                "mean_turns": summary["mean_turns"],
                "invalid": summary["invalid"],
                "turn_scaling": dict(summary["turn_scaling"]),
            }
        out[benchmark] = entry
    return out


def turn_scaling_rows(comparison: dict[str, Any]) -> list[dict[str, Any]]:
    """DVC plot data: a row per (benchmark, turn limit), a column per model (dvc.yaml's top-level plot names
    the columns as its `y`, which draws one line per model)."""
    rows = []
    for benchmark in comparison["benchmarks"]:
        for limit in comparison["turn_limits"]:
            row: dict[str, Any] = {"benchmark": benchmark, "max_turns": limit}
            for model in comparison["models"]:
                row[model] = comparison[benchmark][model]["turn_scaling"].get(str(limit))
            rows.append(row)
    return rows


def comparison_plot(comparison: dict[str, Any], out_png: str | Path) -> Path:
    """A row of two panels per benchmark: accuracy per model with its interval as error bars and a dashed line
    at the chance rate; accuracy vs turn limit per model."""
    names, limits = comparison["models"], comparison["turn_limits"]
    rows = len(comparison["benchmarks"])
    fig, axes = plt.subplots(rows, 2, figsize=(11.0, 4.0 * rows), dpi=110, squeeze=False)
    percent = round(100 * comparison["bootstrap"]["confidence"])
    for (bars, curves), benchmark in zip(axes, comparison["benchmarks"]):
        entry = comparison[benchmark]
        for i, name in enumerate(names):
            m = entry[name]
            color = f"C{i}"
            if m["accuracy"] is not None:
                below = m["accuracy"] - (m["accuracy_ci_low"] if m["accuracy_ci_low"] is not None else m["accuracy"])
                above = (m["accuracy_ci_high"] if m["accuracy_ci_high"] is not None else m["accuracy"]) - m["accuracy"]
                bars.bar(i, m["accuracy"], color=color, yerr=[[below], [above]], capsize=6)
                bars.annotate(f"{m['accuracy']:.3f}", (i, m["accuracy"]), xytext=(8, 3), textcoords="offset points",
                              fontsize=8)
            points = [(x, m["turn_scaling"].get(str(x))) for x in limits]
            curves.plot([x for x, y in points if y is not None], [y for _, y in points if y is not None],
                        marker="o", color=color, label=name)
        bars.axhline(entry["chance_rate"], color="grey", linestyle="--", label=f"chance {entry['chance_rate']:.3f}")
        bars.set_xticks(range(len(names)), names)
        bars.set_ylim(0, 1.05)
        bars.set_ylabel(f"accuracy (Avg@{entry['samples_per_question']})")
        bars.set_title(f"{benchmark}: accuracy, {percent}% interval over {entry['questions']} questions")
        bars.legend(loc="upper left")
        bars.grid(alpha=0.3, axis="y")
        curves.set_xscale("log", base=2)
        curves.set_xticks(limits, [str(x) for x in limits])
        curves.set_ylim(0, 1.05)
        curves.set_xlabel("turn limit")
        curves.set_ylabel("accuracy")
        curves.set_title(f"{benchmark}: accuracy vs turn limit")
        curves.grid(alpha=0.3)
        curves.legend()
    return save_figure(fig, out_png)
