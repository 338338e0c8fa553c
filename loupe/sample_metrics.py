"""Benchmark metrics from scored samples: Avg@K, pass@K, maj@K, per category, end reasons, turn scaling.

The turn-scaling curve needs no extra rollouts: a trajectory that answered within `l` turns would have
answered the same way under a limit of `l`, and one that needed more turns would have been cut off
(over_turn, scored wrong). So one pass at the largest limit gives accuracy at every smaller one.

Metrics are computed from `SampleRecord`s, a few numbers per sample, so eval can keep one per sample for the
whole benchmark while the trajectories themselves (dialogue, crops, token traces) are written out and dropped
a chunk at a time. Every function also takes scored `Trajectory` objects (the rl stage's validation passes
them) and reads the same numbers from them.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from statistics import mean
from typing import Any

from loupe.trajectory import END_REASONS, Trajectory


@dataclass(frozen=True)
class SampleRecord:
    """One scored sample reduced to what the metrics and results.jsonl need: no dialogue, images or tokens."""

    doc_id: str
    sample: int
    """Which of the K samples of the question this is."""
    category: str | None
    solution: str
    answer: str | None
    accuracy: float | None
    """The accuracy reward; None when it could not be scored (a judge that failed)."""
    valid: bool
    """Scored for real (see `is_valid`)."""
    end_reason: str | None
    turns: int
    """Assistant turns taken."""
    valid_turns: int
    """Assistant turns that parsed as a tool call or an answer (for the valid-turn rate)."""
    tool_calls: int
    format_errors: int
    generated_tokens: int

    @classmethod
    def of(cls, trajectory: Trajectory) -> SampleRecord:
        """The record of a scored trajectory."""
        actions = [turn.action for turn in trajectory.turns if turn.role == "assistant"]
        return cls(
            doc_id=trajectory.task["doc_id"],
            sample=trajectory.sample_index,
            category=trajectory.task.get("category"),
            solution=trajectory.task["solution"],
            answer=trajectory.answer,
            accuracy=trajectory.rewards.get("accuracy"),
            valid=is_valid(trajectory),
            end_reason=trajectory.end_reason,
            turns=len(actions),
            valid_turns=sum(a in ("call", "answer") for a in actions),
            tool_calls=trajectory.num_tool_calls,
            format_errors=trajectory.num_format_errors,
            generated_tokens=trajectory.generated_tokens,
        )

    def row(self, benchmark: str) -> dict[str, Any]:
        """The sample's row of results.jsonl."""
        return {
            "benchmark": benchmark,
            "doc_id": self.doc_id,
            "sample": self.sample,
            "category": self.category,
            "solution": self.solution,
            "answer": self.answer,
            "accuracy": self.accuracy,
            "valid": self.valid,
            "end_reason": self.end_reason,
            "turns": self.turns,
            "tool_calls": self.tool_calls,
            "format_errors": self.format_errors,
            "generated_tokens": self.generated_tokens,
        }


Sample = SampleRecord | Trajectory
"""What the metrics take: a compact record, or a scored trajectory it is read from."""


def _record(sample: Sample) -> SampleRecord:
    return sample if isinstance(sample, SampleRecord) else SampleRecord.of(sample)


def is_valid(trajectory: Trajectory) -> bool:
    """Scored for real: a judge that failed after its retries leaves the sample invalid, not wrong."""
    return bool(trajectory.rewards.get("valid", False)) and trajectory.rewards.get("accuracy") is not None


def correct_within(sample: Sample, turn_limit: int) -> bool:
    """Whether the sample would be right had it been stopped after `turn_limit` assistant turns."""
    record = _record(sample)
    return record.end_reason == "answered" and record.turns <= turn_limit and float(record.accuracy or 0.0) >= 1.0


def _ratio(hits: int, total: int) -> float | int:
    """`hits / total` exactly as `statistics.mean` gives it for `total` booleans of which `hits` are true
    (an int when whole), so metrics.json reads the same whichever way the samples were held."""
    return hits // total if hits % total == 0 else hits / total


