"""Pixelis' reward, combined in the RL driver: the task reward beside a curiosity reward and a coherence reward
that a curriculum brings in, plus tool-misuse penalties (`rl.pixelis`).

Upstream: ClayKa/Pixelis @ 08a98fe, `core/modules/reward_shaping.py`:

- **curiosity** (`CuriosityRewardModule`): an intrinsic-curiosity module over step embeddings. A feature
  encoder phi, a forward model f(phi(s), a) that predicts phi(s') and an inverse model g(phi(s), phi(s')) that
  predicts a, all small MLPs; the reward of a transition is `eta` x the mean squared error of the forward
  prediction, a trajectory's the mean over its transitions; the modules train on `beta` x forward loss +
  (1 - beta) x inverse loss. Loupe trains them here once a step on that step's transitions (Adam, `lr`), after
  the step's rewards are computed, as upstream computes the reward under `no_grad` before training.
- **coherence**, **tool penalty**, **task reward**: `loupe.rewards.pixelis` (pure functions of the dialogue).
- **combination** (`RewardOrchestrator.calculate_reward`): each of task, curiosity and coherence z-scored by
  running statistics (an exponential moving average with weight 0.01, std at least 0.1, used from the 10th
  value on, clipped to +-3), weighted by the curriculum, the penalty added unweighted, the total clipped to
  +-`clip`. Upstream updates the statistics before z-scoring each value; Loupe by default z-scores a step's
  trajectories with the statistics from before the step and updates them after it
  (`rl.pixelis.statistics_update`). In upstream's order, equal rewards within a GRPO group get different
  z-scores, and the group's std turns that drift into advantages.
- **curriculum** (`_get_curriculum_weights`): task weight `weights.task` from the start, curiosity and
  coherence 0; each stage `{step: N, weights: {...}}` whose step is reached overrides the weights it names.

Step embeddings are what a small CPU model can afford and what the dialogue holds: per state (the question,
then each observation) a thumbnail of the image the model last saw (8 x 8 RGB) and a hashed bag of the words
of the turn, normalised. Upstream leaves the state embeddings to its caller and encodes each action as a
random vector (`_encode_action`: `torch.randn(128)` with one marked coordinate), which makes its forward
model's error noise; Loupe encodes an action as its operation (one-hot over Pixelis' operations, the answer,
or a broken turn) and its numeric arguments (docs/recipes.md, Pixelis' table).
"""

from __future__ import annotations

import io
import math
import zlib
from typing import Any

import numpy as np
import torch
from torch import nn

from loupe.rewards.pixelis import coherence_reward, pixelis_actions, tool_penalty
from loupe.trajectory import Trajectory

THUMB_SIDE = 8
TEXT_DIM = 64
STATE_DIM = THUMB_SIDE * THUMB_SIDE * 3 + TEXT_DIM
ARGUMENT_SLOTS = 4


def _operations() -> list[str]:
    from loupe.protocol import PIXELIS_OPERATIONS

    return [*PIXELIS_OPERATIONS, "ANSWER", "BROKEN"]


ACTION_DIM = len(_operations()) + ARGUMENT_SLOTS


def text_features(text: str) -> np.ndarray:
    """A hashed bag of the text's lowercased words (CRC-32 into 64 buckets): the same text, the same vector."""
    out = np.zeros(TEXT_DIM, dtype=np.float32)
    for word in text.lower().split():
        out[zlib.crc32(word.encode()) % TEXT_DIM] += 1.0
    return out


def image_features(image: Any) -> np.ndarray:
    """The image as an 8 x 8 RGB thumbnail, centred on 0 (zeros when there is no image)."""
    if image is None:
        return np.zeros(THUMB_SIDE * THUMB_SIDE * 3, dtype=np.float32)
    thumb = image.convert("RGB").resize((THUMB_SIDE, THUMB_SIDE))
    return np.asarray(thumb, dtype=np.float32).reshape(-1) / 255.0 - 0.5


