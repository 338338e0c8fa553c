"""Atomic training checkpoints and exact resume.

A checkpoint is a folder `<out>/checkpoints/step_NNNNNN/` holding

    learner/             the policy and the optimiser (AdamW moments, step counts) as a
                         torch.distributed.checkpoint folder: each learner rank writes its own shard
    critic/              estimator ppo: the value model and its own optimiser, the same way
                         (stages/rl/critic.py; `Learner.save_checkpoint` writes both)
    rng.pt               python, numpy and torch (CPU and CUDA) generator states of the driver
    state.json           step, the prompt stream's position, and the tracking run's facts

It is built under a temporary name and renamed into place (`loupe.io.atomic_directory`), so a kill at any
moment leaves either the previous checkpoint or the new one, never half of one. The learner's ranks write
their shards into the temporary folder (a filesystem every node shares) and read them back in place on
resume: no weights or optimiser state pass through the driver (`Learner.save_checkpoint`). `latest_checkpoint` finds
the newest complete one; older ones beyond `keep` are deleted only after a newer one is complete.
"""

from __future__ import annotations

import json
import pickle
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loupe.io import atomic_directory, atomic_write_json

CHECKPOINTS = "checkpoints"
STATE_FILE = "state.json"


def rng_state() -> dict[str, Any]:
    """Every random generator the stage touches, in a picklable form."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_dir(out_dir: Path, step: int) -> Path:
    return Path(out_dir) / CHECKPOINTS / f"step_{step:06d}"


LEARNER_DIR = "learner"


AHEAD_FILE = "ahead.pkl"
"""The batch generated ahead for the next step (rl.overlap), pickled: trajectories with their token traces."""


def save_checkpoint(
    out_dir: Path, step: int, write_learner: Callable[[Path], None], state: dict[str, Any], keep: int = 2,
    ahead: Any = None, extras: dict[str, bytes] | None = None,
) -> Path:
    """Write step `step`'s checkpoint atomically (`write_learner(folder)` writes the learner's shards; `ahead`,
    the next step's batch generated during this one, is kept beside them), then prune all but the newest `keep`."""
    final = checkpoint_dir(out_dir, step)
    with atomic_directory(final) as tmp:
        write_learner(tmp / LEARNER_DIR)
        if ahead is not None:
            (tmp / AHEAD_FILE).write_bytes(pickle.dumps(ahead))
        for name, data in (extras or {}).items():  # other stateful parts of the driver (rl.pixelis' module)
            (tmp / name).write_bytes(data)
        torch.save(rng_state(), tmp / "rng.pt")
        atomic_write_json(tmp / STATE_FILE, {"step": step, **state})
    for old in list_checkpoints(out_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(out_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (a folder without its state file is not one)."""
    root = Path(out_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if p.is_dir() and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def latest_checkpoint(out_dir: Path) -> Path | None:
    found = list_checkpoints(out_dir)
    return found[-1] if found else None


def load_checkpoint(path: Path) -> tuple[Path, dict[str, Any]]:
    """(the learner's folder, state.json) of a checkpoint; restores the driver's RNG states too."""
    path = Path(path)
    state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    set_rng_state(torch.load(path / "rng.pt", weights_only=False))
    return path / LEARNER_DIR, state


def load_ahead(path: Path) -> Any:
    """The batch a checkpoint generated ahead for its next step, or None."""
    file = Path(path) / AHEAD_FILE
    return pickle.loads(file.read_bytes()) if file.is_file() else None