def valid_turn_rate(samples: Iterable[Sample]) -> float | None:
    """Share of assistant turns that parse as a tool call or an answer: does the model follow the protocol?"""
    records = [_record(s) for s in samples]
    turns = sum(r.turns for r in records)
    return _ratio(sum(r.valid_turns for r in records), turns) if turns else None


def _accuracy(records: list[SampleRecord], turn_limit: int) -> float | None:
    valid = [r for r in records if r.valid]
    return mean(correct_within(r, turn_limit) for r in valid) if valid else None


def vote_form(answer: str) -> str:
    """A free-form answer as one vote: lowercased, its whitespace collapsed. The ttrl stage's vote
    (stages/rl/ttrl.py) and maj@K count answers in this one form."""
    return " ".join(answer.strip().lower().split())


def majority_right(records: list[SampleRecord], turn_limit: int) -> float:
    """Whether the vote of a question's samples is right: 1 when right answers outnumber each wrong answer, a
    share when they tie (the chance a random tie-break picks them), 0 otherwise.

    This is the label test-time RL trains toward (TTRL's majority vote, `ttrl.strategy: majority`), so maj@K
    above Avg@K is the room TTRL has. Every right sample counts for the one right answer (a judge may accept
    several spellings); wrong answers are told apart by their `vote_form`.
    Samples without an answer do not vote.
    """
    right = sum(correct_within(r, turn_limit) for r in records if r.valid)
    wrong = Counter(vote_form(r.answer) for r in records
                    if r.valid and r.answer and not correct_within(r, turn_limit))
    top_wrong = max(wrong.values(), default=0)
    if right == 0 or right < top_wrong:
        return 0.0
    return 1.0 if right > top_wrong else 1.0 / (1 + sum(n == right for n in wrong.values()))


def summarize(samples: Iterable[Sample], turn_limits: list[int]) -> dict[str, Any]:
    """Metrics of one benchmark's samples (all K samples of every question)."""
    records = [_record(s) for s in samples]
    max_turns = max(turn_limits)
    by_question: dict[str, list[SampleRecord]] = defaultdict(list)
    by_category: dict[str, list[SampleRecord]] = defaultdict(list)
    for r in records:
        by_question[r.doc_id].append(r)
        by_category[r.category or "all"].append(r)
    valid = [r for r in records if r.valid]
    scored_questions = [rs for rs in by_question.values() if any(r.valid for r in rs)]
    reasons = Counter(r.end_reason for r in records)
    samples_per_question = max((len(rs) for rs in by_question.values()), default=0)
    return {
        "questions": len(by_question),
        "samples_per_question": samples_per_question,
        "trajectories": len(records),
        "invalid": len(records) - len(valid),
        f"avg@{samples_per_question}": _accuracy(records, max_turns),
        f"pass@{samples_per_question}": (
            mean(any(correct_within(r, max_turns) for r in rs if r.valid) for rs in scored_questions)
            if scored_questions
            else None
        ),
        f"maj@{samples_per_question}": (
            mean(majority_right(rs, max_turns) for rs in scored_questions) if scored_questions else None
        ),
        "accuracy": _accuracy(records, max_turns),
        "by_category": {c: _accuracy(rs, max_turns) for c, rs in sorted(by_category.items())},
        "mean_turns": mean(r.turns for r in records) if records else None,
        "valid_turn_rate": valid_turn_rate(records),
        "mean_tool_calls": mean(r.tool_calls for r in records) if records else None,
        "mean_generated_tokens": mean(r.generated_tokens for r in records) if records else None,
        "end_reasons": {reason: reasons.get(reason, 0) / max(len(records), 1) for reason in END_REASONS},
        "turn_scaling": {str(limit): _accuracy(records, limit) for limit in turn_limits},
    }


def result_rows(benchmark: str, samples: Iterable[Sample]) -> list[dict[str, Any]]:
    """One row per sample, for results.jsonl."""
    return [_record(s).row(benchmark) for s in samples]
