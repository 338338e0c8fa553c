"""Test-time RL (`rl.ttrl`): learn from questions without labels, the way TTRL and Pixelis do.

Each step rolls out K samples of each unlabeled question (the rl stage's group). Their answers vote, with the
answers of the nearest earlier questions in an experience buffer, for a pseudo-label; the vote's confidence
gates the update; each sample is then rewarded by the recipe's own rule against the pseudo-label (agreement),
and the group trains like any GRPO group. The trainer never holds a label: the questions are read with their
solutions replaced (`UNLABELED`), and the eval stage measures the adapted model on the labels it never saw.

Upstream:
- TTRL (PRIME-RL/TTRL, arXiv 2504.16084, on verl): K samples, the majority answer as the pseudo-label, reward 1
  for a sample that agrees with it and 0 otherwise.
- Pixelis (ClayKa/Pixelis @ 08a98fe and 991bb06): `core/engine/inference_engine.py` (k 5 neighbours, an update
  when the vote's confidence reaches 0.7), `core/modules/voting.py`, `TemporalEnsembleVoting` (strategy `weighted`,
  `min_votes_required` 3; a neighbour's vote weighs its confidence times a recency factor exp(-age / 24 h);
  with fewer votes than required the first answer wins at half confidence; the weighted winner's confidence is
  its share of the weight times an agreement factor, `_calculate_agreement_factor`), `core/modules/
  experience_buffer.py` (experiences retrieved by k nearest neighbours of their embeddings), and
  `core/engine/update_worker.py` (conservative updates: a KL penalty to the policy before the update, gradient
  clipping at 1.0, an EMA of the weights). Loupe's age is counted in RL steps (`recency_steps` plays the 24 h),
  its embeddings are the question image's thumbnail and the question's words (`stages.rl.pixelis`). Its
  conservative update is the confidence gate and the gradient clip (`rl.max_grad_norm`). With
  `rl.ttrl.conservative` on, it adds Pixelis' own: the adaptive KL to the pre-update policy, the skip, the
  weight EMA and the confidence-scaled rate (stages/rl/conservative.py; docs/rl.md, "Test-time RL").
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loupe.data.tasks import TaskRecord
from loupe.rewards.choice import extract_choice
from loupe.sample_metrics import vote_form
from loupe.trajectory import Trajectory
from stages.rl.pixelis import image_features, text_features

UNLABELED = "unlabeled"
"""The solution every TTRL question carries in the trainer: its label is never read."""


def unlabeled(tasks: list[TaskRecord]) -> list[TaskRecord]:
    """The questions with their solutions replaced, so nothing downstream can read a label."""
    return [task.model_copy(update={"solution": UNLABELED}) for task in tasks]


def normalised_answer(trajectory: Trajectory) -> str | None:
    """The sample's answer as a vote: the option letter of a choice question (read from its answer, or from its
    last turn when it gave none, as a recipe whose rule reads the whole response would), else the answer
    lowercased; None when it gave nothing to count."""
    answer = trajectory.answer if trajectory.end_reason == "answered" else None
    options = trajectory.task.get("options")
    if options:
        if not (answer or "").strip():
            answer = next((t.text for t in reversed(trajectory.turns) if t.role == "assistant"), None)
        return extract_choice(answer, options) if (answer or "").strip() else None
    if not (answer or "").strip():
        return None
    return vote_form(answer)


def normalised_truth(task: dict[str, Any], solution: str | None) -> str | None:
    """A withheld solution in the votes' form (`normalised_answer`): an option letter, else lowercased words."""
    if solution is None or not str(solution).strip():
        return None
    options = task.get("options")
    if options:
        return extract_choice(str(solution), options)
    return vote_form(str(solution))


def question_embedding(trajectory: Trajectory) -> np.ndarray:
    images = trajectory.trace.images if trajectory.trace is not None else []
    vector = np.concatenate([image_features(images[0] if images else None),
                             text_features(str(trajectory.task.get("problem", "")))])
    return vector / (np.linalg.norm(vector) + 1e-8)


@dataclass
class Experience:
    embedding: np.ndarray
    answer: str
    confidence: float
    step: int


@dataclass
class ExperienceBuffer:
    """Earlier questions' pseudo-labels, retrieved by cosine nearest neighbours (scikit-learn's
    `NearestNeighbors`, brute force: a buffer of thousands is searched in microseconds); the oldest leave first
    when it is full."""

    capacity: int
    entries: list[Experience] = field(default_factory=list)
    _index: Any = None

    def add(self, experience: Experience) -> None:
        self.entries.append(experience)
        if len(self.entries) > self.capacity:
            self.entries.pop(0)
        self._index = None

    def nearest(self, embedding: np.ndarray, k: int, min_similarity: float) -> list[tuple[Experience, float]]:
        if not self.entries or k <= 0:
            return []
        if self._index is None:
            from sklearn.neighbors import NearestNeighbors

            self._index = NearestNeighbors(metric="cosine", algorithm="brute").fit(np.stack([e.embedding for e in self.entries]))
        distances, indices = self._index.kneighbors(embedding[None, :], n_neighbors=min(k, len(self.entries)))
        found = [(self.entries[i], 1.0 - float(d)) for d, i in zip(distances[0], indices[0])]
        return [(e, s) for e, s in found if s >= min_similarity]

    def state(self) -> list[dict[str, Any]]:
        return [{"embedding": e.embedding.tolist(), "answer": e.answer, "confidence": e.confidence, "step": e.step}
                for e in self.entries]

    def load(self, state: list[dict[str, Any]]) -> None:
        self.entries = [Experience(np.asarray(s["embedding"], dtype=np.float32), s["answer"], s["confidence"], s["step"])
                        for s in state]
        self._index = None


