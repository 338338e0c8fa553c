"""Benchmark metrics from scored trajectories: Avg@K, pass@K, per category, end reasons, turn scaling.

The turn-scaling curve needs no extra rollouts: a trajectory that answered within `l` turns would have
answered the same way under a limit of `l`, and one that needed more turns would have been cut off
(over_turn, scored wrong). So one pass at the largest limit gives accuracy at every smaller one.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from statistics import mean
from typing import Any

from loupe.trajectory import END_REASONS, Trajectory


def is_valid(trajectory: Trajectory) -> bool:
    """Scored for real: a judge that failed after its retries leaves the sample invalid, not wrong."""
    return bool(trajectory.rewards.get("valid", False)) and trajectory.rewards.get("accuracy") is not None


def correct_within(trajectory: Trajectory, turn_limit: int) -> bool:
    """Whether the trajectory would be right had it been stopped after `turn_limit` assistant turns."""
    return (
        trajectory.end_reason == "answered"
        and trajectory.num_turns <= turn_limit
        and float(trajectory.rewards.get("accuracy") or 0.0) >= 1.0
    )


def valid_turn_rate(trajectories: list[Trajectory]) -> float | None:
    """Share of assistant turns that parse as a tool call or an answer: does the model follow the protocol?"""
    actions = [turn.action for t in trajectories for turn in t.turns if turn.role == "assistant"]
    return mean(a in ("call", "answer") for a in actions) if actions else None


def _accuracy(trajectories: list[Trajectory], turn_limit: int) -> float | None:
    valid = [t for t in trajectories if is_valid(t)]
    return mean(correct_within(t, turn_limit) for t in valid) if valid else None


def summarize(trajectories: list[Trajectory], turn_limits: list[int]) -> dict[str, Any]:
    """Metrics of one benchmark's trajectories (all K samples of every question)."""
    max_turns = max(turn_limits)
    by_question: dict[str, list[Trajectory]] = defaultdict(list)
    by_category: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajectories:
        by_question[t.task["doc_id"]].append(t)
        by_category[t.task.get("category") or "all"].append(t)
    valid = [t for t in trajectories if is_valid(t)]
    scored_questions = [ts for ts in by_question.values() if any(is_valid(t) for t in ts)]
    reasons = Counter(t.end_reason for t in trajectories)
    samples = max((len(ts) for ts in by_question.values()), default=0)
    return {
        "questions": len(by_question),
        "samples_per_question": samples,
        "trajectories": len(trajectories),
        "invalid": len(trajectories) - len(valid),
        f"avg@{samples}": _accuracy(trajectories, max_turns),
        f"pass@{samples}": (
            mean(any(correct_within(t, max_turns) for t in ts if is_valid(t)) for ts in scored_questions)
            if scored_questions
            else None
        ),
        "accuracy": _accuracy(trajectories, max_turns),
        "by_category": {c: _accuracy(ts, max_turns) for c, ts in sorted(by_category.items())},
        "mean_turns": mean(t.num_turns for t in trajectories) if trajectories else None,
        "valid_turn_rate": valid_turn_rate(trajectories),
        "mean_tool_calls": mean(t.num_tool_calls for t in trajectories) if trajectories else None,
        "mean_generated_tokens": mean(t.generated_tokens for t in trajectories) if trajectories else None,
        "end_reasons": {r: reasons.get(r, 0) / max(len(trajectories), 1) for r in END_REASONS},
        "turn_scaling": {str(limit): _accuracy(trajectories, limit) for limit in turn_limits},
    }


def result_rows(benchmark: str, trajectories: list[Trajectory]) -> list[dict[str, Any]]:
    """One row per sample, for results.jsonl."""
    return [
        {
            "benchmark": benchmark,
            "doc_id": t.task["doc_id"],
            "sample": t.sample_index,
            "category": t.task.get("category"),
            "solution": t.task["solution"],
            "answer": t.answer,
            "accuracy": t.rewards.get("accuracy"),
            "valid": is_valid(t),
            "end_reason": t.end_reason,
            "turns": t.num_turns,
            "tool_calls": t.num_tool_calls,
            "format_errors": t.num_format_errors,
            "generated_tokens": t.generated_tokens,
        }
        for t in trajectories
    ]
