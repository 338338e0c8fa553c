"""Pixelis' rewards: the task reward, trajectory coherence and tool-misuse penalties, read from a finished dialogue.

Upstream: ClayKa/Pixelis @ 08a98fe, `core/modules/reward_shaping.py` (`TrajectoryCoherenceAnalyzer`,
`RewardOrchestrator._calculate_task_reward`, `_calculate_tool_penalty`) over the `Trajectory` of
`core/data_structures.py` (`has_repetitions`, `get_tool_usage_count`). Its curiosity reward (a learned forward
model's prediction error) is stateful and lives in `stages/rl/pixelis.py`, which also combines the terms under
the curriculum.

Pixelis' trajectory is a list of actions, each a REASONING step, a VISUAL_OPERATION (with the operation's
name) or the ANSWER. Loupe's dialogue maps onto it turn by turn: an assistant turn's `<think>` text is a
reasoning action, its call a visual operation named as Pixelis names it (`SEGMENT_OBJECT_AT`, `ZOOM_IN`, ...:
`loupe.protocol.PIXELIS_OPERATIONS`), its answer the answer action.
"""

from __future__ import annotations

from dataclasses import dataclass
from difflib import SequenceMatcher

import numpy as np

from loupe.trajectory import Trajectory

REASONING, VISUAL_OPERATION, ANSWER = "reasoning", "visual_operation", "answer"


@dataclass(frozen=True)
class PixelisAction:
    """One action of Pixelis' trajectory: its type and, for a visual operation, the operation's name."""

    type: str
    operation: str | None = None


def operation_name(tool: str) -> str:
    """Pixelis' name of a Loupe tool (`ZOOM_IN` for `crop`); an unmapped tool keeps its own name."""
    from loupe.protocol import PIXELIS_OPERATIONS

    return next((name for name, (mapped, _, _) in PIXELIS_OPERATIONS.items() if mapped == tool), tool)


def pixelis_actions(trajectory: Trajectory) -> list[PixelisAction]:
    """The dialogue as Pixelis' action list: per assistant turn, its reasoning, then its call or its answer."""
    from loupe.protocol import extract_think

    actions = []
    for turn in trajectory.turns:
        if turn.role != "assistant":
            continue
        if (extract_think(turn.text) or "").strip():
            actions.append(PixelisAction(REASONING))
        if turn.call:
            actions.append(PixelisAction(VISUAL_OPERATION, operation_name(turn.call["tool"])))
        elif turn.action == "answer":
            actions.append(PixelisAction(ANSWER))
    return actions


def has_repetitions(actions: list[PixelisAction], threshold: int = 2) -> bool:
    """Whether `threshold` visual operations in a row are the same operation (data_structures.py,
    `Trajectory.has_repetitions`: reasoning between them does not break the run)."""
    recent: list[str | None] = []
    for action in actions:
        if action.type != VISUAL_OPERATION:
            continue
        recent = (recent + [action.operation])[-threshold:]
        if len(recent) == threshold and len(set(recent)) == 1:
            return True
    return False


def tool_usage(actions: list[PixelisAction]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for action in actions:
        if action.type == VISUAL_OPERATION:
            counts[action.operation or ""] = counts.get(action.operation or "", 0) + 1
    return counts


def logical_flow(actions: list[PixelisAction]) -> float:
    """`_analyze_logical_flow`: per consecutive pair, -0.2 for the same operation again, +0.1 for a change of
    action type, +0.2 for reasoning right after an operation; divided by pairs, clipped to [-1, 1]."""
    score = 0.0
    for prev, curr in zip(actions, actions[1:]):
        if prev.type == curr.type and prev.operation == curr.operation:
            score -= 0.2
        if prev.type != curr.type:
            score += 0.1
        if prev.type == VISUAL_OPERATION and curr.type == REASONING:
            score += 0.2
    if len(actions) > 1:
        score /= len(actions) - 1
    return float(np.clip(score, -1.0, 1.0))


def semantic_coherence(embeddings: list[np.ndarray]) -> float:
    """`_calculate_semantic_coherence`: the mean cosine similarity s of consecutive step embeddings, scored
    -0.5 under 0.3 (no coherence), -0.3 over 0.9 (no progress), else (s - 0.3) / 0.6."""
    if len(embeddings) < 2:
        return 0.0
    similarities = [float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-8))
                    for a, b in zip(embeddings, embeddings[1:])]
    mean = float(np.mean(similarities))
    if mean < 0.3:
        return -0.5
    if mean > 0.9:
        return -0.3
    return (mean - 0.3) / 0.6


def tool_pattern(actions: list[PixelisAction]) -> float:
    """`_analyze_tool_usage_pattern`: 0 without operations; else +0.1 per distinct operation (at most 0.5),
    -0.1 per use of the most used one past 5, +0.2 for each SEGMENT_OBJECT_AT -> GET_PROPERTIES and each
    ZOOM_IN -> READ_TEXT in consecutive actions; clipped to [-1, 1]."""
    counts = tool_usage(actions)
    if not counts:
        return 0.0
    score = min(len(counts) * 0.1, 0.5)
    if max(counts.values()) > 5:
        score -= (max(counts.values()) - 5) * 0.1
    for prev, curr in zip(actions, actions[1:]):
        if prev.type != VISUAL_OPERATION:
            continue
        if (prev.operation, curr.operation) in (("SEGMENT_OBJECT_AT", "GET_PROPERTIES"), ("ZOOM_IN", "READ_TEXT")):
            score += 0.2
    return float(np.clip(score, -1.0, 1.0))


def coherence_reward(actions: list[PixelisAction], embeddings: list[np.ndarray] | None = None,
                     repetition_penalty: float = 0.5, min_length: int = 2) -> float:
    """`TrajectoryCoherenceAnalyzer.calculate_coherence_reward`: 0 for fewer than `min_length` actions, else
    the mean of -repetition_penalty (when an operation repeats), the logical flow, the semantic coherence of
    the step embeddings (when given) and the tool pattern."""
    if len(actions) < min_length:
        return 0.0
    parts = [-repetition_penalty] if has_repetitions(actions) else []
    parts.append(logical_flow(actions))
    if embeddings is not None and len(embeddings) > 1:
        parts.append(semantic_coherence(embeddings))
    parts.append(tool_pattern(actions))
    return float(np.mean(parts))


def tool_penalty(actions: list[PixelisAction], misuse: float = -0.1, excessive_threshold: int = 10,
                 excessive: float = -0.2) -> float:
    """`_calculate_tool_penalty` (always added, whatever the curriculum): `excessive` per operation past
    `excessive_threshold`, `misuse` when an operation repeats, half of `misuse` for each ZOOM_IN right after
    another ZOOM_IN (consecutive actions)."""
    penalty = 0.0
    total = sum(tool_usage(actions).values())
    if total > excessive_threshold:
        penalty += excessive * (total - excessive_threshold)
    if has_repetitions(actions):
        penalty += misuse
    for prev, curr in zip(actions, actions[1:]):
        if prev.type == VISUAL_OPERATION and prev.operation == curr.operation == "ZOOM_IN":
            penalty += misuse * 0.5
    return penalty


def task_reward(answer: str | None, truth: str) -> float:
    """`_calculate_task_reward`: 1 when the answer equals the truth (as written), else half their
    `difflib.SequenceMatcher` ratio as partial credit."""
    if answer is None:
        return 0.0
    if answer == truth:
        return 1.0
    return 0.5 * SequenceMatcher(None, answer, truth).ratio()