def agreement_factor(agreeing: int, total: int) -> float:
    """Pixelis' `_calculate_agreement_factor`: piecewise in the share of votes for the winner, within [0.5, 1]."""
    if total == 0:
        return 0.0
    ratio = agreeing / total
    if ratio > 0.7:
        factor = 0.8 + 0.2 * (ratio - 0.7) / 0.3
    elif ratio < 0.3:
        factor = 0.6 + 0.2 * ratio / 0.3
    else:
        factor = 0.6 + 0.2 * (ratio - 0.3) / 0.4
    return min(max(factor, 0.5), 1.0)


def vote(answers: list[str | None], neighbours: list[tuple[Experience, float]], step: int, strategy: str,
         min_votes: int, recency_steps: float) -> tuple[str | None, float]:
    """(pseudo-label, confidence) from the samples' answers (one vote each, weight 1) and the neighbours' labels
    (weight: their confidence x exp(-age / recency_steps)); module docstring for the rules."""
    votes = [(a, 1.0) for a in answers if a is not None]
    votes += [(e.answer, e.confidence * math.exp(-(step - e.step) / recency_steps)) for e, _ in neighbours]
    if not votes:
        return None, 0.0
    if len(votes) < min_votes:
        return votes[0][0], 0.5 * votes[0][1] / max(w for _, w in votes)
    if strategy == "majority":
        label, count = Counter(a for a, _ in votes).most_common(1)[0]
        return label, count / len(votes)
    total = sum(w for _, w in votes) or 1.0
    weights: dict[str, float] = {}
    for answer, weight in votes:
        weights[answer] = weights.get(answer, 0.0) + weight / total
    label = max(weights, key=weights.__getitem__)
    agreeing = sum(1 for a, _ in votes if a == label)
    return label, weights[label] * agreement_factor(agreeing, len(votes))


class PseudoLabeler:
    """Labels each group of samples before scoring, and gates the groups the vote is unsure of."""

    def __init__(self, params: Any):
        self.params = params
        self.buffer = ExperienceBuffer(params.buffer_size)

    def label(self, trajectories: list[Trajectory], group_size: int, step: int,
              withheld: dict[str, str] | None = None) -> tuple[dict[str, float], set[int]]:
        """Write each group's pseudo-label into its samples' task (`solution`); returns the step's figures and
        the indices of the samples whose group the vote was too unsure of to train on (their task keeps
        `UNLABELED`).

        `withheld` (doc_id -> solution) is read for the figures alone: how often the vote's label is the
        question's true answer, over every labelled group and over those the gate let through."""
        p = self.params
        confidences, kept_confidences, hits = [], [], []
        right: dict[str, list[float]] = {"all": [], "kept": []}
        gated: set[int] = set()
        for start in range(0, len(trajectories), group_size):
            group = trajectories[start : start + group_size]
            embedding = question_embedding(group[0])
            neighbours = self.buffer.nearest(embedding, p.neighbours, p.min_similarity)
            hits.append(float(len(neighbours)))
            label, confidence = vote([normalised_answer(t) for t in group], neighbours, step, p.strategy,
                                     p.min_votes, p.recency_steps)
            confidences.append(confidence)
            passed = label is not None and confidence >= p.confidence_gate
            truth = normalised_truth(group[0].task, (withheld or {}).get(str(group[0].task.get("doc_id"))))
            if label is not None and truth is not None:
                right["all"].append(float(label == truth))
                if passed:
                    right["kept"].append(float(label == truth))
            if not passed:
                gated.update(range(start, start + len(group)))
            else:
                kept_confidences.append(confidence)
                for t in group:
                    t.task["solution"] = label
            if label is not None:
                self.buffer.add(Experience(embedding, label, confidence, step))
        groups = max(1, math.ceil(len(trajectories) / group_size))
        figures = {"ttrl/confidence": float(np.mean(confidences)) if confidences else 0.0,
                   "ttrl/groups_kept": len(kept_confidences) / groups, "ttrl/buffer": float(len(self.buffer.entries)),
                   "ttrl/buffer_hits": float(np.mean(hits)) if hits else 0.0}
        if kept_confidences:
            figures["ttrl/kept_confidence"] = float(np.mean(kept_confidences))
        if right["all"]:
            figures["ttrl/pseudo_label_accuracy"] = float(np.mean(right["all"]))
        if right["kept"]:
            figures["ttrl/kept_label_accuracy"] = float(np.mean(right["kept"]))
        return figures, gated
