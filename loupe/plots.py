"""PNG plots every stage draws (turn-scaling curves, loss curves), with matplotlib's file-only backend."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from loupe.io import atomic_write_bytes  # noqa: E402


def save_figure(fig: Any, out_png: str | Path) -> Path:
    """Lay out `fig`, write it as a PNG atomically (a reader never sees half a file) and close it."""
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    atomic_write_bytes(Path(out_png), buffer.getvalue())
    return Path(out_png)


def line_plot(
    series: dict[str, list[tuple[float, float | None]]],
    out_png: str | Path,
    title: str,
    xlabel: str,
    ylabel: str,
    log2_x: bool = False,
) -> Path:
    """One line per series; points whose y is None are left out."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    for label, points in series.items():
        xs = [x for x, y in points if y is not None]
        ys = [y for _, y in points if y is not None]
        ax.plot(xs, ys, marker="o", label=label)
    if log2_x:
        ax.set_xscale("log", base=2)
        ticks = sorted({x for points in series.values() for x, _ in points})
        ax.set_xticks(ticks, [str(int(t)) if float(t).is_integer() else str(t) for t in ticks])
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if len(series) > 1 or any(series):
        ax.legend()
    return save_figure(fig, out_png)


def bar_plot(
    series: dict[str, dict[str, float]],
    out_png: str | Path,
    title: str,
    xlabel: str,
    ylabel: str,
) -> Path:
    """Grouped bars: one group per category (in order of first appearance), one bar per series in each."""
    categories = list(dict.fromkeys(c for values in series.values() for c in values))
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    width = 0.8 / max(len(series), 1)
    for i, (label, values) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(categories))]
        ax.bar(xs, [values.get(c, 0) for c in categories], width=width, label=label)
    ax.set_xticks(range(len(categories)), categories, rotation=30 if max(map(len, categories), default=0) > 6 else 0)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, axis="y")
    if len(series) > 1:
        ax.legend()
    return save_figure(fig, out_png)