def step_embeddings(trajectory: Trajectory) -> list[np.ndarray]:
    """One embedding per state: the question, then each user turn after it (observation or error)."""
    images = list(trajectory.trace.images) if trajectory.trace is not None else []
    latest = None
    out = []
    for turn in trajectory.turns:
        if turn.role != "user":
            continue
        for index in turn.images:
            latest = images[index] if index < len(images) else latest
        vector = np.concatenate([image_features(latest), text_features(turn.text)])
        out.append(vector / (np.linalg.norm(vector) + 1e-8))
    return out


def action_vectors(trajectory: Trajectory) -> list[np.ndarray]:
    """One vector per assistant turn: which operation (or the answer, or a broken turn) and its numbers."""
    from loupe.rewards.pixelis import operation_name

    names = _operations()
    out = []
    for turn in trajectory.turns:
        if turn.role != "assistant":
            continue
        vector = np.zeros(ACTION_DIM, dtype=np.float32)
        if turn.call:
            name = operation_name(turn.call["tool"])
            vector[names.index(name) if name in names else names.index("BROKEN")] = 1.0
            numbers = [v for value in turn.call.get("arguments", {}).values()
                       for v in (value if isinstance(value, list) else [value])
                       if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
            for slot, value in enumerate(numbers[:ARGUMENT_SLOTS]):
                vector[len(names) + slot] = float(np.clip(value, -1.0, 1.0))
        else:
            vector[names.index("ANSWER" if turn.action == "answer" else "BROKEN")] = 1.0
        out.append(vector)
    return out


class CuriosityModule(nn.Module):
    """Pixelis' intrinsic-curiosity module (module docstring): encoder, forward model, inverse model."""

    def __init__(self, hidden: int, beta: float, eta: float):
        super().__init__()
        self.beta, self.eta = beta, eta
        self.encoder = nn.Sequential(nn.Linear(STATE_DIM, hidden), nn.ReLU(), nn.Linear(hidden, STATE_DIM))
        self.forward_model = nn.Sequential(nn.Linear(STATE_DIM + ACTION_DIM, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                           nn.ReLU(), nn.Linear(hidden, STATE_DIM))
        self.inverse_model = nn.Sequential(nn.Linear(2 * STATE_DIM, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                           nn.ReLU(), nn.Linear(hidden, ACTION_DIM))
        for module in (self.encoder, self.forward_model, self.inverse_model):  # upstream's small initial weights
            for layer in module:
                if isinstance(layer, nn.Linear):
                    nn.init.xavier_uniform_(layer.weight, gain=0.1)
                    nn.init.zeros_(layer.bias)

    def errors(self, states: torch.Tensor, actions: torch.Tensor, nexts: torch.Tensor) -> torch.Tensor:
        """Per transition, eta x the forward model's mean squared error (no gradient)."""
        with torch.no_grad():
            predicted = self.forward_model(torch.cat([self.encoder(states), actions], dim=-1))
            return self.eta * ((predicted - self.encoder(nexts)) ** 2).mean(dim=-1)

    def loss(self, states: torch.Tensor, actions: torch.Tensor, nexts: torch.Tensor) -> torch.Tensor:
        phi, phi_next = self.encoder(states), self.encoder(nexts)
        forward = ((self.forward_model(torch.cat([phi, actions], dim=-1)) - phi_next.detach()) ** 2).mean()
        inverse = ((self.inverse_model(torch.cat([phi, phi_next], dim=-1)) - actions) ** 2).mean()
        return self.beta * forward + (1 - self.beta) * inverse


class RunningStat:
    """`RewardOrchestrator._update_statistics` / `_normalize_reward`: EMA mean and std (weight 0.01, std at
    least 0.1); a value is z-scored and clipped to +-3 from the 10th on."""

    def __init__(self) -> None:
        self.mean, self.std, self.count = 0.0, 1.0, 0

    def update(self, value: float) -> None:
        self.count += 1
        self.mean = 0.99 * self.mean + 0.01 * value
        self.std = max(math.sqrt(0.99 * self.std**2 + 0.01 * (value - self.mean) ** 2), 0.1)

    def normalise(self, value: float) -> float:
        """The value z-scored by the statistics as they are (raw until 10 values are in)."""
        if self.count < 10:
            return value
        return float(np.clip((value - self.mean) / self.std, -3.0, 3.0))

    def update_and_normalise(self, value: float) -> float:
        """Upstream's order: the value joins the statistics, then is z-scored by them."""
        self.update(value)
        return self.normalise(value)


class PixelisShaper:
    """Replaces each valid trajectory's total with Pixelis' combined reward (module docstring)."""

    def __init__(self, params: Any, seed: int = 0):
        self.params = params
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        self.curiosity = CuriosityModule(params.curiosity.hidden, params.curiosity.beta, params.curiosity.eta)
        torch.random.set_rng_state(generator_state)
        self.optimizer = torch.optim.Adam(self.curiosity.parameters(), lr=params.curiosity.lr)
        self.stats = {name: RunningStat() for name in ("task", "curiosity", "coherence")}

    def weights(self, step: int) -> dict[str, float]:
        """The curriculum's weights at `step` (module docstring)."""
        p = self.params
        if not p.curriculum:
            return p.weights.model_dump()
        weights = {"task": p.weights.task, "curiosity": 0.0, "coherence": 0.0}
        for stage in p.curriculum:
            if step >= stage.step:
                weights.update({k: v for k, v in stage.weights.model_dump().items() if v is not None})
        return weights

    def shape(self, trajectories: list[Trajectory], step: int) -> None:
        p = self.params
        weights = self.weights(step)
        transitions: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        per_step = p.normalize and p.statistics_update == "step"
        seen: list[dict[str, float]] = []
        for t in trajectories:
            states, actions = step_embeddings(t), action_vectors(t)
            pairs = [(states[i], actions[i], states[i + 1]) for i in range(min(len(actions), len(states) - 1))]
            transitions += pairs
            if t.rewards.get("total") is None:
                continue
            curiosity = 0.0
            if pairs:
                s, a, n = (torch.tensor(np.stack(x)) for x in zip(*pairs))
                curiosity = float(self.curiosity.errors(s, a, n).mean())
            steps = pixelis_actions(t)
            coherence = coherence_reward(steps, states, p.coherence.repetition_penalty, p.coherence.min_length)
            penalty = tool_penalty(steps, p.penalties.misuse, p.penalties.excessive_threshold, p.penalties.excessive)
            task = float(t.rewards["total"])
            parts = {"task": task, "curiosity": curiosity, "coherence": coherence}
            seen.append(dict(parts))
            if per_step:
                parts = {k: self.stats[k].normalise(v) for k, v in parts.items()}
            elif p.normalize:
                parts = {k: self.stats[k].update_and_normalise(v) for k, v in parts.items()}
            total = sum(weights[k] * parts[k] for k in parts) + penalty
            t.rewards.update({"pixelis_task": parts["task"], "pixelis_curiosity": parts["curiosity"],
                              "pixelis_coherence": parts["coherence"], "pixelis_tool_penalty": penalty,
                              "pixelis_curiosity_raw": curiosity, "pixelis_coherence_raw": coherence,
                              "total": float(np.clip(total, -p.clip, p.clip))})
        if per_step:  # the step's values join the statistics only now (PixelisRewardParams.statistics_update)
            for parts in seen:
                for k, v in parts.items():
                    self.stats[k].update(v)
        if transitions:
            s, a, n = (torch.tensor(np.stack(x)) for x in zip(*transitions))
            self.optimizer.zero_grad()
            self.curiosity.loss(s, a, n).backward()
            self.optimizer.step()

    def state_bytes(self) -> bytes:
        buffer = io.BytesIO()
        torch.save({"module": self.curiosity.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "stats": {k: vars(v) for k, v in self.stats.items()}}, buffer)
        return buffer.getvalue()

    def load_bytes(self, data: bytes) -> None:
        state = torch.load(io.BytesIO(data), weights_only=False)
        self.curiosity.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        for name, values in state["stats"].items():
            vars(self.stats[name]).update(values)
